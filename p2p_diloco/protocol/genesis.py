"""A run's genesis: what a run is beyond its name, and what a starting peer makes of it (pure).

A run id is only a name: with nothing else, a typo, an edited run.toml or a config retried after a
refusal would start a second run under it, silently. So a run also has a genesis, published in the DHT under the
run id by the peers that start it (swarm/trust/records.py), long after their round records expired:
- the run's config (its fingerprint; in certified runs with the organiser's signature over it);
- θ(0)'s digest, what every peer of the config starts from;
- once a peer finished the last round, the final round and digest.

A starting peer judges what it found (`judge`):
- peers of its own config are live: it joins them (their records are the truth, agreement.py);
- peers of another config are live, or nobody is and the genesis is another config's: refused
  (exit 2), however often it retries;
- nobody is live and the genesis is its config's: the run is dormant, or `finished` (it stops with
  "run finished at round R" instead of training θ(0) alone);
- no genesis at all: a new run, and the peer says so, with the run ids it saw nearby (a typo).

In an open run anyone can publish a genesis, as anyone can run a peer; a genesis counts by its
number of publishers, and only while nobody is live, so one record cannot lock a live run out.
In certified runs only organiser-signed geneses from admitted peers count (swarm/trust/gate.py).
"""

from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from p2p_diloco.trust import wire

MAX_TEXT = 4096  # longest signature accepted; fingerprints and digests are far shorter
_FINGERPRINT = re.compile(r"^[0-9a-f]{1,64}$")  # config.Config.fingerprint's hex
COPIES = 8  # a peer publishes its own genesis record only while fewer peers carry the same one


@dataclass(frozen=True)
class Genesis:
    """One peer's record of the run's genesis (untrusted: any node may publish one)."""

    fingerprint: str
    theta0: str  # digest of θ(0)
    final_round: int | None = None  # None while the run is not finished (-1 on the wire)
    final_digest: str = ""
    signature: str = ""  # the organiser's over (run id, fingerprint) in certified runs
    shared: Mapping[str, Any] = field(default_factory=dict, compare=False)  # the config's shared fields

    @staticmethod
    def parse(value: Any) -> Genesis | None:
        """A genesis from the DHT, or None if it is malformed."""
        return wire.parse_or_none(Genesis.read, value, "genesis record")

    @staticmethod
    def read(value: Any) -> Genesis:
        """A genesis from the DHT (trust/wire.py's parsers: raises WireError if malformed)."""
        record = wire.mapping(value)
        final_on_wire = wire.field(record, "final_round", lambda v: wire.integer(v, -1))
        final = None if final_on_wire == -1 else final_on_wire
        final_digest = wire.field(record, "final_digest", lambda v: "" if v == "" else wire.digest(v))
        if (final is not None) != bool(final_digest):
            raise wire.WireError("a final round without its digest, or a digest without its round")
        return Genesis(
            wire.field(record, "fingerprint", lambda v: wire.text(v, 64, _FINGERPRINT)),
            wire.field(record, "theta0", wire.digest),
            final,
            final_digest,
            wire.field(record, "signature", lambda v: wire.text(v, MAX_TEXT)),
            wire.field(record, "shared", wire.config_sections, {}),
        )

    def as_dict(self) -> dict[str, Any]:
        final = -1 if self.final_round is None else self.final_round
        return {**asdict(self), "final_round": final, "shared": dict(self.shared)}

    def finished_at(self, round_: int, digest: str) -> Genesis:
        return replace(self, final_round=round_, final_digest=digest)


# join: the run is live under this peer's config; other: it is another config's (refused, I5);
# dormant: the run exists, nobody is live; new: no run of this id was found.
VerdictKind = Literal["join", "other", "dormant", "new"]


@dataclass(frozen=True)
class Verdict:
    """What a starting peer makes of the run it found."""

    kind: VerdictKind
    rival: str = ""  # "other": the fingerprint of the run's config
    publishers: int = 0  # peers that published the run's genesis (of `rival` for "other")
    final: Genesis | None = None  # a claim that the run finished (any kind but "other" and "new")
    theta0: str = ""  # the θ(0) digest the run's genesis names ("" if none)
    nearby: tuple[str, ...] = ()  # other run ids seen in the swarm, the likeliest typo first


def config_to_defer_to(mine: str, live: Mapping[str, int]) -> str | None:
    """The config (fingerprint) a starting peer must defer to, refusing to start (I5), or None.

    `live`: for this peer's config and every other config of the run id that counts (in certified
    runs, only organiser-signed ones), how many other peers are live under it. A peer joins its own
    config's run whenever anyone runs it. If nobody does and another config has live peers, that
    is the run: the peer is refused, told which fields differ. A config that only a record and no
    live peer speaks for counts for nothing, so one published record cannot lock a run out
    (config squatting); several, the most peers win, then the smallest fingerprint."""
    if live.get(mine, 0) > 0:
        return None
    rivals = [(-n, fp) for fp, n in live.items() if fp != mine and n > 0]
    return min(rivals)[1] if rivals else None


def judge(mine: str, live: Mapping[str, int], found: Mapping[str, Genesis], rounds: int) -> Verdict:
    """The verdict for a peer of config `mine` (run of `rounds` rounds).

    `live`: other peers live under each config of the run id that counts; `found`: genesis records
    by publisher, those that count. The run's genesis is the config published by the most peers,
    then the smallest fingerprint."""
    rival = config_to_defer_to(mine, live)
    if rival is not None:
        return Verdict("other", rival=rival)
    by_config = Counter(g.fingerprint for g in found.values())
    final = final_claim(found, mine, rounds)
    theta0 = _most_common(g.theta0 for g in found.values() if g.fingerprint == mine)
    if live.get(mine, 0) > 0:
        return Verdict("join", publishers=by_config[mine], final=final, theta0=theta0)
    if not by_config:
        return Verdict("new")
    run = min(by_config, key=lambda fp: (-by_config[fp], fp))
    if run != mine:
        return Verdict("other", rival=run, publishers=by_config[run])
    return Verdict("dormant", publishers=by_config[mine], final=final, theta0=theta0)


def final_claim(found: Mapping[str, Genesis], mine: str, rounds: int) -> Genesis | None:
    """The run's end as its publishers claim it: the final digest most of them name, at the run's
    last round (a claim of any other round is not this config's end)."""
    finals = [g for g in found.values() if g.fingerprint == mine and g.final_round == rounds]
    digest = _most_common(g.final_digest for g in finals)
    return next((g for g in finals if g.final_digest == digest), None)


def should_publish(found: Mapping[str, Genesis], own: Genesis) -> bool:
    """Whether this peer adds its record: while fewer than COPIES others carry the same one (the
    genesis outlives every round record, and a handful of holders keeps it alive)."""
    return sum(g == own for g in found.values()) < COPIES


def nearby_runs(run_id: str, seen: Iterable[str], limit: int = 3) -> list[str]:
    """Run ids seen in the swarm that look like `run_id` (a typo), else a few others."""
    others = sorted({r for r in seen if r != run_id})
    close = difflib.get_close_matches(run_id, others, n=limit, cutoff=0.6)
    return close or others[:limit]


def _most_common(values: Iterable[str]) -> str:
    counts = Counter(values)
    return min(counts, key=lambda v: (-counts[v], v)) if counts else ""
