"""The `p2p-diloco` command as a user runs it: subprocesses, real signals, exit codes, files left behind."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from p2p_diloco import config
from p2p_diloco.train import checkpoint
from tests.conftest import TINY
from tests.unit.full_disk import fill, remount, tmpfs

CLI = [sys.executable, "-m", "p2p_diloco.cli"]


def options(overrides):
    return [f"--{k}={v}" for k, v in overrides.items()]


def run_cli(*args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in last, last


def snapshot(folder: Path) -> dict:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def wait_until(condition, proc, timeout_s):
    """Wait for condition() with a deadline, failing at once if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        try:
            proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            continue
        raise AssertionError(f"process exited early with {proc.returncode}: {proc.stderr.read()}")


def metric_rounds(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["round"] for line in path.read_text().splitlines()] if path.exists() else []


def test_help_documents_every_config_field():
    out = run_cli("peer", "--help").stdout
    from p2p_diloco.config import field_specs

    for section, key, *_ in field_specs():
        assert f"--{section}.{key}" in out
    assert "--resume" in out and "--initial-peers" in out


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "p2p-diloco"  # installed next to the interpreter of this venv
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "peer" in result.stdout and "export" in result.stdout


@pytest.mark.parametrize(
    "extra, fragments, code",  # 2: the config is wrong; 1: the data it names cannot be read (DataError)
    [
        (
            {"data.source": "files", "data.path": "/nonexistent/corpus"},
            ["data.path /nonexistent/corpus does not exist"],
            1,
        ),
        ({"model.preset": "huge"}, ["model.preset is unknown: 'huge'"], 2),
        ({"inner.lr": "-0.001"}, ["inner.lr must be > 0, got -0.001", "[inner] lr"], 2),
        ({"model.tokenizer": "/nonexistent/tok.json"}, ["/nonexistent/tok.json"], 1),
        ({"swarm.initial_peers": "/ip4/127.0.0.1/tcp/1"}, ["has no /p2p/<peer id> part"], 2),
        ({"swarm.initial_peers": "127.0.0.1:31337"}, ["is not a multiaddr"], 2),
    ],
    ids=["missing-data-path", "unknown-preset", "negative-lr", "missing-tokenizer", "peer-without-id", "not-a-maddr"],
)
def test_bad_input_is_one_line_and_creates_nothing(tmp_path, capsys, extra, fragments, code):
    # In-process (the same main() the console script calls), to spare six interpreter starts;
    # the subprocess path is covered by the other tests here.
    run_dir = tmp_path / "run"
    result = main_in_process(capsys, "peer", *options({**TINY, "run.dir": str(run_dir), **extra}))
    assert_one_line_error(result, *fragments)
    assert result.returncode == code
    assert not run_dir.exists()


@pytest.mark.parametrize("command", ["peer", "bootstrap", "config"])
def test_a_config_that_is_a_folder_is_one_line_with_the_fix(tmp_path, capsys, command):
    # `docker run -v "$PWD/run.toml:/config/run.toml:ro"` before run.toml was copied there makes a
    # folder of that name; under compose the node restarted into a 20-line IsADirectoryError.
    folder = tmp_path / "run.toml"
    folder.mkdir()
    result = main_in_process(capsys, command, "--config", str(folder))
    assert_one_line_error(result, f"config file {folder} is a folder, not a file", "copy run.toml there first")
    assert result.returncode == 2 and not any(folder.iterdir())


