"""Issue 17: two claims of the DiLoCo scaling-law study (Charles et al., arXiv 2503.09799) that this
machine can test, at 0.47M and 1.9M parameters.

Claim 1: DiLoCo's gap to data-parallel shrinks as the model grows. Here: DiLoCo k = 4 against
data-parallel with 4 workers, equal tokens, at the tiny preset (469,632 parameters) and at a Llama
about 4x larger (hidden 192, 4 layers, 4 heads, intermediate 528: 1,909,440 parameters).
Claim 2: DiLoCo with a single worker (k = 1) and a tuned outer lr beats plain AdamW. Here: k = 1
over a grid of outer lr x momentum at the tiny preset, against plain AdamW on the same tokens;
the grid's best setting and AdamW again on a fresh seed.

An in-process simulation, not the swarm: every piece of maths is the project's own (`init_model`,
`InnerTrainer` and its `lr_at` schedule, `TrainStream` and `sharding`, `outer.pseudo_gradient`,
`outer.weighted_mean`, `outer.outer_step`), only the network is left out. This measures the
algorithm's quality, and the swarm's exact (fp32) all-reduce produces the same token-weighted mean
that `outer.weighted_mean` computes here, so no network is needed. (bench/convergence.py runs the
real swarm, with its default codec and robust aggregator, at the tiny preset; it takes 4 minutes
per run, too slow for the 21 runs here.)

- DiLoCo with k workers: k models from the same θ(0) (`init_model` with the run seed), each with its
  own `InnerTrainer` (its AdamW state kept across rounds, as a peer keeps it) and its own
  `TrainStream` on shard i of `data.num_shards = k`. Each round: H inner steps per worker, Δ_i =
  `pseudo_gradient`, averaged by tokens with `weighted_mean`, one Nesterov `outer_step`, and the new
  θ copied into every worker's model.
- Data-parallel with k workers: one model and one AdamW; each step's batch is one batch from each
  of the k shards' streams, cut back into k micro-batches by `InnerTrainer`, so the gradient is the
  mean of the k workers' gradients, which is what gloo's averaging computes. R·H steps: the same
  tokens as DiLoCo k = k. With k = 1 it is plain AdamW.

Every arm runs the same inner schedule (warm-up, then cosine over the whole run), fp32, 2 threads,
fixed seeds, and is evaluated on the same 128 held-out sequences (`data.heldout_batch`) every H steps.

    .venv/bin/python bench/quality_scaling.py           # 40-45 minutes on 2 idle cores
    .venv/bin/python bench/quality_scaling.py --quick   # a 2-minute smoke run (writes to /tmp)
    .venv/bin/python bench/quality_scaling.py --plan    # time both sizes, print the plan, stop

Writes bench/results/quality_scaling.json and quality_scaling.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from p2p_diloco import config
from p2p_diloco.protocol import outer
from p2p_diloco.train import data, model
from p2p_diloco.train.inner import InnerTrainer

HERE = Path(__file__).resolve().parent
CPU = torch.device("cpu")
# The larger model: the tiny preset's layout (Llama, untied embeddings, byte vocabulary) about 4x
# larger. head_dim is given because a copied config keeps the tiny preset's 128 / 4 = 32.
LARGER = dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=4, head_dim=48, intermediate_size=528)
# The best k = 4 outer setting of bench/results/convergence_sweep.json (2.300 at lr 0.2, μ 0.9 with
# 20 warm-up steps; the 60-step warm-up run was better, but data-parallel was not rerun with it).
K4_OUTER = (0.2, 0.9)
GRID_LR = (0.1, 0.2, 0.4, 0.7, 1.0)
GRID_MOMENTUM = (0.5, 0.9)
EVAL_SEQUENCES = 128
BUDGET_MIN = 60  # issue 17: every run together, on 2 cores


@dataclasses.dataclass(frozen=True)
class Arm:
    """One run: `kind` is "diloco" or "dp" (data-parallel; plain AdamW when k = 1)."""

    claim: int
    size: str
    kind: str
    k: int
    seed: int
    outer_lr: float | None = None
    outer_momentum: float | None = None

    @property
    def name(self) -> str:
        if self.kind == "dp":
            return f"{self.size} plain AdamW" if self.k == 1 else f"{self.size} data-parallel k={self.k}"
        return f"{self.size} DiLoCo k={self.k} lr {self.outer_lr} mu {self.outer_momentum}"


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every arm shares: the schedule, the corpus, the tokenizer and the held-out sequences."""

    args: argparse.Namespace
    corpus: data.Corpus
    tokenizer: Any
    heldout: torch.Tensor  # [EVAL_SEQUENCES, seq_len]

    def config(self, arm: Arm) -> config.Config:
        a = self.args
        return config.load(
            None,
            {
                "run.seed": str(arm.seed),
                "run.rounds": str(a.rounds),
                "model.preset": "tiny",
                "model.seq_len": str(a.seq_len),
                "data.num_shards": str(arm.k),
                "inner.steps": str(a.steps),
                "inner.batch_size": str(a.batch),
                "inner.micro_batch_size": str(a.batch),
                "inner.lr": str(a.lr),
                "inner.warmup_steps": str(a.warmup),
                "inner.precision": "fp32",
                # Data-parallel arms have no outer step: their outer fields keep the defaults, unused.
                "outer.lr": str(arm.outer_lr if arm.outer_lr is not None else 0.7),
                "outer.momentum": str(arm.outer_momentum if arm.outer_momentum is not None else 0.9),
            },
        )

    def architecture(self, size: str, cfg: config.Config) -> Any:
        tiny = model.model_config(cfg.model, self.tokenizer.vocab_size)
        return tiny if size == "tiny" else type(tiny).from_dict({**tiny.to_dict(), **LARGER})

    def streams(self, cfg: config.Config, k: int) -> list[data.TrainStream]:
        """Worker i's stream reads shard i of k, as `p2p-diloco baseline` and the peers of the benchmarks do."""
        shard_of_key = data.sharding(self.corpus, cfg.data, cfg.run.seed)
        return [
            data.TrainStream(
                self.corpus,
                self.tokenizer,
                cfg.model.seq_len,
                i,
                k,
                cfg.run.seed,
                cfg.data.heldout_fraction,
                shard_of_key,
            )
            for i in range(k)
        ]


