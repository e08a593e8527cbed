"""A peer of two processes (run.nproc = 2, gloo on the CPU), in-process as rank 0 with its follower a
real child process. Replicated (DDP) it trains bit for bit what one process trains; sharded (FSDP) the
same within rounding, and it resumes bit-exactly (AdamW's state gathered into the checkpoint and
sharded again)."""

import json
from pathlib import Path

import pytest
import torch

from p2p_diloco import config
from p2p_diloco.peer import Peer
from p2p_diloco.train import checkpoint, fsdp
from tests.conftest import TINY
from tests.e2e.test_peer_resume import StopAfter, digests, run_peer


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The tiny run trained by one process: batch 4 in micro-batches of 2, 3 rounds."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    cfg = config.load(None, config_overrides(run_dir))
    assert cfg.inner.micro_batch_size == 2 and cfg.inner.batch_size == 4 and cfg.run.rounds == 3
    run_peer(cfg)
    return run_dir


def run_stopped(cfg):
    """Round 1, then Ctrl+C after 1 of round 2's 2 steps (both ranks stop there); the follower's exit code."""
    peer = Peer(cfg)
    try:
        (follower,) = peer.ranks._followers
        assert follower.is_alive()
        peer.run(StopAfter(5))
    finally:
        peer.close()
    assert checkpoint.latest(cfg.run.dir).name == "round-000001.pt"
    return follower.exitcode


def test_two_ranks_train_bit_for_bit_what_one_process_trains(tmp_path, one_process):
    # Each rank trains 2 of the batch's 4 rows: what one process's 2 micro-batches train. (Their
    # resume: tests/e2e/test_cli.py stops such a peer with Ctrl+C and resumes it; every phase after
    # checks that both ranks hold the same bits.)
    two = config.load(None, {**config_overrides(tmp_path / "two"), "run.nproc": "2"})
    peer = Peer(two)
    try:
        (follower,) = peer.ranks._followers
        assert follower.is_alive()
        peer.run()
    finally:
        peer.close()
    assert follower.exitcode == 0  # told to exit, not terminated
    assert digests(Path(two.run.dir)) == digests(one_process)
    # The peer's tokens (both ranks'), and the mean loss over both ranks' rows (summed in another order).
    mine, ours = records(one_process), records(Path(two.run.dir))
    assert [r.get("tokens") for r in ours] == [r.get("tokens") for r in mine] == [0, 256, 256, 256]
    assert [r["train_loss"] for r in ours[1:]] == pytest.approx([r["train_loss"] for r in mine[1:]], rel=1e-6)


def test_sharded_ranks_train_what_one_process_trains_within_rounding_and_resume_bit_exactly(tmp_path, one_process):
    sharded = {**config_overrides(tmp_path / "whole"), "run.nproc": "2", "run.fsdp": "true"}
    whole = config.load(None, sharded)
    peer = Peer(whole)
    try:  # rank 0 holds half of each parameter's rows: the embedding's 264 rows (the vocabulary) as 132
        fsdp.resharded(peer.model)  # held gathered since the evaluation of θ(0), a forward without backward
        embedding = dict(peer.model.named_parameters())["model.embed_tokens.weight"]
        assert embedding.shape[0] == 264 and embedding.to_local().shape[0] == 132
        peer.run()
    finally:
        peer.close()
    split = config.load(None, {**sharded, "run.dir": str(tmp_path / "split")})
    assert run_stopped(split) == 0
    run_peer(split, resume=True)  # AdamW's state gathered into the checkpoint, sharded again
    assert digests(Path(split.run.dir)) == digests(Path(whole.run.dir))
    mine, ours = records(one_process), records(Path(whole.run.dir))
    assert [r["train_loss"] for r in ours[1:]] == pytest.approx([r["train_loss"] for r in mine[1:]], rel=1e-5)
    assert [r["eval_loss"] for r in ours] == pytest.approx([r["eval_loss"] for r in mine], rel=1e-5)
    theirs, ours_theta = (checkpoint.load(checkpoint.latest(d))["params"] for d in (one_process, whole.run.dir))
    for name, theta in theirs.items():
        torch.testing.assert_close(ours_theta[name], theta, rtol=0, atol=1e-5)


def config_overrides(run_dir):
    return {**TINY, "run.dir": str(run_dir)}
