"""The provenance of an exported model, as `provenance.json` and as a model card (`README.md`), pure.

What one peer can vouch for comes from its verified checkpoint: the run, the round and the state's
digest, the shared config and its fingerprint, the tokens this peer trained. Who else trained the
run, one peer does not know: the run's observer credits each peer with its verified tokens
(`p2p-diloco observe`, `/api/v1/run`), and `read_contributors` takes that JSON as untrusted input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from p2p_diloco.errors import ExportError

FORMAT = 1  # of provenance.json
MAX_CONTRIBUTORS_BYTES = 16 * 2**20  # an observer's view of even a large run is far smaller
MAX_NAME_CHARS = 64
MAX_REASON_CHARS = 200  # a revocation's reason, as the organiser wrote it
MAX_ACCUSERS = 256  # peers that say they convicted one contributor
_PEER_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")  # libp2p ids are base58; this also bars Markdown
DIGEST_COVERS = (
    "sha256 (the first 32 hex digits) over the round number, then the names, shapes, dtypes and bytes "
    "of theta, then those of the outer momentum"
)
_FIX = "pass the JSON that the run's observer serves at /api/v1/run (p2p-diloco observe)"


# --- contributors: untrusted input ----------------------------------------------------------------


def read_contributors(path: str | Path, run_id: str, fingerprint: str) -> tuple[list[dict[str, Any]], int | None]:
    """The contributors of an observer's `/api/v1/run` JSON, most verified tokens first, and the
    latest round the observer saw (None if the file does not say); ExportError on anything malformed."""
    view = _load_json(Path(path))
    where = f"contributors file {path}"
    if not isinstance(view, dict) or not isinstance(view.get("contributors"), list):
        raise ExportError(f'{where} holds no "contributors" list; {_FIX}')
    seen_round = _check_run(view.get("run"), run_id, fingerprint, where)
    found = [_contributor(entry, f"{where}, contributor {i}") for i, entry in enumerate(view["contributors"])]
    peers = [c["peer"] for c in found]
    if len(set(peers)) != len(peers):
        twice = sorted({p for p in peers if peers.count(p) > 1})
        raise ExportError(f"{where} lists peer {twice[0]} more than once; {_FIX}")
    return sorted(found, key=lambda c: (-c["tokens"], c["peer"])), seen_round


def _load_json(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONTRIBUTORS_BYTES + 1)
    except OSError as e:
        raise ExportError(f"cannot read contributors file {path} ({e.strerror or e}); {_FIX}") from None
    if len(raw) > MAX_CONTRIBUTORS_BYTES:
        raise ExportError(f"contributors file {path} is over {MAX_CONTRIBUTORS_BYTES // 2**20} MiB; {_FIX}")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ExportError(f"contributors file {path} is not JSON ({str(e)[:120]}); {_FIX}") from None


def _check_run(run: Any, run_id: str, fingerprint: str, where: str) -> int | None:
    """The file must be of this run and config, where it says which (an observer's view says both)."""
    if run is None:
        return None
    if not isinstance(run, dict):
        raise ExportError(f'{where}: "run" must be an object; {_FIX}')
    for key, ours in (("run_id", run_id), ("fingerprint", fingerprint)):
        if key in run and run[key] != ours:
            raise ExportError(f"{where} is of {key} {str(run[key])[:80]!r}, the checkpoint of {ours!r}; {_FIX}")
    seen = run.get("round")
    return seen if _count(seen) else None


def _contributor(entry: Any, where: str) -> dict[str, Any]:
    """One contributor: peer, name, tokens (as the averages weighed them), rounds; from an observer
    of this version also tokens_trained, revoked (the organiser's reason) and convicted_by."""
    if not isinstance(entry, dict):
        raise ExportError(f"{where} must be an object with peer, name, tokens and rounds; {_FIX}")
    peer, name = entry.get("peer"), entry.get("name", "")
    if not _is_peer(peer):
        raise ExportError(f"{where}: peer must be a peer id (letters, digits, . _ -), got {str(peer)[:80]!r}; {_FIX}")
    if not _is_text(name):
        raise ExportError(f"{where}: name must be printable text of up to {MAX_NAME_CHARS} characters; {_FIX}")
    for key in ("tokens", "rounds", "tokens_trained"):
        if not _count(entry.get(key)) and (key != "tokens_trained" or key in entry):
            raise ExportError(f"{where}: {key} must be a whole number >= 0, got {str(entry.get(key))[:40]}; {_FIX}")
    revoked, convicted_by = entry.get("revoked"), entry.get("convicted_by", [])
    if revoked is not None and not _is_text(revoked, MAX_REASON_CHARS):
        raise ExportError(f"{where}: revoked must be printable text of up to {MAX_REASON_CHARS} characters; {_FIX}")
    if not isinstance(convicted_by, list) or len(convicted_by) > MAX_ACCUSERS or not all(map(_is_peer, convicted_by)):
        raise ExportError(f"{where}: convicted_by must be a list of up to {MAX_ACCUSERS} peer ids; {_FIX}")
    found = {k: entry[k] for k in ("peer", "tokens", "rounds")}
    return {
        **found,
        "name": name,
        "tokens_trained": entry.get("tokens_trained"),
        "revoked": revoked,
        "convicted_by": convicted_by,
    }


def _is_peer(value: Any) -> bool:
    return isinstance(value, str) and _PEER_ID.fullmatch(value) is not None


def _is_text(value: Any, most: int = MAX_NAME_CHARS) -> bool:
    return isinstance(value, str) and len(value) <= most and value.isprintable()


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# --- provenance.json ------------------------------------------------------------------------------


def provenance(
    payload: Mapping[str, Any],
    version: str,
    contributors: list[dict[str, Any]] | None = None,
    observer_round: int | None = None,
) -> dict[str, Any]:
    """The facts of a verified checkpoint's `payload` that an exported model carries."""
    config, totals = payload["config"], payload.get("totals", {})
    return {
        "format": FORMAT,
        "run_id": config["run"]["run_id"],
        "round": payload["round"],
        "rounds_total": config["run"]["rounds"],
        "digest": payload["digest"],
        "digest_covers": DIGEST_COVERS,
        "fingerprint": payload["fingerprint"],
        "shared_config": payload["shared_config"],
        "parameters": sum(t.numel() for t in payload["params"].values()),
        "preset": None if config["model"]["config_path"] else config["model"]["preset"],
        "model_config_path": config["model"]["config_path"] or None,
        "peer_id": payload.get("peer_id"),
        "served_by": _servers(payload.get("served_by")),  # exported from the swarm: the holders that served it
        "tokens_by_this_peer": totals.get("tokens"),
        "inner_steps_by_this_peer": totals.get("inner_steps"),
        "p2p_diloco_version": version,
        "contributors": contributors,
        "contributors_seen_to_round": observer_round,
    }


def provenance_json(facts: Mapping[str, Any]) -> str:
    return json.dumps(facts, indent=2, ensure_ascii=False) + "\n"


# --- the model card -------------------------------------------------------------------------------

FRONT_MATTER = "---\nlibrary_name: transformers\n{license}tags:\n- p2p-diloco\n- diloco\n---\n"
_LICENSE = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}")  # a Hub licence identifier: apache-2.0, mit, cc-by-4.0, other