def run_diloco(setup: Setup, arm: Arm) -> list[tuple[int, int, float]]:
    """k workers, R rounds of H inner steps; returns (tokens, steps per worker, held-out loss) per round."""
    cfg = setup.config(arm)
    arch = setup.architecture(arm.size, cfg)
    total_steps = cfg.run.rounds * cfg.inner.steps
    trainers = [InnerTrainer(model.init_model(arch, cfg.run.seed), cfg.inner, total_steps, CPU) for _ in range(arm.k)]
    streams = setup.streams(cfg, arm.k)
    state = outer.initial_state(dict(trainers[0].model.named_parameters()))
    curve, tokens = [(0, 0, trainers[0].evaluate(setup.heldout))], 0
    for r in range(1, cfg.run.rounds + 1):
        deltas, weights = [], []
        for trainer, stream in zip(trainers, streams):
            phase = trainer.run_phase(lambda s=stream: s.next_batch(cfg.inner.batch_size), cfg.inner.steps)
            deltas.append(outer.pseudo_gradient(state.params, dict(trainer.model.named_parameters())))
            weights.append(phase.tokens)
        state = outer.outer_step(
            state, outer.weighted_mean(deltas, weights), cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov
        )
        with torch.no_grad():  # every peer of the round applies the same θ(r) (invariant I1)
            for trainer in trainers:
                for name, p in trainer.model.named_parameters():
                    p.copy_(state.params[name])
        tokens += sum(weights)
        curve.append((tokens, r * cfg.inner.steps, trainers[0].evaluate(setup.heldout)))
    return curve


