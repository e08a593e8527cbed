"""Signed DHT records of a run: configs, the genesis, each peer's latest round, run ids. Values are
validated on read (I4).

Every record lives under a subkey that holds its owner's RSA public key, so hivemind's
RSASignatureValidator lets only the owner write it; that key is the owner's libp2p identity
(swarm/transport/identity.py), so a round or progress record that claims another peer id than its signer's is
dropped (`signed_by_their_peer`). What a record *says* is still untrusted:
`RoundRecord.parse` (protocol/network.py) drops anything malformed, and majorities decide, never a single
record (protocol/agreement.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

from hivemind.utils import get_dht_time

from p2p_diloco.protocol.budget import ProgressReport
from p2p_diloco.protocol.genesis import Genesis
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.transport.identity import owner_peer_id
from p2p_diloco.trust import wire

logger = logging.getLogger(__name__)


class _Claimed(Protocol):
    """A record that names the peer it speaks for."""

    @property
    def peer(self) -> str: ...


T = TypeVar("T", bound=_Claimed)

RECORD_TTL_S = 90.0  # a peer that stops refreshing its record drops out of the swarm's view after this
REFRESH_S = 30.0  # live peers re-publish their latest record this often (a heartbeat)
PROGRESS_TTL_S = 30.0  # progress reports are stale after seconds anyway (protocol/budget.py); they need not live long
# The round and progress keys: each DHT node a lookup asks answers every peer's entry under the key
# (protocol/cadence.py). A store looks for hivemind's num_replicas (5) nearest nodes, and one spare,
# not the 20 of its default lookup; a read asks the 3 nearest of those, two at a time (read_entries).
STORE_NEAREST, READ_NEAREST, READ_WORKERS = 6, 3, 2
MAX_TOKENS_PER_S = 1e9  # a claimed speed beyond this is no GPU's (an H100 trains a 1B model at ~1e5)
MAX_UNIX_TIME = 4102444800.0  # 2100-01-01


def run_prefix(run_id: str, fingerprint: str) -> str:
    """The DHT namespace of a run and config: peers with another config never meet (I5)."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", run_id)
    return f"{safe}-{fingerprint}"


def bucket_prefix(prefix: str, round_: int, bucket: int, buckets: int) -> str:
    """The namespace of one bucket's round and progress records of round `round_` under the run's
    `prefix` (the two-level layout, docs/design.md §3 "Records by bucket"; measured by
    bench/dht_load.py, not yet used by the swarm): the run's own prefix where there is one bucket."""
    return prefix if buckets <= 1 else f"{prefix}-r{round_}-b{bucket}of{buckets}"


def round_bits(round_: int) -> str:
    """hivemind group bits for round r: one matchmaking key, so one group, per round."""
    return format(round_, "032b")


def bucket_bits(bucket: int, groups: int) -> str:
    """What a two-level round's bucket adds to its round's group bits: G and the bucket, so that each
    bucket of each G meets under a key of its own (hivemind's group bits are 0s and 1s)."""
    return format(groups, "016b") + format(bucket, "016b")


def parse_progress(value: Any) -> ProgressReport | None:
    """A progress report from the DHT, or None if it is malformed (untrusted, like every record)."""
    return wire.parse_or_none(read_progress_report, value, "progress report")


def read_progress_report(value: Any) -> ProgressReport:
    """A progress report (trust/wire.py's parsers: raises WireError if malformed). Its time is a unix
    time, within a century of the epoch's 2000s: an infinite one made every estimate infinite."""
    report = wire.mapping(value)
    return ProgressReport(
        wire.field(report, "peer", wire.peer_id),
        wire.field(report, "round", wire.integer),
        wire.field(report, "tokens", wire.integer),
        wire.field(report, "tokens_per_s", lambda v: wire.real(v, 0.0, MAX_TOKENS_PER_S)),
        wire.field(report, "time", lambda v: wire.real(v, 0.0, MAX_UNIX_TIME)),
    )


def _store(
    dht: Any, validator: Any, key: str, value: Any, ttl: float = RECORD_TTL_S, wait: bool = True, **lookup: int
) -> Any:
    """Store `value` under this peer's subkey; with `wait=False`, return the store's future at once."""
    expiration = get_dht_time() + ttl
    subkey = validator.local_public_key
    return dht.store(key, value, expiration_time=expiration, subkey=subkey, return_future=not wait, **lookup)


