"""One malicious peer among four, with real processes on 127.0.0.1: what each attack does to the
honest peers' held-out loss under each aggregator (issue 14).

The issue's set-up: the tiny preset, H = 20 (fixed: `swarm.speed_aware = false`, so every run
trains the same tokens, except the progress runs), 8 rounds, the same four identities in every
run (so the same data shards), three honest peers a, b, c and one attacker m
(tests/swarm/attacker_peer.py) that lies in one way through the normal code path. For every run:
the honest peers' held-out loss after 8 rounds against the clean run with the same aggregator,
whether the honest digests agreed in every round, exit codes, NaN, and the run's wall time.
Writes bench/results/attacks.json and attacks.png.

    python bench/attacks.py                      # every run below, about 30 minutes on 2 cores
    python bench/attacks.py --only clip          # the runs of one label of PLAN
    python bench/attacks.py --plot               # only the plot, from the results file
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

from lab import TINY_FIXED_H, LocalSwarm

HERE = Path(__file__).resolve().parent
ROUNDS = 8
HONEST = ("a", "b", "c")
CONFIG = {"run.run_id": "attacks", "run.rounds": str(ROUNDS), **TINY_FIXED_H}
# Runs whose settings differ from their label's (the same identities and shards: one invocation)
RUN_SETTINGS = {"clean, mean": {"swarm.aggregator": "mean"}, "clean, clip": {"swarm.aggregator": "clip"}}
STATE_ATTACKS = ["state-malformed:0", "state-huge:20", "state-tamper:0", "state-round:0"]
SENDER_ATTACKS = ["scale:1e4", "flip:10", "zero:1000", "weight:1000", "replay:0"]
REDUCER_ATTACKS = ["reducer-scale:100", "reducer-random:1", "reducer-mute:0"]
# (label, settings, runs): "clean..." is a run without an attack, anything else attacker_peer's ATTACK
PLAN = [
    # no attacker: the default against the plain mean (target: within 1 %)
    ("no attacker", {}, ["clean", "clean, mean", "clean, clip"]),
    # forged round records (a later round, with a state the attacker serves and that verifies)
    # and a faked link figure, by an admitted member
    ("aligned-clip, records and links", {}, ["clean", "clean, 3 honest alone", "ahead:1", "ahead:50", "link:1000"]),
    # peer c joins after round 2 and catches up; the attacker's id sorts first among the holders,
    # so c asks it first (a malformed state, a state 20 x the model's size, a tampered one)
    ("aligned-clip, a late joiner and bad state servers", {}, ["clean", *STATE_ATTACKS]),
    # the default: every attack by 1 of 4; an attacker convicted in round 1 leaves the 3 honest alone
    (
        "aligned-clip",
        {"swarm.aggregator": "aligned-clip"},
        ["clean", "clean, 3 honest alone", *SENDER_ATTACKS, *REDUCER_ATTACKS, "garbage:0"],
    ),
    (
        "aligned-clip, speed-aware rounds",
        {"swarm.aggregator": "aligned-clip", "swarm.speed_aware": "true"},
        ["clean", "progress:1000", "progress-inf:0"],
    ),
    ("mean", {"swarm.aggregator": "mean"}, ["clean", "scale:1e4", "flip:10", "zero:1000"]),
    ("clip", {"swarm.aggregator": "clip"}, ["clean", "clean (repeat)", *SENDER_ATTACKS]),
    # reducers audited (trust/audit.py): the same clip runs, measured again with the audit in place
    ("clip, audited reducers", {"swarm.aggregator": "clip"}, ["clean", *REDUCER_ATTACKS]),
    # a sender of signed NaN parts: convicted on its own signature (swarm/averaging/evidence.py)
    ("clip, malformed parts", {"swarm.aggregator": "clip"}, ["clean", "garbage:0"]),
    # signed parts with a malformed weight (convicted on its own signature) or of another size than
    # the group's layout (refused by each reducer it sends one to), issue 27
    (
        "aligned-clip, malformed parts",
        {},
        ["clean", "clean, 3 honest alone", "part-weight:nan", "part-weight:-1", "part-shape:0"],
    ),
    # all-gather data that does not parse (vouches that are not a mapping): refused at every honest
    # leader's door; followers of a group it leads leave it out (swarm/averaging/gathered.py), issue 27
    ("aligned-clip, malformed group data", {}, ["clean", "gather:0"]),
    # two colluders among five (the label's "2 of 5"): a coordinated sign flip, and ALIE with
    # z = 1 (Baruch et al. 2019 give z_max = 0.84 for n = 5, f = 2)
    ("clip, 2 of 5", {"swarm.aggregator": "clip"}, ["clean", "flip:10", "alie:1"]),
    ("mean, 2 of 5", {"swarm.aggregator": "mean"}, ["clean", "alie:1"]),
    ("trimmed-mean, 2 of 5", {"swarm.aggregator": "trimmed-mean"}, ["clean", "flip:10"]),
    ("centered-clip, 2 of 5", {"swarm.aggregator": "centered-clip"}, ["clean", "flip:10", "alie:1"]),
    # "clean, 3 honest alone": no attacker runs at all, what a perfect defence would leave
    (
        "aligned-clip, 2 of 5",
        {"swarm.aggregator": "aligned-clip"},
        ["clean", "clean, 3 honest alone", "flip:10", "alie:1"],
    ),
    ("trimmed-mean", {"swarm.aggregator": "trimmed-mean"}, ["clean", "flip:10", "zero:1000", "weight:1000"]),
    ("centered-clip", {"swarm.aggregator": "centered-clip"}, ["clean", "flip:10", "zero:1000"]),
    # progress reports matter only where rounds end on the swarm's tokens
    ("clip, speed-aware rounds", {"swarm.aggregator": "clip", "swarm.speed_aware": "true"}, ["clean", "progress:1000"]),
]


def run(
    folder: Path, keys: dict[str, Path], settings: dict[str, str], attack: str | None, attackers=("m",), late=None
) -> dict:
    """One run: the honest peers a, b, c and `attackers`, who lie with `attack` (None: honest);
    the honest peer `late` (if any) starts once a finished round 2, and catches up."""
    started = time.monotonic()
    with LocalSwarm(folder, {**CONFIG, **settings}) as lab:
        for name in (*(p for p in HONEST if p != late), *attackers):
            lab.start(name, {"swarm.identity_path": str(keys[name])}, attack=attack if name in attackers else None)
        if late is not None:
            lab.wait(lambda: max(lab.records("a"), default=0) >= 2, 600, "a finishes round 2")
            lab.start(late, {"swarm.identity_path": str(keys[late])})
        lab.wait(lambda: all(not lab.running(p) for p in HONEST), 900, "honest peers finish")
        exits = {p: lab.procs[p].returncode for p in HONEST}
        recs = {p: lab.records(p) for p in HONEST}
        logs = {p: (folder / f"{p}.log").read_text(errors="replace") for p in HONEST}
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
        # From this round on the honest peers averaged without the attacker (a conviction), if ever.
        "excluded_from_round": _excluded_from(recs["a"], rounds, len(HONEST) + len(attackers)),
        "allreduce_s_median": _median_allreduce(recs["a"], rounds),
        "eval_loss": [recs["a"][n].get("eval_loss") for n in rounds],
        "catch_ups": {p: logs[p].count("caught up with the swarm") for p in HONEST},
        "refused_states": {p: _refused(logs[p]) for p in HONEST},
        "waits_ahead": {p: logs[p].count("waiting up to") for p in HONEST},
        "wall_s": round(time.monotonic() - started, 1),
    }


def _refused(log: str) -> int:
    """States a peer refused from one server (swarm.download_state logs each), or kept its own over."""
    marks = ("state download from", "rejected the state offered by", "keeping this peer's own state")
    return sum(1 for line in log.splitlines() if any(mark in line for mark in marks))


def _excluded_from(recs: dict[int, dict], rounds: list[int], everyone: int) -> int | None:
    """The first round from which every recorded group was smaller than all the run's peers."""
    later = [n for n in rounds if n > 0]
    for i, n in enumerate(later):
        if all(recs[m].get("group_size", 1) < everyone for m in later[i:]):
            return n
    return None