def run_data_parallel(setup: Setup, arm: Arm) -> list[tuple[int, int, float]]:
    """One model, each step on one batch of each of the k shards: k micro-batches of `batch` rows."""
    cfg = setup.config(arm)
    arch = setup.architecture(arm.size, cfg)
    total_steps = cfg.run.rounds * cfg.inner.steps
    trainer = InnerTrainer(model.init_model(arch, cfg.run.seed), cfg.inner, total_steps, CPU)
    streams = setup.streams(cfg, arm.k)
    curve, tokens = [(0, 0, trainer.evaluate(setup.heldout))], 0
    for r in range(1, cfg.run.rounds + 1):
        for _ in range(cfg.inner.steps):
            batch = torch.cat([s.next_batch(cfg.inner.batch_size) for s in streams])  # [k * batch, seq_len]
            trainer.train_step(batch)
            tokens += batch.numel()
        curve.append((tokens, r * cfg.inner.steps, trainer.evaluate(setup.heldout)))
    return curve


def plan(args: argparse.Namespace) -> list[Arm]:
    """Claim 2's grid first (seed 0), then claim 1 seed by seed: a cut-short run still has whole comparisons."""
    arms = [Arm(2, "tiny", "dp", 1, 0)]
    arms += [Arm(2, "tiny", "diloco", 1, 0, lr, mu) for mu in args.grid_momentum for lr in args.grid_lr]
    for seed in range(args.seeds):
        for size in ("tiny", "larger"):
            arms += [Arm(1, size, "dp", 4, seed), Arm(1, size, "diloco", 4, seed, *K4_OUTER)]
    return arms


def confirmation(args: argparse.Namespace, summary: dict) -> list[Arm]:
    """Claim 2's best setting and plain AdamW again on the other seeds: the best of a grid of 10 on one
    seed is biased toward a lucky draw, a fresh seed is not."""
    best = summary["claim2"].get("best")
    if best is None:
        return []
    lr, mu = best["outer_lr"], best["outer_momentum"]
    return [
        a
        for seed in range(1, args.seeds)
        for a in (Arm(2, "tiny", "dp", 1, seed), Arm(2, "tiny", "diloco", 1, seed, lr, mu))
    ]


def tokens_per_s(setup: Setup, size: str, steps: int) -> tuple[float, float]:
    """(training tokens/s, evaluation s) of one worker of `size`, after two warm-up steps."""
    arm = Arm(0, size, "dp", 1, 0)
    cfg = setup.config(arm)
    trainer = InnerTrainer(model.init_model(setup.architecture(size, cfg), 0), cfg.inner, 1000, CPU)
    stream = setup.streams(cfg, 1)[0]
    for _ in range(2):
        trainer.train_step(stream.next_batch(cfg.inner.batch_size))
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(stream.next_batch(cfg.inner.batch_size))
    rate = steps * cfg.inner.batch_size * cfg.model.seq_len / (time.perf_counter() - started)
    started = time.perf_counter()
    trainer.evaluate(setup.heldout)
    return rate, time.perf_counter() - started


def estimate_s(arm: Arm, args: argparse.Namespace, timing: dict[str, tuple[float, float]]) -> float:
    rate, eval_s = timing[arm.size]
    tokens = arm.k * args.rounds * args.steps * args.batch * args.seq_len
    return tokens / rate + (args.rounds + 1) * eval_s


def parameters(setup: Setup) -> dict[str, int]:
    cfg = setup.config(Arm(0, "tiny", "dp", 1, 0))
    return {size: model.parameter_count(setup.architecture(size, cfg)) for size in ("tiny", "larger")}


