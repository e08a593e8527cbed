"""Partition heal: two halves of one run train apart, then are joined again; rounds until one state.

Each half has its own bootstrap node, so the halves are two disjoint DHTs running the same run
(same run id, same config): a network partition that happened before the second half's peers
joined. After SPLIT_S the halves are joined by a third node that knows both entry nodes (a link
coming back). Then, every half second, each peer's latest round record is read from its
metrics.jsonl: healed when every peer's latest record has the same round and digest.

A peer counts ids it first sees more than 120 s after its own start only after 120 s
(swarm/heartbeat.py, the sybil rule), so the split lasts longer than that: the halves meet as
strangers, as they would after a real partition.

    python bench/partition.py                 # 3 + 1 and 2 + 2, about 15 minutes on 2 cores
    python bench/partition.py --halves 3 1    # one scenario

Writes bench/results/partition.json (appends a scenario per run, keyed by its halves).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from lab import CLI, ENV, TINY_FIXED_H, LocalSwarm

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "partition.json"
SPLIT_S = 150.0  # longer than heartbeat.FRESH_S (120 s): the halves meet as strangers
HEAL_DEADLINE_S = 420.0
CONFIG = {**TINY_FIXED_H, "run.run_id": "partition", "run.rounds": "1000", "run.eval_every_rounds": "0"}


def latest(lab: LocalSwarm, name: str) -> tuple[int, str] | None:
    records = lab.records(name)
    return (max(records), records[max(records)]["digest"]) if records else None


def bridge(folder: Path, entries: list[str], run_toml: Path) -> subprocess.Popen:
    """A node that knows both halves' entry nodes: the link that comes back."""
    return subprocess.Popen(
        [*CLI, "bootstrap", "--host", "127.0.0.1", "--port", "0", "--identity", str(folder / "bridge.key")]
        + ["--config", str(run_toml), "--initial-peers", *entries],
        stdout=subprocess.DEVNULL,
        stderr=open(folder / "bridge.log", "w"),
        env=ENV,
        start_new_session=True,
    )


def run_scenario(halves: tuple[int, int], folder: Path) -> dict:
    names = [[f"{side}{i}" for i in range(n)] for side, n in zip("ab", halves, strict=True)]
    with LocalSwarm(folder / "a", CONFIG) as first, LocalSwarm(folder / "b", CONFIG) as second:
        labs = {name: lab for lab, group in zip((first, second), names, strict=True) for name in group}
        for shard, (name, lab) in enumerate(labs.items()):
            lab.start(name, {"data.shard": str(shard)})  # drawn shards may repeat across halves: equal digests
        time.sleep(SPLIT_S)  # the partition's length (the scenario itself, not a synchronisation)
        at_heal = {name: latest(lab, name) for name, lab in labs.items()}
        node = bridge(folder, [first.maddr, second.maddr], first.run_toml)
        healed_at, trace, start = None, [], time.monotonic()
        try:
            while time.monotonic() - start < HEAL_DEADLINE_S and healed_at is None:
                now = {name: latest(lab, name) for name, lab in labs.items()}
                trace.append({"t": round(time.monotonic() - start, 1), "peers": now})
                if None not in now.values() and len(set(now.values())) == 1:
                    healed_at = time.monotonic() - start
                time.sleep(0.5)  # a poll interval, bounded by the deadline above
        finally:
            node.terminate()
            node.wait(timeout=30)
        return summary(halves, names, at_heal, trace, healed_at, labs)


def summary(halves, names, at_heal, trace, healed_at, labs) -> dict:
    final = trace[-1]["peers"]
    heal_round = max(r for r, _ in at_heal.values() if r is not None) if any(at_heal.values()) else 0
    rounds = (final[names[0][0]][0] - heal_round) if healed_at is not None else None
    switched = [n for n in names[0] + names[1] if _switched(labs[n], n, heal_round)]
    return {
        "halves": list(halves),
        "split_s": SPLIT_S,
        "rounds_at_heal": {n: r for n, (r, _) in at_heal.items()},
        "healed": healed_at is not None,
        "seconds_to_one_state": round(healed_at, 1) if healed_at is not None else None,
        "rounds_to_one_state": rounds,
        "peers_that_took_the_other_half_state": switched,
        "trace": trace[:: max(1, len(trace) // 60)],
    }


def _switched(lab: LocalSwarm, name: str, since: int) -> bool:
    """Whether the peer downloaded another state after the heal (caught up, or adopted the
    majority's in agreement): its own rounds since the split are gone."""
    return any(r.get("adopted") or "group_size" not in r for k, r in lab.records(name).items() if k > since)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--halves", type=int, nargs=2, action="append")
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for halves in args.halves or [[3, 1], [2, 2]]:
        with tempfile.TemporaryDirectory() as folder:
            result = run_scenario(tuple(halves), Path(folder))
        results[f"{halves[0]}+{halves[1]}"] = {**result, "machine": f"{platform.machine()}, {_cores()} cores"}
        print(json.dumps({k: v for k, v in result.items() if k != "trace"}, indent=1))
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