def check_license(license_: str) -> None:
    """ExportError unless `license_` is a licence identifier as the Hub's model cards take them."""
    if not _LICENSE.fullmatch(license_):
        raise ExportError(
            f"--license {license_[:80]!r} is not a licence identifier: lower-case letters, digits, . + -, "
            "as the Hugging Face Hub lists them (e.g. apache-2.0, mit, cc-by-4.0, or other)"
        )


def held_out_fact(loss: float | None, why_not: str, sequences: int, seq_len: int) -> dict[str, Any]:
    """What the card says of the exported θ's held-out loss, computed at export (evaluate.held_out_loss)."""
    if loss is None:
        return {"loss": None, "why_not": why_not}
    return {"loss": loss, "sequences": sequences, "seq_len": seq_len}


def model_card(facts: Mapping[str, Any], load_from: str) -> str:
    """README.md of the exported folder: a Hugging Face model card with YAML front matter."""
    license_ = facts.get("license")
    parts = [
        FRONT_MATTER.format(license=f"license: {license_}\n" if license_ else ""),
        _title(facts, load_from),
        _facts_table(facts),
        _digest_text(facts),
        _use_text(facts),
        _contributors_text(facts),
        _config_text(facts),
    ]
    return "\n".join(parts)


def _title(facts: Mapping[str, Any], load_from: str) -> str:
    return (
        f"# {_md(facts['run_id'])}, round {facts['round']} of {facts['rounds_total']}\n\n"
        f"A causal language model trained peer to peer with DiLoCo "
        f"([Douillard et al., 2023](https://arxiv.org/abs/2311.08105)) in the p2p-diloco run "
        f"`{_code(facts['run_id'])}`, exported by `p2p-diloco export` from {_source(facts)}.\n\n"
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f"model = AutoModelForCausalLM.from_pretrained({json.dumps(load_from)})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({json.dumps(load_from)})\n```\n"
    )