def summarise(runs: list[dict]) -> dict:
    """Claim 1's gaps, claim 2's grid, best setting and its other seeds, from whatever runs are done."""
    final = {Arm(**r["arm"]): r["final_eval_loss"] for r in runs}
    claim1 = []
    for arm, loss in final.items():
        dp = final.get(Arm(1, arm.size, "dp", arm.k, arm.seed))
        if arm.claim == 1 and arm.kind == "diloco" and dp is not None:
            claim1.append(
                {"size": arm.size, "seed": arm.seed, "dp": dp, "diloco": loss, "gap_pct": 100 * (loss - dp) / dp}
            )
    grid = [
        {"outer_lr": a.outer_lr, "outer_momentum": a.outer_momentum, "loss": loss}
        for a, loss in final.items()
        if a.claim == 2 and a.kind == "diloco" and a.seed == 0
    ]
    adamw = final.get(Arm(2, "tiny", "dp", 1, 0))
    claim2: dict[str, Any] = {"adamw": adamw, "grid": grid, "seeds": []}
    if grid and adamw is not None:
        best = min(grid, key=lambda g: g["loss"])
        claim2["best"] = {**best, "vs_adamw_pct": 100 * (best["loss"] - adamw) / adamw}
        for arm, loss in final.items():
            plain = final.get(Arm(2, "tiny", "dp", 1, arm.seed))
            same = (arm.outer_lr, arm.outer_momentum) == (best["outer_lr"], best["outer_momentum"])
            if arm.claim == 2 and arm.kind == "diloco" and same and plain is not None:
                claim2["seeds"].append(
                    {"seed": arm.seed, "adamw": plain, "diloco": loss, "vs_adamw_pct": 100 * (loss - plain) / plain}
                )
    return {"claim1": claim1, "claim2": claim2}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, gaps, grid) = plt.subplots(1, 3, figsize=(16, 4.6))
    plot_curves(curves, result)
    plot_gaps(gaps, result)
    plot_grid(grid, result)
    for ax in (curves, gaps, grid):
        ax.grid(alpha=0.3)
    s = result["setting"]
    fig.suptitle(
        f"{s['rounds']} rounds x H = {s['inner_steps']}, batch {s['batch']} x {s['seq_len']} per worker, "
        f"inner lr {s['inner_lr']}, k = 4 outer lr {K4_OUTER[0]}, momentum {K4_OUTER[1]}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_curves(ax: Any, result: dict) -> None:
    params = result["parameters"]
    colours = {"tiny": "C0", "larger": "C3"}
    for r in result["runs"]:
        arm = r["arm"]
        if arm["claim"] == 1 and arm["seed"] == 0:
            tokens, _, loss = zip(*r["curve"])
            style = "--" if arm["kind"] == "dp" else "-"
            kind = "data-parallel" if arm["kind"] == "dp" else "DiLoCo"
            label = f"{arm['size']} ({params[arm['size']] / 1e6:.2f}M), {kind}"
            ax.plot(tokens, loss, style, color=colours[arm["size"]], lw=1.4, label=f"{label}: {loss[-1]:.3f}")
    ax.xaxis.set_major_formatter(lambda v, _: f"{v / 1e6:.1f}M")
    ax.set_xlabel("tokens, all 4 workers")
    ax.set_ylabel("held-out loss")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title("claim 1: k = 4, seed 0", fontsize=10)
    ax.legend(fontsize=7)


def plot_gaps(ax: Any, result: dict) -> None:
    params = result["parameters"]
    for seed in sorted({c["seed"] for c in result["summary"]["claim1"]}):
        rows = [c for c in result["summary"]["claim1"] if c["seed"] == seed]
        ax.plot([params[c["size"]] for c in rows], [c["gap_pct"] for c in rows], "o-", label=f"seed {seed}")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("(DiLoCo − data-parallel) / data-parallel, %")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_title("claim 1: does the gap shrink?", fontsize=10)
    ax.legend(fontsize=8)


def plot_grid(ax: Any, result: dict) -> None:
    claim2 = result["summary"]["claim2"]
    for i, mu in enumerate(sorted({g["outer_momentum"] for g in claim2["grid"]})):
        rows = sorted((g["outer_lr"], g["loss"]) for g in claim2["grid"] if g["outer_momentum"] == mu)
        ax.plot(*zip(*rows), "o-", color=f"C{i + 4}", label=f"DiLoCo k = 1, momentum {mu}")
    if claim2["adamw"] is not None:
        ax.axhline(claim2["adamw"], color="k", ls="--", lw=1, label=f"plain AdamW: {claim2['adamw']:.3f}")
    for c in claim2["seeds"]:
        if c["seed"]:
            x = claim2["best"]["outer_lr"]
            ax.plot(
                [x], [c["diloco"]], "*", ms=10, color="C6", label=f"seed {c['seed']}, best setting: {c['diloco']:.3f}"
            )
            ax.axhline(c["adamw"], color="k", ls=":", lw=1, label=f"seed {c['seed']}, plain AdamW: {c['adamw']:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("outer lr")
    ax.set_ylabel("final held-out loss")
    ax.set_title(f"claim 2: tiny ({result['parameters']['tiny'] / 1e6:.2f}M), same tokens", fontsize=10)
    ax.legend(fontsize=7)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12, help="R (bench/convergence.py: 12)")
    parser.add_argument("--steps", type=int, default=30, help="H (bench/convergence.py: 30)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step per worker")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3, help="inner (and data-parallel) AdamW lr")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--seeds", type=int, help="seeds of claim 1, and of claim 2's best setting against AdamW (default 2; quick 1)"
    )
    parser.add_argument("--grid-lr", type=float, nargs="+", default=list(GRID_LR))
    parser.add_argument("--grid-momentum", type=float, nargs="+", default=list(GRID_MOMENTUM))
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds x H = 5, a 2 x 1 grid, 1 seed")
    parser.add_argument("--plan", action="store_true", help="time both sizes, print the plan and stop")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 5, 2
        args.grid_lr, args.grid_momentum = [0.2, 0.7], [0.9]
    if args.seeds is None:
        args.seeds = 1 if args.quick else 2
    return args


