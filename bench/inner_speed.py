"""Inner-loop speed, measured: tokens/s of the peer's inner phase against a bare PyTorch loop with
the same model, batch and optimizer, in one process. Target: the peer at 0.98 of the bare loop or
better. Writes bench/results/inner_speed.json.

    python bench/inner_speed.py                       # CPU: peers/cpu.toml (tiny, 32 x 128 tokens), ~2.5 min
    python bench/inner_speed.py --preset small --budget-s 300        # 26M parameters: ~7 s a step on 2 cores
    python bench/inner_speed.py --device cuda         # peers/home-gpu.toml (150m, 64 x 1,024, bf16), MFU, memory
    python bench/inner_speed.py --device cuda --compile                 # both arms under torch.compile

The two arms:
- peer: `InnerTrainer.run_phase` fed by the peer's data path, a `Prefetcher` (pinned memory on
  CUDA) over a `TrainStream` of the profile's corpus and shard, with the peer's per-step callback
  (progress bar off, as in a log file): schedule, accumulation, clipping, autocast, the step
  losses kept on the device and read at the end of the phase.
- bare: the loop a tutorial writes: the same model (same init), micro-batches, autocast, clipping
  and AdamW (fused on CUDA, foreach on the CPU, as the peer's), on batches built beforehand and
  already on the device; no schedule, no callback, no loss read.

Both run with the same torch threads (`--threads`), after `--warmup-steps` each, in pairs: a peer
phase of `--steps` steps and a bare run of as many (A B, then B A), pairs until `--budget-s` is
spent. A pair's ratio is peer tokens/s over bare tokens/s; the figure is the median over pairs with
a bootstrap 95 % interval. On a shared CPU other processes move step times by tens of percent
within seconds, so the CPU arms are one step each (0.1-0.3 s): both arms of a pair see nearly the
same load, and many pairs narrow the interval. A 1-step phase pays the phase's own costs (the
loss read, the end) at every step instead of once per H = 50 steps, which can only understate the
peer. On CUDA the arms run 10 steps, and both synchronise only at their end.

On CUDA also: MFU = tokens/s x FLOPs per token / the GPU's peak bf16 FLOP/s (FLOPs per token and
the table of GPUs from bench/gpu_presets.py, or `--peak-tflops`), and the peer arm's peak memory
(`torch.cuda.max_memory_allocated`, taken before the bare arm's model exists).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpu_presets import flops_per_token, peak_flops  # bench/ is on sys.path when run as a script

from p2p_diloco import config
from p2p_diloco.config import Config
from p2p_diloco.train import data
from p2p_diloco.train import model as model_mod
from p2p_diloco.train.inner import InnerTrainer, autocast_dtype
from p2p_diloco.train.metrics import ProgressBar
from p2p_diloco.train.prefetch import Prefetcher

ROOT = Path(__file__).resolve().parents[1]
PROFILES = {"cpu": ROOT / "peers" / "cpu.toml", "cuda": ROOT / "peers" / "home-gpu.toml"}
DEFAULTS = {"cpu": {"steps": 1, "budget_s": 150.0}, "cuda": {"steps": 10, "budget_s": 60.0}}
TARGET = 0.98
MIN_PAIRS = 6  # measured even past the budget: fewer give no interval worth the name
BOOTSTRAP_SAMPLES = 5000
# Pairs whose middle half spans more than this factor were measured on a machine too busy to
# trust: with 2 torch threads on 2 shared cores, two identical arms spread 0.45-4.2.
WIDE_QUARTILES = 1.25


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def new_model(cfg: Config, device: torch.device) -> torch.nn.Module:
    vocab = model_mod.load_tokenizer(cfg.model.tokenizer).vocab_size
    return model_mod.init_model(model_mod.model_config(cfg.model, vocab), cfg.run.seed).to(device)


def train_stream(cfg: Config) -> data.TrainStream:
    """Shard 0 of the profile's corpus, as a peer reads it."""
    corpus, d, seed = data.open_corpus(cfg.data), cfg.data, cfg.run.seed
    tokenizer = model_mod.load_tokenizer(cfg.model.tokenizer)
    sharding = data.sharding(corpus, d, seed)
    return data.TrainStream(corpus, tokenizer, cfg.model.seq_len, 0, d.num_shards, seed, d.heldout_fraction, sharding)


