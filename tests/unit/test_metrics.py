"""metrics.jsonl on a full disk, and log lines that reach stderr once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from p2p_diloco import config
from p2p_diloco.errors import WriteError
from p2p_diloco.train.metrics import MetricsLog
from tests.unit.full_disk import fill, tmpfs


def test_a_full_disk_cuts_metrics_back_to_whole_lines(tmp_path):
    with tmpfs(tmp_path / "disk", 64 * 1024) as disk:
        log = MetricsLog(disk / "metrics.jsonl")
        log.append({"round": 0, "eval_loss": 5.5})
        log.append({"round": 1, "eval_loss": 4.25})
        before = log.path.read_bytes()
        fill(disk)  # what is left: the rest of the page metrics.jsonl already holds
        with pytest.raises(WriteError) as failed:
            log.append({"round": 2, "note": "x" * 5000})  # more than that rest: written in part, then ENOSPC
        assert str(failed.value) == (
            f"cannot write {log.path} (No space left on device); free space on {disk} or choose another --run.dir"
        )
        assert log.path.read_bytes() == before
        assert list(log.records()) == [{"round": 0, "eval_loss": 5.5}, {"round": 1, "eval_loss": 4.25}]


def test_a_full_disk_leaves_config_toml_as_it_was(tmp_path):
    with tmpfs(tmp_path / "disk", 64 * 1024) as disk:
        (disk / "config.toml").write_text("# the config of the run so far\n")
        fill(disk)
        with pytest.raises(WriteError) as failed:
            config.save(config.load(), disk / "config.toml", "the checkpoint of round 4 is intact")
        assert str(failed.value) == (
            f"cannot write {disk / 'config.toml'} (No space left on device); free space on {disk} or choose "
            "another --run.dir; the checkpoint of round 4 is intact"
        )
        assert sorted(p.name for p in disk.iterdir()) == ["config.toml", "filler"]
        assert (disk / "config.toml").read_text() == "# the config of the run so far\n"


# A hub request that fails and is retried once, a datasets warning and a line of ours, in a fresh
# interpreter: the libraries' own handlers are made at their import, as in a peer.
HUB_AND_DATASETS_WARN = """
import logging, sys
import datasets
from huggingface_hub.utils import http_backoff
from p2p_diloco.train.metrics import setup_logging

setup_logging("info")
try:
    http_backoff("HEAD", sys.argv[1], max_retries=1, base_wait_time=0.01)
except Exception:
    pass
datasets.utils.logging.get_logger("datasets.load").warning("a datasets warning")
logging.getLogger("p2p_diloco.peer").info("a line of ours")
"""


# How many lines of stderr hold each text: the refused HEAD is logged at the try and at the retry.
LINES_HOLDING = {
    "thrown while requesting HEAD http://127.0.0.1:": 2,
    "Retrying in 0.01s [Retry 1/1].": 1,
    "a datasets warning": 1,
    "a line of ours": 1,
}


def test_a_hub_or_datasets_warning_reaches_stderr_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")} | {"HF_HOME": str(tmp_path / "hf")}
    with socket.socket() as closed:  # bound, never listening: a request to it is refused at once
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/"
        done = subprocess.run(
            [sys.executable, "-c", HUB_AND_DATASETS_WARN, url], capture_output=True, text=True, env=env, timeout=60
        )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert {text: sum(text in line for line in lines) for text in LINES_HOLDING} == LINES_HOLDING, done.stderr


def test_a_peer_s_averager_process_names_the_peer_in_every_line_of_ours():
    import io
    import logging

    from p2p_diloco.train.metrics import tag_process_logs

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers[:] = [handler]  # as in the forked averager process: the peer's one handler
    try:
        tag_process_logs("peer T4fo averager")
        logging.getLogger("p2p_diloco.swarm.averaging.averager").warning(
            "parts of this peer's span: %s", "Qm1: 1 dropped of 1"
        )
        logging.getLogger("p2p_diloco.swarm.trust.doors").warning("[already tagged] x")
        logging.getLogger("another_library").warning("theirs")  # (hivemind's loggers do not reach the root)
    finally:
        root.handlers[:] = saved
    assert out.getvalue().splitlines() == [
        "[peer T4fo averager] parts of this peer's span: Qm1: 1 dropped of 1",
        "[already tagged] x",
        "theirs",
    ]