def _servers(served_by: Any) -> list[str] | None:
    """The holders an export from the swarm names: a list, or one string (exports before chunked
    downloads); None for an export from a peer's checkpoint."""
    if isinstance(served_by, str):
        return [served_by]
    return [str(p) for p in served_by] if isinstance(served_by, list) and served_by else None


def _source(facts: Mapping[str, Any]) -> str:
    if servers := facts.get("served_by"):
        named = ", ".join(f"`{_code(p)}`" for p in servers)
        how = f"from peer {named}" if len(servers) == 1 else f"in chunks from {len(servers)} peers ({named})"
        return (
            f"the swarm's agreed state of round {facts['round']}, downloaded {how} "
            "and verified against the digest the round's peers published"
        )
    return f"one peer's verified checkpoint of round {facts['round']}"


def _facts_table(facts: Mapping[str, Any]) -> str:
    model = f"preset `{facts['preset']}`" if facts["preset"] else f"config `{_code(facts['model_config_path'])}`"
    tokens = "not recorded" if facts["tokens_by_this_peer"] is None else f"{facts['tokens_by_this_peer']:,}"
    if facts.get("served_by"):
        tokens = "none: exported from the swarm by a node that trains nothing"
    peer = f" (peer `{_code(facts['peer_id'])}`)" if facts["peer_id"] else ""
    rows = [
        ("run", f"`{_code(facts['run_id'])}`"),
        ("round", f"{facts['round']} of {facts['rounds_total']}"),
        ("state digest", f"`{facts['digest']}`"),
        ("config fingerprint", f"`{facts['fingerprint']}`"),
        ("model", f"{facts['parameters']:,} parameters, {model}"),
        ("tokens trained by the exporting peer", tokens + peer),
        ("exported with", f"p2p-diloco {_md(facts['p2p_diloco_version'])}"),
    ]
    return "## Provenance\n\n| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _digest_text(facts: Mapping[str, Any]) -> str:
    r = facts["round"]
    return (
        f"The state digest is what the swarm agreed on: at the end of every round each peer publishes the "
        f"digest of its state, and a peer that does not hold the majority's digest loads the majority's state. "
        f"It covers (round, θ, momentum): {DIGEST_COVERS}. The momentum is not in this folder, so the digest "
        f"cannot be recomputed from it alone. To verify: compare it with the digest of round {r} that other "
        f"peers of the run logged (`metrics.jsonl`, the `round done` log line) or that the run's observer "
        f"shows; `p2p-diloco export RUN_DIR OUT --round {r}` on any peer's run dir recomputes the digest of "
        f"its checkpoint and refuses one that does not match, and exports the same θ.\n"
    )