def main() -> int:
    args = arguments()
    torch.set_num_threads(2)
    session = time.perf_counter()
    cfg = config.load(None, {"model.seq_len": str(args.seq_len)})
    corpus = data.open_corpus(cfg.data)
    tokenizer = model.load_tokenizer(cfg.model.tokenizer)
    heldout = data.heldout_batch(corpus, tokenizer, args.seq_len, EVAL_SEQUENCES, cfg.data.heldout_fraction)
    setup = Setup(args, corpus, tokenizer, heldout)
    counts = parameters(setup)
    print(
        f"parameters: tiny {counts['tiny']:,}, larger {counts['larger']:,} ({counts['larger'] / counts['tiny']:.2f}x)"
    )
    timing = {size: tokens_per_s(setup, size, 3 if args.quick else 8) for size in ("tiny", "larger")}
    for size, (rate, eval_s) in timing.items():
        print(f"{size}: {rate:,.0f} training tokens/s, {eval_s:.2f} s per evaluation ({os.getloadavg()[0]:.1f} load)")
    arms = plan(args)
    # Claim 2's confirmation runs (2 per further seed) are chosen once the grid is done.
    extra = [Arm(2, "tiny", "dp", 1, seed) for seed in range(1, args.seeds) for _ in range(2)]
    estimate = sum(estimate_s(arm, args, timing) for arm in arms + extra)
    print(f"plan: {len(arms + extra)} runs, estimated {estimate / 60:.1f} minutes at this load", flush=True)
    if args.plan:
        return 0
    if estimate > 60 * BUDGET_MIN:
        # The losses do not depend on the load, only the wall time does: warn, do not refuse.
        print(f"above the {BUDGET_MIN} minutes of issue 17 at this load; on 2 idle cores it fits")
    # A smoke run's files go to the temporary folder, never next to the measured results.
    out = Path(tempfile.gettempdir()) / "quality_scaling_quick" if args.quick else HERE / "results" / "quality_scaling"
    result = header(args, setup, counts, timing, estimate)
    result = resumed(result, out.with_suffix(".json"))
    previous_s = result.get("total_wall_s", 0.0)

    def save() -> None:
        result["summary"] = summarise(result["runs"])
        result["total_wall_s"] = round(previous_s + time.perf_counter() - session, 1)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")

    execute(setup, arms, args, timing, result, save)
    execute(setup, confirmation(args, summarise(result["runs"])), args, timing, result, save)
    save()
    plot(result, out.with_suffix(".png"))
    report(result)
    print(f"wrote {out.with_suffix('.json')} and .png ({result['total_wall_s'] / 60:.1f} minutes in all)")
    return 0


