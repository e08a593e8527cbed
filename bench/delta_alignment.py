"""How aligned honest pseudo-gradients are: why 2 colluders among 5 beat every per-round aggregator.

Five peers start from the same θ (the tiny preset, H = 20 as in bench/attacks.py) and train one
inner phase each on its own shard (1..5 of 8); their pseudo-gradients Δᵢ are captured in-process
(tests/unit/fake_swarm.py stands in for the swarm: nothing is averaged). θ is θ(0), and then the
state of one peer that trained ROUNDS rounds alone (shard 0) before the five branch off. Reports
every pairwise cosine, and what each aggregator makes of 3 of them plus 2 colluders that send
−10·Δ of their own: the result's projection on the 3 honest peers' mean (1 = their mean's full
step, < 0 = training undone), computed with p2p_diloco/trust/robust.py exactly as a reducer would.

    python bench/delta_alignment.py          # about a minute on 2 cores
Writes bench/results/delta_alignment.json.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

import torch

from lab import TINY_FIXED_H

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco import config  # noqa: E402
from p2p_diloco.peer import Peer  # noqa: E402
from p2p_diloco.protocol import outer  # noqa: E402
from p2p_diloco.trust import robust  # noqa: E402
from tests.unit.fake_swarm import FakeSwarm  # noqa: E402

SHARDS = (1, 2, 3, 4, 5)
HOW = robust.AGGREGATORS
ROUNDS = (0, 4)  # θ(0), and after 4 rounds (the attack bench runs 8)


def train(folder: Path, shard: int, rounds: int, start: outer.GlobalState | None = None) -> tuple[FakeSwarm, Peer]:
    """`rounds` rounds alone in `folder` on `shard`, from `start` (else θ(0)); the phase after them
    is stopped once its Δ is handed to the (fake) swarm."""
    fake, stop = FakeSwarm(), threading.Event()

    def alone(call):  # nobody came: the peer keeps its own Δ; the call holds it
        if len(fake.calls) > rounds:
            stop.set()

    options = {**TINY_FIXED_H, "run.rounds": "1000", "run.dir": str(folder), "data.shard": str(shard)}
    options.update({"swarm.speed_aware": "false", "log.progress": "false"})
    peer = Peer(config.load(None, options), join=lambda *args: fake)
    if start is not None:
        peer.adopt(start)  # as a catch-up would: θ and momentum of the other peer's round
    fake.script = [alone] * (rounds + 1)
    try:
        peer.run(stop)
    finally:
        peer.close()
    return fake, peer


def deltas_after(rounds: int, folder: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each shard's Δ from the state a peer reached alone after `rounds` rounds: the lossy part
    (the matrices), and the exact part (norms and biases, one part of one reducer's span)."""
    start = train(folder / f"base{rounds}", 0, rounds)[1].state if rounds else None
    calls = [train(folder / f"r{rounds}-s{s}", s, 0, start)[0].calls[-1] for s in SHARDS]
    return [call.delta.clone() for call in calls], [call.exact.clone() for call in calls]


def fit(v: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
    """How `v` matches `target`: its projection on it (1 = the full step), and the norm of the
    rest of `v`, relative to the target's norm (0 = nothing else)."""
    projection = float(torch.dot(v, target) / torch.dot(target, target))
    return {"projection": projection, "off_target": float((v - projection * target).norm() / target.norm())}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = {}
        for r in ROUNDS:
            lossy, exact = deltas_after(r, Path(tmp))
            out[f"after_{r}_rounds"] = {**measure(lossy), "exact_part": measure(exact)}
    path = ROOT / "bench" / "results" / "delta_alignment.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


def measure(deltas: list[torch.Tensor]) -> dict:
    cosines = [float(torch.nn.functional.cosine_similarity(a, b, 0)) for a, b in itertools.combinations(deltas, 2)]
    honest, flipped = deltas[:3], [-10 * d for d in deltas[3:]]
    mean3, mean5 = robust.weighted_mean(honest, [1.0] * 3), robust.weighted_mean(deltas, [1.0] * 5)
    attacked = {how: fit(robust.aggregate([*honest, *flipped], [1.0] * 5, how, 1.0, 2.0), mean3) for how in HOW}
    clean = {how: fit(robust.aggregate(deltas, [1.0] * 5, how, 1.0, 2.0), mean5) for how in HOW}
    # Each of 5 reducers combines one contiguous span (one part of the tiny model): in how many
    # spans do the colluders' parts still point the way of the coordinate-wise median?
    spans = [torch.stack([*honest, *flipped]).chunk(5, dim=1)[i].unbind(0) for i in range(5)]
    kept = [robust.aligned(list(parts), [1.0] * 5)[3:] for parts in spans]
    return {
        "numel": deltas[0].numel(),
        "spans_where_colluders_count": sum(1 for k in kept if any(w > 0 for w in k)),
        "pairwise_cosine": {"median": statistics.median(cosines), "min": min(cosines), "max": max(cosines)},
        "norms": [float(d.norm()) for d in deltas],
        "fit_to_honest_mean": {"2_of_5_flip10": attacked, "clean_5": clean},
    }


if __name__ == "__main__":
    main()
