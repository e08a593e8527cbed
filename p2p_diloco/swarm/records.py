"""Signed DHT records of a run: configs and each peer's latest round. Values are validated on read (I4).

Every record lives under a subkey that holds its owner's RSA public key, so hivemind's
RSASignatureValidator lets only the owner write it. What a record *says* is still untrusted:
`RoundRecord.parse` drops anything malformed, and majorities decide, never a single record.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from hivemind.utils import get_dht_time

from p2p_diloco.rounds import Progress

RECORD_TTL_S = 90.0  # a peer that stops refreshing its record drops out of the swarm's view after this
REFRESH_S = 30.0  # live peers re-publish their latest record this often (a heartbeat)
PROGRESS_TTL_S = 30.0  # progress reports are stale after seconds anyway (rounds.py); they need not live long
_DIGEST = re.compile(r"^[0-9a-f]{32}$")


def run_prefix(run_id: str, fingerprint: str) -> str:
    """The DHT namespace of a run and config: peers with another config never meet (I5)."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", run_id)
    return f"{safe}-{fingerprint}"


def round_bits(round_: int) -> str:
    """hivemind group bits for round r: one matchmaking key, so one group, per round."""
    return format(round_, "032b")


@dataclass(frozen=True)
class RoundRecord:
    peer: str
    round: int
    digest: str
    tokens: int
    loss: float
    addrs: tuple[str, ...] = ()  # where the peer listens (its multiaddrs), for operators and dashboards
    serves: bool = True  # False for client-mode peers: nobody can connect to them to download a state

    @classmethod
    def parse(cls, value: Any) -> "RoundRecord | None":
        """A record from the DHT, or None if it is malformed (it came from another peer: trust nothing)."""
        if not isinstance(value, dict):
            return None
        try:
            addrs = tuple(str(a) for a in value.get("addrs", ())[:8])
            record = cls(str(value["peer"]), int(value["round"]), str(value["digest"]), int(value["tokens"]),
                         float(value["loss"]), addrs, bool(value.get("serves", True)))
        except (KeyError, TypeError, ValueError):
            return None
        if record.round < 0 or record.tokens < 0 or not _DIGEST.match(record.digest) or len(record.peer) > 128:
            return None
        return record


def parse_progress(value: Any) -> Progress | None:
    """A progress report from the DHT, or None if it is malformed (untrusted, like every record)."""
    if not isinstance(value, dict):
        return None
    try:
        report = Progress(str(value["peer"]), int(value["round"]), int(value["tokens"]),
                          float(value["tokens_per_s"]), float(value["time"]))
    except (KeyError, TypeError, ValueError):
        return None
    numbers_ok = report.tokens >= 0 and 0.0 <= report.tokens_per_s < float("inf") and report.time == report.time
    if report.round < 0 or not numbers_ok or len(report.peer) > 128:
        return None
    return report


def _store(dht: Any, validator: Any, key: str, value: Any, ttl: float = RECORD_TTL_S) -> None:
    dht.store(key, value, expiration_time=get_dht_time() + ttl, subkey=validator.local_public_key)


def _read(dht: Any, key: str) -> list[Any]:
    """The values under `key`, freshest first (by expiration: each is stored with the same TTL)."""
    found = dht.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    entries = [entry for entry in found.value.values() if hasattr(entry, "value")]
    return [entry.value for entry in sorted(entries, key=lambda e: -e.expiration_time)]


def publish_round(dht: Any, validator: Any, prefix: str, record: RoundRecord) -> None:
    _store(dht, validator, f"{prefix}_rounds", {**asdict(record), "addrs": list(record.addrs)})


def read_rounds(dht: Any, prefix: str) -> dict[str, RoundRecord]:
    """Each peer's latest round record. A peer id under two owner keys (a restarted peer signs with
    a new key; its old record lives until it expires) counts once: the freshest record wins.
    Nothing here is trusted further: digests are checked on every download."""
    out: dict[str, RoundRecord] = {}
    for record in map(RoundRecord.parse, _read(dht, f"{prefix}_rounds")):
        if record is not None and record.peer not in out:
            out[record.peer] = record
    return out


def publish_progress(dht: Any, validator: Any, prefix: str, report: Progress) -> None:
    _store(dht, validator, f"{prefix}_progress", asdict(report), ttl=PROGRESS_TTL_S)


def read_progress(dht: Any, prefix: str) -> list[Progress]:
    """Every peer's latest progress report (one per peer id, the freshest)."""
    out: dict[str, Progress] = {}
    for report in map(parse_progress, _read(dht, f"{prefix}_progress")):
        if report is not None and (report.peer not in out or report.time > out[report.peer].time):
            out[report.peer] = report
    return list(out.values())


def latest_majority(recs: Iterable[RoundRecord]) -> tuple[int, str, list[str]] | None:
    """(round, digest, peers) of the highest round, with the digest most peers hold (ties: smallest digest).

    Only peers that serve their state count: a client-mode peer's state cannot be downloaded, so
    it cannot be the swarm's reference; it follows the reachable peers instead."""
    recs = [r for r in recs if r.serves]
    if not recs:
        return None
    top = max(r.round for r in recs)
    digests = Counter(r.digest for r in recs if r.round == top)
    digest = min(digests, key=lambda d: (-digests[d], d))
    return top, digest, sorted(r.peer for r in recs if r.round == top and r.digest == digest)


def majority(digests: dict[str, str]) -> str:
    """The digest most peers hold; ties go to the smallest digest so every peer picks the same one."""
    counts = Counter(digests.values())
    return min(counts, key=lambda d: (-counts[d], d))


def publish_config(dht: Any, validator: Any, run_id: str, fingerprint: str, shared: dict) -> None:
    _store(dht, validator, f"{run_prefix(run_id, 'configs')}", {"fingerprint": fingerprint, "shared": shared})


def read_configs(dht: Any, run_id: str) -> dict[str, tuple[str, dict]]:
    """Configs that peers of this run id published: {fingerprint: (fingerprint, shared fields)}."""
    out = {}
    for value in _read(dht, run_prefix(run_id, "configs")):
        if isinstance(value, dict) and isinstance(value.get("fingerprint"), str) and isinstance(value.get("shared"), dict):
            out[value["fingerprint"]] = (value["fingerprint"], value["shared"])
    return out