class PeerArm:
    """The peer's inner phase on the peer's data path."""

    def __init__(self, cfg: Config, device: torch.device):
        self.device, self.model = device, new_model(cfg, device)
        self.trainer = InnerTrainer(self.model, cfg.inner, 10**6, device)  # the schedule only needs a length
        self.stream = Prefetcher(train_stream(cfg), cfg.inner.batch_size, pin_memory=device.type == "cuda")
        self.progress = ProgressBar(False, "")  # the peer's bar, off (not a terminal)

    def run(self, steps: int) -> None:
        started = time.perf_counter()

        def on_step(step: int, loss: Any, tokens: int) -> None:  # as driver.PhaseRunner's
            self.progress.update(loss, tokens / max(time.perf_counter() - started, 1e-9))

        self.trainer.run_phase(self.stream.next_batch, steps, on_step=on_step)  # synchronises at its end


class BareArm:
    """A bare PyTorch loop: the same model, batches, autocast, clipping and AdamW kernel."""

    def __init__(self, cfg: Config, device: torch.device, batches: list[torch.Tensor], compile_: bool):
        self.device, self.model = device, new_model(cfg, device)
        self.forward = torch.compile(self.model) if compile_ else self.model
        self.cfg, self.batches = cfg.inner, [b.to(device) for b in batches]
        self.amp = autocast_dtype(cfg.inner.precision, device)
        cuda, params = device.type == "cuda", list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(  # nanoGPT's groups: matrices decayed, gains and biases not
            [
                {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.inner.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
            ],
            lr=cfg.inner.lr,
            betas=(cfg.inner.beta1, cfg.inner.beta2),
            fused=True if cuda else None,
            foreach=None if cuda else True,
        )

    def run(self, steps: int) -> None:
        for i in range(steps):
            parts = self.batches[i % len(self.batches)].split(self.cfg.micro_batch_size)
            for mb in parts:
                with self._autocast():
                    loss = self.forward(input_ids=mb, labels=mb).loss / len(parts)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp)


def timed(arm: PeerArm | BareArm, steps: int) -> float:
    """Wall seconds of `steps` steps of `arm`, from an idle device to an idle device."""
    sync(arm.device)
    started = time.perf_counter()
    arm.run(steps)  # ends with a device synchronisation
    return time.perf_counter() - started


def measure_pairs(peer: PeerArm, bare: BareArm, args: argparse.Namespace, tokens: int) -> list[dict[str, float]]:
    """Pairs of a peer phase and a bare run of `args.steps` steps each (A B, then B A) until the budget is spent."""
    pairs: list[dict[str, float]] = []
    deadline = time.monotonic() + args.budget_s
    while len(pairs) < MIN_PAIRS or time.monotonic() < deadline:
        arms = {"peer": peer, "bare": bare}
        order = ["peer", "bare"] if len(pairs) % 2 == 0 else ["bare", "peer"]
        seconds = {name: timed(arms[name], args.steps) for name in order}
        pair = {
            "peer_tokens_per_s": tokens / seconds["peer"],
            "bare_tokens_per_s": tokens / seconds["bare"],
            "ratio": seconds["bare"] / seconds["peer"],
        }
        pairs.append(pair)
        if len(pairs) % args.print_every == 0:
            line = f"peer {pair['peer_tokens_per_s']:,.0f} tokens/s, bare {pair['bare_tokens_per_s']:,.0f}"
            print(f"pair {len(pairs):3d} ({order[0]} first): {line}: ratio {pair['ratio']:.4f}", flush=True)
    return pairs


