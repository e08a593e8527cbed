"""The paper's main result at small scale, on the real swarm code (issue 6; Table 2 of arXiv 2311.08105).

Five runs of the tiny preset on the embedded corpus, same seed, same schedule:
1. single worker: plain AdamW, one peer's batch and steps (`p2p-diloco baseline --workers 1`);
2. data-parallel: K workers averaging gradients every step with torch.distributed gloo, K x the
   batch (`p2p-diloco baseline --workers K`): the synchronous reference;
3. DiLoCo: K real peers on 127.0.0.1 (bootstrap node, DHT, all-reduce; bench/lab.py), R rounds of H;
4. the same with half the pseudo-gradients dropped at random (outer.drop_rate = 0.5: a dropped peer
   joins the all-reduce with weight 0);
5. the same with non-i.i.d. shards (data.shard_by = folder: each peer trains on other top-level
   stdlib folders; one of them holds the whole test suite).
Worker/peer i reads shard i of K, so (2)-(5) see the same number of tokens, and (2) and (3) the
same tokens. Every run is evaluated on the same held-out sequences after every H steps.

    .venv/bin/python bench/convergence.py          # about 20 minutes on 2 cores

Writes bench/results/convergence.json and convergence.png.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lab import CLI, ENV, LocalSwarm

HERE = Path(__file__).resolve().parent
PAPER = {
    "single worker": 16.23,
    "data-parallel (8x batch)": 15.30,
    "DiLoCo k=8, H=500": 15.02,
    "DiLoCo, 50 % dropped": "+2.1 %",
    "DiLoCo, non-i.i.d.": "about the same as i.i.d.",
}


def setting(args: argparse.Namespace) -> dict[str, str]:
    return {
        "run.run_id": "convergence",
        "run.rounds": str(args.rounds),
        "run.seed": "0",
        "run.eval_every_rounds": "1",
        "run.eval_sequences": "128",
        "log.progress": "false",
        "model.preset": "tiny",
        "model.seq_len": "128",
        "data.num_shards": str(args.k),
        "inner.steps": str(args.steps),
        "inner.batch_size": str(args.batch),
        "inner.micro_batch_size": str(args.batch),
        "inner.lr": str(args.lr),
        "inner.warmup_steps": str(args.warmup),
        "inner.precision": "fp32",
        "outer.lr": str(args.outer_lr),
        "outer.momentum": str(args.outer_momentum),
        "swarm.speed_aware": "false",
        "swarm.matchmaking_time_s": "8",
        "swarm.averaging_timeout_s": "30",
    }


def baseline(name: str, workers: int, args: argparse.Namespace, folder: Path) -> dict:
    options = {**setting(args), "run.dir": str(folder)}
    started = time.perf_counter()
    with open(folder.parent / f"{folder.name}.log", "w") as log:
        proc = subprocess.run(
            [*CLI, "baseline", "--workers", str(workers), *[f"--{k}={v}" for k, v in options.items()]],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=ENV,
            timeout=60 * 30,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: baseline exited with {proc.returncode}; see {folder.parent / folder.name}.log")
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return summary(
        name,
        "data-parallel" if workers > 1 else "single",
        workers,
        wall,
        [(r["total_tokens"], r["step"], r["eval_loss"]) for r in records],
        records[-1]["bytes_sent"],
        {},
    )


def diloco(name: str, extra: dict[str, str], args: argparse.Namespace, folder: Path) -> dict:
    started = time.perf_counter()
    peers = [f"p{i}" for i in range(args.k)]
    with LocalSwarm(folder, {**setting(args), **extra}) as lab:
        for i, peer in enumerate(peers):
            lab.start(peer, {"data.shard": str(i)})
        lab.wait(lambda: not any(lab.running(p) for p in peers), 60 * 30, f"{name}: every peer finishes")
        records = [lab.records(p) for p in peers]
    wall = time.perf_counter() - started
    final = [r.get(args.rounds, {}).get("digest") for r in records]
    if None in final or len(set(final)) != 1:
        raise RuntimeError(f"{name}: the peers did not all finish with the same state ({final}); see {folder}")
    # Tokens that went into the averages: a peer that missed a round's group (and caught up with
    # its result instead) records 0 tokens for it.
    curve, tokens = [], 0
    for r in sorted(records[0]):
        tokens += sum(rec[r].get("tokens", 0) for rec in records if r in rec)
        if "eval_loss" in records[0][r]:
            curve.append((tokens, r * args.steps, records[0][r]["eval_loss"]))
    rounds = range(1, args.rounds + 1)
    details = {
        "group_sizes": [records[0][r].get("group_size", 1) for r in rounds],
        "dropped": sum(bool(rec[r].get("dropped")) for rec in records for r in rounds),
        "contributions": args.k * args.rounds,
    }
    # The tiny model's Δ is one part of the all-reduce, so one peer per round reduces it all and
    # sends k - 1 times more than the others: the mean over peers is the fair per-worker figure.
    sent = [sum(rec[r].get("bytes_sent", 0) for r in rounds) for rec in records]
    details["bytes_sent_max_worker"] = max(sent)
    details["missed_groups"] = sum(r not in rec or "group_size" not in rec[r] for rec in records for r in rounds)
    return summary(name, "diloco", args.k, wall, curve, sum(sent) // len(sent), {"overrides": extra, **details})


def summary(name: str, kind: str, workers: int, wall: float, curve: list, bytes_sent: int, extra: dict) -> dict:
    tokens, steps, loss = curve[-1]
    return {
        "name": name,
        "kind": kind,
        "workers": workers,
        "final_eval_loss": loss,
        "final_ppl": math.exp(loss),
        "total_tokens": tokens,
        "steps_per_worker": steps,
        "bytes_sent_per_worker": bytes_sent,
        "wall_s": round(wall, 1),
        "curve": curve,
        **extra,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = {"single": ":", "data-parallel": "--", "diloco": "-"}
    for i, r in enumerate(result["runs"]):
        tokens, steps, loss = zip(*r["curve"])
        left.plot(
            tokens, loss, styles[r["kind"]], color=f"C{i}", lw=1.4, label=f"{r['name']}: {r['final_eval_loss']:.3f}"
        )
        right.plot(steps, loss, styles[r["kind"]], color=f"C{i}", lw=1.4, label=r["name"])
    left.xaxis.set_major_formatter(lambda v, _: f"{v / 1e6:.1f}M")
    left.set_xlabel("tokens, all workers")
    right.set_xlabel("optimizer steps per worker (inner steps for DiLoCo)")
    for ax in (left, right):
        ax.set_ylabel("held-out loss")
        ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
        ax.grid(alpha=0.3)
    left.legend(fontsize=7)
    s = result["setting"]
    fig.suptitle(
        f"tiny preset ({s['parameters']:,} parameters), stdlib corpus, K = {s['k']}, "
        f"{s['rounds']} rounds x H = {s['inner_steps']}, batch {s['batch']} x {s['seq_len']} per worker",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4, help="DiLoCo peers and data-parallel workers")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30, help="H")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step per worker")
    parser.add_argument("--lr", type=float, default=3e-3, help="inner (and baseline) AdamW lr")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--outer-lr",
        type=float,
        default=0.2,
        help="0.2 is best here (bench/results/convergence_sweep_*.json); the paper uses 0.7",
    )
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--runs", nargs="+", default=["single", "dp", "diloco", "dropped", "noniid"])
    parser.add_argument("--out", default="convergence", help="name of the result files")
    args = parser.parse_args()
    plan = {
        "single": lambda f: baseline("single worker", 1, args, f),
        "dp": lambda f: baseline(f"data-parallel ({args.k}x batch)", args.k, args, f),
        "diloco": lambda f: diloco(f"DiLoCo k={args.k}, H={args.steps}", {}, args, f),
        "dropped": lambda f: diloco("DiLoCo, 50 % dropped", {"outer.drop_rate": "0.5"}, args, f),
        "noniid": lambda f: diloco("DiLoCo, non-i.i.d. shards", {"data.shard_by": "folder"}, args, f),
    }
    started = time.perf_counter()
    results, by_key = [], {}
    with tempfile.TemporaryDirectory(prefix="convergence-") as tmp:
        for key in args.runs:
            results.append(plan[key](Path(tmp) / key))
            r = by_key[key] = results[-1]
            r["key"] = key
            print(
                f"{r['name']}: held-out loss {r['final_eval_loss']:.4f} (ppl {r['final_ppl']:.2f}), "
                f"{r['total_tokens']:,} tokens, {r['bytes_sent_per_worker'] / 1e6:.1f} MB sent per worker, "
                f"{r['wall_s']:.0f} s",
                flush=True,
            )
    if "diloco" in by_key:
        full = by_key["diloco"]
        for r in results:
            r["vs_diloco_pct"] = round(100 * (r["final_eval_loss"] / full["final_eval_loss"] - 1), 2)
    if "dp" in by_key:
        for r in results:
            r["vs_dp_pct"] = round(100 * (r["final_eval_loss"] / by_key["dp"]["final_eval_loss"] - 1), 2)
            if r["kind"] == "diloco":
                r["communication_vs_dp"] = round(
                    by_key["dp"]["bytes_sent_per_worker"] / max(r["bytes_sent_per_worker"], 1), 1
                )
    from p2p_diloco import config
    from p2p_diloco.train import model

    cfg = config.load(None, setting(args))
    vocab = model.load_tokenizer(cfg.model.tokenizer).vocab_size
    params = model.count_parameters(model.init_model(model.model_config(cfg.model, vocab), 0))
    result = {
        "setting": {
            "k": args.k,
            "rounds": args.rounds,
            "inner_steps": args.steps,
            "batch": args.batch,
            "seq_len": 128,
            "preset": "tiny",
            "parameters": params,
            "inner_lr": args.lr,
            "warmup": args.warmup,
            "outer_lr": args.outer_lr,
            "outer_momentum": args.outer_momentum,
            "codec": cfg.swarm.compression,
            "machine": "2 cores, no GPU",
        },
        "paper_table_2_ppl": PAPER,
        "total_wall_s": round(time.perf_counter() - started, 1),
        "runs": results,
    }
    out = HERE / "results" / f"{args.out}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, HERE / "results" / f"{args.out}.png")
    print(f"wrote {out} ({result['total_wall_s']:.0f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
