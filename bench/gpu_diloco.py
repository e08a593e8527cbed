"""DiLoCo with k = 4 workers against data-parallel training and a single worker, on one GPU, with a
40M-parameter Llama (bench/convergence.py measures the same on a CPU with the 0.47M tiny preset).

All in one process, with the package's own inner and outer code. The k DiLoCo workers train one
after another on the device, each with its own model and AdamW state (`InnerTrainer`), H steps from
the same theta(r) on its own shard; their pseudo-gradients are averaged (equal weights: equal
tokens) and `outer.outer_step` (CPU, fp32) makes theta(r+1). Data-parallel is one model stepping on
the k workers' batches at once: the mean of k workers' gradients of their mean losses is the
gradient of the mean loss over the k batches, which one step on the concatenated batch computes
(up to float summation order). So all see the same tokens in the same steps, with the same inner lr
schedule; the single worker sees one worker's. The swarm itself (hivemind, codecs, agreement) is not
part of this run: bench/gpu_swarm.py checks it on the GPU.

    python bench/gpu_diloco.py --device cuda --out bench/results/gpu_diloco.json
    python bench/gpu_diloco.py --device cpu --smoke --out /tmp/diloco.json   # seconds (tests/unit/test_gpu_bench.py)

The JSON is rewritten after each run, so a deadline that cuts the last run short keeps the others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gpu_presets import usable  # bench/ is on sys.path: the scripts import each other
from transformers import LlamaConfig

from p2p_diloco.config import DataSection, InnerSection
from p2p_diloco.protocol import outer
from p2p_diloco.train.data import TrainStream, heldout_batch, open_corpus
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.model import ByteTokenizer, init_model, parameter_count

HELDOUT_FRACTION = 0.05
# A Llama between the small (26M) and 150m (123M) presets, laid out as they are (head size 64,
# SwiGLU at 8/3 x hidden rounded up to 64, untied embeddings): 39,998,080 parameters with bytes.
MODEL_40M = dict(hidden_size=640, num_hidden_layers=8, num_attention_heads=10, head_dim=64, intermediate_size=1728)
MODEL_SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16, intermediate_size=176)
SMOKE = dict(k=2, rounds=2, steps=2, batch=2, micro_batch=2, seq_len=32, eval_sequences=2, warmup=1)


def llama(shape: dict, seq_len: int) -> LlamaConfig:
    vocab = -(-ByteTokenizer.vocab_size // 8) * 8  # as the presets: a multiple of 8
    return LlamaConfig(**shape, vocab_size=vocab, max_position_embeddings=seq_len, tie_word_embeddings=False)


class Bench:
    """The corpus, shards, held-out batch and schedule shared by every run."""

    def __init__(self, args: argparse.Namespace, device: torch.device):
        self.args, self.device = args, device
        self.config = llama(MODEL_SMOKE if args.smoke else MODEL_40M, args.seq_len)
        self.tokenizer = ByteTokenizer()
        self.corpus = open_corpus(DataSection(num_shards=args.k, heldout_fraction=HELDOUT_FRACTION))
        self.heldout = heldout_batch(self.corpus, self.tokenizer, args.seq_len, args.eval_sequences, HELDOUT_FRACTION)
        self.total_steps = args.rounds * args.steps

    def streams(self, n: int) -> list[TrainStream]:
        """Shards 0..n-1 of k: worker i reads shard i, as `p2p-diloco baseline` and the peers do."""
        a = self.args
        return [TrainStream(self.corpus, self.tokenizer, a.seq_len, i, a.k, a.seed, HELDOUT_FRACTION) for i in range(n)]

    def trainer(self, batch_size: int) -> InnerTrainer:
        a = self.args
        inner = InnerSection(
            steps=a.steps,
            batch_size=batch_size,
            micro_batch_size=min(a.micro_batch, batch_size),
            lr=a.lr,
            warmup_steps=a.warmup,
            precision="bf16" if self.device.type == "cuda" else "fp32",
        )
        model = init_model(self.config, self.args.seed).to(self.device)
        return InnerTrainer(model, inner, self.total_steps, self.device)

    def evaluate(self, evaluator: InnerTrainer, params: dict[str, torch.Tensor] | None = None) -> float:
        if params is not None:
            load(evaluator.model, params)
        return evaluator.evaluate(self.heldout)


def load(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def synchronous(bench: Bench, workers: int) -> list[tuple[int, float]]:
    """Data-parallel over `workers` shards (1: the single worker): one step on their batches at once."""
    a = bench.args
    streams = bench.streams(workers)
    trainer = bench.trainer(a.batch * workers)
    curve = [(0, bench.evaluate(trainer))]
    for r in range(1, a.rounds + 1):
        trainer.run_phase(lambda: torch.cat([s.next_batch(a.batch) for s in streams]), a.steps)
        curve.append((r * a.steps * a.batch * workers * a.seq_len, bench.evaluate(trainer)))
    return curve


def diloco(bench: Bench) -> list[tuple[int, float]]:
    """k workers, `rounds` rounds of H inner steps each, the outer Nesterov step between rounds."""
    a = bench.args
    streams = bench.streams(a.k)
    workers = [bench.trainer(a.batch) for _ in range(a.k)]
    state = outer.initial_state(dict(workers[0].model.named_parameters()))
    curve = [(0, bench.evaluate(workers[0]))]
    for r in range(1, a.rounds + 1):
        deltas = []
        for worker, stream in zip(workers, streams):
            load(worker.model, state.params)
            worker.run_phase(lambda stream=stream: stream.next_batch(a.batch), a.steps)
            deltas.append(outer.pseudo_gradient(state.params, dict(worker.model.named_parameters())))
        state = outer.outer_step(
            state, outer.weighted_mean(deltas, [1.0] * a.k), a.outer_lr, a.outer_momentum, nesterov=True
        )
        curve.append((r * a.steps * a.batch * a.k * a.seq_len, bench.evaluate(workers[0], state.params)))
    return curve


def record(name: str, run: Callable[[], list[tuple[int, float]]], device: torch.device) -> dict:
    started = time.perf_counter()
    curve = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    tokens, loss = curve[-1]
    print(f"{name}: held-out loss {loss:.4f} after {tokens:,} tokens, {wall:.0f} s", flush=True)
    return {"name": name, "final_eval_loss": loss, "final_ppl": math.exp(loss), "wall_s": wall, "curve": curve}


def setting(bench: Bench) -> dict:
    a = bench.args
    return {
        "parameters": parameter_count(bench.config),
        "model": {k: getattr(bench.config, k) for k in MODEL_40M},
        "corpus": bench.corpus.description,
        **{k: getattr(a, k) for k in ("k", "rounds", "steps", "batch", "seq_len", "lr", "warmup", "outer_lr")},
        "outer_momentum": a.outer_momentum,
        "device": torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--k", type=int, default=4, help="DiLoCo workers and data-parallel workers")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=50, help="H")
    p.add_argument("--batch", type=int, default=32, help="sequences per worker and step")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3, help="inner (and baseline) AdamW peak lr")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--outer-lr", type=float, default=0.7, help="the paper's; bench/convergence.py uses 0.2")
    p.add_argument("--outer-momentum", type=float, default=0.9)
    p.add_argument("--eval-sequences", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for a CPU: " + str(SMOKE))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = usable(args.device)
    if device is None:
        return 2
    bench = Bench(args, device)
    result: dict = {"setting": setting(bench), "runs": []}
    plan = [
        (f"data-parallel ({args.k} workers)", lambda: synchronous(bench, args.k)),
        (f"DiLoCo k={args.k}, H={args.steps}", lambda: diloco(bench)),
        ("single worker", lambda: synchronous(bench, 1)),
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, run in plan:
        result["runs"].append(record(name, run, device))
        dp = result["runs"][0]["final_eval_loss"]
        for r in result["runs"]:
            r["vs_dp_pct"] = 100 * (r["final_eval_loss"] / dp - 1)
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
