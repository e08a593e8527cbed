"""The GPU check (bench/gpu_check.sh) is ready to run where a GPU is lent: its Python helpers run
here on the CPU at toy sizes, and the script itself parses. The full check, steps and deadlines
included, runs on a CPU with `bench/gpu_check.sh --smoke DIR` (about a minute: it starts a swarm).
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from p2p_diloco import config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    """Import a bench/ script as the scripts import each other: with bench/ on sys.path."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_the_gpu_check_script_parses_and_bounds_every_step_with_a_deadline():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True, timeout=10)
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "set -euo pipefail" in script and 'timeout --kill-after=10 "$budget"' in script
    assert "DEADLINE_S=${DEADLINE_S:-600}" in script


def test_preset_speed_on_a_cpu_reports_tokens_per_s_and_mfu_from_a_given_peak(bench, tmp_path):
    presets = bench("gpu_presets")
    out = tmp_path / "presets.json"
    argv = ["--device", "cpu", "--presets", "tiny", "--steps", "2", "--warmup-steps", "1", "--seq-len", "32"]
    assert presets.main([*argv, "--micro-batch", "2", "--peak-tflops", "1", "--out", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    # 6 x (469,632 parameters - 264 x 128 of input embedding) + 12 x 2 layers x 128 hidden x 32 tokens
    assert case["flops_per_token"] == 6 * (469_632 - 264 * 128) + 12 * 2 * 128 * 32 == 2_713_344
    assert case["tokens_per_s"] == pytest.approx(2 * 4 * 32 / (2 * case["step_s"]))
    assert case["mfu"] == pytest.approx(case["tokens_per_s"] * 2_713_344 / 1e12)
    assert case["peak_allocated_gib"] is None and torch.isfinite(torch.tensor(case["final_loss"]))


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA L40S", 362.1),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA Tesla T4", None),
    ],
)
def test_peak_flops_come_from_the_longest_matching_name(bench, monkeypatch, name, tflops):
    presets = bench("gpu_presets")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: name)
    peak, shown = presets.peak_flops(torch.device("cuda"), None)
    assert (peak, shown) == ((tflops * 1e12 if tflops else None), name)


def test_diloco_against_data_parallel_on_a_cpu_sees_equal_tokens_and_learns(bench, tmp_path):
    out = tmp_path / "diloco.json"
    assert bench("gpu_diloco").main(["--device", "cpu", "--smoke", "--out", str(out)]) == 0
    dp, diloco, single = json.loads(out.read_text())["runs"]
    assert dp["curve"][-1][0] == diloco["curve"][-1][0] == 2 * single["curve"][-1][0]  # k = 2 in the smoke run
    assert dp["curve"][0] == diloco["curve"][0] == single["curve"][0]  # the same theta(0), the same held-out set
    assert all(r["final_eval_loss"] < r["curve"][0][1] for r in (dp, diloco, single))


def test_the_gpu_swarm_check_runs_a_valid_config_of_two_peers(bench):
    swarm = bench("gpu_swarm")
    args = swarm.argparse.Namespace(device="cuda", preset="small", rounds=3, steps=10, seq_len=256)
    c = config.load(None, swarm.overrides(args))
    assert (c.run.device, c.run.rounds, c.data.num_shards, c.swarm.speed_aware) == ("cuda", 3, 2, False)
