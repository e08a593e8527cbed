"""The seam between a peer and its swarm: the `Swarm` protocol, what crosses it, and `Solo`.

The peer's round logic (round/driver.py, round/averaging.py, round/sync.py) talks to the network only through a
`Swarm`. Three things implement it:
- `p2p_diloco.swarm.HivemindSwarm`: real hivemind peers (the only package that imports hivemind);
- `Solo`: a peer with no initial peers, a swarm of one: nobody publishes, nobody to wait for or
  download from. The round logic asks it one question (`solo`: is there anybody to average with?)
  and otherwise runs the same path as with a real swarm;
- the fake in `tests/unit/fake_swarm.py`, which scripts the other peers for in-process round tests.

A `Swarm` does I/O only. What to make of what it reads (whom to wait for, which digest is the
majority, whether to adopt or catch up) is decided by the pure functions of agreement.py.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import torch

from p2p_diloco.errors import StateDownloadError, WriteError
from p2p_diloco.protocol import chunks
from p2p_diloco.protocol.budget import SwarmProgress
from p2p_diloco.protocol.genesis import Genesis, Verdict
from p2p_diloco.protocol.twolevel import Levels
from p2p_diloco.trust import wire

logger = logging.getLogger(__name__)

# What a peer serves to another that downloads its state: ({"round", "digest"}, [θ, momentum]).
ServedState = tuple[dict[str, Any], list[torch.Tensor]]


def served_metadata(value: Any) -> dict[str, Any]:
    """A served state's metadata as another peer sent it, read through trust/wire.py (raises WireError):
    its round (an int of 64 bits: the state's digest packs it so, and raises on more) and the
    digest it claims."""
    meta = wire.mapping(value, "state metadata")
    return {"round": wire.field(meta, "round", wire.integer), "digest": wire.field(meta, "digest", wire.digest)}


# Checks a downloaded state: returns the digest of what arrived, or None if it is malformed (it
# does not even have this model's shape: outer.served_digest).
StateCheck = Callable[[dict[str, Any], list[torch.Tensor]], str | None]
# Asks one peer (by id) for the state it serves now, within a timeout: None if it sent none.
Fetch = Callable[[str, float], "ServedState | None"]


MALFORMED = "malformed (not this model's shape)"  # how a state whose StateCheck is None is named


class StateSource(Protocol):
    """Downloads states peers serve, for one who is not a peer (swarm/state_client.py): whole from
    one holder, or a manifest's chunks from several at once."""

    def fetch(self, peer: str, timeout: float) -> ServedState | None: ...

    def manifests(self, peers: list[str], wanted: tuple[int, str]) -> dict[str, chunks.Manifest]: ...

    def download_chunks(self, manifest: chunks.Manifest, holders: list[str], timeout: float) -> Assembled: ...

    def close(self) -> None: ...


def download_verified(
    fetch: Fetch,
    from_peers: list[str],
    timeout: float,
    verify: StateCheck,
    wanted: Callable[[int, str], bool],
    describe: str,
    say: Callable[..., None] = logger.info,
) -> tuple[str, ServedState]:
    """(the peer, the state): the first state one of `from_peers` serves whose (round, digest) is `wanted`, the digest
    computed by `verify` from what arrived. A peer that fails, sends a malformed state (`verify`
    returns None: named MALFORMED) or anything else is skipped, and `say` it (INFO: the caller
    asks again, and says so if it gives up; a joiner whose first try met a peer not yet routable
    alarmed volunteers with WARNs); StateDownloadError naming each one's problem if none served one."""
    problems: list[str] = []
    served: dict[str, tuple[int, str | None]] = {}
    for peer in from_peers:
        try:
            got = fetch(peer, timeout)
        except Exception as e:  # a dead, slow, refusing or misbehaving peer: try the next one
            problems.append(f"{peer[-6:]}: {type(e).__name__} {str(e)[:80]}")
            say("state download from %s failed: %s", peer, problems[-1])
            continue
        if got is None:
            problems.append(f"{peer[-6:]}: sent nothing")
            say("state download from %s failed: it sent no state", peer)
            continue
        metadata, tensors = got
        actual = verify(metadata, tensors)
        round_ = metadata.get("round")
        if isinstance(round_, int) and actual is not None and wanted(round_, actual):
            return peer, (metadata, tensors)
        shown = MALFORMED if actual is None else f"digest {actual[:12]}"
        problems.append(f"{peer[-6:]}: state of round {round_} {shown} does not match {describe} (rejected)")
        if isinstance(round_, int):
            served[peer] = (round_, actual)
        say(
            "rejected the state offered by %s: round %s %s",
            peer,
            round_,
            shown if actual is None else f"digest {actual}",
        )
    raise StateDownloadError(f"no peer served {describe}: {'; '.join(problems) or 'no peers'}", served)


@dataclass(frozen=True)
class Assembled:
    """What a download of one manifest's chunks from several holders brought (swarm/averaging/chunked.py)."""

    tensors: list[torch.Tensor] | None  # the state's tensors, each chunk checked; None: it did not finish
    problem: str  # why it did not finish ("" if it did)
    dropped: dict[str, str]  # holder -> why it was asked no more
    liars: frozenset[str]  # those of them that sent what no honest holder sends


# Asks holders for their manifests of (round, digest): {holder: its manifest}, those that sent one.
Manifests = Callable[[list[str]], dict[str, chunks.Manifest]]
# Downloads one manifest's chunks from the holders that sent it.
Chunks = Callable[[chunks.Manifest, list[str]], Assembled]


def download_chunked(
    manifests: Manifests,
    fetch: Chunks,
    from_peers: list[str],
    verify: StateCheck,
    wanted: tuple[int, str],
    say: Callable[..., None] = logger.info,
) -> tuple[list[str], ServedState] | None:
    """(its holders, the state) of round and digest `wanted`, downloaded from several holders at
    once, or None if none of `from_peers` sends manifests (peers of an older version: the caller
    asks them one at a time, `download_verified`).

    The manifest most holders sent is tried first (`chunks.manifest_groups`), then the next: each
    chunk is checked against the manifest as it arrives, and the assembled state against the
    digest the swarm agreed on (`verify`), which the manifest cannot prove by itself. A manifest
    whose state misses it costs one download, and its holders are named in the StateDownloadError,
    like the holders dropped for a lying chunk, so that the catch-up asks them nothing more
    (sync.Retry). StateDownloadError if no manifest gave the state."""
    round_, digest = wanted
    try:
        sent = manifests(from_peers)
    except Exception as e:  # the averager process failed to answer: ask one holder at a time
        say("asking %d holders for their manifests failed: %s %s", len(from_peers), type(e).__name__, e)
        return None
    if not sent:
        return None
    served: dict[str, tuple[int, str | None]] = {p: (m.round, m.digest) for p, m in sent.items() if m.digest != digest}
    problems = [f"{p[-6:]}: manifest of round {r} digest {d[:12]}" for p, (r, d) in served.items() if d]
    for manifest, holders in chunks.manifest_groups(sent, round_, digest):
        got = _assembled(fetch, manifest, holders, say)
        served |= {p: (round_, None) for p in got.liars}
        problems += [f"{p[-6:]}: {why}" for p, why in got.dropped.items()]
        if got.tensors is None:
            problems.append(f"chunks from {len(holders)} holders: {got.problem}")
            continue
        metadata = {"round": manifest.round, "digest": manifest.digest}
        actual = verify(metadata, got.tensors)
        if actual == digest:
            return holders, (metadata, got.tensors)
        served |= {p: (round_, actual) for p in holders}
        shown = MALFORMED if actual is None else f"digest {actual[:12]}"
        problems.append(
            f"{', '.join(p[-6:] for p in holders)}: state of round {round_} {shown} in chunks does not match "
            f"the published digest {digest[:12]} (rejected)"
        )
        say("rejected the state assembled from the chunks of %s: round %s %s", holders, round_, shown)
    raise StateDownloadError(f"no peer served round {round_} with digest {digest[:12]}: {'; '.join(problems)}", served)


def _assembled(fetch: Chunks, manifest: chunks.Manifest, holders: list[str], say: Callable[..., None]) -> Assembled:
    """`fetch(manifest, holders)`, each holder it dropped said (also when the others carried the
    download); a failure of the averager process itself, which blames no holder, as unfinished."""
    try:
        got = fetch(manifest, holders)
    except Exception as e:
        return Assembled(None, f"{type(e).__name__} {str(e)[:80]}", {}, frozenset())
    for peer, why in got.dropped.items():
        say("%s %s was asked for no more chunks: %s", "lying holder" if peer in got.liars else "holder", peer, why)
    return got


MAX_GROUP = 64  # members listed in a round record
# How a peer's round went: averaged in a group, alone, all-reduce failed (own Δ), or the state it
# started from (θ(0), a checkpoint, a catch-up: no round trained).
RoundOutcome = Literal["averaged", "alone", "failed", "start"]
OUTCOMES: tuple[RoundOutcome, ...] = get_args(RoundOutcome)

# A record repeats its peer's final records of its latest past rounds (`RoundRecord.history`): a
# reader that polls less often than rounds end (the observer, `status`) still sees every round each
# peer went through. Bounded: at most HISTORY_ROUNDS rounds, and fewer when groups are large (at
# most HISTORY_MEMBERS members listed in all: a swarm of large groups has rounds of minutes).
HISTORY_ROUNDS = 8
HISTORY_MEMBERS = 64


@dataclass(frozen=True)
class PastRound:
    """A peer's final record of one of its past rounds, as its later records repeat it."""

    round: int
    digest: str
    tokens: int
    loss: float
    copied: bool = False
    group: tuple[str, ...] = ()
    outcome: str = ""

    @classmethod
    def parse(cls, value: Any) -> PastRound | None:
        """One entry of a record's history, or None if it is malformed (untrusted, like the record)."""
        return wire.parse_or_none(cls.read, value, "past round")

    @classmethod
    def read(cls, value: Any) -> PastRound:
        """One entry of a record's history (trust/wire.py's parsers: raises WireError if malformed)."""
        entry = wire.mapping(value)
        return cls(
            wire.field(entry, "round", wire.integer),
            wire.field(entry, "digest", wire.digest),
            wire.field(entry, "tokens", wire.integer),
            wire.field(entry, "loss", real_loss),
            wire.field(entry, "copied", wire.flag, False),
            wire.field(entry, "group", group_list, ()),
            wire.field(entry, "outcome", outcome_word, ""),
        )


MAX_LOSS = 1e6  # a train loss beyond this is published as none (-1): a diverged peer's is no number to average


def real_loss(value: Any) -> float:
    """A published loss: in [0, MAX_LOSS], or -1 for none (`published_loss`)."""
    return wire.real(value, -1.0, MAX_LOSS)


def published_loss(loss: float) -> float:
    """The loss a record carries: -1 for none, or a loss no reader would take (not finite, or past
    MAX_LOSS): a record that readers drop would hide its peer from the swarm."""
    return loss if math.isfinite(loss) and 0.0 <= loss <= MAX_LOSS else -1.0


def group_list(value: Any) -> tuple[str, ...]:
    return wire.items(value, MAX_GROUP, wire.peer_id)


def outcome_word(value: Any) -> str:
    return wire.choice(value, OUTCOMES, other="")  # a newer peer's outcome reads as "does not say"


def bounded(past: Iterable[PastRound]) -> tuple[PastRound, ...]:
    """Past rounds newest first, one entry a round (the first given: the latest published), at most
    HISTORY_ROUNDS of them and HISTORY_MEMBERS group members in all."""
    out: list[PastRound] = []
    members = 0
    for entry in sorted(past, key=lambda p: -p.round):
        if out and out[-1].round == entry.round:
            continue
        members += len(entry.group)
        if len(out) == HISTORY_ROUNDS or members > HISTORY_MEMBERS:
            break
        out.append(entry)
    return tuple(out)


def parse_history(value: Any, before: int) -> tuple[PastRound, ...]:
    """A record's history as read: each entry parsed on its own (a malformed one is dropped, never
    the record), only rounds before the record's own, bounded as its publisher bounds it."""
    if not isinstance(value, list | tuple):
        return ()
    found = (PastRound.parse(v) for v in value[:HISTORY_ROUNDS])
    return bounded(p for p in found if p is not None and p.round < before)


def history_after(previous: RoundRecord | None, round_: int) -> tuple[PastRound, ...]:
    """The history a peer's next record, of `round_`, carries: its previous record (its final word
    on that round once it publishes a later one, or was replaced by a copy of the same round) and
    that record's history."""
    if previous is None:
        return ()
    p = previous
    latest = PastRound(p.round, p.digest, p.tokens, p.loss, p.copied, p.group, p.outcome)
    return bounded(e for e in (latest, *p.history) if e.round < round_)


@dataclass(frozen=True)
class RoundRecord:
    """A peer's latest round as it published it in the DHT: untrusted until checked (I4)."""

    peer: str
    round: int
    digest: str
    tokens: int
    loss: float
    addrs: tuple[str, ...] = ()  # where the peer listens (its multiaddrs), for operators and dashboards
    serves: bool = True  # False for client-mode peers: nobody can connect to them to download a state
    copied: bool = False  # the peer holds this state by download (catch-up, agreement), not by its own outer step
    group: tuple[str, ...] = ()  # the peers whose average made this state (observers credit work by it)
    outcome: str = ""  # how the round went: one of OUTCOMES ("" from a peer that does not say)
    history: tuple[PastRound, ...] = ()  # its final records of its latest past rounds, newest first
    punches: bool = False  # a private peer under swarm.hole_punching: it reduces for members that reached it
    groups: int = 1  # a two-level round's: the most groups a sub-span of its result counted (1: flat)
    spans: int = 0  # a two-level round's spans a group (0: a flat round; `group` is then its stage-1 group)

    @classmethod
    def parse(cls, value: Any) -> RoundRecord | None:
        """A record from the DHT, or None if it is malformed (it came from another peer: trust nothing)."""
        return wire.parse_or_none(cls.read, value, "round record")

    @classmethod
    def read(cls, value: Any) -> RoundRecord:
        """A record from the DHT (trust/wire.py's parsers: raises WireError if malformed). A malformed
        entry of its history is dropped, never the record."""
        record = wire.mapping(value)
        round_ = wire.field(record, "round", wire.integer)
        return cls(
            wire.field(record, "peer", wire.peer_id),
            round_,
            wire.field(record, "digest", wire.digest),
            wire.field(record, "tokens", wire.integer),
            wire.field(record, "loss", real_loss),
            wire.field(record, "addrs", address_list, ()),
            wire.field(record, "serves", wire.flag, True),
            wire.field(record, "copied", wire.flag, False),
            wire.field(record, "group", group_list, ()),
            wire.field(record, "outcome", outcome_word, ""),
            parse_history(record.get("history"), round_),
            punches=wire.field(record, "punches", wire.flag, False),
            groups=wire.field(record, "groups", level_count, 1),
            spans=wire.field(record, "spans", lambda v: wire.integer(v, 0, MAX_LEVEL), 0),
        )

    @property
    def tier(self) -> str:
        """public, punched (private, under hole punching) or private: protocol/reachability.py."""
        return "public" if self.serves else "punched" if self.punches else "private"


MAX_LEVEL = 1024  # groups of a round, or spans of a group, a record may name (claims.MAX_SHOWN)


def level_count(value: Any) -> int:
    return wire.integer(value, 1, MAX_LEVEL)


def address_list(value: Any) -> tuple[str, ...]:
    return wire.items(value, 8, lambda a: wire.text(a, 256))


@dataclass(frozen=True)
class Made:
    """How a peer came by the state it publishes: the group and outcome of the round that made it
    (its own outer step), or a copy (downloaded by catch-up or agreement)."""

    group: tuple[str, ...] = ()
    outcome: RoundOutcome = "start"
    copied: bool = False
    groups: int = 1  # a two-level round's: the most groups a sub-span of its result counted
    spans: int = 0  # a two-level round's spans a group (0: a flat round)


STARTED = Made()  # the state a peer starts from: θ(0) or its checkpoint
COPIED = Made(copied=True)


@dataclass(frozen=True)
class AllReduced:
    """One all-reduce of a round's group: the average and what it cost."""

    delta: torch.Tensor  # flat fp32, identical bytes on every member of the group
    exact: torch.Tensor | None  # the exact part (norms, biases), if the swarm has one
    group: tuple[str, ...]  # peer ids of the group, this peer included
    allreduce_s: float
    bytes_sent: int
    bytes_received: int
    link_bps: float | None = None  # the link figure this peer announced (bytes/s, links.LinkMeter), if any
    butterfly_s: float = 0.0  # of allreduce_s: the parts' reduce-scatter and all-gather
    audit_s: float = 0.0  # of allreduce_s: the audit of the other reducers that followed
    audit_bytes: int = 0  # what the audit's answers took (not in bytes_received)
    groups: int = 1  # a two-level round's: the most groups a sub-span of the result counted
    across_s: float = 0.0  # of allreduce_s: a two-level round's stages 2 and 3, after the audit
    across_bytes: tuple[int, int] = (0, 0)  # their messages' bytes, (sent, received), not in bytes_sent/received
    spans: int = 0  # a two-level round's spans a group (0: a flat round)


class Swarm(Protocol):
    """One peer's membership of a run's swarm: the only way the round logic reaches other peers.

    Every wait has a deadline from the config (I3). Everything read from other peers is
    validated before it is returned (I4).
    """

    peer_id: str
    solo: bool  # True only for `Solo`: there is nobody to average with

    @property
    def serves(self) -> bool:
        """Others can dial this peer: it reduces and serves its state (protocol/reachability.py)."""

    def check_config(self, theta0: str) -> Verdict:
        """Judge the run this peer found (genesis.py): raise RunConfigMismatch if the run's peers,
        or its genesis, hold another config (I5); then publish this peer's config and genesis
        record (`theta0`: the digest of its θ(0))."""

    def publish_final(self, round_: int, digest: str) -> None:
        """This peer finished the run's last round with `digest`: say so in the run's genesis."""

    def final_state(self) -> Genesis | None:
        """The run's end, if its genesis records claim one (genesis.final_claim)."""

    def wait_for_reachable_peer(self, round_: int | None = None) -> None:
        """A private peer: block until a live peer that others can reach beats in the run (at
        start, or at `round_` when it found no group), or raise SwarmError."""

    def publish_round(self, round_: int, digest: str, tokens: int, loss: float, made: Made = STARTED) -> None:
        """Publish this peer's latest round record (kept fresh until the next one); `made`: how
        this peer came by the state (RoundRecord's group, outcome and copied)."""

    def peers(self) -> dict[str, RoundRecord]:
        """The latest round record of every live peer of the run, by peer id."""
        ...

    def stale_peers(self) -> set[str]:
        """Peers whose heartbeat stopped: dead, hung or asleep. Nobody waits for them."""
        ...

    def fresh_peers(self) -> set[str]:
        """Ids this peer first saw only moments ago, well after it started: they do not count in
        the swarm's state yet (agreement.counted)."""
        ...

    def direct_peers(self) -> set[str]:
        """The peers this peer holds a direct connection to under hole punching (empty without it):
        the private ones among them can serve it their state, as public peers can (agreement.backed)."""
        ...

    def wait_for_round(self, round_: int, timeout: float) -> bool:
        """Whether the swarm's backed state (agreement.backed) reaches round `round_` (or later)
        within `timeout` s, with a peer that serves it."""
        ...

    def wait_for_digests(self, round_: int, expected: tuple[str, ...]) -> dict[str, str]:
        """Digests of round `round_` published by `expected`, waiting until all live ones are in or
        swarm.agreement_timeout_s ran out."""
        ...

    def report_progress(self, round_: int, tokens: int, tokens_per_s: float) -> None:
        """This peer's progress in its round (speed-aware rounds)."""

    def round_progress(self, round_: int, my_tokens: int, tokens_per_peer: int) -> SwarmProgress:
        """The swarm's progress in `round_` as last heard (speed-aware rounds); reads memory only."""
        ...

    def swarm_round(self) -> int | None:
        """The round of the swarm's backed state (agreement.backed) as last heard, if a peer serves it."""
        ...

    def average(
        self,
        delta: torch.Tensor,
        weight: float,
        round_: int,
        retry: bool = False,
        expected_group: int = 0,
        exact: torch.Tensor | None = None,
        levels: Levels | None = None,
    ) -> AllReduced | None:
        """All-reduce this round's flat Δ with the peers at the same round (in a two-level round, with
        its group, then across groups: `levels`). None: nobody else came within the matchmaking window.
        Raises AveragingError if the group's all-reduce failed: nothing of it was applied (I2)."""
        ...

    def download_state(self, round_: int, digest: str, from_peers: list[str], verify: StateCheck) -> ServedState:
        """A state of round `round_` whose digest (by `verify`) is `digest`, from one of `from_peers`;
        raises StateDownloadError if none serves it."""
        ...

    def close(self) -> None:
        """Leave the swarm (also on errors)."""


class Solo:
    """The swarm of a peer that trains alone (no initial peers): DiLoCo with k = 1.

    Nobody else publishes, so agreement is with itself and catch-up finds nothing; its id is made
    on first start and kept in the run dir, so a resumed peer keeps its data shard.
    """

    solo = True
    serves = True

    def __init__(self, run_dir: Path):
        path = run_dir / "peer_id"
        if not path.exists() or not path.read_text().strip():  # empty: a start that met a full disk
            tmp = path.with_name(".peer_id.tmp")
            try:
                tmp.write_text(secrets.token_hex(8) + "\n")
                tmp.replace(path)  # never a half-written id under the final name
            except OSError as e:
                with contextlib.suppress(OSError):  # a read-only disk refuses even this
                    tmp.unlink(missing_ok=True)
                raise WriteError.of(path, e) from None
        self.peer_id = path.read_text().strip()

    def check_config(self, theta0: str) -> Verdict:
        return Verdict("new")

    def publish_final(self, round_: int, digest: str) -> None:
        return None

    def final_state(self) -> Genesis | None:
        return None

    def wait_for_reachable_peer(self, round_: int | None = None) -> None:
        return None

    def publish_round(self, round_: int, digest: str, tokens: int, loss: float, made: Made = STARTED) -> None:
        return None

    def peers(self) -> dict[str, RoundRecord]:
        return {}

    def stale_peers(self) -> set[str]:
        return set()

    def fresh_peers(self) -> set[str]:
        return set()

    def direct_peers(self) -> set[str]:
        return set()

    def wait_for_round(self, round_: int, timeout: float) -> bool:
        return False

    def wait_for_digests(self, round_: int, expected: tuple[str, ...]) -> dict[str, str]:
        return {}

    def report_progress(self, round_: int, tokens: int, tokens_per_s: float) -> None:
        return None

    def round_progress(self, round_: int, my_tokens: int, tokens_per_peer: int) -> SwarmProgress:
        return SwarmProgress(float(my_tokens), tokens_per_peer, 1)

    def swarm_round(self) -> int | None:
        return None

    def average(
        self,
        delta: torch.Tensor,
        weight: float,
        round_: int,
        retry: bool = False,
        expected_group: int = 0,
        exact: torch.Tensor | None = None,
        levels: Levels | None = None,
    ) -> AllReduced | None:
        return None

    def download_state(self, round_: int, digest: str, from_peers: list[str], verify: StateCheck) -> ServedState:
        raise StateDownloadError("a peer that trains alone has nobody to download a state from")

    def close(self) -> None:
        return None
