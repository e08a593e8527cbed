"""Shared test helpers: a tiny run config on the embedded default corpus."""

import pytest

from p2p_diloco import config

TINY = {
    "run.rounds": "3",
    "run.eval_sequences": "4",
    "model.preset": "tiny",
    "model.seq_len": "32",
    "data.num_shards": "4",
    "data.shard": "1",
    "inner.steps": "2",
    "inner.batch_size": "4",
    "inner.micro_batch_size": "2",
    "inner.warmup_steps": "2",
    "inner.lr": "3e-3",
    "log.progress": "false",
    "swarm.linger_s": "0",  # swarm tests wait for peers that still finish; the window has its own test
}


@pytest.fixture
def tiny_overrides(tmp_path):
    """Overrides for a run of 3 rounds x 2 steps of the tiny model, seconds on a CPU."""
    return {**TINY, "run.dir": str(tmp_path / "run")}


@pytest.fixture
def tiny_config(tiny_overrides):
    return config.load(None, tiny_overrides)
