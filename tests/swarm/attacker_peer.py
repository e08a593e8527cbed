"""A malicious member: a real peer that lies in one way, chosen by ATTACK, through the normal code.

    ATTACK=<kind>:<x> python -m tests.swarm.attacker_peer peer ...   (same arguments as p2p-diloco peer)

As a sender (its pseudo-gradient, norms and biases included, and the weight it claims):
- `scale:x`     sends x · Δ (x = 1e4: a blown-up update);
- `flip:x`      sends -x · Δ (x = 10: a sign flip);
- `zero:x`      sends a zero Δ with x times its weight (training undone);
- `weight:x`    claims x times its tokens;
- `replay:0`    sends its first round's Δ every round (an old update).
As a reducer (the span it reduces, for every member, itself included):
- `reducer-scale:x`   answers x · the true average;
- `reducer-random:x`  answers random values of x times the true average's scale.
In its progress reports:
- `progress:x`  reports x times the tokens it trained.
"""

import os
import sys

import torch

from p2p_diloco import cli
from p2p_diloco.swarm import Swarm
from p2p_diloco.swarm.allreduce import ConsistentAllReduceRunner
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
        factor = {"scale": X, "flip": -X, "zero": 0.0}.get(KIND, 1.0)
        if KIND in ("zero", "weight"):
            weight = weight * X
        delta = delta * factor
        exact = None if exact is None else exact * factor
        return original(self, delta, weight, round_, retry, expected_group, exact)

    Swarm.average = average


def lie_as_reducer() -> None:
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


if KIND in ("scale", "flip", "zero", "weight", "replay"):
    lie_as_sender()
elif KIND.startswith("reducer-"):
    lie_as_reducer()
elif KIND == "progress":
    lie_about_progress()
else:
    raise SystemExit(f"unknown ATTACK {KIND!r}")

if __name__ == "__main__":
    sys.exit(cli.main())
