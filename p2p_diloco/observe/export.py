"""`p2p-diloco export`: θ of a run's checkpoint as a `transformers` model folder, with its provenance.

The folder holds the model and tokenizer, a model card (`README.md`) and `provenance.json` (card.py),
every file readable by everyone (0644). `push_to_hub` then uploads it to a Hugging Face Hub repo.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2p_diloco import __version__
from p2p_diloco import config as config_mod
from p2p_diloco.errors import CheckpointError, ConfigError, ExportError
from p2p_diloco.observe import card
from p2p_diloco.observe.evaluate import held_out_loss
from p2p_diloco.train import checkpoint
from p2p_diloco.train import model as model_mod

DEFAULT_HUB = "https://huggingface.co"
CONNECT_TIMEOUT_S = 10.0  # the Hub client itself waits for a connection without a deadline


def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    round_: int | None = None,
    contributors: str | Path | None = None,
    hub_repo: str | None = None,
    license_: str | None = None,
) -> Path:
    """Write θ of the latest (or the given round's) checkpoint to `out_dir`, loadable by
    `AutoModelForCausalLM.from_pretrained(out_dir)`, with its model card and provenance.json.
    The checkpoint is verified first; a malformed `contributors` file writes nothing.
    `hub_repo` only names where the card says the model loads from; `license_`, the licence it
    states (the exporter's choice)."""
    path = _checkpoint_path(run_dir, round_)
    payload = checkpoint.load(path)
    cfg = config_mod.from_mapping(payload["config"], where=str(path))
    return _export(cfg, payload, out_dir, contributors, hub_repo, license_)


def export_agreed(
    cfg: config_mod.Config,
    round_: int,
    digest: str,
    served_by: Sequence[str],
    params: dict[str, Any],
    out_dir: str | Path,
    contributors: str | Path | None = None,
    hub_repo: str | None = None,
    license_: str | None = None,
) -> Path:
    """Write θ of the swarm's agreed state of `round_` (downloaded from the holders `served_by`, in
    chunks or whole from one, and verified against `digest`, service.fetch_agreed) to `out_dir`, as
    `export_run` writes a checkpoint's. provenance.json names them as a list (one string before)."""
    payload = {
        "config": cfg.to_dict(),
        "round": round_,
        "digest": digest,
        "fingerprint": cfg.fingerprint(),
        "shared_config": cfg.shared_dict(),
        "params": params,
        "served_by": list(served_by),
    }
    return _export(cfg, payload, out_dir, contributors, hub_repo, license_)


def _export(
    cfg: config_mod.Config,
    payload: dict[str, Any],
    out_dir: str | Path,
    contributors: str | Path | None,
    hub_repo: str | None,
    license_: str | None,
) -> Path:
    if license_ is not None:
        card.check_license(license_)
    seen: tuple[list[dict[str, Any]] | None, int | None] = (None, None)
    if contributors is not None:
        seen = card.read_contributors(contributors, cfg.run.run_id, payload["fingerprint"])
    facts = card.provenance(payload, __version__, *seen)
    loss, why_not = held_out_loss(cfg, payload["params"])
    facts.update(
        license=license_, held_out=card.held_out_fact(loss, why_not, cfg.run.eval_sequences, cfg.model.seq_len)
    )
    files = {
        "README.md": card.model_card(facts, hub_repo or str(out_dir)),
        "provenance.json": card.provenance_json(facts),
    }
    tokenizer = model_mod.load_tokenizer(cfg.model.tokenizer)
    model_config = model_mod.model_config(cfg.model, tokenizer.vocab_size)
    return model_mod.export_model(payload["params"], model_config, cfg.model.tokenizer, out_dir, files)


def _checkpoint_path(run_dir: str | Path, round_: int | None) -> Path:
    path = checkpoint.latest(run_dir) if round_ is None else checkpoint.path_for(run_dir, round_)
    if path is None or not path.exists():
        found = ", ".join(p.name for p in checkpoint.list_checkpoints(run_dir)) or "none"
        which = "latest checkpoint" if round_ is None else f"checkpoint of round {round_}"
        raise CheckpointError(f"no {which} in {checkpoint.checkpoint_dir(run_dir)} (found: {found})")
    return path


# --- the Hugging Face Hub -------------------------------------------------------------------------


def check_repo_id(repo: str) -> None:
    """ConfigError unless `repo` is a Hub repo id ("name" or "user/name"): checked before any export."""
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo)
    except ValueError as e:
        raise ConfigError(
            f"--push-to-hub {repo!r} is not a Hub repo id ({str(e).splitlines()[0]}); use user/name"
        ) from None


def hub_endpoint() -> str:
    """The Hub to upload to: HF_ENDPOINT, as for every Hugging Face tool, else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_HUB).rstrip("/")


def push_to_hub(folder: Path, repo: str) -> str:
    """Upload `folder` to the Hub repo `repo` (created if missing) in one commit; the repo's URL.
    ExportError in one line if the Hub is unreachable or refuses; the folder stays as it is."""
    from huggingface_hub import HfApi

    endpoint = hub_endpoint()
    later = f"the model is in {folder}; upload it later with `hf upload {repo} {folder}`"
    _check_reachable(endpoint, later)
    api = HfApi(endpoint=endpoint)
    try:
        url = api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=folder, commit_message=f"p2p-diloco export of {folder.name}")
    # The client raises its HTTP library's errors (httpx or requests, by version), OSError and
    # ValueError; at this boundary every one of them is the same news: the upload did not happen.
    except Exception as e:
        raise ExportError(f"cannot upload to {repo} on {endpoint}: {_reason(e)}; {later}") from None
    return str(url)


def _check_reachable(endpoint: str, later: str) -> None:
    """Fail within CONNECT_TIMEOUT_S if nothing answers at the Hub's address: the client would wait
    for a connection as long as the kernel lets it (minutes) before it says anything."""
    url = urllib.parse.urlsplit(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ExportError(f"HF_ENDPOINT {endpoint!r} is not an http(s) URL; unset it for huggingface.co")
    if url.scheme in urllib.request.getproxies() and not urllib.request.proxy_bypass(url.hostname):
        return  # through a proxy: only the client knows how to reach the Hub
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ExportError(
            f"cannot reach the Hub at {endpoint} ({reason}): check the network and HF_ENDPOINT; {later}"
        ) from None


def _reason(error: Exception) -> str:
    status = getattr(getattr(error, "response", None), "status_code", None)
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    if status in (401, 403):
        return f"{first} (log in with `hf auth login` or set HF_TOKEN to a token that may write to the repo)"
    return first
