"""Which device each rank of a peer trains on, and the configs a peer of several ranks refuses."""

import pytest
import torch

from p2p_diloco import config
from p2p_diloco.errors import ConfigError
from p2p_diloco.train.ranks import rank_devices
from tests.conftest import TINY


def test_rank_r_trains_on_cuda_r_and_cpu_ranks_share_the_cpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert rank_devices(cuda, 1, 4) == [cuda]  # one process keeps run.device as it is
    assert rank_devices(cuda, 3, 4) == [torch.device("cuda", r) for r in range(3)]
    assert rank_devices(cpu, 2, 0) == [cpu, cpu]


def test_more_ranks_than_gpus_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"run.nproc = 4 trains on 4 GPUs .* torch sees 2; pass --nproc 2$"):
        rank_devices(torch.device("cuda"), 4, 2)
    with pytest.raises(ConfigError, match=r"torch sees 0; install a CUDA build of torch, or pass --run.device=cpu$"):
        rank_devices(torch.device("cuda"), 2, 0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"run.nproc": "0"}, r"run.nproc must be >= 1, got 0"),
        ({"run.nproc": "3"}, r"\(2\) must divide each rank's share of inner.batch_size \(4 / run.nproc 3\)"),
        ({"run.nproc": "4"}, r"\(2\) must divide each rank's share of inner.batch_size \(4 / run.nproc 4\)"),
        ({"run.nproc": "2", "run.device": "cuda:1"}, r"run.device = cuda:1 names one GPU, but run.nproc = 2"),
    ],
)
def test_configs_a_peer_of_several_ranks_cannot_train(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(None, {**TINY, **overrides})
    assert config.load(None, {**TINY, "run.nproc": "2"}).run.nproc == 2
