"""What an export says about itself: the model card, provenance.json, contributors from an observer
(untrusted), the files' permissions, the upload to the Hub, and the line that ends a run."""

import json
import logging
import os
import socket
import time

import pytest
import torch

from p2p_diloco import config
from p2p_diloco.errors import ExportError
from p2p_diloco.observe import card
from p2p_diloco.observe.export import push_to_hub
from p2p_diloco.train.model import ByteTokenizer, export_model, init_model, model_config
from tests.conftest import TINY
from tests.unit.hub_standin import HubStandIn
from tests.unit.test_round_protocol import make_peer, run

A, B, C = "QmAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "QmBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB", "12D3KooWC"


@pytest.fixture
def cfg():
    return config.load(None, {**TINY, "run.run_id": "card-test"})


def payload_of(cfg, tokens=12_345):
    """What a checkpoint holds that an export reads (the digest need not match: load() checks that)."""
    return {
        "round": 2,
        "params": {"w": torch.zeros(3, 4), "b": torch.zeros(5)},
        "digest": "0f" * 16,
        "shared_config": cfg.shared_dict(),
        "config": cfg.to_dict(),
        "fingerprint": cfg.fingerprint(),
        "peer_id": A,
        "totals": {"tokens": tokens, "inner_steps": 4, "compute_s": 1.5},
    }


def observer_view(cfg, contributors, **run):
    return {
        "run": {"run_id": cfg.run.run_id, "fingerprint": cfg.fingerprint(), "round": 9, **run},
        "peers": [],
        "contributors": contributors,
    }


def write(tmp_path, content) -> str:
    path = tmp_path / "run.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def entry(peer, tokens, rounds=1, name="x"):
    return {"peer": peer, "name": name, "tokens": tokens, "rounds": rounds}


def test_provenance_holds_the_checkpoints_facts(cfg):
    facts = card.provenance(payload_of(cfg), "9.9.9")
    assert (facts["run_id"], facts["round"], facts["rounds_total"]) == ("card-test", 2, 3)
    assert (facts["digest"], facts["fingerprint"]) == ("0f" * 16, cfg.fingerprint())
    assert (facts["parameters"], facts["preset"], facts["tokens_by_this_peer"]) == (17, "tiny", 12_345)
    assert facts["contributors"] is None and facts["p2p_diloco_version"] == "9.9.9"
    assert json.loads(card.provenance_json(facts))["shared_config"] == json.loads(json.dumps(cfg.shared_dict()))


def test_the_card_is_a_model_card_naming_the_run_round_digest_tokens_and_config(cfg):
    text = card.model_card(card.provenance(payload_of(cfg), "9.9.9"), "user/model")
    assert text.startswith("---\nlibrary_name: transformers\ntags:\n- p2p-diloco\n- diloco\n---\n")
    for fact in ("card-test", "round 2 of 3", "0f" * 16, cfg.fingerprint(), "12,345", "17 parameters", "9.9.9"):
        assert fact in text, fact
    assert 'from_pretrained("user/model")' in text
    assert "not known to a single peer" in text and "p2p-diloco observe" in text
    assert f'```toml\n# fingerprint {cfg.fingerprint()}\n[run]\nrun_id = "card-test"' in text


def test_contributors_are_listed_by_verified_tokens_and_names_cannot_inject_markdown(cfg, tmp_path):
    view = observer_view(cfg, [entry(C, 5), entry(A, 700, 3, name="<b>alice</b> | [x](y)"), entry(B, 40)])
    found, seen = card.read_contributors(write(tmp_path, view), cfg.run.run_id, cfg.fingerprint())
    assert [c["peer"] for c in found] == [A, B, C] and seen == 9
    text = card.model_card(card.provenance(payload_of(cfg), "1", found, seen), "m")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line and line[2].isdigit()]
    assert [r.split(" | ")[1] for r in rows] == [f"`{A}`", f"`{B}`", f"`{C}`"]
    assert r"\<b\>alice\</b\> \| \[x\](y)" in rows[0] and "745 credited tokens from 3 peers" in text
    assert "up to round 9" in text


