"""One peer of bench/allreduce.py: joins the swarm from its lab address and averages a large
random pseudo-gradient once per "go" line on stdin.

    python bench/allreduce_worker.py MADDR HOST_IP INDEX GROUP CODEC NUMEL RUN_DIR AVERAGING_TIMEOUT_S [AGGREGATOR]
Prints "ready" once joined; for each "go" prints one JSON line: allreduce_s, bytes_sent,
bytes_received, group (size), its measured link (bytes/s), sha256 (of the averaged bytes: equal
on every member), or error.
Ends at EOF on stdin. Logs go to stderr.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import lockstep
import noseal
import part_trace
import torch

from p2p_diloco import config
from p2p_diloco.errors import AveragingError
from p2p_diloco.protocol import links
from p2p_diloco.swarm import HivemindSwarm


def main(
    maddr: str,
    host: str,
    index: int,
    group: int,
    codec: str,
    numel: int,
    run_dir: Path,
    timeout_s: float,
    aggregator: str = "clip",
    quic: bool = False,
) -> None:
    cfg = config.load(
        None,
        {
            "swarm.host": host,
            "swarm.initial_peers": maddr,
            "swarm.compression": codec,
            "swarm.matchmaking_time_s": "5",
            "swarm.averaging_timeout_s": str(timeout_s),
            "swarm.aggregator": aggregator,
            "swarm.quic": str(quic).lower(),
            "run.dir": str(run_dir),
        },
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    if trace_dir := os.environ.get("PART_TRACE_DIR"):  # bench/part_trace.py: before the averager forks
        os.environ["PART_TRACE"] = str(Path(trace_dir) / f"w{index}.jsonl")
        part_trace.install()
    if os.environ.get("LOCKSTEP"):  # bench/lockstep.py, an experiment
        lockstep.install()
    if os.environ.get("NOSEAL"):  # bench/noseal.py, an experiment
        noseal.install()
    if parts := os.environ.get("PARTS_PER_MEMBER"):  # bench/allreduce.py --parts-per-member: before the averager forks
        links.PARTS_PER_MEMBER = int(parts)
    swarm = HivemindSwarm(cfg, run_dir, numel, lambda: ({}, []))
    try:
        print("ready", flush=True)
        for round_ in range(1_000_000):
            # Drawn before "go", so that the parent's release is what starts every peer's clock.
            delta = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * round_ + index))
            if sys.stdin.readline().strip() != "go":
                return
            print(json.dumps(average(swarm, delta, round_, group)), flush=True)
    finally:
        swarm.close()


def average(swarm: HivemindSwarm, delta: torch.Tensor, round_: int, group: int) -> dict:
    try:
        result = swarm.average(delta, 1.0, round_=round_, expected_group=group)  # starts once all `group` met
    except AveragingError as e:
        return {"error": str(e)}
    if result is None:
        return {"error": "no group formed"}
    return {
        "ended_at": time.time(),  # the all-reduce's end on this machine's clock (the sampler's too)
        "allreduce_s": result.allreduce_s,
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "butterfly_s": result.butterfly_s,
        "audit_s": result.audit_s,
        "audit_bytes": result.audit_bytes,
        "group": len(result.group),
        "bandwidth": result.link_bps,  # the link figure this peer announced, bytes/s (protocol/links.py)
        "probes": wait_for_probes(swarm),
        "sha256": hashlib.sha256(result.delta.numpy().tobytes()).hexdigest(),
    }


def wait_for_probes(swarm: HivemindSwarm) -> dict | None:
    """The probe sweep this all-reduce started, if any: done before the next "go", so that probes
    never share the links with an all-reduce here (in a real run they overlap the inner phase)."""
    if swarm.probes is None:
        return None
    probes, swarm.probes = swarm.probes, None
    try:
        return probes.result(timeout=120)
    except Exception as e:  # a sweep that failed or hung: the next all-reduce runs without its figures
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    maddr, host, index, group, codec, numel, run_dir, timeout_s = sys.argv[1:9]
    aggregator = sys.argv[9] if len(sys.argv) > 9 else "clip"
    quic = len(sys.argv) > 10 and sys.argv[10] == "quic"
    main(maddr, host, int(index), int(group), codec, int(numel), Path(run_dir), float(timeout_s), aggregator, quic)
