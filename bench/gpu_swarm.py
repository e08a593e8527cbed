"""Two peers share one GPU for a few short rounds of a real swarm (a bootstrap node and two
`p2p-diloco peer` processes on 127.0.0.1, bench/lab.py): both train on the device (bf16 autocast on
CUDA), average through hivemind, and must hold the same digest of (round, theta, momentum) after
every round, with both in the group.

    python bench/gpu_swarm.py --device cuda --out bench/results/gpu_swarm.json    # about a minute
    python bench/gpu_swarm.py --device cpu --preset tiny --out /tmp/swarm.json     # the same on a CPU

Exits 1 if the peers disagree in any round, or a round was not averaged by both.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

from lab import TINY_FIXED_H, LocalSwarm

PEERS = ("a", "b")


def overrides(args: argparse.Namespace) -> dict[str, str]:
    return {
        **TINY_FIXED_H,
        "run.run_id": "gpu-swarm-check",
        "run.rounds": str(args.rounds),
        "run.device": args.device,
        "run.eval_sequences": "16",
        "model.preset": args.preset,
        "model.seq_len": str(args.seq_len),
        "data.num_shards": "2",
        "inner.steps": str(args.steps),
        "inner.batch_size": "16",
        "inner.micro_batch_size": "8",
        "inner.precision": "auto",  # bf16 autocast on CUDA, fp32 on a CPU
        "swarm.averaging_timeout_s": "60",
    }


def run(args: argparse.Namespace, folder: Path) -> dict:
    started = time.perf_counter()
    with LocalSwarm(folder, overrides(args)) as lab:
        for shard, name in enumerate(PEERS):
            lab.start(name, {"data.shard": str(shard)})
        lab.wait(lambda: not any(lab.running(p) for p in PEERS), args.timeout_s, "both peers finish")
        codes = {p: lab.procs[p].returncode for p in PEERS}
        records = {p: lab.records(p) for p in PEERS}
    rounds = range(1, args.rounds + 1)
    digests = {r: [records[p].get(r, {}).get("digest") for p in PEERS] for r in rounds}
    groups = {r: [records[p].get(r, {}).get("group_size") for p in PEERS] for r in rounds}
    agree = all(None not in d and len(set(d)) == 1 for d in digests.values())
    averaged = all(g == [2, 2] for g in groups.values())
    return {
        "setting": {**overrides(args), "peers": len(PEERS)},
        "exit_codes": codes,
        "digests": digests,
        "group_sizes": groups,
        "agree": agree,
        "averaged_by_both": averaged,
        "tokens_per_s": {p: [records[p].get(r, {}).get("tokens_per_s") for r in rounds] for p in PEERS},
        "allreduce_s": {p: [records[p].get(r, {}).get("allreduce_s") for r in rounds] for p in PEERS},
        "eval_loss": {p: [records[p].get(r, {}).get("eval_loss") for r in range(args.rounds + 1)] for p in PEERS},
        "wall_s": round(time.perf_counter() - started, 1),
    }


def stop_on_term(signum: int, frame: object) -> None:
    # A deadline (`timeout`) sends SIGTERM: leave through LocalSwarm.__exit__, which ends every
    # process it started (they run in sessions of their own, out of reach of the deadline's signal).
    raise SystemExit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="H")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=240, help="deadline for both peers to finish")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, stop_on_term)
    with tempfile.TemporaryDirectory(prefix="gpu-swarm-") as tmp:
        try:
            result = run(args, Path(tmp))
        except TimeoutError as e:
            logs = {p.name: p.read_text()[-2000:] for p in Path(tmp).glob("*.log")}
            result = {"error": str(e), "log_tails": logs, "agree": False, "averaged_by_both": False}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"digests per round: {result.get('digests')}; agree: {result['agree']}; wrote {args.out}")
    return 0 if result["agree"] and result["averaged_by_both"] else 1


if __name__ == "__main__":
    sys.exit(main())
