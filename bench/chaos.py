"""Swarm runs under timing chaos (issue 25): 3 peers of the tiny preset, short rounds as in
tests/swarm's SWARM, and peer c treated unkindly:

    hog         a CPU hog on one core for the whole run
    quota       c in a cgroup v1 CPU quota of 15 % of one core, its whole process tree
    pauses      c's process tree stopped (SIGSTOP) for 0.1-3 s at random moments, seeded
    late        c started 0-30 s after a and b, seeded
    last-round  c started during the run's last round

Each run's verdict: ok; failure (a peer exited non-zero, with its last error line as the root
cause); hang (peers still running at the run's deadline); split (peers that exited 0 with
"run complete" on different final (round, digest)). Beside it, `rounds_off_the_swarm`: rounds a
peer recorded with a digest other than the one most peers recorded (I1). The run dirs of runs that are not ok, or
in which c did not end on the swarm's final digest, are kept. Writes bench/results/chaos.json after every run.

    python bench/chaos.py                                  # every scenario once, about 5 minutes
    python bench/chaos.py --runs 20 --budget-s 3000        # round-robin until 20 each or the budget
    python bench/chaos.py --scenarios quota --set swarm.linger_s=60   # with the default linger
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

from lab import LocalSwarm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, as lab.py does
from bench.chaos_kinds import CpuQuota, Hog, Pauses, Reaper  # noqa: E402
from tests.swarm.conftest import SWARM  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIG = {**SWARM, "run.run_id": "chaos", "run.rounds": "10"}  # --rounds changes run.rounds
PEERS = ("a", "b", "c")  # c is the one chaos picks on
SCENARIOS = ("hog", "quota", "pauses", "late", "last-round")
QUOTA_SHARE = 0.15
# A run of 10 rounds took 30-110 s on 2 busy cores (load average 4-15); a starved peer starts
# (imports torch, starts its DHT) about 7 x slower and slows the rounds it joins. Each round beyond
# 10 adds 10 s to the deadline.
DEADLINE_S = {"quota": 420, "late": 300, "last-round": 300}
DEFAULT_DEADLINE_S = 240
ERROR = re.compile(r"error|traceback|fail|could not|refus|timeout|timed out|exception", re.IGNORECASE)


def swarm_round(lab: LocalSwarm) -> int:
    return max((max(recs) for recs in (lab.records(p) for p in ("a", "b")) if recs), default=0)


def chaos(scenario: str, lab: LocalSwarm, stack: ExitStack, rng: random.Random, facts: dict, rounds: int):
    """Starts the peers under `scenario`; returns a function called every poll (late starts, quota
    sweeps) that says whether every peer has been started."""
    lab.start("a")
    lab.start("b")
    if scenario == "hog":
        stack.enter_context(Hog(core=0))
    if scenario in ("hog", "pauses", "quota"):
        quota = stack.enter_context(CpuQuota("c", QUOTA_SHARE)) if scenario == "quota" else None
        pid = lab.start("c").pid
        if quota:
            facts["quota_pids_max"] = quota.add(pid)
        if scenario == "pauses":
            facts["pauses"] = stack.enter_context(Pauses(pid, rng)).pauses

        def tick() -> bool:
            if quota:  # anything forked before the first add (none expected) joins it here
                facts["quota_pids_max"] = max(facts["quota_pids_max"], quota.add(pid))
            return True

        return tick
    start_at = time.monotonic() + rng.uniform(0, 30) if scenario == "late" else None
    facts["late_s"] = round(start_at - time.monotonic(), 1) if start_at else None

    def tick() -> bool:
        if "c" in lab.procs:
            return True
        due = time.monotonic() >= start_at if start_at else swarm_round(lab) >= rounds - 1
        if due:
            facts["c_started_at_swarm_round"] = swarm_round(lab)
            lab.start("c")
        return due

    return tick


def run_once(scenario: str, seed: int, folder: Path, rounds: int, overrides: dict[str, str]) -> dict:
    rng = random.Random(seed)
    deadline_s = DEADLINE_S.get(scenario, DEFAULT_DEADLINE_S) + 10 * max(0, rounds - 10)
    facts: dict = {}
    reaper = Reaper()
    started = time.monotonic()
    hung = False
    with ExitStack() as stack:
        stack.callback(reaper.end)  # last: whatever outlived its peer (p2pd of a killed peer)
        lab = stack.enter_context(LocalSwarm(folder, {**CONFIG, "run.rounds": str(rounds), **overrides}))
        tick = chaos(scenario, lab, stack, rng, facts, rounds)
        while True:
            reaper.note(proc.pid for proc in lab.procs.values())
            all_started = tick()
            if all_started and not any(lab.running(p) for p in PEERS if p in lab.procs):
                break
            if time.monotonic() - started > deadline_s:
                hung = True
                break
            time.sleep(0.5)  # a poll interval, bounded by the deadline
        codes = {p: lab.procs[p].poll() if p in lab.procs else None for p in PEERS}
    wall = time.monotonic() - started
    return {"scenario": scenario, "seed": seed, **judge(folder, codes, hung), "wall_s": round(wall, 1), **facts}


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def peer_outcome(folder: Path, name: str, code: int | None) -> dict:
    lines = read(folder / name / "metrics.jsonl").splitlines()
    records = {r["round"]: r for r in (json.loads(line) for line in lines if line.endswith("}"))}
    log = read(folder / f"{name}.log")
    last = records[max(records)] if records else None
    return {
        "exit": code,
        "final_round": last["round"] if last else None,
        "final_digest": last["digest"] if last else None,
        "run_complete": "run complete" in log,
        "rounds_recorded": len([r for r in records if r > 0]),
        "rounds_averaged_with_others": sum(1 for r in records.values() if (r.get("group_size") or 1) > 1),
        "last_error": last_error(log) if code != 0 else None,
        "last_line": (log.strip().splitlines() or [None])[-1],
        "digests": {r: rec["digest"] for r, rec in records.items()},
    }


def rounds_off_the_swarm(peers: dict) -> dict[str, list[int]]:
    """For each peer, the rounds whose recorded digest is not the one most peers recorded for that
    round (I1: a peer that completed a round holds the swarm's bytes of it)."""
    digests = {name: o.pop("digests") for name, o in peers.items()}
    off: dict[str, list[int]] = {}
    for r in sorted({r for d in digests.values() for r in d}):
        held = Counter(d[r] for d in digests.values() if r in d)
        if len(held) > 1:
            top = min(held, key=lambda digest: (-held[digest], digest))
            for name, d in digests.items():
                if r in d and d[r] != top:
                    off.setdefault(name, []).append(r)
    return off


def last_error(log: str) -> str | None:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    hits = [line for line in lines if ERROR.search(line)] or lines
    return hits[-1][:400] if hits else None


def cause(error: str | None) -> str:
    """A failure's kind, from its error line: the refusal of a finished run is the designed
    outcome for a peer that could not see the run before it ended (docs/design.md I1)."""
    if error and "finished at round" in error and "could not be downloaded" in error:
        return "refused: the run finished before this peer could download its final state"
    return "other: see root_cause"


def judge(folder: Path, codes: dict, hung: bool) -> dict:
    peers = {name: peer_outcome(folder, name, code) for name, code in codes.items()}
    off = rounds_off_the_swarm(peers)
    finals = {(o["final_round"], o["final_digest"]) for o in peers.values() if o["exit"] == 0 and o["run_complete"]}
    if len(finals) > 1:
        verdict = "split"
    elif hung:
        verdict = "hang"
    elif any(o["exit"] != 0 for o in peers.values()):
        verdict = "failure"
    else:
        verdict = "ok"
    swarm_final = Counter(
        (o["final_round"], o["final_digest"]) for n, o in peers.items() if n != "c" and o["run_complete"]
    ).most_common(1)
    c = peers["c"]
    return {
        "verdict": verdict,
        "exit_codes": {n: o["exit"] for n, o in peers.items()},
        "final_digests": {n: o["final_digest"] for n, o in peers.items()},
        "c_on_swarm_final": bool(swarm_final) and (c["final_round"], c["final_digest"]) == swarm_final[0][0],
        "peers": peers,
        "rounds_off_the_swarm": off,
        "root_cause": {n: o["last_error"] for n, o in peers.items() if o["exit"] != 0} or None,
        "cause": {n: cause(o["last_error"]) for n, o in peers.items() if o["exit"] != 0} or None,
    }


def summary(runs: list[dict]) -> dict:
    out = {}
    for scenario in [*SCENARIOS, "all"]:
        mine = [r for r in runs if scenario in ("all", r["scenario"])]
        counts = Counter(r["verdict"] for r in mine)
        out[scenario] = {
            "runs": len(mine),
            **{k: counts.get(k, 0) for k in ("ok", "failure", "hang", "split")},
            "c_on_swarm_final": sum(r["c_on_swarm_final"] for r in mine),
            "runs_with_rounds_off_the_swarm": sum(bool(r.get("rounds_off_the_swarm")) for r in mine),
            "failure_causes": Counter(c for r in mine if r["verdict"] == "failure" for c in r["cause"].values()),
        }
    quota = [r for r in runs if r["scenario"] == "quota"]
    out["starved_peer"] = [
        {
            "seed": r["seed"],
            "verdict": r["verdict"],
            "rounds_recorded": r["peers"]["c"]["rounds_recorded"],
            "rounds_averaged_with_others": r["peers"]["c"]["rounds_averaged_with_others"],
            "on_swarm_final_digest": r["c_on_swarm_final"],
            "pids_in_quota": r.get("quota_pids_max"),
        }
        for r in quota
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of " + ", ".join(SCENARIOS))
    parser.add_argument("--runs", type=int, default=1, help="runs of each scenario (round-robin)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=10, help="the run's rounds (about 1-2 s each)")
    parser.add_argument("--set", action="append", default=[], help="a config override, e.g. swarm.linger_s=60")
    parser.add_argument("--budget-s", type=float, default=None, help="start no run after this many seconds")
    parser.add_argument("--keep", type=Path, default=Path("/tmp/chaos-runs"), help="where run dirs go")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "chaos.json")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    overrides = dict(item.split("=", 1) for item in args.set)
    # SIGTERM (and SIGINT, ignored in a background job) ends the runs through their finally blocks:
    # peers, hog, pauses and cgroup are ended and removed as on any other exit.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit(143))
    began, runs = time.monotonic(), []
    for i in range(args.runs):
        for scenario in scenarios:
            if args.budget_s and time.monotonic() - began > args.budget_s:
                break
            seed = args.seed * 1000 + i
            folder = args.keep / f"{scenario}-{seed}-{int(time.time())}"
            load = round(os.getloadavg()[0], 2)
            result = {**run_once(scenario, seed, folder, args.rounds, overrides), "load_avg_1m_at_start": load}
            if result["verdict"] == "ok" and result["c_on_swarm_final"]:
                shutil.rmtree(folder, ignore_errors=True)
            else:
                result["run_dir"] = str(folder)
            runs.append(result)
            brief = {k: result[k] for k in ("scenario", "seed", "verdict", "exit_codes", "wall_s")}
            print(json.dumps(brief), flush=True)
            write(args.out, runs, {"run.rounds": str(args.rounds), **overrides})


def write(out: Path, runs: list[dict], overrides: dict[str, str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": f"{platform.machine()}, {platform.system()}, {os.cpu_count()} cores, shared with other work",
        "config": {**CONFIG, **overrides},
        "quota_share": QUOTA_SHARE,
        "summary": summary(runs),
        "runs": runs,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
