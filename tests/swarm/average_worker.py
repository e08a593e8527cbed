"""One swarm member that averages a known pseudo-gradient once and prints what it got.

    python -m tests.swarm.average_worker MADDR INDEX WEIGHT CODEC RUN_DIR
Prints "ready" once joined, waits for "go" on stdin, then prints one JSON line: the averaged
values, the sha256 of their bytes and the group size.
"""

import hashlib
import json
import sys
from pathlib import Path

import torch

from p2p_diloco import config
from p2p_diloco.swarm import Swarm

NUMEL = 1000


def known_delta(index: int) -> torch.Tensor:
    """Δ_i[j] = (i + 1) · (1 + j / 1000)."""
    return (index + 1) * (1 + torch.arange(NUMEL, dtype=torch.float32) / 1000)


def main(maddr: str, index: int, weight: float, codec: str, run_dir: str) -> None:
    cfg = config.load(None, {"swarm.host": "127.0.0.1", "swarm.initial_peers": maddr, "swarm.compression": codec,
                             "swarm.matchmaking_time_s": "4", "swarm.averaging_timeout_s": "20", "run.dir": run_dir})
    Path(run_dir).mkdir(parents=True)
    swarm = Swarm(cfg, Path(run_dir), NUMEL, lambda: ({}, []))
    try:
        print("ready", flush=True)
        assert sys.stdin.readline().strip() == "go"
        result = swarm.average(known_delta(index), weight, round_=0)
        values = result.delta
        print(json.dumps({"values": values.tolist(), "sha256": hashlib.sha256(values.numpy().tobytes()).hexdigest(),
                          "group": len(result.group), "bytes_sent": result.bytes_sent}), flush=True)
    finally:
        swarm.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5])
