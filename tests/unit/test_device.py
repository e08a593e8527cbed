"""run.device: what `auto` picks, and the GPU-sized model it will not put on a CPU unasked."""

from __future__ import annotations

import pytest
import torch

from p2p_diloco.config import ModelSection
from p2p_diloco.errors import ConfigError
from p2p_diloco.peer import auto_device, resolve_device
from p2p_diloco.train.model import GPU_SIZED_PARAMETERS, ByteTokenizer, model_config, parameter_count

TINY, SMALL, P150M, P1B = 469_632, 25_969_152, 122_982_272, 970_057_728  # the presets (test_model.py)


def preset_config(preset: str):
    return model_config(ModelSection(preset=preset, seq_len=32), ByteTokenizer.vocab_size)


def test_auto_is_the_gpu_whenever_there_is_one_whatever_the_size():
    assert [auto_device(True, n, "2.13.0") for n in (TINY, P150M, P1B)] == ["cuda", "cuda", "cuda"]


def test_auto_without_a_gpu_trains_tiny_and_small_on_the_cpu():
    assert [auto_device(False, n, "2.13.0+cpu") for n in (TINY, SMALL, GPU_SIZED_PARAMETERS - 1)] == ["cpu"] * 3


@pytest.mark.parametrize("parameters", [GPU_SIZED_PARAMETERS, P150M, P1B], ids=["the-line", "150m", "1b"])
def test_auto_without_a_gpu_refuses_a_gpu_sized_model_naming_both_fixes(parameters):
    with pytest.raises(ConfigError) as refused:
        auto_device(False, parameters, "2.13.0+cpu")
    assert str(refused.value) == (
        f"run.device = auto but torch 2.13.0+cpu sees no GPU, and the model's {parameters:,} parameters are "
        "GPU-sized (100,000,000 or more: the 150m preset and up); install a CUDA build of torch (README: GPU "
        "peers), or pass --run.device=cpu to train on the CPU anyway (slow)"
    )


def test_the_gpu_sized_line_falls_between_the_small_and_150m_presets():
    assert parameter_count(preset_config("small")) == SMALL < GPU_SIZED_PARAMETERS
    assert parameter_count(preset_config("150m")) == P150M >= GPU_SIZED_PARAMETERS


def test_an_explicit_cpu_device_trains_a_model_of_any_size():
    assert resolve_device("cpu", preset_config("1b")) == torch.device("cpu")


def test_auto_counts_the_model_it_is_given_when_there_is_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    assert resolve_device("auto", preset_config("small")) == torch.device("cpu")
    with pytest.raises(ConfigError, match=f"the model's {P150M:,} parameters are GPU-sized"):
        resolve_device("auto", preset_config("150m"))
