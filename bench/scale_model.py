"""A time model of one round's all-reduce past one group: flat butterfly, two levels, sparse all-gather.

A model, not a measurement: every input below is an assumption, stated, and the figures move with
them. It answers the question the real-process bench cannot reach on this machine (hundreds of
home peers): at which N each scheme stops being the best, and which group size s to default to.

Peers. N peers with links drawn per round from home broadband: upload 5-40 Mbit/s, download
20-100 Mbit/s (uniform), a share `--nat` behind NAT (they send and receive but reduce nothing and
are dialled through a relay or a punched hole). Each peer fails during an all-reduce with
probability `--fail` (a crash, a hang, a lost link), independently.

Schemes, for an encoded pseudo-gradient of M bytes (default 150M values at int8: 154.7 MB):
- flat: one group of all N; hivemind's balancer gives each reachable peer a span proportional to
  its upload (at most half the vector); a peer's time is the larger of what it sends over its
  upload and receives over its download (2M(N-1)/N each for equal spans); matchmaking through one
  leader grows with N; the reducer audit after it costs about 2 x 4 x N chunks per member (O(N):
  each audited chunk has 2 checkers; every member checked every chunk, (N - 1) x 4 x N, before);
  past p2pd's connection limit (256 low water) the extra connections are
  dialled again every round; one failure anywhere retries everyone.
- two-level (protocol/twolevel.py): groups from the real bucket code, stage 1 inside each group as
  flat (its audit O(s)) with spans owned as `twolevel.owners` gives them (by upload), stage 2
  among each span's owners (every owner sends its partial's sub-spans to 2
  replicas, each replica returns its sums), stage 3 back inside the group; a failed group retries
  alone (a sub-span fails only if both its replicas fail: p^2, left out).
- sparse all-gather: every peer sends its top-`--density` values (int8 value + 4-byte index) to
  every other peer directly (no reducer: nothing to audit, nothing robust), and receives N-1 such.

Times add a fixed latency per stage (`--rtt` x round trips). The round's time is the slowest
peer's (median over `--draws` draws of the links); retries multiply it by the expected number of
attempts.

    .venv/bin/python bench/scale_model.py        # a few seconds
Writes bench/results/scale_model.json and scale_model.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2p_diloco.protocol import codecs, twolevel  # noqa: E402
from p2p_diloco.trust import audit  # noqa: E402

OUT = ROOT / "bench" / "results" / "scale_model"
NS = [8, 16, 32, 64, 128, 256, 512, 1024]
SIZES = [8, 16, 32, 64]
CONN_LIMIT = 256  # p2pd's connection manager trims above this (low water)
DIAL_S = {"public": 0.3, "nat": 3.0}  # one connection's set-up: direct, and relayed or punched
DIAL_PARALLEL = 16
JOIN_S = 0.05  # a leader's time per follower joining its group (matchmaking)
MAX_SHARE = 0.5  # swarm.max_reduce_share


@dataclass(frozen=True)
class Peer:
    name: str
    up: float  # bytes/s
    down: float
    nat: bool


def draw_peers(n: int, nat_share: float, rng: random.Random) -> list[Peer]:
    return [
        Peer(f"p{i}", rng.uniform(5, 40) * 1e6 / 8, rng.uniform(20, 100) * 1e6 / 8, rng.random() < nat_share)
        for i in range(n)
    ]


def shares(group: list[Peer]) -> list[float]:
    """Each member's span share: proportional to upload among the reachable ones, at most MAX_SHARE
    (the excess spread over the others); none reachable: even (the model's fallback)."""
    ups = [0.0 if p.nat else p.up for p in group]
    if sum(ups) == 0:
        return [1 / len(group)] * len(group)
    out = [u / sum(ups) for u in ups]
    for _ in range(len(group)):
        over = sum(max(0.0, f - MAX_SHARE) for f in out)
        if over <= 1e-12:
            break
        free = [f if 0 < f < MAX_SHARE else 0.0 for f in out]
        out = [min(f, MAX_SHARE) + (over * g / sum(free) if sum(free) else 0.0) for f, g in zip(out, free)]
    return out


def butterfly_s(group: list[Peer], m: float, fractions: list[float] | None = None) -> float:
    """One consistent all-reduce of `group` on M bytes each, each member reducing its fraction of
    the vector (default: `shares`): the slowest member's upload or download."""
    n = len(group)
    if n == 1:
        return 0.0
    worst = 0.0
    for p, f in zip(group, fractions or shares(group)):
        send = m * (1 - f) + f * m * (n - 1)  # its Δ's other spans out; its span's averages to the others
        recv = f * m * (n - 1) + m * (1 - f)
        worst = max(worst, send / p.up, recv / p.down)
    return worst


def audit_s(group: list[Peer]) -> float:
    """The reducer audit after a group's butterfly (trust/audit.py): AUDIT_CHUNKS chunks of each
    reducer's span, each checked by CHECKERS of the g - 1 others (`audit.checkers`), every sender's
    int8 chunk of CHUNK_VALUES values each; a member is dealt AUDIT_CHUNKS x CHECKERS / (g - 1) of
    each other reducer's items on average (the model takes the mean: at g = 16 a member checks 8
    items on average, 13 or more 0.8 % of the time). The slowest member's."""
    g = len(group)
    reducers = [p for p in group if not p.nat] or group
    chunk = codecs.CHUNK_VALUES * codecs.get("int8").bytes_per_value()
    checkers = min(audit.CHECKERS, g - 1)
    others = len(reducers) if len(reducers) < g else len(reducers) - 1  # a client audits every reducer
    fetched = others * audit.AUDIT_CHUNKS * checkers / max(1, g - 1) * g * chunk  # what one member downloads
    answered = audit.AUDIT_CHUNKS * checkers * g * chunk  # what one reducer uploads
    return max([fetched / p.down for p in group] + [answered / p.up for p in reducers])


def setup_s(group: list[Peer], partners: int, rtt: float) -> float:
    """Matchmaking (JOIN_S per member, through one leader) and the connections past the limit."""
    redial = max(0, partners - CONN_LIMIT)
    nat = sum(p.nat for p in group) / max(1, len(group))
    dial = redial * (nat * DIAL_S["nat"] + (1 - nat) * DIAL_S["public"]) / DIAL_PARALLEL
    return len(group) * JOIN_S + dial + 4 * rtt


def flat(peers: list[Peer], m: float, fail: float, rtt: float) -> float:
    t = butterfly_s(peers, m) + audit_s(peers) + setup_s(peers, len(peers) - 1, rtt)
    return t / (1 - fail) ** len(peers)  # expected attempts: every member must come through


def two_level(peers: list[Peer], m: float, size: int, fail: float, rtt: float, rng: random.Random) -> float:
    by_name = {p.name: p for p in peers}
    groups = [
        [by_name[n] for n in g]
        for g in twolevel.groups_of(f"seed{rng.random()}", [p.name for p in peers], size, lambda n: not by_name[n].nat)
    ]
    count = len(groups)
    if count == 1:
        return flat(peers, m, fail, rtt)
    owned = [owned_spans(g, size) for g in groups]  # the fixed spans each member owns (twolevel.owners)
    stage1 = max(
        (butterfly_s(g, m, [n / size for n in o]) + audit_s(g)) / (1 - fail) ** len(g) for g, o in zip(groups, owned)
    )
    # Stage 2: an owner of n of the s spans sends each span's sub-spans to 2 replicas (2 M/s a span)
    # and, as a replica of 2 sub-spans of each span it owns, receives G partials of each and returns
    # its sums (about M/s a span, the two replicas splitting the consumers).
    stage2 = max(n * 3 * m / size / min(p.up, p.down) for g, o in zip(groups, owned) for p, n in zip(g, o))
    partners = max(len(g) for g in groups) - 1 + 2 * (count - 1)
    setup = max(setup_s(g, partners, rtt) for g in groups) + 4 * rtt  # stage 2's own round trips
    return stage1 + stage2 + setup


def owned_spans(group: list[Peer], size: int) -> list[int]:
    """How many of the `size` spans each member of `group` owns."""
    behind_nat = {p.name for p in group if p.nat}
    rates = {p.name: p.up for p in group}
    owner = twolevel.owners("model", [p.name for p in group], size, lambda n: n not in behind_nat, rates)
    return [owner.count(p.name) for p in group]


def sparse(peers: list[Peer], m_values: float, density: float, rtt: float) -> float:
    piece = density * m_values * 5  # int8 value + 4-byte index
    n = len(peers)
    worst = max(max((n - 1) * piece / p.up, (n - 1) * piece / p.down) for p in peers)
    return worst + setup_s(peers, n - 1, rtt)  # a sender that fails loses its own piece only: no retry


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    m = args.values * (1 + 4 / 128)  # int8: one fp32 scale per 128 values
    rows = []
    for n in NS:
        draws: dict[str, list[float]] = {"flat": [], "sparse": []} | {f"two_level_s{s}": [] for s in SIZES}
        for _ in range(args.draws):
            peers = draw_peers(n, args.nat, rng)
            draws["flat"].append(flat(peers, m, args.fail, args.rtt))
            draws["sparse"].append(sparse(peers, args.values, args.density, args.rtt))
            for s in SIZES:
                draws[f"two_level_s{s}"].append(two_level(peers, m, s, args.fail, args.rtt, rng))
        rows.append({"peers": n} | {k: statistics.median(v) for k, v in draws.items()})
    return {"assumptions": vars(args), "encoded_bytes": m, "rows": rows, "defaults": choose(rows)}


def choose(rows: list[dict]) -> dict:
    """The group size with the lowest median round time at 256 peers, and the smallest N from
    which the two-level round at that size beats the flat butterfly (and the sparse all-gather)."""
    at = next(r for r in rows if r["peers"] == 256)
    best = min(SIZES, key=lambda s: at[f"two_level_s{s}"])
    key = f"two_level_s{best}"
    beats_flat = next((r["peers"] for r in rows if r[key] < r["flat"]), None)
    beats_sparse = next((r["peers"] for r in rows if r[key] < r["sparse"]), None)
    return {"group_size": best, "two_level_beats_flat_from": beats_flat, "two_level_beats_sparse_from": beats_sparse}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ns = [r["peers"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in ["flat", "sparse"] + [f"two_level_s{s}" for s in SIZES]:
        ax.plot(ns, [r[key] for r in rows], marker="o", label=key.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("peers in the round")
    ax.set_ylabel("round's all-reduce, s (median of draws)")
    ax.set_title("time model: 150M values int8, home links 5-40 up / 20-100 down")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--values", type=float, default=150e6, help="values in the pseudo-gradient")
    p.add_argument("--nat", type=float, default=0.5, help="share of peers behind NAT (reduce nothing)")
    p.add_argument("--fail", type=float, default=0.002, help="a peer's probability of failing one all-reduce")
    p.add_argument("--rtt", type=float, default=0.08, help="round trip between peers, s")
    p.add_argument("--density", type=float, default=0.01, help="share of values the sparse all-gather sends")
    p.add_argument("--draws", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=OUT.name, help="name of the results in bench/results (.json, .png)")
    args = p.parse_args()
    out = OUT.with_name(args.out)
    result = run(args)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for r in result["rows"]:
        print(" ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    print("defaults:", result["defaults"])
    print(f"wrote {out.with_suffix('.json').relative_to(ROOT)} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