def summarise(ratios: list[float]) -> dict[str, Any]:
    """The median ratio, a bootstrap 95 % interval of it over pairs, and the verdict against TARGET."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP_SAMPLES))
    low, high = medians[int(0.025 * BOOTSTRAP_SAMPLES)], medians[int(0.975 * BOOTSTRAP_SAMPLES) - 1]
    if low >= TARGET:
        verdict = f"at least {TARGET}"
    elif high < TARGET:
        verdict = f"below {TARGET}"
    else:
        verdict = f"not resolved: the interval holds {TARGET}; give it a longer --budget-s or a quieter machine"
    quartiles = statistics.quantiles(ratios, n=4)[::2]
    if quartiles[1] / quartiles[0] > WIDE_QUARTILES:
        verdict += "; but the pairs spread widely (a busy machine): on a shared CPU measure with --threads 1"
    return {
        "median": statistics.median(ratios),
        "ci95": [low, high],
        "quartiles": quartiles,
        "min": min(ratios),
        "max": max(ratios),
        "verdict": verdict,
    }


def gpu_figures(result: dict[str, Any], cfg: Config, args: argparse.Namespace, device: torch.device) -> dict:
    """MFU of both arms (None where the GPU's peak is unknown) and the device's name."""
    peak, name = peak_flops(device, args.peak_tflops)
    vocab = model_mod.load_tokenizer(cfg.model.tokenizer).vocab_size
    per_token = flops_per_token(model_mod.model_config(cfg.model, vocab), cfg.model.seq_len)
    mfu = {arm: result[f"{arm}_tokens_per_s"] * per_token / peak if peak else None for arm in ("peer", "bare")}
    return {"device_name": name, "peak_bf16_flops": peak, "flops_per_token": per_token, "mfu": mfu}


def build_config(args: argparse.Namespace, device: torch.device) -> Config:
    overrides = {"run.device": str(device), "log.progress": "false", "inner.compile": str(args.compile).lower()}
    if args.preset:
        overrides["model.preset"] = args.preset
    return config.load(args.config or PROFILES[device.type], overrides)


def build_arms(cfg: Config, device: torch.device, args: argparse.Namespace) -> tuple[PeerArm, BareArm, dict]:
    """Both arms, warmed up; the peer arm's peak memory is taken before the bare arm exists."""
    peer = PeerArm(cfg, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peer.run(args.warmup_steps)
    memory = {}
    if device.type == "cuda":
        memory["peer_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    plain = train_stream(cfg)
    batches = [plain.next_batch(cfg.inner.batch_size) for _ in range(4)]
    bare = BareArm(cfg, device, batches, args.compile)
    bare.run(args.warmup_steps)
    return peer, bare, memory


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cfg = build_config(args, device)
    load_before, started = os.getloadavg(), time.perf_counter()
    peer, bare, memory = build_arms(cfg, device, args)
    try:
        pairs = measure_pairs(peer, bare, args, args.steps * cfg.inner.batch_size * cfg.model.seq_len)
    finally:
        peer.stream.close()
    result = {
        "settings": settings(cfg, args, device, sum(p.numel() for p in peer.model.parameters())),
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "wall_s": time.perf_counter() - started,
        "ratio": summarise([p["ratio"] for p in pairs]),
        "peer_tokens_per_s": statistics.median(p["peer_tokens_per_s"] for p in pairs),
        "bare_tokens_per_s": statistics.median(p["bare_tokens_per_s"] for p in pairs),
        **memory,
        "pairs": pairs,
    }
    if device.type == "cuda":
        result.update(gpu_figures(result, cfg, args, device))
    return result


def settings(cfg: Config, args: argparse.Namespace, device: torch.device, parameters: int) -> dict[str, Any]:
    return {
        "device": str(device),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "preset": cfg.model.preset,
        "parameters": parameters,
        "seq_len": cfg.model.seq_len,
        "batch_size": cfg.inner.batch_size,
        "micro_batch_size": cfg.inner.micro_batch_size,
        "precision": cfg.inner.precision,
        "compile": args.compile,
        "steps_per_arm": args.steps,
        "warmup_steps": args.warmup_steps,
        "budget_s": args.budget_s,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    parser.add_argument("--config", default=None, help="the profile (default peers/cpu.toml; CUDA: home-gpu.toml)")
    parser.add_argument("--preset", default=None, help="a model preset instead of the profile's: tiny, small, 150m")
    parser.add_argument("--steps", type=int, default=None, help="inner steps per arm and pair (CPU 1, CUDA 10)")
    parser.add_argument("--budget-s", type=float, default=None, help="seconds of pairs (CPU 150, CUDA 60)")
    parser.add_argument("--warmup-steps", type=int, default=5, help="untimed steps of each arm first")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads, both arms")
    parser.add_argument("--compile", action="store_true", help="torch.compile both arms (inner.compile = true)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's bf16 peak if not in the table")
    parser.add_argument("--print-every", type=int, default=50, help="print every n-th pair")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "inner_speed.json"))
    args = parser.parse_args(argv)
    for name, value in DEFAULTS["cuda" if args.device.startswith("cuda") else "cpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def report(result: dict[str, Any]) -> None:
    r = result["ratio"]
    spread = f"95 % bootstrap interval {r['ci95'][0]:.4f}-{r['ci95'][1]:.4f}, min {r['min']:.4f}, max {r['max']:.4f}"
    print(f"peer / bare tokens/s: {r['median']:.4f} (median of {len(result['pairs'])} pairs; {spread}): {r['verdict']}")
    print(f"peer {result['peer_tokens_per_s']:,.0f} tokens/s, bare {result['bare_tokens_per_s']:,.0f} (medians)")
    if "mfu" in result:
        mfu = {arm: f"{100 * v:.1f} %" if v is not None else "n/a" for arm, v in result["mfu"].items()}
        print(
            f"MFU peer {mfu['peer']}, bare {mfu['bare']}; peer peak memory {result['peer_peak_allocated_gib']:.2f} GiB"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    result = run(args)
    report(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