def test_the_card_credits_what_the_average_weighed_beside_what_was_trained_and_marks_revoked_and_convicted(
    cfg, tmp_path
):
    fast = {**entry(A, 200, 2), "tokens_trained": 2000, "revoked": "sold | `its` slot", "convicted_by": [B, C]}
    view = observer_view(cfg, [fast, {**entry(B, 200, 2), "tokens_trained": 200, "revoked": None, "convicted_by": []}])
    found, _ = card.read_contributors(write(tmp_path, view), cfg.run.run_id, cfg.fingerprint())
    text = card.model_card(card.provenance(payload_of(cfg), "1", found, 9), "m")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line and line[2].isdigit()]
    marks = r"revoked by the organiser: sold \| \`its\` slot; convicted in reducer audits by 2 peer(s)"
    assert rows[0].endswith(f"| 200 | 2,000 | 2 | {marks} |")
    assert rows[1].endswith("| 200 | 200 | 2 |  |") and "weighed them at" in text


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("{not json", "is not JSON"),
        ([1, 2], 'no "contributors" list'),
        ({"contributors": {"a": 1}}, 'no "contributors" list'),
        ({"contributors": ["Qm"]}, "contributor 0 must be an object"),
        ({"contributors": [entry(A, -1)]}, "tokens must be a whole number >= 0, got -1"),
        ({"contributors": [entry(A, True)]}, "tokens must be a whole number"),
        ({"contributors": [entry(A, 1.5)]}, "tokens must be a whole number"),
        ({"contributors": [{"peer": A, "name": "a", "tokens": 1}]}, "rounds must be a whole number"),
        ({"contributors": [entry("Qm`| <script>", 1)]}, "peer must be a peer id"),
        ({"contributors": [entry(A, 1, name="two\nlines")]}, "name must be printable"),
        ({"contributors": [entry(A, 1), entry(A, 2)]}, f"lists peer {A} more than once"),
        ({"contributors": [{**entry(A, 1), "tokens_trained": -3}]}, "tokens_trained must be a whole number"),
        ({"contributors": [{**entry(A, 1), "revoked": "x" * 201}]}, "revoked must be printable text"),
        ({"contributors": [{**entry(A, 1), "revoked": 7}]}, "revoked must be printable text"),
        ({"contributors": [{**entry(A, 1), "convicted_by": ["../x"]}]}, "convicted_by must be a list"),
        ({"contributors": [{**entry(A, 1), "convicted_by": "Qm"}]}, "convicted_by must be a list"),
        ({"run": {"run_id": "another"}, "contributors": []}, "is of run_id 'another'"),
        ({"run": {"fingerprint": "ffff"}, "contributors": []}, "is of fingerprint 'ffff'"),
        ({"run": [], "contributors": []}, '"run" must be an object'),
    ],
)
def test_a_malformed_contributors_file_is_refused_in_one_line_that_names_the_fix(cfg, tmp_path, content, fragment):
    with pytest.raises(ExportError) as refused:
        card.read_contributors(write(tmp_path, content), cfg.run.run_id, cfg.fingerprint())
    message = str(refused.value)
    assert fragment in message and "\n" not in message and "/api/v1/run" in message


def test_a_missing_or_oversized_contributors_file_is_refused(cfg, tmp_path, monkeypatch):
    with pytest.raises(ExportError, match="cannot read contributors file"):
        card.read_contributors(tmp_path / "none.json", cfg.run.run_id, cfg.fingerprint())
    monkeypatch.setattr(card, "MAX_CONTRIBUTORS_BYTES", 10)
    with pytest.raises(ExportError, match="is over"):
        card.read_contributors(write(tmp_path, observer_view(cfg, [])), cfg.run.run_id, cfg.fingerprint())