def test_a_run_dir_under_a_file_is_one_line_and_creates_nothing(tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder\n")
    run_dir = tmp_path / "a-file" / "run"
    result = main_in_process(capsys, "peer", *options({**TINY, "run.dir": str(run_dir)}))
    assert_one_line_error(result, f"run dir {run_dir} cannot be used (Not a directory); choose another --run.dir")
    assert (tmp_path / "a-file").read_text() == "not a folder\n"


def test_auto_device_refuses_a_gpu_sized_model_without_a_gpu_and_creates_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    run_dir = tmp_path / "run"
    extra = {"run.dir": str(run_dir), "model.preset": "150m", "run.device": "auto"}
    result = main_in_process(capsys, "peer", *options({**TINY, **extra}))
    assert_one_line_error(
        result, "sees no GPU, and the model's 122,982,272 parameters are GPU-sized", "--run.device=cpu"
    )
    assert result.returncode == 2 and not run_dir.exists()


def test_baseline_refuses_what_cannot_run(tmp_path):
    # The other refusals: tests/unit/test_dataparallel.py.
    run_dir = tmp_path / "run"
    result = run_cli("baseline", "--workers", "0", *options({**TINY, "run.dir": str(run_dir)}))
    assert_one_line_error(result, "--workers must be >= 1, got 0")
    assert not run_dir.exists()


def test_unknown_option_is_refused_with_the_nearest_one_and_no_prefix_is_taken(capsys):
    result = run_cli("peer", "--inner.lrr=1")
    assert (
        result.returncode == 2 and "unrecognized arguments: --inner.lrr=1 (did you mean --inner.lr?)" in result.stderr
    )
    # argparse would take a prefix of one option for it: `--inner.step 5` set inner.steps
    with pytest.raises(SystemExit) as stopped:
        main_in_process(capsys, "peer", "--inner.step", "5")
    assert stopped.value.code == 2
    assert "unrecognized arguments: --inner.step 5 (did you mean --inner.steps?)" in capsys.readouterr().err
    # a known option that is missing gets no "did you mean" (it said "--config (did you mean --config?)")
    with pytest.raises(SystemExit) as stopped:
        main_in_process(capsys, "admission", "list")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "the following arguments are required: --config" in err
    assert "did you mean" not in err, err
    # nor a known option given a bad value ("argument --metrics-port: …" named itself as the fix)
    with pytest.raises(SystemExit) as stopped:
        main_in_process(capsys, "bootstrap", "--metrics-port", "70000")
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "argument --metrics-port: a TCP port, 0 to 65535 (0: a free one)" in err
    assert "did you mean" not in err, err


def test_status_without_a_run_to_read_is_one_line(tmp_path, capsys):
    for argv, fragment in [
        ((), "status needs --config and --initial-peers, or the --run-dir of a peer of the run"),
        (("--run-dir", str(tmp_path)), f"{tmp_path} holds no config.toml (a peer writes it at start): pass --config"),
    ]:
        result = main_in_process(capsys, "status", *argv)
        assert_one_line_error(result, fragment)
        assert result.returncode == 2


def test_status_of_a_run_dir_reads_the_run_from_the_config_its_peer_wrote(tmp_path):
    # A volunteer's `status --run-dir DIR` needed --config and --initial-peers too.
    import argparse

    from p2p_diloco.cli import _status_config

    maddr = "/ip4/127.0.0.1/tcp/31337/p2p/QmXoypizjW3WknFiJnKLwHCnL72vedxjQkDDP1mXWo6uco"
    config.save(config.load(None, {**TINY, "run.rounds": "7", "swarm.initial_peers": maddr}), tmp_path / "config.toml")
    cfg = _status_config(argparse.Namespace(config=None, initial_peers=None, run_dir=str(tmp_path)))
    assert cfg.swarm.initial_peers == (maddr,) and cfg.run.rounds == 7


def test_version(capsys):
    from p2p_diloco import __version__

    with pytest.raises(SystemExit) as stopped:
        main_in_process(capsys, "--version")
    assert stopped.value.code == 0 and capsys.readouterr().out == f"p2p-diloco {__version__}\n"


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One run of 2 rounds through the CLI, shared (as copies) by the tests that need a finished run."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    result = run_cli("peer", *options({**TINY, "run.dir": str(run_dir), "run.rounds": "2"}))
    assert result.returncode == 0, result.stderr
    return run_dir


def copy_of(run_dir, tmp_path):
    import shutil

    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def main_in_process(capsys, *argv):
    """The console script's main() in this process (spares an interpreter start): (code, stderr, stdout)."""
    from types import SimpleNamespace

    from p2p_diloco.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stderr=captured.err, stdout=captured.out)


def test_truncated_checkpoint_is_refused_and_nothing_is_overwritten(trained_run, tmp_path, capsys):
    run_dir = copy_of(trained_run, tmp_path)
    latest = checkpoint.latest(run_dir)
    latest.write_bytes(latest.read_bytes()[:1000])
    before = snapshot(run_dir)
    args = options({**TINY, "run.dir": str(run_dir), "run.rounds": "2"})
    result = main_in_process(capsys, "peer", "--resume", *args)
    assert_one_line_error(result, "round-000002.pt is truncated or corrupt", "move it away")
    assert snapshot(run_dir) == before


def test_existing_run_without_resume_is_refused(trained_run, tmp_path, capsys):
    run_dir = copy_of(trained_run, tmp_path)
    before = snapshot(run_dir)
    args = options({**TINY, "run.dir": str(run_dir), "run.rounds": "2"})
    assert_one_line_error(main_in_process(capsys, "peer", *args), "already holds checkpoints", "--resume")
    assert snapshot(run_dir) == before


