"""A malicious member: a real peer that lies in one way, chosen by ATTACK, through the normal code.

    ATTACK=<kind>:<x> python -m tests.swarm.attacker_peer peer ...   (same arguments as p2p-diloco peer)

As a sender (its pseudo-gradient, norms and biases included, and the weight it claims):
- `scale:x`     sends x · Δ (x = 1e4: a blown-up update);
- `flip:x`      sends -x · Δ (x = 10: a sign flip);
- `zero:x`      sends a zero Δ with x times its weight (training undone);
- `weight:x`    claims x times its tokens;
- `replay:0`    sends its first round's Δ every round (an old update);
- `garbage:0`   sends NaN for every value, signed (a malformed part);
- `alie:z`      "a little is enough" (Baruch et al., 2019): ATTACK_COLLUDERS attackers (default 2)
                pool their own honest Δ of the round in a folder beside the run config, and each
                sends μ − z·σ of the pool, coordinate-wise: a shift hidden inside the spread.
As a reducer (the span it reduces, for every member, itself included):
- `reducer-scale:x`   answers x · the true average;
- `reducer-random:x`  answers random values of x times the true average's scale;
- `reducer-mute:0`    answers true averages, but no audit (a standing denial of averaging).
In its progress reports:
- `progress:x`  reports x times the tokens it trained.
"""

import os
import sys
import time
from pathlib import Path

import torch

from p2p_diloco import cli
from p2p_diloco.swarm import Swarm
from p2p_diloco.swarm.allreduce import ConsistentAllReduceRunner
from p2p_diloco.swarm.auditor import Audits
from p2p_diloco.swarm.heartbeat import Heartbeat

KIND, X = os.environ["ATTACK"].split(":")
X = float(X)


def lie_as_sender() -> None:
    original = Swarm.average
    first: dict = {}

    def average(self, delta, weight, round_, retry=False, expected_group=0, exact=None):
        if KIND == "replay":
            first.setdefault("delta", delta.clone())
            first.setdefault("exact", None if exact is None else exact.clone())
            delta, exact = first["delta"], first["exact"]
        if KIND == "alie":
            delta, exact = alie(self.peer_id, round_, delta, exact)
        factor = {"scale": X, "flip": -X, "zero": 0.0, "garbage": float("nan")}.get(KIND, 1.0)
        if KIND in ("zero", "weight"):
            weight = weight * X
        delta = delta * factor
        exact = None if exact is None else exact * factor
        return original(self, delta, weight, round_, retry, expected_group, exact)

    Swarm.average = average


def _pool_folder() -> Path:
    """A folder the colluders share: beside the run config they were all started with."""
    config = sys.argv[sys.argv.index("--config") + 1]
    folder = Path(config).resolve().parent / "collude"
    folder.mkdir(exist_ok=True)
    return folder


def alie(peer_id: str, round_: int, delta: torch.Tensor, exact) -> tuple:
    """μ − z·σ over the colluders' own Δ of this round (each waits, at most a minute, for all)."""
    folder, colluders = _pool_folder(), int(os.environ.get("ATTACK_COLLUDERS", "2"))
    mine = folder / f"{round_}-{peer_id}.pt"
    if not mine.exists():
        partial = folder / f"{round_}-{peer_id}.partial"
        torch.save({"delta": delta, "exact": exact}, partial)
        os.replace(partial, mine)
    deadline = time.monotonic() + 60
    while len(pool := sorted(folder.glob(f"{round_}-*.pt"))) < colluders and time.monotonic() < deadline:
        time.sleep(0.1)  # a poll of the shared folder, bounded by the deadline
    loaded = [torch.load(path) for path in pool]

    def shifted(key: str):
        if loaded[0][key] is None:
            return None
        stacked = torch.stack([item[key] for item in loaded])
        return stacked.mean(0) - X * stacked.std(0, correction=0)

    return shifted("delta"), shifted("exact")


def lie_as_reducer() -> None:
    if KIND == "reducer-mute":
        Audits._shown_for_audit = lambda self, request, auditor: []
        return
    original = ConsistentAllReduceRunner._encode_average

    def encode_average(self, part_index, averaged):
        if KIND == "reducer-scale":
            averaged = averaged * X
        else:
            averaged = torch.randn_like(averaged) * X * float(averaged.abs().mean())
        return original(self, part_index, averaged)

    ConsistentAllReduceRunner._encode_average = encode_average


def lie_about_progress() -> None:
    original = Heartbeat.report_progress

    def report_progress(self, round_, tokens, tokens_per_s):
        return original(self, round_, int(tokens * X), tokens_per_s * X)

    Heartbeat.report_progress = report_progress


if KIND in ("scale", "flip", "zero", "weight", "replay", "alie", "garbage"):
    lie_as_sender()
elif KIND.startswith("reducer-"):
    lie_as_reducer()
elif KIND == "progress":
    lie_about_progress()
else:
    raise SystemExit(f"unknown ATTACK {KIND!r}")

if __name__ == "__main__":
    sys.exit(cli.main())