def header(args: argparse.Namespace, setup: Setup, counts: dict, timing: dict, estimate: float) -> dict:
    return {
        "what": "issue 17: claims of arXiv 2503.09799 at two model sizes, in-process (project maths, no network)",
        "setting": {
            "rounds": args.rounds,
            "inner_steps": args.steps,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "inner_lr": args.lr,
            "warmup": args.warmup,
            "eval_sequences": EVAL_SEQUENCES,
            "k4_outer_lr": K4_OUTER[0],
            "k4_outer_momentum": K4_OUTER[1],
            "k4_outer_from": "bench/results/convergence_sweep.json: best k = 4 setting with 20 warm-up steps",
            "larger_architecture": LARGER,
            "precision": "fp32",
            "threads": torch.get_num_threads(),
            "corpus": setup.corpus.description,
        },
        "parameters": counts,
        "timing_tokens_per_s": {size: round(rate) for size, (rate, _) in timing.items()},
        "estimated_s": round(estimate),
        "machine": f"{os.cpu_count()} cores, no GPU, shared with other work; run under nice -n 19",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "runs": [],
    }


def resumed(result: dict, path: Path) -> dict:
    """The runs of an earlier file with the same setting are kept, not rerun: the losses depend on
    nothing else (fixed seeds, 2 threads), and a rerun of the larger model costs 10 minutes."""
    if not path.exists():
        return result
    earlier = json.loads(path.read_text())
    if earlier.get("setting") != result["setting"]:
        return result
    print(f"resuming {path.name}: {len(earlier['runs'])} runs done", flush=True)
    return {**result, "runs": earlier["runs"], "total_wall_s": earlier.get("total_wall_s", 0.0)}


def execute(
    setup: Setup,
    arms: list[Arm],
    args: argparse.Namespace,
    timing: dict,
    result: dict,
    save: Callable[[], None],
) -> None:
    """Run the arms not yet in result["runs"], saving after each."""
    runners: dict[str, Callable[[Setup, Arm], list]] = {"diloco": run_diloco, "dp": run_data_parallel}
    done = [Arm(**r["arm"]) for r in result["runs"]]
    for i, arm in enumerate(arms, 1):
        if arm in done:
            continue
        load_before, t = os.getloadavg()[0], time.perf_counter()
        curve = runners[arm.kind](setup, arm)
        wall = time.perf_counter() - t
        result["runs"].append(
            {
                "arm": dataclasses.asdict(arm),
                "name": arm.name,
                "final_eval_loss": curve[-1][2],
                "total_tokens": curve[-1][0],
                "wall_s": round(wall, 1),
                "estimated_s": round(estimate_s(arm, args, timing), 1),
                "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "curve": curve,
            }
        )
        save()
        print(f"[{i}/{len(arms)}] {arm.name}: held-out loss {curve[-1][2]:.4f}, {wall:.0f} s", flush=True)


def report(result: dict) -> None:
    for c in result["summary"]["claim1"]:
        print(
            f"claim 1, {c['size']}, seed {c['seed']}: data-parallel {c['dp']:.4f}, "
            f"DiLoCo {c['diloco']:.4f}, gap {c['gap_pct']:+.2f} %"
        )
    claim2 = result["summary"]["claim2"]
    if "best" in claim2:
        best = claim2["best"]
        print(
            f"claim 2, seed 0: plain AdamW {claim2['adamw']:.4f}, best k = 1 DiLoCo {best['loss']:.4f} "
            f"(lr {best['outer_lr']}, mu {best['outer_momentum']}): {best['vs_adamw_pct']:+.2f} %"
        )
    for c in claim2["seeds"]:
        if c["seed"]:
            print(
                f"claim 2, seed {c['seed']}: plain AdamW {c['adamw']:.4f}, "
                f"DiLoCo {c['diloco']:.4f}: {c['vs_adamw_pct']:+.2f} %"
            )


if __name__ == "__main__":
    sys.exit(main())
