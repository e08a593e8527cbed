"""A malicious member: a real peer that lies in one way, chosen by ATTACK, through the normal code.

    ATTACK=<kind>:<x> python -m tests.swarm.attacker_peer peer ...   (same arguments as p2p-diloco peer)

As a sender (its pseudo-gradient, norms and biases included, and the weight it claims):
- `scale:x`     sends x · Δ (x = 1e4: a blown-up update);
- `flip:x`      sends -x · Δ (x = 10: a sign flip);
- `zero:x`      sends a zero Δ with x times its weight (training undone);
- `weight:x`    claims x times its tokens;
- `replay:0`    sends its first round's Δ every round (an old update);
- `garbage:0`   sends NaN for every value, signed (a malformed part);
- `part-weight:x`  signs and sends its parts with weight x (nan, -1: a malformed weight);
- `part-shape:0`   signs and sends parts one value longer than the group's layout (well-formed);
- `alie:z`      "a little is enough" (Baruch et al., 2019): ATTACK_COLLUDERS attackers (default 2)
                pool their own honest Δ of the round in a folder beside the run config, and each
                sends μ − z·σ of the pool, coordinate-wise: a shift hidden inside the spread.
As a reducer (the span it reduces, for every member, itself included):
- `reducer-scale:x`   answers x · the true average;
- `reducer-random:x`  answers random values of x times the true average's scale;
- `reducer-mute:0`    answers true averages, but no audit (a standing denial of averaging).
In its progress reports:
- `progress:x`      reports x times the tokens it trained;
- `progress-inf:0`  reports infinite tokens at an infinite rate (written raw into its record).
In its round records and the states it serves:
- `ahead:x`     publishes every round as x rounds later, with the digest of a state of its own
                making (θ negated, momentum zero) that it serves and that verifies.
As a server of its state to peers that catch up (it trains and publishes honestly):
- `state-malformed:0`  metadata whose round is not a number;
- `state-huge:x`       a state x times the model's size (a stream without end, to the downloader);
- `state-tamper:0`     θ + 1e-3 (it does not hash to the digest it published);
- `state-round:0`      metadata whose round is 2**64 - 1 (msgpack carries it; a digest packs 64 signed bits).
In link probes:
- `link:x`      announces x times the link figure it measured (10 Gbit/s before it measured one).
In the group's all-gather:
- `gather:0`    shows its group vouches that are not a mapping (group data that does not parse).
"""

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from p2p_diloco import cli, peer
from p2p_diloco.protocol import outer
from p2p_diloco.swarm import HivemindSwarm
from p2p_diloco.swarm.averaging.allreduce import ConsistentAllReduceRunner
from p2p_diloco.swarm.averaging.auditor import Auditor
from p2p_diloco.swarm.averaging.step import AveragingStep
from p2p_diloco.swarm.heartbeat import Heartbeat
from p2p_diloco.swarm.trust import records
from tests.swarm.round_gate import install_gate

KIND, X = os.environ["ATTACK"].split(":")
X = float(X)


def lie_as_sender() -> None:
    original = HivemindSwarm.average
    first: dict = {}

    def average(self, delta, weight, round_, retry=False, expected_group=0, exact=None, levels=None):
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
        return original(self, delta, weight, round_, retry, expected_group, exact, levels)

    HivemindSwarm.average = average


def lie_in_parts() -> None:
    """A sender that signs what it sends, but sends a weight (`part-weight`) or a size
    (`part-shape`) no honest member sends."""
    original_init = ConsistentAllReduceRunner.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if KIND == "part-weight":
            self.weight = X

    def encode_input(self, peer_index, part_index, part, info):
        flat = part.reshape(-1)
        encoded = self.codec.compress(torch.cat([flat, flat[:1]]), info)
        decoded = self.codec.extract(encoded)
        return encoded, self.ledger.sign_part(peer_index, part_index, self.weight, encoded, decoded)

    ConsistentAllReduceRunner.__init__ = init
    if KIND == "part-shape":
        ConsistentAllReduceRunner._encode_input = encode_input


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
        Auditor._shown_for_audit = lambda self, request, auditor: []
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


def lie_about_progress_without_bounds() -> None:
    original = records.publish_progress

    def publish_progress(dht, validator, prefix, report, convicted=(), **kwargs):
        infinite = replace(report, tokens=float("inf"), tokens_per_s=float("inf"))
        return original(dht, validator, prefix, infinite, convicted, **kwargs)

    records.publish_progress = publish_progress


def lie_about_rounds() -> None:
    me: list[peer.Peer] = []
    original_init, original_publish = peer.Peer.__init__, HivemindSwarm.publish_round

    def init(self, *args, **kwargs):
        me.append(self)
        original_init(self, *args, **kwargs)

    def made_up() -> outer.GlobalState:
        state = me[0].state
        negated = {name: -t for name, t in state.params.items()}
        return outer.GlobalState(state.round + int(X), negated, {name: t * 0 for name, t in state.params.items()})

    def publish_round(self, round_, digest, tokens, loss, **kwargs):
        lie = made_up()
        return original_publish(self, lie.round, lie.digest(), tokens, loss, **kwargs)

    def serve_state(self):
        lie = made_up()
        return {"round": lie.round, "digest": lie.digest()}, [outer.flatten(lie.params), outer.flatten(lie.momentum)]

    peer.Peer.__init__, HivemindSwarm.publish_round, peer.Peer.serve_state = init, publish_round, serve_state


def serve_bad_states() -> None:
    honest = peer.Peer.serve_state

    def serve_state(self):
        metadata, (theta, momentum) = honest(self)
        if KIND == "state-malformed":
            return {**metadata, "round": "many"}, [theta, momentum]
        if KIND == "state-round":
            return {**metadata, "round": 2**64 - 1}, [theta, momentum]
        if KIND == "state-huge":
            return metadata, [theta.repeat(int(X)), momentum.repeat(int(X))]
        return metadata, [theta + 1e-3, momentum]

    peer.Peer.serve_state = serve_state


def lie_about_the_link() -> None:
    original = AveragingStep._link_report

    def link_report(self):
        figure, seen = original(self)
        return (1e10 if figure is None else figure * X), seen

    AveragingStep._link_report = link_report


def show_malformed_group_data() -> None:
    original = AveragingStep._link_report

    def link_report(self):
        figure, _ = original(self)
        return figure, "not a mapping"  # goes into the all-gather as "seen"

    AveragingStep._link_report = link_report


if KIND in ("scale", "flip", "zero", "weight", "replay", "alie", "garbage"):
    lie_as_sender()
elif KIND in ("part-weight", "part-shape"):
    lie_in_parts()
elif KIND.startswith("reducer-"):
    lie_as_reducer()
elif KIND == "progress":
    lie_about_progress()
elif KIND == "progress-inf":
    lie_about_progress_without_bounds()
elif KIND == "ahead":
    lie_about_rounds()
elif KIND == "link":
    lie_about_the_link()
elif KIND == "gather":
    show_malformed_group_data()
elif KIND.startswith("state-"):
    serve_bad_states()
else:
    raise SystemExit(f"unknown ATTACK {KIND!r}")

install_gate()  # tests that need every peer in the first round hold them all before it (round_gate.py)

if __name__ == "__main__":
    sys.exit(cli.main())
