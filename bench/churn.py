"""Churn soak: peers crash, leave, join and come back every few rounds of a 24-round run.

Events are keyed to the swarm's round (the highest round any peer recorded): crashes are SIGKILL
of a peer's whole process group, leaves are Ctrl+C, comebacks restart a peer on its own run dir
with --resume (its checkpoint is behind, so it catches up from the swarm), joins are fresh peers.
For every round: which peers recorded it, whether their digests were equal, the group sizes, and
the held-out loss. Writes bench/results/churn.json and churn.png.

    python bench/churn.py          # about 4 minutes on 2 cores
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path

from lab import LocalSwarm

HERE = Path(__file__).resolve().parent
ROUNDS = 24
CONFIG = {
    "run.run_id": "churn",
    "run.rounds": str(ROUNDS),
    "run.eval_sequences": "32",
    "run.eval_every_rounds": "1",
    "model.preset": "tiny",
    "model.seq_len": "128",
    "data.num_shards": "16",
    "inner.steps": "20",
    "inner.batch_size": "16",
    "inner.micro_batch_size": "16",
    "inner.lr": "3e-3",
    "inner.warmup_steps": "20",
    "swarm.matchmaking_time_s": "3",
    "swarm.averaging_timeout_s": "30",
    "swarm.agreement_timeout_s": "15",
}
# (swarm round, action, peer)
EVENTS = [
    (3, "crash", "c"),
    (5, "join", "d"),
    (8, "leave", "b"),
    (10, "resume", "c"),
    (13, "crash", "a"),
    (15, "resume", "b"),
    (18, "join", "e"),
    (21, "leave", "d"),
]
PEERS = ("a", "b", "c", "d", "e")


def swarm_round(lab: LocalSwarm) -> int:
    return max((max(recs) for recs in (lab.records(p) for p in PEERS if (lab.folder / p).exists()) if recs), default=0)


def main() -> None:
    log = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, LocalSwarm(Path(tmp), CONFIG) as lab:
        for peer in ("a", "b", "c"):
            lab.start(peer)
        for at, action, peer in EVENTS:
            lab.wait(lambda at=at: swarm_round(lab) >= at, 300, f"round {at}")
            if action == "crash":
                lab.kill(peer)
            elif action == "leave":
                code = lab.interrupt(peer)
                assert code == 0, f"{peer} left with exit code {code}"
            elif action == "join":
                lab.start(peer)
            else:
                lab.start(peer, resume=True)
            log.append(
                {
                    "round": swarm_round(lab),
                    "action": action,
                    "peer": peer,
                    "t_s": round(time.perf_counter() - started, 1),
                }
            )
            print(log[-1], flush=True)
        live = [p for p in PEERS if p in lab.procs and lab.running(p)]
        lab.wait(lambda: not any(lab.running(p) for p in live), 600, "the live peers finish")
        records = {p: lab.records(p) for p in PEERS}
        codes = {p: lab.procs[p].returncode for p in live}
    wall = time.perf_counter() - started
    rounds = []
    for r in range(ROUNDS + 1):
        here = {p: recs[r] for p, recs in records.items() if r in recs}
        losses = [rec["eval_loss"] for rec in here.values() if rec.get("eval_loss") is not None]
        rounds.append(
            {
                "round": r,
                "peers": sorted(here),
                "digests_equal": len({rec["digest"] for rec in here.values()}) == 1,
                "group_sizes": {p: rec.get("group_size") for p, rec in here.items()},
                "eval_loss": losses[0] if losses else None,
            }
        )
    result = {
        "machine": f"{platform.machine()}, {platform.system()}, 2 cores",
        "config": CONFIG,
        "events": log,
        "wall_s": round(wall, 1),
        "final_exit_codes": codes,
        "rounds_recorded": sum(1 for row in rounds if row["peers"]),
        "rounds_with_disagreement": [row["round"] for row in rounds if row["peers"] and not row["digests_equal"]],
        "eval_loss_first_last": [rounds[0]["eval_loss"], rounds[-1]["eval_loss"]],
        "rounds": rounds,
    }
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "churn.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "churn.png")
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, height_ratios=[2, 1])
    rows = [row for row in result["rounds"] if row["eval_loss"] is not None]
    top.plot([row["round"] for row in rows], [row["eval_loss"] for row in rows], marker="o", ms=3)
    top.set_ylabel("held-out loss")
    for event in result["events"]:
        top.axvline(event["round"], color="grey", lw=0.6, ls=":")
        top.annotate(
            f"{event['action']} {event['peer']}",
            (event["round"], top.get_ylim()[1]),
            fontsize=7,
            rotation=90,
            va="top",
            ha="right",
        )
    bottom.bar(
        [row["round"] for row in result["rounds"]],
        [len(row["peers"]) for row in result["rounds"]],
        color=["tab:green" if row["digests_equal"] else "tab:red" for row in result["rounds"]],
    )
    bottom.set_ylabel("peers at round\n(green: digests equal)")
    bottom.set_xlabel("round")
    fig.suptitle("churn soak: crashes, leaves, joins and comebacks in a 24-round swarm")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
