"""What compression and overlap cost in quality: held-out loss of each codec and of overlapped
rounds against fp32 blocking rounds, on the same run (same seed, same shards, same tokens).

Two real peers on 127.0.0.1 (bench/lab.py) train the tiny preset on the embedded corpus for
ROUNDS rounds of exactly H inner steps each (speed-aware rounds off, fixed shards 0 and 1), so every
run sees the same tokens in the same order; only the codec or the overlap differs. The figure is
the held-out loss of the final θ, which both peers hold bit for bit (checked).

    .venv/bin/python bench/codec_loss.py         # about 12 minutes on 2 cores

Writes bench/results/codec_loss.json and codec_loss.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from lab import LocalSwarm

HERE = Path(__file__).resolve().parent
RUNS = {
    "fp32": {"swarm.compression": "fp32"},
    "bf16": {"swarm.compression": "bf16"},
    "scaled-fp16": {"swarm.compression": "scaled-fp16"},
    "int8 + EF": {"swarm.compression": "int8"},
    "int4 + EF": {"swarm.compression": "int4"},
    "int4, no EF": {"swarm.compression": "int4", "swarm.error_feedback": "false"},
    "int2 + EF": {"swarm.compression": "int2"},
    "fp32 overlapped (delayed)": {"swarm.compression": "fp32", "swarm.overlap": "delayed"},
    "fp32 overlapped (eager)": {"swarm.compression": "fp32", "swarm.overlap": "eager"},
}
REFERENCE = "fp32"


def overrides(args: argparse.Namespace) -> dict[str, str]:
    return {
        "run.run_id": "codec-loss",
        "run.rounds": str(args.rounds),
        "run.seed": str(args.seed),
        "run.eval_every_rounds": "1",
        "run.eval_sequences": "64",
        "model.preset": "tiny",
        "model.seq_len": "128",
        "data.num_shards": "8",
        "inner.steps": str(args.steps),
        "inner.batch_size": "16",
        "inner.micro_batch_size": "16",
        "inner.lr": "3e-3",
        "inner.warmup_steps": "20",
        "inner.weight_decay": "0.1",
        "inner.precision": "fp32",
        "outer.lr": str(args.outer_lr),
        "outer.momentum": "0.9",
        "swarm.speed_aware": "false",
        "swarm.matchmaking_time_s": "3",
        "swarm.averaging_timeout_s": "30",
    }


def run(name: str, extra: dict[str, str], args: argparse.Namespace, folder: Path) -> dict:
    started = time.perf_counter()
    with LocalSwarm(folder, {**overrides(args), **extra}) as lab:
        for shard, peer in enumerate(("a", "b")):
            lab.start(peer, {"data.shard": str(shard)})
        lab.wait(lambda: not lab.running("a") and not lab.running("b"), 60 * 20, f"{name}: both peers finish")
        a, b = lab.records("a"), lab.records("b")
    final = a[args.rounds]
    if final["digest"] != b[args.rounds]["digest"]:
        raise RuntimeError(f"{name}: the peers ended with different states; see {folder}")
    return {
        "name": name,
        "overrides": extra,
        "wall_s": time.perf_counter() - started,
        "final_eval_loss": final["eval_loss"],
        "curve": [[a[r]["total_tokens"] if r else 0, a[r]["eval_loss"]] for r in sorted(a) if "eval_loss" in a[r]],
        "group_sizes": [a[r].get("group_size", 1) for r in range(1, args.rounds + 1)],
        "bytes_sent": sum(a[r].get("bytes_sent", 0) for r in range(1, args.rounds + 1)),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(result["runs"]):
        tokens, loss = zip(*r["curve"])
        left.plot(tokens, loss, label=r["name"], color=f"C{i}", lw=1.2)
    left.xaxis.set_major_formatter(lambda v, _: f"{v / 1e3:.0f}k")
    left.set_xlabel("tokens per peer")
    left.set_ylabel("held-out loss")
    left.set_ylim(top=min(4.0, left.get_ylim()[1]))
    left.legend(fontsize=7)
    names = [r["name"] for r in result["runs"]]
    right.barh(names, [r["vs_reference_pct"] for r in result["runs"]], color=[f"C{i}" for i in range(len(names))])
    right.axvline(1, color="grey", ls=":", label="target codecs: +1 %")
    right.axvline(2, color="black", ls="--", lw=0.8, label="target overlap: +2 %")
    right.set_xlabel(f"final held-out loss vs {REFERENCE} blocking (%)")
    right.invert_yaxis()
    right.legend(fontsize=7)
    s = result["setting"]
    fig.suptitle(f"2 peers, tiny preset, {s['rounds']} rounds x H = {s['inner_steps']}, same tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=30, help="H")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), help="names from RUNS")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0, help="run.seed: the model's initialisation and the shards")
    parser.add_argument("--out", default="codec_loss", help="name of the result files")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="codec-loss-") as tmp:
        for i, name in enumerate(args.runs):
            results.append(run(name, RUNS[name], args, Path(tmp) / f"run{i}"))
            print(
                f"{name}: held-out loss {results[-1]['final_eval_loss']:.4f} "
                f"({results[-1]['wall_s']:.0f} s, groups {results[-1]['group_sizes']})",
                flush=True,
            )
    reference = next(r["final_eval_loss"] for r in results if r["name"] == REFERENCE)
    for r in results:
        r["vs_reference_pct"] = 100 * (r["final_eval_loss"] / reference - 1)
    result = {
        "setting": {
            "peers": 2,
            "rounds": args.rounds,
            "inner_steps": args.steps,
            "preset": "tiny",
            "outer_lr": args.outer_lr,
            "seed": args.seed,
            "tokens_per_peer": args.rounds * args.steps * 16 * 128,
        },
        "reference": REFERENCE,
        "runs": results,
    }
    out = HERE / "results" / f"{args.out}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, HERE / "results" / f"{args.out}.png")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
