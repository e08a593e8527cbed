"""The swarm's heartbeat: one background thread that keeps this peer's records fresh in the DHT and
everyone else's in memory, so that the training loop only ever reads memory.

Every BEAT_S it reads everyone's progress, and publishes this peer's where the readers'
extrapolation would mislead or it nears staleness; it reads the round records when the progress
shows one changed, else every ROUNDS_EVERY_S (protocol/cadence.py: each DHT operation on a key costs
the whole key). Every REFRESH_S it re-publishes this peer's round record, which expires after
RECORD_TTL_S, so a peer that died drops out of everyone's view within a minute and a half.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

from p2p_diloco.protocol import agreement, cadence
from p2p_diloco.protocol.budget import STALE_S, ProgressReport, SwarmProgress, swarm_progress
from p2p_diloco.protocol.network import RoundRecord
from p2p_diloco.swarm.transport import entry
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.convictions import Convictions
from p2p_diloco.swarm.trust.gate import Gate
from p2p_diloco.swarm.trust.run_dht import RunDHT

logger = logging.getLogger(__name__)

LAST_WORD_S = 5.0  # how long a leaving peer waits for the store of its last convictions
BEAT_S = 1.0  # how often a peer reads everyone's progress (and may publish its own: cadence.report_due)
# An id this peer first saw after it knew the swarm is new to it for FRESH_S: it does not count in
# the swarm's state (agreement.counted) until then. The peers a starting peer finds are known: those
# of its first read that showed anyone, and of its reads in the SETTLE_S after it (peers started
# together, whose records reach the DHT a few seconds apart).
FRESH_S = 120.0
SETTLE_S = 10.0


class Heartbeat:
    """This peer's published round and progress, and the latest view of everyone's."""

    def __init__(self, run_dht: RunDHT, peer_id: str, gate: Gate, entries: Entries | None = None):
        """`run_dht`: the run's records; this thread never holds its lock while it waits (RunDHT)."""
        self.run_dht, self.peer_id = run_dht, peer_id
        self.entries = entries or Entries(run_dht.dht)  # the entry nodes to ping, and the address book to keep
        self.gate = gate  # only admitted peers' records count (certified runs), and not the convicted
        self.convictions = Convictions(gate, peer_id)
        self._last_record: RoundRecord | None = None
        self._last_refresh = 0.0
        self._my_progress: ProgressReport | None = None
        self._sent_report: ProgressReport | None = None  # the last progress this peer published
        self._sent_convicted: frozenset[str] = frozenset()  # and the convictions it carried
        self._marks: dict[str, int] | None = None  # each peer's round at the last read of the round records
        self._rounds_read_at = 0.0
        self._reports: list[ProgressReport] = []
        self._rounds_seen: dict[str, RoundRecord] = {}
        self._started = time.time()
        self._read_at = self._started  # when the last beat read the swarm's records
        self._first_seen: dict[str, float] = {}
        self._knew_swarm_at: float | None = None  # when a read first showed another peer
        self._sending: dict[str, Any] = {}  # the store in flight of each kind of this peer's records
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="swarm-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._say_convictions()

    def _say_convictions(self) -> None:
        """Before this peer leaves: if it convicted someone since its last report, one last report
        that says so, waited for up to LAST_WORD_S. Its accusation would otherwise never reach
        the others or the organiser's list (a peer that convicted on a case and ended its run two
        seconds later, with swarm.linger_s = 0: CI of session 33)."""
        self.convictions.refresh({})  # the verdicts that came in since the last beat
        convicted, mine = frozenset(self.gate.convicted), self._my_progress
        if mine is None or convicted == self._sent_convicted:
            return
        report = replace(mine, time=time.time())
        try:
            self.run_dht.send_progress(report, convicted).result(timeout=LAST_WORD_S)
            self._sent_report, self._sent_convicted = report, convicted
        except Exception as e:  # the DHT may be gone already: nothing more to do on the way out
            logger.warning("could not publish this peer's last convictions before leaving: %s", e)

    def _loop(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
            except Exception as e:  # a failed beat is retried at the next one; never kill the peer
                logger.debug("heartbeat failed: %s", e)

    def _beat(self) -> None:
        now = time.time()
        refreshed = self._send(now)
        (progress_entries,) = self.run_dht.read_now(records.progress_key)
        # admitted peers' records only, none of another parsed (Gate.admitted: all in open runs)
        reports, accusations = records.progress_from(progress_entries, self.gate.admitted)
        if cadence.rounds_due(self._marks, reports, self._rounds_read_at, now):
            (round_entries,) = self.run_dht.read_now(records.rounds_key)
            self._rounds_seen = records.rounds_from(round_entries, self.gate.admitted)
            self._marks, self._rounds_read_at = cadence.marks_of(reports), now
        if refreshed:
            self.gate.publish()
        self.gate.refresh_revocations()
        self._reports = reports
        self.convictions.refresh(accusations)
        self._read_at = now
        with self.run_dht.turn():
            self.entries.tend(now, self._rounds_seen, self.peer_id)
        seen = {r.peer for r in self._reports} | set(self._rounds_seen)
        if self._knew_swarm_at is None and seen - {self.peer_id}:
            self._knew_swarm_at = now
        for p in seen:
            self._first_seen.setdefault(p, now)

    def _send(self, now: float) -> bool:
        """Send this peer's round record if its refresh is due, and its progress if due
        (cadence.report_due); whether the record was refreshed. Stores are not waited for, and
        nothing here holds the DHT lock while it waits (RunDHT's discipline): with a member asleep,
        a store waits 3 s for each try of it, and under the lock every read of the swarm by the
        peer, a survivor's catch-up too, would wait behind it (docs/design.md §4, I3)."""
        refresh = self._last_record is not None and now - self._last_refresh >= records.REFRESH_S
        if refresh and self._last_record is not None and self._sent("round"):
            self._sending["round"] = self.run_dht.send_round(self._last_record)
            self._last_refresh = now
        mine, convicted = self._my_progress, frozenset(self.gate.convicted)
        changed = convicted != self._sent_convicted
        if mine is not None and self._sent("progress") and cadence.report_due(self._sent_report, mine, now, changed):
            report = replace(mine, time=now)
            self._sending["progress"] = self.run_dht.send_progress(report, convicted)
            self._sent_report, self._sent_convicted = report, convicted
        return refresh

    def _sent(self, kind: str) -> bool:
        """Whether this peer's last store of `kind` ended: one at a time (a newer one follows)."""
        future = self._sending.get(kind)
        return future is None or future.done()

    def published(self, record: RoundRecord) -> None:
        """This peer just published `record`: refresh it from now on; a new round has no tokens yet."""
        self._last_record, self._last_refresh = record, time.time()
        mine = self._my_progress
        if mine is None or mine.round < record.round:
            self._my_progress = ProgressReport(self.peer_id, record.round, 0, 0.0, time.time())

    def report_progress(self, round_: int, tokens: int, tokens_per_s: float) -> None:
        """This peer's progress in its round; the next beat publishes it (with rate 0 once the inner
        phase ended, so nobody extrapolates tokens that will never come)."""
        self._my_progress = ProgressReport(self.peer_id, round_, tokens, tokens_per_s, time.time())

    def round_progress(self, round_: int, my_tokens: int, tokens_per_peer: int, cap: float) -> SwarmProgress:
        """The swarm's progress in `round_` as of the last beat, claims counted up to `cap` x the
        lower median (budget.claim_cap); reads memory only."""
        reports = [r for r in self._reports if r.peer not in self.gate.convicted]  # convicted since the last beat
        return swarm_progress(self.peer_id, round_, my_tokens, reports, time.time(), tokens_per_peer, STALE_S, cap)

    def stale_peers(self) -> set[str]:
        """Peers whose heartbeat stopped more than STALE_S ago: dead, hung, or asleep (the `stale`
        of agreement.live). Nobody waits for them, and they do not count in the swarm's state. A
        peer with a round record and no progress report is stale once this peer has known it for
        STALE_S: a dead peer's progress record expires after records.PROGRESS_TTL_S (30 s), its
        round record only after RECORD_TTL_S (90 s). (A peer that just started has no progress
        report yet: not stale.)

        Judged as of this peer's last read of the swarm, not now: while its own reads fail (a link
        saturated by a state download) it knows nothing newer, every peer would look stale, and a
        joiner would take the holder it downloads from for gone (see docs/benchmarks.md, A joiner
        on a slow link)."""
        now = self._read_at
        reporting = {r.peer for r in self._reports}
        silent = {p for p in self._rounds_seen if p not in reporting and now - self._first_seen.get(p, now) > STALE_S}
        return {r.peer for r in self._reports if now - r.time > STALE_S} | silent

    def beats(self) -> dict[str, float]:
        """Each peer's latest progress report time, by its own clock, as of the last beat."""
        return {r.peer: r.time for r in self._reports}

    def fresh_peers(self) -> set[str]:
        """Ids first seen less than FRESH_S ago, and more than SETTLE_S after this peer's first read
        that showed another peer. Only those of the first SETTLE_S count at once, not every id seen
        in a peer's own first FRESH_S: a flood of ids that arrives while a peer starts would
        otherwise count in its votes (threat model)."""
        now = time.time()
        known_until = (now if self._knew_swarm_at is None else self._knew_swarm_at) + SETTLE_S
        return {p for p, t in self._first_seen.items() if t > known_until and now - t < FRESH_S}

    def swarm_round(self) -> int | None:
        """The round of the swarm's backed state (agreement.backed), as of the last beat."""
        seen = {p: r for p, r in self._rounds_seen.items() if p not in self.gate.convicted}
        counted = agreement.counted(seen, self.stale_peers(), self.fresh_peers())
        state = agreement.backed(seen, counted, self.peer_id, self._last_record)
        return None if state is None or not state.holders else state.round


class Entries:
    """A node's entry nodes, pinged every entry.REATTACH_S (a restarted one knows the swarm again
    within seconds), and its address book, written every entry.REMEMBER_S (swarm/transport/entry.py)."""

    def __init__(self, dht: Any, initial_peers: list[str] | None = None, identity_path: Any = None):
        self.dht, self.initial_peers, self.identity_path = dht, list(initial_peers or []), identity_path
        self._pinging: Any = None
        self._last_ping, self._last_book = 0.0, time.time()  # the first ping at once

    def tend(self, now: float, seen: dict[str, RoundRecord], me: str, also: tuple[str, ...] = ()) -> None:
        """Called with the DHT handle held: ping the entry nodes (and `also`) if it is time and no
        ping is in flight; write the address book if it is time."""
        targets = [*self.initial_peers, *also]
        if targets and now - self._last_ping >= entry.REATTACH_S and (self._pinging is None or self._pinging.done()):
            self._pinging, self._last_ping = entry.start_pings(self.dht, targets), now
        if now - self._last_book >= entry.REMEMBER_S:
            entry.remember(self.identity_path, entry.addresses_of(seen, me))
            self._last_book = now
