"""Training speed of model presets on one device: tokens/s, model FLOPs utilisation (MFU) and peak
memory of the package's own inner step (`InnerTrainer.train_step`: AdamW, gradient accumulation,
clipping, autocast), what a peer runs.

    python bench/gpu_presets.py --device cuda --presets small 150m --out bench/results/gpu_presets.json
    python bench/gpu_presets.py --device cuda --presets 150m --vocab 32000 --micro-batch 8 16 \\
        --out bench/results/gpu_public_150m.json      # peers/public-150m.toml's shape (Llama 2's vocabulary)
    python bench/gpu_presets.py --device cpu --presets tiny --steps 2 --warmup-steps 1 --seq-len 32 \\
        --micro-batch 2 --out /tmp/smoke.json        # smoke test (tests/unit/test_gpu_bench.py)

Batches are random token ids: a step's speed does not depend on them. Each case runs `--warmup-steps`
steps (CUDA kernels chosen, AdamW state allocated), then times `--steps` steps between two device
synchronisations. Peak memory is torch's allocator peak over the timed steps (model, gradients,
AdamW state and activations; the CUDA context, ~0.5 GB, comes on top).

MFU = tokens/s x FLOPs per token / the device's peak dense bf16 FLOP/s. FLOPs per token of a training
step (forward and backward): 6 x the parameters that multiply (all but the input embedding, a
lookup) + 12 x layers x hidden x seq_len (attention scores and their use; PaLM's count, appendix B,
causal masking not discounted).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from p2p_diloco.config import InnerSection, ModelSection
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.model import ByteTokenizer, init_model, model_config, parameter_count

# Peak dense bf16 tensor FLOP/s (fp32 accumulate) from NVIDIA's data sheets, by a part of the name
# torch reports; the first match wins, so a longer name comes before its prefix.
PEAK_BF16_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L4", 121.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
)


def peak_flops(device: torch.device, override_tflops: float | None) -> tuple[float | None, str]:
    """(peak FLOP/s or None if unknown, the device's name)."""
    if device.type != "cuda":
        name = platform.processor() or platform.machine()
        return (override_tflops * 1e12 if override_tflops else None), f"cpu {name}"
    name = torch.cuda.get_device_name(device)
    if override_tflops:
        return override_tflops * 1e12, name
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in name:
            return tflops * 1e12, name
    return None, name


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of the model `config` describes."""
    embedding = config.vocab_size * config.hidden_size  # the input embedding: a lookup, no multiply
    matmul_params = parameter_count(config) - embedding
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq_len
    return 6 * matmul_params + attention


def measure(preset: str, micro: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One case: `preset` at micro-batch `micro` for args.steps timed steps."""
    config = model_config(ModelSection(preset=preset, seq_len=args.seq_len), args.vocab)
    model = init_model(config, seed=0).to(device)
    batch_size = micro * args.accumulation
    inner = InnerSection(batch_size=batch_size, micro_batch_size=micro, precision=args.precision, warmup_steps=10)
    trainer = InnerTrainer(model, inner, total_steps=args.warmup_steps + args.steps, device=device)
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab, (batch_size, args.seq_len), generator=generator)
    for _ in range(args.warmup_steps):
        trainer.train_step(batch)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    losses = [trainer.train_step(batch) for _ in range(args.steps)]
    synchronize(device)
    elapsed = time.perf_counter() - started
    tokens_per_s = args.steps * batch_size * args.seq_len / elapsed
    result = {
        "preset": preset,
        "parameters": parameter_count(config),
        "vocab_size": config.vocab_size,
        "seq_len": args.seq_len,
        "micro_batch": micro,
        "accumulation": args.accumulation,
        "steps": args.steps,
        "step_s": elapsed / args.steps,
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token(config, args.seq_len),
        "final_loss": float(losses[-1]),
        **memory(device),
    }
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--presets", nargs="+", default=["small", "150m"])
    parser.add_argument("--micro-batch", nargs="+", type=int, default=[8], help="sequences per forward pass")
    parser.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=ByteTokenizer.vocab_size, help="259: the byte tokenizer")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, if not in the table")
    parser.add_argument("--out", required=True, help="the JSON file to write")
    return parser.parse_args(argv)


def usable(name: str) -> torch.device | None:
    """The device named, or None (said on stderr) if it is CUDA and this machine has none."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return None
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = usable(args.device)
    if device is None:
        return 2
    peak, name = peak_flops(device, args.peak_tflops)
    cases = []
    for preset in args.presets:
        for micro in args.micro_batch:
            case = measure(preset, micro, args, device)
            case["mfu"] = case["tokens_per_s"] * case["flops_per_token"] / peak if peak else None
            cases.append(case)
            print(describe(case), flush=True)
    result = {
        "device": name,
        "peak_bf16_flops": peak,
        "precision": args.precision,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cases": cases,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def describe(case: dict) -> str:
    mfu = f"{100 * case['mfu']:.1f} %" if case["mfu"] is not None else "n/a"
    peak = f"{case['peak_allocated_gib']:.2f} GiB" if case["peak_allocated_gib"] is not None else "n/a"
    return (
        f"{case['preset']} ({case['parameters'] / 1e6:.1f}M, vocab {case['vocab_size']}), micro-batch "
        f"{case['micro_batch']} x {case['seq_len']}: {case['tokens_per_s']:,.0f} tokens/s, "
        f"{case['step_s']:.3f} s/step, MFU {mfu}, peak memory {peak}"
    )


if __name__ == "__main__":
    sys.exit(main())