def _read(dht: Any, key: str, **lookup: int) -> list[tuple[Any, Any]]:
    return _entries(dht.get(key, latest=True, **lookup))


def _entries(found: Any) -> list[tuple[Any, Any]]:
    """(subkey, value) of the entries of a DHT answer, freshest first (by expiration: each is
    stored with the same TTL). hivemind's validator has checked that each value was signed by the
    owner of its subkey."""
    if found is None or not isinstance(found.value, dict):
        return []
    entries = [(subkey, entry) for subkey, entry in found.value.items() if hasattr(entry, "value")]
    return [(subkey, entry.value) for subkey, entry in sorted(entries, key=lambda e: -e[1].expiration_time)]


Admit = Callable[[set[str]], set[str]]  # of these signers, those whose records are read (Gate.admitted)


def everyone(signers: set[str]) -> set[str]:
    return signers


def admitted_signers(entries: list[tuple[Any, Any]], admit: Admit) -> list[tuple[str, Any]]:
    """(signer's peer id, value) of the entries whose signer `admit` lets in, before a field of the
    value is read: in a certified run a non-member's record is never parsed. An entry whose
    subkey is no peer's key is dropped."""
    signed = [(owner_peer_id(subkey), value) for subkey, value in entries]
    allowed = admit({signer for signer, _ in signed if signer is not None})
    return [(signer, value) for signer, value in signed if signer is not None and signer in allowed]


def signed_by_their_peer(
    entries: list[tuple[Any, Any]], parse: Callable[[Any], T | None], admit: Admit = everyone
) -> list[T]:
    """The parsed records of admitted signers whose claimed peer id is the id of the key that
    signed them (I4). Any other is dropped and logged once: one key speaks for one peer id,
    never for another's."""
    out = []
    for signer, value in admitted_signers(entries, admit):
        record = parse(value)
        if record is None:
            continue
        if record.peer == signer:
            out.append(record)
        else:
            _log_forged_once(signer, record.peer)
    return out


_forged_seen: set[tuple[str | None, str]] = set()


def _log_forged_once(signer: str | None, claimed: str) -> None:
    if (signer, claimed) in _forged_seen or len(_forged_seen) >= 1024:
        return
    _forged_seen.add((signer, claimed))
    logger.warning(
        "dropped a record that claims peer %s but was signed by %s: a record speaks only for its signer's peer id",
        claimed[-12:],
        (signer or "no peer key")[-12:],
    )


def publish_round(dht: Any, validator: Any, prefix: str, record: RoundRecord, wait: bool = True) -> Any:
    value = {**asdict(record), "addrs": list(record.addrs)}
    return _store(dht, validator, rounds_key(prefix), value, wait=wait, beam_size=STORE_NEAREST)


def read_rounds(dht: Any, prefix: str, admit: Admit = everyone) -> dict[str, RoundRecord]:
    """`rounds_from` the run's round records as read now."""
    return rounds_from(read_entries(dht, rounds_key(prefix)), admit)


def rounds_key(prefix: str) -> str:
    return f"{prefix}_rounds"


def progress_key(prefix: str) -> str:
    return f"{prefix}_progress"


def read_entries(dht: Any, key: str) -> list[tuple[Any, Any]]:
    """The (subkey, value) entries under `key`, unparsed: a reader holding the DHT lock reads them,
    and parses them once it let go (`admit` may read certificates, under the same lock).

    The round and progress keys are read every second and by every peer, and each DHT node asked
    answers every peer's entry: they are read from the READ_NEAREST nodes nearest to the key only
    (Kademlia's lookup finds them; every store reaches the 5 nearest, hivemind's num_replicas), not
    from all the 20 a lookup keeps by default (protocol/cadence.py)."""
    return _read(dht, key, beam_size=READ_NEAREST, num_workers=READ_WORKERS)


def rounds_from(entries: list[tuple[Any, Any]], admit: Admit = everyone) -> dict[str, RoundRecord]:
    """Each admitted peer's latest round record, only from the peer itself (its id is its signing
    key). Nothing here is trusted further: digests are checked on every download."""
    out: dict[str, RoundRecord] = {}
    for record in signed_by_their_peer(entries, RoundRecord.parse, admit):
        if record.peer not in out:
            out[record.peer] = record
    return out