TINY_COPY_BYTES = 469_632 * 4  # one fp32 copy of the tiny preset's parameters


def test_a_disk_that_fills_mid_run_stops_the_peer_with_one_line_and_resume_continues(tmp_path, capsys):
    # A checkpoint of round 0 holds 2 copies (θ, momentum), a later one 4 (and AdamW's 2 moments):
    # 7 copies of space hold rounds 0 and 1, and round 2's checkpoint fills the disk.
    with tmpfs(tmp_path / "disk", 7 * TINY_COPY_BYTES) as disk:
        run_dir = disk / "run"
        args = options({**TINY, "run.dir": str(run_dir)})
        result = run_cli("peer", *args)
        assert_one_line_error(result)
        assert result.returncode == 1 and result.stderr.strip().splitlines()[-1] == (
            f"error: cannot write {checkpoint.path_for(run_dir, 2)} (No space left on device); free space on "
            f"{disk} or choose another --run.dir; the checkpoint of round 1 is intact, continue with --resume"
        )
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["round-000000.pt", "round-000001.pt"]
        assert checkpoint.load(checkpoint.latest(run_dir))["round"] == 1  # its digest verified
        assert metric_rounds(run_dir) == [0, 1, 2]  # whole lines; round 2's goes at the resume
        remount(disk, f"size={28 * TINY_COPY_BYTES}")  # the user freed space
        resumed = main_in_process(capsys, "peer", "--resume", *args)
        assert resumed.returncode == 0, resumed.stderr
        assert metric_rounds(run_dir) == [0, 1, 2, 3]


def test_a_disk_full_at_start_is_one_line_with_the_fix(tmp_path, capsys):
    with tmpfs(tmp_path / "disk", 64 * 1024) as disk:
        fill(disk)
        result = main_in_process(capsys, "peer", *options({**TINY, "run.dir": str(disk / "run")}))
    assert_one_line_error(result, "(No space left on device); free space on", "choose another --run.dir")
    assert result.returncode == 1


