"""The fault table of docs/benchmarks.md: one real swarm per fault, 3 peers of which one fails on purpose.

Each run: peers a and b survive, peer c is started with a fault (tests/swarm/faulty_peer.py) in one
phase of a round: the inner phase, matchmaking, the all-reduce, the audit after it, or serving its
state to a joiner (then a fourth peer d joins to ask it). SIGKILL is a crash, SIGSTOP a hang (a
laptop asleep). Reported per fault: rounds the survivors lost (rounds after the fault in which they
did not average together), seconds lost (from the first survivor's round before the fault to its
end, beyond the median round, by the records' commit times), whether every common
round's digest was equal, and whether any survivor applied an average that included the dead peer
after it died. Writes bench/results/faults.json.

    python bench/faults.py          # about 8 minutes on 2 cores
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
from pathlib import Path

from lab import LocalSwarm

HERE = Path(__file__).resolve().parent
ROUNDS = 12
CONFIG = {
    "run.run_id": "faults",
    "run.rounds": str(ROUNDS),
    "run.eval_sequences": "4",
    "run.eval_every_rounds": "0",
    "model.preset": "tiny",
    "model.seq_len": "32",
    "data.num_shards": "8",
    "inner.steps": "3",
    "inner.batch_size": "4",
    "inner.micro_batch_size": "2",
    "inner.warmup_steps": "2",
    "inner.lr": "3e-3",
    "swarm.matchmaking_time_s": "4",
    "swarm.averaging_timeout_s": "20",
    "swarm.agreement_timeout_s": "15",
    "swarm.join_timeout_s": "20",
}
FAULTS = [
    ("inner phase", "crash", "inner:3:KILL"),
    ("inner phase", "hang", "inner:3:STOP"),
    ("matchmaking", "crash", "matchmaking:3:KILL"),
    ("matchmaking", "hang", "matchmaking:3:STOP"),
    ("all-reduce (sender and reducer)", "crash", "allreduce:3:KILL"),
    ("all-reduce (sender and reducer)", "hang", "allreduce:3:STOP"),
    ("the audit (one member audited it)", "hang", "audit:3:STOP"),
    ("serving a state download", "crash", "serve:1:KILL"),
    ("serving a state download", "hang", "serve:1:STOP"),
]


def run(phase: str, kind: str, fault: str, folder: Path) -> dict:
    serve = fault.startswith("serve")
    config = {**CONFIG, "run.rounds": "30"} if serve else CONFIG
    rounds = int(config["run.rounds"])
    with LocalSwarm(folder, config) as lab:
        if serve:
            # A joiner asks the holders of the state in peer-id order: the subject gets the smaller id.
            subject_key, survivor_key = identities(folder)
            lab.start("a", {"swarm.identity_path": str(survivor_key)})
            lab.start("c", {"swarm.identity_path": str(subject_key)}, fault=fault)
            lab.wait(lambda: 2 in lab.records("a") and 2 in lab.records("c"), 120, "two rounds")
            lab.start("d")
            survivors = ("a", "d")
        else:
            lab.start("a")
            lab.start("b")
            lab.start("c", fault=fault)
            survivors = ("a", "b")
        lab.wait(lambda: not any(lab.running(p) for p in survivors), 300, f"{fault}: survivors finish")
        recs = {p: lab.records(p) for p in (*survivors, "c")}
        codes = {p: lab.procs[p].returncode for p in survivors}
        fired = lab.procs["c"].poll() == -9 or stopped(lab.procs["c"].pid)
    first = survivors[0]
    last = max(recs["c"]) if recs["c"] else 0
    ours = recs[first]
    median = statistics.median(r["wall_s"] for r in ours.values() if "wall_s" in r)
    after = {r: rec for r, rec in ours.items() if r > last and "wall_s" in rec}
    since = max(r for r in ours if r <= last)  # from commit times: a round caught up with has no wall_s
    common = set(recs[survivors[0]]) & set(recs[survivors[1]])
    return {
        "phase": phase,
        "fault": kind,
        "injected": fault,
        "fired": bool(fired),
        "survivors_exit_codes": codes,
        "subject_last_round": last,
        "rounds": rounds,
        "survivors_finished": all(max(recs[p]) == rounds for p in survivors),
        "digests_agreed": all(recs[survivors[0]][r]["digest"] == recs[survivors[1]][r]["digest"] for r in common),
        "common_rounds": len(common),
        # rounds after the fault that the survivors did not average as a group of 2 or more
        "rounds_lost": sum(1 for rec in after.values() if rec["group_size"] < 2),
        "seconds_lost": round(ours[rounds]["time"] - ours[since]["time"] - (rounds - since) * median, 1),
        "median_round_s": round(median, 2),
        "dead_peer_in_a_later_group": any(rec["group_size"] >= 3 for r, rec in after.items() if r > last + 1),
    }


def identities(folder: Path) -> tuple[Path, Path]:
    """Two fresh peer identities, the one with the smaller peer id first."""
    from hivemind.p2p import P2P, PeerID

    paths = [folder / "id-1.key", folder / "id-2.key"]
    for path in paths:
        P2P.generate_identity(str(path))
    return tuple(sorted(paths, key=lambda path: str(PeerID.from_identity(path.read_bytes()))))


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, IndexError):
        return False


def main() -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (phase, kind, fault) in enumerate(FAULTS):
            results.append(run(phase, kind, fault, Path(tmp) / str(i)))
            print(json.dumps(results[-1]))
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "faults.json").write_text(
        json.dumps(
            {"machine": f"{platform.machine()}, {platform.system()}, 2 cores", "config": CONFIG, "runs": results},
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {out / 'faults.json'}")


if __name__ == "__main__":
    main()