def publish_progress(
    dht: Any, validator: Any, prefix: str, report: ProgressReport, convicted: Collection[str] = (), wait: bool = True
) -> Any:
    """This peer's progress, with the peers it convicted (its accusations, swarm/averaging/evidence.py): one
    record that every peer reads every beat anyway."""
    value = {**asdict(report), "convicted": sorted(convicted)[:MAX_CONVICTIONS]}
    return _store(dht, validator, progress_key(prefix), value, ttl=PROGRESS_TTL_S, wait=wait, beam_size=STORE_NEAREST)


def read_progress(dht: Any, prefix: str, admit: Admit = everyone) -> tuple[list[ProgressReport], dict[str, list[str]]]:
    """`progress_from` the run's progress records as read now."""
    return progress_from(read_entries(dht, progress_key(prefix)), admit)


def progress_from(
    entries: list[tuple[Any, Any]], admit: Admit = everyone
) -> tuple[list[ProgressReport], dict[str, list[str]]]:
    """Every admitted peer's latest progress report (one per peer id, the freshest), and their
    accusations ({accuser, by the key that signed them: the peers it says it convicted})."""
    out: dict[str, ProgressReport] = {}
    for report in signed_by_their_peer(entries, parse_progress, admit):
        if report.peer not in out or report.time > out[report.peer].time:
            out[report.peer] = report
    return list(out.values()), _accusations(admitted_signers(entries, admit))