def stop_after_rounds(args, run_dir, rounds, stop):
    """Start a peer, let it finish `rounds` more rounds, then `stop` it: a signal to its process
    group (as a terminal sends Ctrl+C), or a function of the process; return (exit code, stderr)."""
    start = len(metric_rounds(run_dir))
    proc = subprocess.Popen([*CLI, "peer", *args], stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(lambda: len(metric_rounds(run_dir)) >= start + rounds, proc, timeout_s=120)
        stop(proc) if callable(stop) else os.killpg(proc.pid, stop)
        _, err = proc.communicate(timeout=60)
        assert_group_ends(proc.pid, deadline_s=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return proc.returncode, err


def test_a_peer_whose_second_process_is_killed_stops_with_one_line_and_resumes(tmp_path):
    """SIGKILL to rank 1 of a peer of 2 processes (an out-of-memory kill, say): rank 0's next collective
    fails, and the peer says which process died and that its last checkpoint is on disk."""
    from tests.swarm.procs import descendants

    run_dir = tmp_path / "run"
    args = [*options({**TINY, "run.dir": str(run_dir), "run.rounds": "1000"}), "--nproc", "2"]

    def kill_rank_1(proc):
        (follower,) = [pid for pid in descendants(proc.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        os.kill(follower, signal.SIGKILL)

    code, err = stop_after_rounds(args, run_dir, 3, kill_rank_1)
    saved = checkpoint.load(checkpoint.latest(run_dir))["round"]
    assert code == 1, err
    # Said at once, then as the peer's one error line. (A process killed with SIGKILL leaves a
    # semaphore that multiprocessing's resource tracker warns about afterwards.)
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    (line,) = errors
    assert line.startswith("error: rank-1 of this peer exited with code -9 ("), err
    assert line.endswith(f"the checkpoint of round {saved} is on disk, continue with --resume"), err
    assert "Traceback" not in err, err
    # Resumed, then Ctrl+C to its whole foreground group: rank 1 ignores it and ends when rank 0
    # tells it to; nothing is left behind (stop_after_rounds), and the partial round is discarded.
    code, err = stop_after_rounds(["--resume", *args], run_dir, 2, signal.SIGINT)
    assert code == 0 and f"resumed from {checkpoint.path_for(run_dir, saved)}" in err, err
    assert "partial round was discarded" in err and "Traceback" not in err, err
    resumed_to = checkpoint.load(checkpoint.latest(run_dir))["round"]
    assert resumed_to >= saved + 1 and metric_rounds(run_dir) == list(range(resumed_to + 1))


def assert_group_ends(pgid, deadline_s):
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"processes of group {pgid} left running"
        time.sleep(0.1)  # a poll interval, bounded by the deadline


# SIGTERM takes the same handler (tests/swarm/test_faults.py sends it to peers' groups). A peer of 2
# processes stopped by Ctrl+C: test_a_peer_whose_second_process_is_killed_stops_with_one_line_and_resumes.
def test_signal_stops_cleanly_and_resume_continues(tmp_path):
    run_dir = tmp_path / "run"
    args = options({**TINY, "run.dir": str(run_dir), "run.rounds": "1000"})
    code, err = stop_after_rounds(args, run_dir, 3, signal.SIGINT)
    assert code == 0, err
    assert "partial round was discarded" in err and "Traceback" not in err, err
    stopped_at = checkpoint.load(checkpoint.latest(run_dir))["round"]
    assert stopped_at >= 2 and metric_rounds(run_dir) == list(range(stopped_at + 1))
    code, err = stop_after_rounds(["--resume", *args], run_dir, 2, signal.SIGINT)
    assert code == 0, err
    assert f"resumed from {checkpoint.path_for(run_dir, stopped_at)}" in err
    resumed_to = checkpoint.load(checkpoint.latest(run_dir))["round"]
    assert resumed_to >= stopped_at + 1 and metric_rounds(run_dir) == list(range(resumed_to + 1))


def test_export_loads_in_transformers_with_thetas_values(trained_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, out = trained_run, tmp_path / "model"
    result = run_cli("export", str(run_dir), str(out))
    assert result.returncode == 0, result.stderr
    theta = checkpoint.load(checkpoint.latest(run_dir))["params"]
    model = AutoModelForCausalLM.from_pretrained(out)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), theta[name]), name
    assert AutoTokenizer.from_pretrained(out)("def f():")["input_ids"] == list(b"def f():")
    modes = {p.relative_to(out).as_posix(): p.stat().st_mode & 0o777 for p in out.rglob("*")}
    assert out.stat().st_mode & 0o777 == 0o755 and set(modes.values()) == {0o644}, modes  # safetensors' was 0600
    assert {"model.safetensors", "README.md", "provenance.json"} <= set(modes)
    assert_one_line_error(main_in_process(capsys, "export", str(run_dir), str(out)), str(out))
    assert_one_line_error(
        main_in_process(capsys, "export", str(tmp_path / "nothing"), str(tmp_path / "m2")), "no latest checkpoint"
    )


def exported_facts(run_dir: Path) -> dict:
    """What provenance.json must say, computed from the verified checkpoint itself."""
    payload = checkpoint.load(checkpoint.latest(run_dir))
    return {
        "run_id": payload["config"]["run"]["run_id"],
        "round": payload["round"],
        "rounds_total": payload["config"]["run"]["rounds"],
        "digest": payload["digest"],
        "fingerprint": payload["fingerprint"],
        "shared_config": json.loads(json.dumps(payload["shared_config"])),
        "tokens_by_this_peer": payload["totals"]["tokens"],
        "parameters": sum(t.numel() for t in payload["params"].values()),
        "preset": payload["config"]["model"]["preset"],
        "peer_id": payload["peer_id"],
    }


def test_export_writes_a_model_card_and_provenance_of_the_checkpoint(trained_run, tmp_path, capsys):
    out = tmp_path / "model"
    assert main_in_process(capsys, "export", str(trained_run), str(out), "--license", "apache-2.0").returncode == 0
    expected = exported_facts(trained_run)
    facts = json.loads((out / "provenance.json").read_text())
    assert {key: facts[key] for key in expected} == expected and facts["contributors"] is None
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\nlicense: apache-2.0\ntags:\n- p2p-diloco\n- diloco\n---\n")
    # The held-out loss computed at export is the one the peer computed of its own state of the round.
    own = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    (peer_loss,) = [r["eval_loss"] for r in own if r["round"] == expected["round"] and "eval_loss" in r]
    assert facts["held_out"] == {"loss": peer_loss, "sequences": 4, "seq_len": 32}
    assert f"of this θ: **{peer_loss:.4f}**" in card and "## Intended use and limitations" in card
    assert "## Licence\n\n`apache-2.0`, as the exporter stated it" in card
    for fact in (
        f"`{expected['run_id']}`",
        f"round {expected['round']} of {expected['rounds_total']}",
        f"`{expected['digest']}`",
        f"{expected['tokens_by_this_peer']:,}",
        f"# fingerprint {expected['fingerprint']}",
        "not known to a single peer",
    ):
        assert fact in card, fact


def observer_file(tmp_path: Path, run_dir: Path, contributors) -> Path:
    facts = exported_facts(run_dir)
    view = {"run": {"run_id": facts["run_id"], "fingerprint": facts["fingerprint"]}, "contributors": contributors}
    path = tmp_path / "observer.json"
    path.write_text(json.dumps(view))
    return path


def test_export_lists_the_observers_contributors_by_verified_tokens(trained_run, tmp_path, capsys):
    found = [{"peer": f"Qm{c * 20}", "name": c, "tokens": t, "rounds": 2} for c, t in zip("abc", (10, 300, 20))]
    path, out = observer_file(tmp_path, trained_run, found), tmp_path / "model"
    assert main_in_process(capsys, "export", str(trained_run), str(out), "--contributors", str(path)).returncode == 0
    in_order = [found[1], found[2], found[0]]
    unmarked = {"tokens_trained": None, "revoked": None, "convicted_by": []}  # an observer that did not say
    assert json.loads((out / "provenance.json").read_text())["contributors"] == [{**c, **unmarked} for c in in_order]
    card = (out / "README.md").read_text()
    rows = [line for line in card.splitlines() if line.startswith(("| 1 |", "| 2 |", "| 3 |"))]
    expected = [
        f"| {i} | `{c['peer']}` | {c['name']} | {c['tokens']:,} | not said | 2 |  |" for i, c in enumerate(in_order, 1)
    ]
    assert rows == expected
    assert "330 credited tokens from 3 peers" in card


def test_export_refuses_a_malformed_contributors_file_in_one_line_and_writes_nothing(trained_run, tmp_path, capsys):
    path, out = observer_file(tmp_path, trained_run, [{"peer": "Qm1", "tokens": "many", "rounds": 1}]), tmp_path / "m"
    result = main_in_process(capsys, "export", str(trained_run), str(out), "--contributors", str(path))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert_one_line_error(result, "contributor 0: tokens must be a whole number", "/api/v1/run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["observer.json"]


def test_export_to_an_unreachable_hub_fails_at_once_and_keeps_the_folder(trained_run, tmp_path, capsys, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    out = tmp_path / "model"
    result = main_in_process(capsys, "export", str(trained_run), str(out), "--push-to-hub", "someone/model")
    assert result.returncode == 1
    assert_one_line_error(result, "cannot reach the Hub", f"upload it later with `hf upload someone/model {out}`")
    assert (out / "model.safetensors").exists() and (out / "README.md").exists()
    assert_one_line_error(
        main_in_process(capsys, "export", str(trained_run), str(tmp_path / "m2"), "--push-to-hub", "not/a/repo"),
        "is not a Hub repo id",
    )
    assert not (tmp_path / "m2").exists()


def test_export_pushes_the_folder_to_a_hub_stand_in(trained_run, tmp_path, capsys, monkeypatch):
    from tests.unit.hub_standin import HubStandIn

    out = tmp_path / "model"
    with HubStandIn() as hub:  # a stand-in for the Hub, not the Hub: see tests/unit/hub_standin.py
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        result = main_in_process(capsys, "export", str(trained_run), str(out), "--push-to-hub", "someone/model")
    assert result.returncode == 0 and f"uploaded to {hub.url}/someone/model" in result.stdout
    exported = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert hub.repos == {"someone/model": exported}
    assert 'from_pretrained("someone/model")' in (out / "README.md").read_text()


def test_config_command_prints_the_resolved_config_and_fingerprint():
    result = run_cli("config", "--inner.steps=7")
    assert result.returncode == 0
    assert result.stdout.startswith("# fingerprint ") and "steps = 7" in result.stdout
    assert os.linesep.join(["", "[inner]"]) in result.stdout


def test_an_export_from_a_certified_swarm_without_a_certified_key_says_what_it_needs_at_once(tmp_path, capsys):
    from p2p_diloco.trust import admission

    public = admission.make_run_key(tmp_path / "run.key")
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(f'[admission]\nmode = "certified"\norganiser_key = "{public}"\n')
    entry = "/ip4/127.0.0.1/tcp/9/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ"
    started = time.monotonic()
    out = tmp_path / "out"
    result = main_in_process(capsys, "export", str(out), "--config", str(run_toml), "--initial-peers", entry)
    assert time.monotonic() - started < 10, "it must not wait for the swarm first"
    assert_one_line_error(result, "is certified: its peers serve their state to admitted peers only")
    assert "--identity KEY --certificate FILE" in result.stderr and "export RUN_DIR OUT" in result.stderr
    assert result.returncode == 2 and not out.exists()
