"""What admission costs, and what forged records do, with real peer processes on 127.0.0.1.

Three peers (the same three identities, so the same data shards, in every scenario) train the
tiny preset for ROUNDS rounds:
- `open` and `certified` runs, twice each and alternating (A B A B), for the cost of admission per
  round and per all-reduce, compared in one run;
- a `certified` run attacked by bench/forger.py: records under the honest peers' ids signed by
  another key, records under made-up ids, and 4 sybils (fresh keys, valid signatures, no
  certificate), all claiming a round 50 ahead with a made-up digest;
- an `open` run attacked by the same forger without sybils (identity binding holds in every mode);
- an `open` run attacked with 4 sybils: what a sybil can still do where anyone may join.

It also times the admission checks themselves in-process (a certificate verified cold, and a group
of 3 checked from the cache). Writes bench/results/admission.json and admission.png.

    python bench/admission.py          # about 6 minutes on 2 cores
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from p2p_diloco import config
from p2p_diloco.swarm.transport.identity import peer_id_of
from p2p_diloco.trust import admission

from lab import ENV, TINY_FIXED_H, LocalSwarm

HERE = Path(__file__).resolve().parent
ROUNDS = 8
PEERS = ("a", "b", "c")
CONFIG = {"run.run_id": "admission-bench", "run.rounds": str(ROUNDS), **TINY_FIXED_H}
# (name, admission mode, forger: None, or the number of sybils it runs besides its forgeries)
SCENARIOS = [
    ("open", "open", None),
    ("certified", "certified", None),
    ("open (repeat)", "open", None),
    ("certified (repeat)", "certified", None),
    ("certified + forger + 4 sybils", "certified", 4),
    ("open + forger", "open", 0),
    ("open + forger + 4 sybils", "open", 4),
]


def organiser(folder: Path, ids: dict[str, str]) -> tuple[dict[str, str], dict[str, Path]]:
    """A certified run: its config overrides (signed) and a certificate per peer."""
    public = admission.make_run_key(folder / "run.key")
    run = {**CONFIG, "admission.mode": "certified", "admission.organiser_key": public}
    cfg = config.load(None, run)
    run["admission.config_signature"] = admission.sign_config(
        folder / "run.key", cfg.run.run_id, public, cfg.fingerprint()
    ).signature
    certs = {}
    for name, peer in ids.items():
        certs[name] = folder / f"{name}.cert"
        admission.admit(folder / "run.key", cfg.run.run_id, public, peer, name, 1, certs[name])
    return run, certs


def run_scenario(folder: Path, keys: dict[str, Path], mode: str, sybils: int | None) -> dict:
    ids = {name: peer_id_of(key) for name, key in keys.items()}
    run, certs = organiser(folder, ids) if mode == "certified" else (dict(CONFIG), {})
    started = time.monotonic()
    with LocalSwarm(folder, run) as lab:
        forger = None
        if sybils is not None:
            command = [sys.executable, str(HERE / "forger.py"), str(lab.run_toml), lab.maddr, *ids.values()]
            forger = subprocess.Popen(
                [*command, "--sybils", str(sybils)],
                stdout=open(folder / "forger.log", "w"),
                stderr=subprocess.STDOUT,
                env=ENV,
                start_new_session=True,
            )
            lab.procs["forger"], lab.groups = forger, lab.groups | {forger.pid}
        for name in PEERS:
            extra = {"swarm.identity_path": str(keys[name])}
            if name in certs:
                extra["admission.certificate"] = str(certs[name])
            lab.start(name, extra)
        lab.wait(lambda: all(not lab.running(p) for p in PEERS), 900, "all peers finish")
        exits = {p: lab.procs[p].returncode for p in PEERS}
        recs = {p: lab.records(p) for p in PEERS}
    return summarise(recs, exits, time.monotonic() - started)


def summarise(recs: dict[str, dict[int, dict]], exits: dict[str, int], wall_s: float) -> dict:
    rounds = sorted(set.intersection(*(set(r) for r in recs.values())))
    trained = [rec for r in recs.values() for n, rec in r.items() if n > 0]
    averaged = [rec["allreduce_s"] for rec in trained if rec.get("group_size", 1) >= 2 and "allreduce_s" in rec]
    return {
        "exit_codes": exits,
        "rounds_recorded": len(rounds),
        "digests_equal_every_round": all(len({recs[p][n]["digest"] for p in PEERS}) == 1 for n in rounds),
        "group_sizes": [recs["a"][n].get("group_size", 1) for n in rounds if n > 0],
        "final_digest": recs["a"].get(ROUNDS, {}).get("digest"),
        "final_eval_loss": recs["a"].get(ROUNDS, {}).get("eval_loss"),
        "eval_loss": [recs["a"][n].get("eval_loss") for n in rounds],
        "median_allreduce_s": statistics.median(averaged) if averaged else None,
        "median_round_wall_s": statistics.median(rec["wall_s"] for rec in trained if "wall_s" in rec),
        "run_wall_s": round(wall_s, 1),
    }


def micro_costs() -> dict:
    """The admission checks themselves, timed in-process on this machine (seconds per call)."""

    from p2p_diloco.swarm.trust.doors import Doors

    with tempfile.TemporaryDirectory() as folder:
        public = admission.make_run_key(Path(folder) / "run.key")
        key = admission.load_run_key(Path(folder) / "run.key")
    peers = [f"QmPeer{i}" for i in range(3)]
    certs = [admission.issue(key, "r", p, p, 2**33).to_json() for p in peers]
    cold, n = time.perf_counter(), 200
    for _ in range(n):
        Doors("r", public, None).reason_to_refuse(peers[0], certs[0])
    cold = (time.perf_counter() - cold) / n
    doors = Doors("r", public, None)
    for peer, text in zip(peers, certs):
        doors.check_member(peer, text)
    cached = time.perf_counter()
    for _ in range(n):
        for peer, text in zip(peers, certs):
            doors.check_member(peer, text)
    return {"verify_one_certificate_cold_s": cold, "check_group_of_3_cached_s": (time.perf_counter() - cached) / n}


def main() -> None:
    results: dict = {"machine": platform.processor() or platform.machine(), "rounds": ROUNDS, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        keys = {name: Path(tmp) / f"{name}.key" for name in PEERS}
        for name, mode, sybils in SCENARIOS:
            folder = Path(tmp) / name.replace(" ", "_").replace("+", "").replace("(", "").replace(")", "")
            results["scenarios"][name] = run_scenario(folder, keys, mode, sybils)
            print(name, json.dumps(results["scenarios"][name]), flush=True)
    results["micro"] = micro_costs()
    results["cost"] = cost(results)
    out = HERE / "results" / "admission.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results)
    print(json.dumps(results["cost"], indent=1))


def cost(results: dict) -> dict:
    """Certified against open, pooled over both repeats of each, and the checks' own time."""
    s = results["scenarios"]

    def pooled(key: str, *names: str) -> float:
        return statistics.mean(s[n][key] for n in names)

    allreduce_open = pooled("median_allreduce_s", "open", "open (repeat)")
    allreduce_cert = pooled("median_allreduce_s", "certified", "certified (repeat)")
    micro = results["micro"]
    # Per all-reduce a member checks the join requests it leads and the group's certificates: at
    # worst every certificate cold, once (afterwards cached until it expires).
    checks_s = 3 * micro["verify_one_certificate_cold_s"] + micro["check_group_of_3_cached_s"]
    return {
        "median_allreduce_s_open": allreduce_open,
        "median_allreduce_s_certified": allreduce_cert,
        "allreduce_ratio_certified_to_open": allreduce_cert / allreduce_open,
        "round_wall_ratio_certified_to_open": pooled("median_round_wall_s", "certified", "certified (repeat)")
        / pooled("median_round_wall_s", "open", "open (repeat)"),
        "checks_per_allreduce_s_worst": checks_s,
        "checks_share_of_open_allreduce": checks_s / allreduce_open,
    }


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results["scenarios"].items():
        left.plot(range(len(r["eval_loss"])), r["eval_loss"], marker="o", label=name)
    left.set_xlabel("round")
    left.set_ylabel("held-out loss (peer a)")
    left.legend(fontsize=7)
    names = list(results["scenarios"])
    right.barh(names, [results["scenarios"][n]["median_allreduce_s"] or 0 for n in names])
    right.set_xlabel("median all-reduce time (s)")
    right.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "results" / "admission.png", dpi=110)


if __name__ == "__main__":
    main()