def _median_allreduce(recs: dict[int, dict], rounds: list[int]) -> float | None:
    times = [recs[n]["allreduce_s"] for n in rounds if recs[n].get("group_size", 1) > 1 and "allreduce_s" in recs[n]]
    return round(statistics.median(times), 3) if times else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", action="append", help="one label's runs (e.g. clip); may be repeated")
    parser.add_argument("--plot", action="store_true", help="only draw the plot from the results file")
    args = parser.parse_args()
    out = HERE / "results" / "attacks.json"
    if args.plot:
        return plot(json.loads(out.read_text()))
    results = json.loads(out.read_text()) if args.only and out.exists() else {}
    results.update({"machine": platform.processor() or platform.machine(), "rounds": ROUNDS})
    with tempfile.TemporaryDirectory() as tmp:
        keys = identities(Path(tmp) / "keys")
        for label, settings, names in PLAN:
            if args.only and label not in args.only:
                continue
            runs = results[label] = {}
            for name in names:
                folder = Path(tmp) / f"{label}-{name}".replace(" ", "_").replace(":", "_").replace(",", "")
                attack = None if name.startswith("clean") else name
                attackers = () if "honest alone" in name else ("m", "n") if "2 of 5" in label else ("m",)
                late = "c" if "late joiner" in label else None
                runs[name] = run(folder, keys, {**settings, **RUN_SETTINGS.get(name, {})}, attack, attackers, late)
                print(label, name, json.dumps(runs[name]), flush=True)
            compare(runs)
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results)


