"""The progress-claim cap (`swarm.claim_cap`), measured in real swarms: what it costs honest peers
of different speeds, and how far it lets a liar shorten everyone's rounds (docs/design.md §6).

- **fast**: three peers, two throttled to 0.45 of the time (SIGSTOP/SIGCONT duty cycle on their
  trainer processes), speed-aware rounds. Per round: the tokens the three trained over the round's
  budget (H x batch x seq_len for each of them).
- **liar**: four peers, one of them `attacker_peer progress:1000` (1000 x the tokens it trained, at
  1000 x its rate, in every progress record), against four honest ones. Per round: the tokens each honest peer
  trained over its share of the budget (H x batch x seq_len); 1.0 without the liar.

Each at the defaults of open (1.4) and certified runs (4.5), and at 2 (the cap before). Writes
bench/results/claims.json, replacing only the runs it repeats.

    python bench/claims.py                    # about 13 minutes on 2 cores
    python bench/claims.py --caps 1.4 --no-clean   # one cap's runs
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from heterogeneous import BASE as HETEROGENEOUS

from lab import LocalSwarm

HERE = Path(__file__).resolve().parent
# the heterogeneous bench's run (H = 40, batch 16, seq 128), speed-aware, evaluated once at the end
BASE = {
    **HETEROGENEOUS,
    "run.run_id": "claims",
    "run.eval_sequences": "16",
    "run.eval_every_rounds": "100",
    "swarm.speed_aware": "true",
}
SHARE = int(BASE["inner.steps"]) * int(BASE["inner.batch_size"]) * int(BASE["model.seq_len"])  # tokens per peer
SCENARIOS = {  # name: (peers, throttled shares, attacker)
    "fast": (("a", "b", "fast"), {"a": 0.45, "b": 0.45}, None),  # measured: about 4.5 x slower on 2 cores
    "clean": (("a", "b", "c", "d"), {}, None),
    "liar": (("a", "b", "c", "liar"), {}, "liar"),
}


def run(scenario: str, cap: float, rounds: int, folder: Path) -> dict:
    peers, shares, attacker = SCENARIOS[scenario]
    overrides = {**BASE, "run.rounds": str(rounds), "swarm.claim_cap": str(cap)}
    started = time.perf_counter()
    with LocalSwarm(folder, overrides) as lab:
        for i, peer in enumerate(peers):
            lab.start(peer, {"data.shard": str(i)}, attack="progress:1000" if peer == attacker else None)
        lab.wait(lambda: all(0 in lab.records(p) for p in peers), 120, "peers up")
        for peer, share in shares.items():
            lab.throttle(peer, share)
        lab.wait(lambda: not any(lab.running(p) for p in peers), 60 * rounds, f"{scenario}: every peer finishes")
        records = {p: lab.records(p) for p in peers}
    honest = [p for p in peers if p != attacker]
    per_round = []
    for r in range(2, rounds + 1):  # round 1 ran before the throttles were on
        recs = {p: records[p][r] for p in honest if "inner_steps" in records[p].get(r, {})}
        per_round.append(
            {
                "round": r,
                "tokens": {p: rec["tokens"] for p, rec in recs.items()},
                "group_size": max((rec["group_size"] for rec in recs.values()), default=0),
                "over_budget": round(sum(rec["tokens"] for rec in recs.values()) / (SHARE * len(peers)), 3),
                "honest_share": round(statistics.mean(rec["tokens"] for rec in recs.values()) / SHARE, 3),
                "digests_equal": len({rec["digest"] for rec in recs.values()}) == 1,
            }
        )
    return {
        "scenario": scenario,
        "claim_cap": cap,
        "wall_s": round(time.perf_counter() - started, 1),
        "tokens_per_s": {
            p: round(statistics.mean(records[p][r["round"]]["tokens_per_s"] for r in per_round)) for p in honest
        },
        "mean_over_budget": round(statistics.mean(r["over_budget"] for r in per_round), 3),
        "mean_honest_share": round(statistics.mean(r["honest_share"] for r in per_round), 3),
        "all_digests_equal": all(r["digests_equal"] for r in per_round),
        "per_round": per_round,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--caps", default="1.4,2,4.5", help="claim caps to compare")
    parser.add_argument("--no-clean", action="store_true", help="skip the run without a liar")
    args = parser.parse_args()
    out = HERE / "results" / "claims.json"
    results = json.loads(out.read_text())["runs"] if out.exists() else []
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in SCENARIOS:
            if scenario == "clean" and args.no_clean:
                continue
            for cap in [float(c) for c in args.caps.split(",")] if scenario != "clean" else [2.0]:
                new = run(scenario, cap, args.rounds, Path(tmp) / f"{scenario}-{cap}")
                results = [r for r in results if (r["scenario"], r["claim_cap"]) != (scenario, cap)] + [new]
                print(json.dumps({k: v for k, v in new.items() if k != "per_round"}), flush=True)
    machine = f"{platform.machine()}, {platform.system()}, 2 cores"
    out.write_text(json.dumps({"machine": machine, "config": BASE, "runs": results}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
