"""Peers of different speeds: one of three peers throttled to a third of the time (SIGSTOP/SIGCONT
duty cycle on its trainer process), speed-aware rounds against fixed-H rounds, same config otherwise.

What it shows, per run: each peer's inner steps and tokens per round (its weight in the average),
how long each peer idled between the end of its inner phase and the start of its all-reduce
(`wait_s`, the slack), all the time of a round that was not inner compute (`idle_s`: matchmaking,
all-reduce, agreement), the round wall time, and whether every peer held the same digest.
Writes bench/results/heterogeneous.json and .png.

    python bench/heterogeneous.py          # about 5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from lab import LocalSwarm

HERE = Path(__file__).resolve().parent
PEERS = ("a", "b", "slow")
BASE = {
    "run.run_id": "hetero",
    "run.eval_sequences": "32",
    "run.eval_every_rounds": "4",
    "model.preset": "tiny",
    "model.seq_len": "128",
    "data.num_shards": "16",
    "inner.steps": "40",
    "inner.batch_size": "16",
    "inner.micro_batch_size": "16",
    "inner.lr": "3e-3",
    "inner.warmup_steps": "40",
    "swarm.matchmaking_time_s": "3",
    "swarm.averaging_timeout_s": "30",
    "swarm.agreement_timeout_s": "15",
}


def run(name: str, speed_aware: bool, rounds: int, share: float, folder: Path) -> dict:
    overrides = {**BASE, "run.rounds": str(rounds), "swarm.speed_aware": str(speed_aware).lower()}
    started = time.perf_counter()
    with LocalSwarm(folder, overrides) as lab:
        for i, peer in enumerate(PEERS):
            lab.start(peer, {"data.shard": str(i)})
        lab.wait(lambda: all(0 in lab.records(p) for p in PEERS), 120, "peers up")
        lab.throttle("slow", share)
        lab.wait(lambda: not any(lab.running(p) for p in PEERS), 60 * rounds, f"{name}: every peer finishes")
        records = {p: lab.records(p) for p in PEERS}
    wall = time.perf_counter() - started
    per_round = []
    for r in range(2, rounds + 1):  # round 1 ran before the throttle was on
        recs = {p: records[p].get(r) for p in PEERS}
        trained = {p: rec for p, rec in recs.items() if rec and "inner_steps" in rec}
        per_round.append(
            {
                "round": r,
                "digests_equal": len({rec["digest"] for rec in recs.values() if rec}) == 1,
                "steps": {p: rec["inner_steps"] for p, rec in trained.items()},
                "tokens": {p: rec["tokens"] for p, rec in trained.items()},
                "wait_s": {p: round(rec.get("wait_s", 0.0), 2) for p, rec in trained.items()},
                # everything in the round that was not inner compute: matchmaking, all-reduce, agreement
                "idle_s": {p: round(rec["wall_s"] - rec["compute_s"], 2) for p, rec in trained.items()},
                "wall_s": {p: round(rec["wall_s"], 2) for p, rec in trained.items()},
                "group_size": {p: rec["group_size"] for p, rec in trained.items()},
            }
        )
    summary = {}
    for p in PEERS:
        rows = [row for row in per_round if p in row["steps"]]
        summary[p] = {
            "rounds_trained": len(rows),
            "mean_steps": round(statistics.mean(row["steps"][p] for row in rows), 1) if rows else 0,
            "tokens": sum(row["tokens"][p] for row in rows),
            "mean_wait_s": round(statistics.mean(row["wait_s"][p] for row in rows), 2) if rows else None,
            "max_wait_s": max((row["wait_s"][p] for row in rows), default=None),
            "mean_idle_s": round(statistics.mean(row["idle_s"][p] for row in rows), 2) if rows else None,
            "max_idle_s": max((row["idle_s"][p] for row in rows), default=None),
            "mean_round_wall_s": round(statistics.mean(row["wall_s"][p] for row in rows), 2) if rows else None,
            "tokens_per_s": round(statistics.mean(records[p][row["round"]]["tokens_per_s"] for row in rows), 0)
            if rows
            else None,
        }
    total_tokens = sum(s["tokens"] for s in summary.values()) or 1
    for s in summary.values():
        s["weight_share"] = round(s["tokens"] / total_tokens, 3)
    final = {p: records[p][rounds].get("eval_loss") for p in PEERS if rounds in records[p]}
    return {
        "name": name,
        "speed_aware": speed_aware,
        "wall_s": round(wall, 1),
        "rounds": rounds,
        "slow_share": share,
        "all_digests_equal": all(row["digests_equal"] for row in per_round),
        "final_eval_loss": final,
        "peers": summary,
        "per_round": per_round,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for k, res in enumerate(results):
        xs = [i + (k - 0.5) * width for i in range(len(PEERS))]
        axes[0].bar(xs, [res["peers"][p]["mean_steps"] for p in PEERS], width, label=res["name"])
        axes[1].bar(xs, [res["peers"][p]["mean_idle_s"] or 0 for p in PEERS], width, label=res["name"])
    for ax, title in zip(axes, ("inner steps per round", "idle per round: wall - inner compute (s)")):
        ax.set_xticks(range(len(PEERS)), PEERS)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(f"3 peers, 'slow' runs {results[0]['slow_share']:.2f} of the time (H = {BASE['inner.steps']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--share", type=float, default=1 / 3, help="fraction of the time the slow peer runs")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, speed_aware in (("speed-aware rounds", True), ("fixed H rounds", False)):
            results.append(run(name, speed_aware, args.rounds, args.share, Path(tmp) / name.split()[0]))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "per_round"}, indent=1))
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "heterogeneous.json").write_text(
        json.dumps(
            {
                "machine": f"{platform.machine()}, {platform.system()}, 2 cores",
                "peers": PEERS,
                "config": BASE,
                "runs": results,
            },
            indent=1,
        )
        + "\n"
    )
    plot(results, out / "heterogeneous.png")
    print(f"wrote {out / 'heterogeneous.json'} and .png")


if __name__ == "__main__":
    main()