@pytest.mark.parametrize("umask", [0o077, 0o000])
def test_every_exported_file_is_readable_by_everyone_whatever_the_umask(tmp_path, umask):
    model_cfg = model_config(config.ModelSection(preset="tiny", seq_len=32), ByteTokenizer.vocab_size)
    state = init_model(model_cfg, seed=0).state_dict()
    old = os.umask(umask)
    try:
        out = export_model(state, model_cfg, "bytes", tmp_path / "export", {"README.md": "# card\n"})
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert modes.pop("export") == 0o755 and modes.pop("model.safetensors") == 0o644
    assert modes and set(modes.values()) == {0o644}, modes
    assert (out / "README.md").read_text() == "# card\n"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_fails_at_once_in_one_line_and_keeps_the_folder(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "README.md").write_text("# card\n")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    started = time.monotonic()
    with pytest.raises(ExportError) as refused:
        push_to_hub(folder, "someone/model")
    assert time.monotonic() - started < 5
    message = str(refused.value)
    assert message.startswith("cannot reach the Hub at http://127.0.0.1:") and "\n" not in message
    assert f"upload it later with `hf upload someone/model {folder}`" in message
    assert (folder / "README.md").exists()


def test_push_to_hub_commits_the_folders_exact_bytes_to_a_hub_stand_in(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    files = {
        "README.md": b"---\nlibrary_name: transformers\n---\n",
        "model.bin": bytes(range(256)) * 9,
        "sub/t.json": b"{}",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    with HubStandIn() as hub:  # a stand-in, not the Hub: see tests/unit/hub_standin.py
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", "hf_standin_token")
        assert push_to_hub(folder, "someone/model") == f"{hub.url}/someone/model"
        assert push_to_hub(folder, "someone/model") == f"{hub.url}/someone/model"  # the repo exists: fine
    assert hub.repos == {"someone/model": files}
    assert hub.calls[0] == "POST /api/repos/create" and "Bearer hf_standin_token" in hub.authorization


def test_the_end_of_a_run_says_how_to_export(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    peer = run(make_peer(tmp_path, None, **{"run.rounds": "1"}))
    assert f"export the model: p2p-diloco export {peer.run_dir} <folder>" in caplog.text


def test_a_card_of_a_state_exported_from_the_swarm_names_its_servers_and_no_exporting_peer(cfg):
    payload = {**payload_of(cfg), "served_by": [B], "peer_id": None}
    del payload["totals"]
    facts = card.provenance(payload, "0.5.0")
    text = card.model_card(facts, "out")
    assert facts["served_by"] == [B] and facts["peer_id"] is None and facts["tokens_by_this_peer"] is None
    assert f"the swarm's agreed state of round 2, downloaded from peer `{B}` and verified" in text
    # In chunks from several holders, it names them all; an export from before names one, as a string.
    chunked = card.model_card(card.provenance({**payload, "served_by": [A, B]}, "0.5.0"), "out")
    assert f"downloaded in chunks from 2 peers (`{A}`, `{B}`) and verified" in chunked
    assert card.provenance({**payload, "served_by": B}, "0.5.0")["served_by"] == [B]
    assert (
        "| tokens trained by the exporting peer | none: exported from the swarm by a node that trains nothing |" in text
    )
    assert "one peer's verified checkpoint" not in text


def test_a_licence_is_an_identifier_as_the_hub_takes_it_and_a_held_out_loss_not_computed_says_why(cfg):
    for bad in ("Apache 2.0", "", "mit\nlicense: x", "a" * 65):
        with pytest.raises(ExportError, match="is not a licence identifier"):
            card.check_license(bad)
    card.check_license("cc-by-4.0")
    facts = card.provenance(payload_of(cfg), "1")
    facts["held_out"] = card.held_out_fact(None, "no such file: /data/shard-*.jsonl", 4, 32)
    text = card.model_card(facts, "m")
    assert "Held-out loss: not computed at export (no such file: /data/shard-\\*.jsonl)." in text
    assert "license:" not in text and "not stated by the exporter (`p2p-diloco export --license ID`)" in text
