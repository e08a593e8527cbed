"""One malicious peer among four, with real processes on 127.0.0.1: what each attack does to the
honest peers' held-out loss under each aggregator (issue 14).

The issue's set-up: the tiny preset, H = 20 (fixed: `swarm.speed_aware = false`, so every run
trains the same tokens), 8 rounds, three honest peers a, b, c and one attacker m
(tests/swarm/attacker_peer.py) that lies in one way through the normal code path. For every run:
the honest peers' held-out loss after 8 rounds against the clean run with the same aggregator,
whether the honest digests agreed in every round, exit codes, NaN, and the run's wall time.
Writes bench/results/attacks.json and attacks.png.

    python bench/attacks.py                      # every run below, about 20 minutes on 2 cores
    python bench/attacks.py --only clip          # the runs with one aggregator
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import tempfile
import time
from pathlib import Path

from lab import LocalSwarm

HERE = Path(__file__).resolve().parent
ROUNDS = 8
HONEST = ("a", "b", "c")
CONFIG = {
    "run.run_id": "attacks",
    "run.rounds": str(ROUNDS),
    "run.eval_sequences": "32",
    "model.preset": "tiny",
    "model.seq_len": "128",
    "data.num_shards": "8",
    "inner.steps": "20",
    "inner.batch_size": "16",
    "inner.micro_batch_size": "16",
    "inner.lr": "3e-3",
    "inner.warmup_steps": "20",
    "swarm.speed_aware": "false",
    "swarm.matchmaking_time_s": "3",
    "swarm.averaging_timeout_s": "30",
    "swarm.agreement_timeout_s": "10",
    "swarm.join_timeout_s": "10",
}
ATTACKS = [
    None,
    "scale:1e4",
    "flip:10",
    "zero:1000",
    "weight:1000",
    "progress:1000",
    "replay:0",
    "reducer-scale:100",
    "reducer-random:1",
]
# (aggregator, the attacks run under it)
PLAN = [
    ("mean", [None, "scale:1e4", "flip:10", "zero:1000"]),
    ("clip", ATTACKS),
    ("trimmed-mean", [None, "flip:10", "zero:1000", "weight:1000"]),
    ("centered-clip", [None, "flip:10", "zero:1000"]),
]


def run(folder: Path, aggregator: str, attack: str | None) -> dict:
    started = time.monotonic()
    with LocalSwarm(folder, {**CONFIG, "swarm.aggregator": aggregator}) as lab:
        for name in HONEST:
            lab.start(name)
        lab.start("m", attack=attack)
        lab.wait(lambda: all(not lab.running(p) for p in HONEST), 900, "honest peers finish")
        exits = {p: lab.procs[p].returncode for p in HONEST}
        recs = {p: lab.records(p) for p in HONEST}
    rounds = sorted(set.intersection(*(set(r) for r in recs.values())))
    finals = [recs[p].get(ROUNDS, {}).get("eval_loss") for p in HONEST]
    losses = [x for x in finals if isinstance(x, (int, float)) and math.isfinite(x)]
    return {
        "exit_codes": exits,
        "rounds_recorded": len(rounds),
        "honest_digests_agree": all(len({recs[p][n]["digest"] for p in HONEST}) == 1 for n in rounds),
        "final_eval_loss": statistics.mean(losses) if len(losses) == len(HONEST) else None,
        "nan": len(losses) != len(finals),
        "group_sizes": [recs["a"][n].get("group_size", 1) for n in rounds if n > 0],
        "eval_loss": [recs["a"][n].get("eval_loss") for n in rounds],
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", help="one aggregator's runs")
    args = parser.parse_args()
    out = HERE / "results" / "attacks.json"
    results = json.loads(out.read_text()) if args.only and out.exists() else {}
    results.update({"machine": platform.processor() or platform.machine(), "rounds": ROUNDS})
    with tempfile.TemporaryDirectory() as tmp:
        for aggregator, attacks in PLAN:
            if args.only and aggregator != args.only:
                continue
            runs = results.setdefault(aggregator, {})
            for attack in attacks:
                folder = Path(tmp) / f"{aggregator}-{(attack or 'clean').replace(':', '_')}"
                runs[attack or "clean"] = run(folder, aggregator, attack)
                print(aggregator, attack or "clean", json.dumps(runs[attack or "clean"]), flush=True)
            clean = runs.get("clean", {}).get("final_eval_loss")
            for result in runs.values():
                loss = result["final_eval_loss"]
                result["vs_clean"] = loss / clean - 1 if clean and loss is not None else None
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    aggregators = [a for a, _ in PLAN if a in results]
    fig, axes = plt.subplots(1, len(aggregators), figsize=(4.5 * len(aggregators), 4.5), sharey=True)
    for ax, aggregator in zip(axes if len(aggregators) > 1 else [axes], aggregators):
        names = list(results[aggregator])
        losses = [results[aggregator][n]["final_eval_loss"] or float("nan") for n in names]
        ax.barh(names, [min(x, 10.0) for x in losses])
        ax.set_title(f"aggregator: {aggregator}")
        ax.set_xlabel("honest held-out loss after 8 rounds (capped at 10)")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "results" / "attacks.png", dpi=110)


if __name__ == "__main__":
    main()