def _use_text(facts: Mapping[str, Any]) -> str:
    """The held-out loss, what the model is for, and its licence."""
    held = facts.get("held_out") or {"loss": None, "why_not": "not computed"}
    if held["loss"] is not None:
        loss = (
            f"Held-out loss (cross-entropy, nats per token) of this θ: **{held['loss']:.4f}**, on the run's held-out "
            f"batch ({held['sequences']} sequences of {held['seq_len']} tokens from the documents the run holds "
            "out, `data.heldout_fraction`), computed at export with the code every peer computes its `eval_loss` with."
        )
    else:
        loss = f"Held-out loss: not computed at export ({_md(held['why_not'])})."
    data = facts["shared_config"].get("data", {})
    source = data.get("name") or data.get("source", "?")
    license_ = facts.get("license")
    terms = (
        f"`{license_}`, as the exporter stated it (`--license`)."
        if license_
        else "not stated by the exporter (`p2p-diloco export --license ID`); the training data's terms apply."
    )
    return (
        f"## Evaluation\n\n{loss}\n\n## Intended use and limitations\n\nA research checkpoint of a "
        f"peer-to-peer DiLoCo run, trained on `{_code(source)}` (`data.source` `{_code(data.get('source', '?'))}`). "
        "It has not been evaluated beyond the held-out loss above: not for safety, bias or factual accuracy, so "
        "it is not for use in products or decisions about people. The `tiny` preset is for testing the "
        "training system, not for generating text. Its training was open to volunteers: the "
        "contributors below are as the run's observer verified them, and the state digest ties this θ to the "
        f"round the peers agreed on.\n\n## Licence\n\n{terms}\n"
    )


def _contributors_text(facts: Mapping[str, Any]) -> str:
    found = facts["contributors"]
    if found is None:
        return (
            "## Contributors\n\nWho trained this model is not known to a single peer: its checkpoint holds only "
            "its own tokens. The run's observer (`p2p-diloco observe`) credits every peer with its verified "
            "tokens; export again with `--contributors FILE`, FILE being the JSON it serves at `/api/v1/run`, "
            "to list them here.\n"
        )
    seen = facts["contributors_seen_to_round"]
    up_to = f" up to round {seen}" if seen is not None else ""
    rows = "".join(
        f"| {i} | `{c['peer']}` | {_md(c['name'])} | {c['tokens']:,} | {_trained(c)} | {c['rounds']} | {_marks(c)} |\n"
        for i, c in enumerate(found, 1)
    )
    return (
        f"## Contributors\n\nVerified work per peer, as the run's observer saw it{up_to}: a peer is credited "
        "with its tokens of a round only when its record holds the round's agreed digest and another member "
        "of its group lists it, and with what its group's average weighed them at (under the default "
        "aggregator, at most `swarm.weight_cap` times the group's median); the tokens it trained in those "
        "rounds are beside them.\n\n| # | peer | name | credited tokens | trained tokens | rounds | marks |\n"
        f"|---|---|---|---|---|---|---|\n{rows}\n{sum(c['tokens'] for c in found):,} credited tokens from "
        f"{len(found)} peers.\n"
    )


def _trained(contributor: Mapping[str, Any]) -> str:
    trained = contributor.get("tokens_trained")
    return "not said" if trained is None else f"{trained:,}"


def _marks(contributor: Mapping[str, Any]) -> str:
    """What the organiser and the audits said of a contributor (its work before stays credited)."""
    marks = []
    if contributor.get("revoked") is not None:
        marks.append(f"revoked by the organiser: {_md(contributor['revoked'])}")
    if contributor.get("convicted_by"):
        marks.append(f"convicted in reducer audits by {len(contributor['convicted_by'])} peer(s)")
    return "; ".join(marks)


def _config_text(facts: Mapping[str, Any]) -> str:
    shared = {section: values for section, values in facts["shared_config"].items() if values}
    return (
        "## Run config\n\nThe shared fields of the run config: every peer of the run holds these values, "
        f"and the fingerprint `{facts['fingerprint']}` is the first 16 hex digits of sha256 over them. With a "
        "peer's local fields (its directory, device, micro-batch) they make a `run.toml`.\n\n"
        f"```toml\n# fingerprint {facts['fingerprint']}\n{tomli_w.dumps(shared)}```\n"
    )


def _md(text: str) -> str:
    """Text from a file or a config as literal Markdown: no link, emphasis, HTML or table cell break."""
    return re.sub(r"([\\`*_\[\]<>|#])", r"\\\1", " ".join(str(text).split()))


def _code(text: str) -> str:
    """Text inside a `code span` (a backtick or | would end it or the table cell)."""
    return " ".join(str(text).split()).replace("`", "'").replace("|", "/")