def _accusations(signed: list[tuple[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for accuser, value in signed:
        if accuser in out or not isinstance(value, dict):
            continue
        accused = wire.parse_or_none(_convicted_list, value.get("convicted", []), "accusation list")
        if accused is not None:
            out[accuser] = list(accused)
    return out


def _convicted_list(value: Any) -> tuple[str, ...]:
    return wire.items(value, MAX_CONVICTIONS, wire.peer_id)


def convicted_by(accusations: dict[str, list[str]]) -> dict[str, list[str]]:
    """{accused: the peers that say they convicted it, sorted}. A peer lists only those it convicted
    in its own audit or after judging the accuser's signed case again (swarm/trust/convictions.py)."""
    out: dict[str, set[str]] = {}
    for accuser, accused in accusations.items():
        for peer in accused:
            if peer != accuser:
                out.setdefault(peer, set()).add(accuser)
    return {peer: sorted(by) for peer, by in out.items()}


@dataclass(frozen=True)
class _Published:
    """A certificate as a peer published it: the JSON text and the peer id it names."""

    peer: str
    text: str


def _parse_certificate(value: Any) -> _Published | None:
    """The peer id a published certificate names (admission.check verifies the rest)."""
    return wire.parse_or_none(_read_certificate, value, "certificate")


def _read_certificate(value: Any) -> _Published:
    text = wire.text(value, 4096)
    try:
        found = json.loads(text)
    except (ValueError, RecursionError):
        raise wire.WireError("not JSON") from None
    return _Published(wire.field(wire.mapping(found), "peer_id", wire.peer_id), text)


def certificates_key(prefix: str) -> str:
    return f"{prefix}_certs"


def publish_certificate(dht: Any, validator: Any, prefix: str, text: str) -> None:
    _store(dht, validator, certificates_key(prefix), text)


def read_certificates(dht: Any, prefix: str) -> dict[str, str]:
    return certificates_in(dht.get(certificates_key(prefix), latest=True))


def certificates_in(found: Any) -> dict[str, str]:
    """{peer id: certificate JSON} from a DHT answer, as each peer published its own (signed by its
    key); unchecked."""
    return {c.peer: c.text for c in signed_by_their_peer(_entries(found), _parse_certificate)}


@dataclass(frozen=True)
class PublishedConfig:
    """A run config as a peer published it under the run id (untrusted: any node may publish one)."""

    fingerprint: str
    shared: dict
    signature: str  # the organiser's, in certified runs (admission.ConfigSignature); "" in open runs


def publish_config(dht: Any, validator: Any, run_id: str, config: PublishedConfig) -> None:
    _store(dht, validator, f"{run_prefix(run_id, 'configs')}", asdict(config))


def read_configs(dht: Any, run_id: str) -> dict[str, PublishedConfig]:
    """Configs that nodes published under this run id, by fingerprint (unchecked: see
    genesis.config_to_defer_to for which of them count)."""
    out: dict[str, PublishedConfig] = {}
    for _, value in _read(dht, run_prefix(run_id, "configs")):
        config = wire.parse_or_none(_read_config, value, "published config")
        if config is not None:
            out.setdefault(config.fingerprint, config)
    return out


def _read_config(value: Any) -> PublishedConfig:
    config = wire.mapping(value)
    return PublishedConfig(
        wire.field(config, "fingerprint", lambda v: wire.text(v, 64)),
        wire.field(config, "shared", wire.config_sections),
        wire.field(config, "signature", lambda v: wire.text(v, 4096), ""),
    )


def live_peers(dht: Any, run_id: str, fingerprint: str) -> set[str]:
    """Peers whose (self-signed) round records are live in the namespace of this run and config.
    Live here means not expired (RECORD_TTL_S), not agreement.live: read at a peer's start, before
    its heartbeat, and of other configs' namespaces, which no heartbeat of this peer reads."""
    return set(read_rounds(dht, run_prefix(run_id, fingerprint)))


MAX_CONVICTIONS = 256  # accusations per peer
MAX_REVOCATIONS = 256  # per publisher; a run that revokes more needs a new run key


def publish_revocations(dht: Any, validator: Any, prefix: str, texts: list[str]) -> None:
    """The organiser's revocations this node has verified, under its own subkey: no other node can
    overwrite them, so one honest holder keeps a revocation alive in the DHT."""
    _store(dht, validator, f"{prefix}_revoked", sorted(texts)[:MAX_REVOCATIONS])


def revocation_holders(dht: Any, prefix: str, text: str) -> set[str]:
    """The peers (by the key that signed their list) that publish revocation `text`."""
    return {
        signer
        for subkey, value in _read(dht, f"{prefix}_revoked")
        if text in (wire.parse_or_none(_revocation_list, value, "revocation list") or ())
        and (signer := owner_peer_id(subkey)) is not None
    }


def read_revocations(dht: Any, prefix: str) -> list[str]:
    """Every revocation text any node published for this run (unchecked: admission.revoked_ids)."""
    texts: set[str] = set()
    for _, value in _read(dht, f"{prefix}_revoked"):
        found = wire.parse_or_none(_revocation_list, value, "revocation list")
        texts.update(found or ())
    return sorted(texts)


def _revocation_list(value: Any) -> tuple[str, ...]:
    return wire.items(value, MAX_REVOCATIONS, lambda t: wire.text(t, 4096))


GENESIS_TTL_S = 30 * 24 * 3600.0  # a run's genesis outlives its round records: a finished run stays finished
RUNS_KEY = "p2p-diloco_runs"  # every run id a node has run or watched, so a typo can be pointed at the right one
RUNS_TTL_S = 24 * 3600.0
MAX_RUN_IDS = 256  # run ids read


def publish_genesis(dht: Any, validator: Any, run_id: str, genesis: Genesis) -> None:
    _store(dht, validator, run_prefix(run_id, "genesis"), genesis.as_dict(), ttl=GENESIS_TTL_S)


def read_geneses(dht: Any, run_id: str) -> dict[str, Genesis]:
    """{publisher peer id: its genesis record of run `run_id`} (unchecked beyond its form)."""
    out: dict[str, Genesis] = {}
    for subkey, value in _read(dht, run_prefix(run_id, "genesis")):
        publisher, genesis = owner_peer_id(subkey), Genesis.parse(value)
        if publisher is not None and genesis is not None:
            out.setdefault(publisher, genesis)
    return out


def publish_run_id(dht: Any, validator: Any, run_id: str) -> None:
    _store(dht, validator, RUNS_KEY, run_id[:128], ttl=RUNS_TTL_S)


def read_run_ids(dht: Any) -> set[str]:
    found = [v for _, v in _read(dht, RUNS_KEY) if isinstance(v, str) and 0 < len(v) <= 128]
    return set(found[:MAX_RUN_IDS])
