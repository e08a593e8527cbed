"""The data-parallel baseline refuses what cannot run, before any worker starts."""

import re

import pytest

from p2p_diloco import config
from p2p_diloco.errors import ConfigError
from p2p_diloco.train import dataparallel
from tests.conftest import TINY


@pytest.mark.parametrize(
    "workers, extra, fragment",
    [
        (0, {}, "--workers must be >= 1, got 0"),
        (8, {}, "--workers 8 needs at least that many shards, data.num_shards is 4"),
        (2, {"data.shard": "1"}, "data.shard names one shard"),
    ],
)
def test_refusals_name_the_problem(tmp_path, workers, extra, fragment):
    overrides = {**TINY, "run.dir": str(tmp_path / "run"), **extra}
    if "data.shard" not in extra:
        del overrides["data.shard"]
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        dataparallel.check(config.load(None, overrides), workers)


def test_a_run_dir_with_metrics_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    overrides = {**TINY, "run.dir": str(tmp_path / "run")}
    del overrides["data.shard"]
    with pytest.raises(ConfigError, match="already holds a metrics.jsonl"):
        dataparallel.check(config.load(None, overrides), 2)


def test_the_communication_hook_counts_what_a_ring_sends():
    comm = dataparallel.Communication(4)
    comm.payload = 1000
    assert comm.bytes_sent() == 1500  # 2 (k - 1) / k of the gradient bytes
    assert dataparallel.Communication(1).bytes_sent() == 0