def identities(folder: Path) -> dict[str, Path]:
    """The same five identities in every run: the same data shards, so runs differ only by the
    attack. The attacker m's id sorts before a's and b's, so a peer that catches up asks it first
    (holders are asked in id order)."""
    from p2p_diloco.swarm.transport.identity import peer_id_of  # imports hivemind: only here

    keys = {name: folder / f"{name}.key" for name in (*HONEST, "m", "n")}
    while peer_id_of(keys["m"]) > min(peer_id_of(keys["a"]), peer_id_of(keys["b"])):
        keys["m"].unlink()
    return keys


def compare(runs: dict[str, dict]) -> None:
    """Each run against its label's references: held-out loss, and seconds of wall time lost."""
    for reference, key in (("clean", "vs_clean"), ("clean, 3 honest alone", "vs_3_honest_alone")):
        base = runs.get(reference, {}).get("final_eval_loss")
        for result in runs.values() if base else ():
            loss = result["final_eval_loss"]
            result[key] = loss / base - 1 if loss is not None else None
    clean = runs.get("clean", {}).get("wall_s")
    for result in runs.values() if clean else ():
        result["seconds_lost"] = round(result["wall_s"] - clean, 1)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    aggregators = [label for label, _, _ in PLAN if label in results]
    fig, axes = plt.subplots(1, len(aggregators), figsize=(4.6 * len(aggregators), 4.2))
    for ax, aggregator in zip(axes if len(aggregators) > 1 else [axes], aggregators):
        names = list(results[aggregator])
        losses = [results[aggregator][n]["final_eval_loss"] for n in names]
        ax.barh(names, [min(x, 10.0) if x is not None else 0.0 for x in losses])
        for i, loss in enumerate(losses):
            label = "honest peers exit 1" if loss is None else f"{loss:,.3f}" if loss < 100 else f"{loss:.0f}"
            ax.text(0.1, i, label, va="center", fontsize=7, color="white" if loss and loss > 1.5 else "black")
        ax.set_xlim(0, 10)
        ax.set_title(f"aggregator: {aggregator}")
        ax.set_xlabel("honest held-out loss after 8 rounds (bar capped at 10)")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "results" / "attacks.png", dpi=110)


if __name__ == "__main__":
    main()
