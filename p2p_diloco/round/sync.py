"""Agreement and catch-up, carried out: publish, wait, compare, download, adopt.

agreement.py decides (whom to wait for, the majority, adopt or keep, whom to download from);
this module does what it says through the peer's `Swarm`. It never commits: it returns the whole
verified state to adopt, and the caller adopts it (`Replica.adopt`). A majority's state it
publishes as held is offered first (`Replica.offer`), so that it serves what it publishes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from p2p_diloco.errors import CatchUpFailed, StateDownloadError
from p2p_diloco.protocol import agreement, deadlines, outer
from p2p_diloco.protocol.deadlines import poll_until
from p2p_diloco.protocol.network import COPIED, Made, RoundRecord, Swarm
from p2p_diloco.protocol.pending import Pending
from p2p_diloco.train.inner import PhaseResult

if TYPE_CHECKING:
    from p2p_diloco.config import OuterSection, SwarmSection
    from p2p_diloco.round.replica import Replica

# A starting peer looks this long at the swarm before it follows a state that a single peer backs:
# peers started at the same moment publish their first records within seconds of each other, and
# one that saw only an attacker's later round would otherwise follow it (bench/attacks.py ahead:50).
SETTLE_S = 10.0
CATCH_UP_JOINS = 4  # a catch-up that cannot download keeps trying for this many state download deadlines
RETRY_MAX_S = 8.0  # the longest pause between two downloads of one state (each may move gigabytes)


@dataclass(frozen=True)
class Unsettled:
    """An overlapped round's agreement, collected in the background while the next phase trains,
    and settled before the next outer step is applied."""

    round: int
    collecting: Pending[tuple[str, list[str]]]  # (majority digest, holders)
    phase: PhaseResult
    record: dict[str, Any]  # the round's metrics record, rewritten if the peer adopts another state
    expected: tuple[str, ...] = ()  # the peers whose digests decide the round's agreement


@dataclass(frozen=True)
class OwnRound:
    """This peer's own pseudo-gradient of a round, and the Δ it applied to the round's start (None
    while it has not): what a state offered for the round's end must not point against."""

    round: int  # the round Δ was trained in: offered states are of round + 1
    own: outer.Tensors
    applied: outer.Tensors | None


class Retry:
    """A catch-up's failed downloads: its deadline, a backoff, and the holders that served another
    state of the very round asked for (liars, or broken): never asked for that state again."""

    def __init__(self, deadline: float):
        self.deadline = deadline
        self.tries = 0  # failed downloads of the current state
        self.wanted: tuple[int, str] | None = None
        self.refused: set[tuple[str, int, str]] = set()  # (holder, round, digest) it did not serve

    def sources(self, target: agreement.Reference) -> list[str]:
        return [h for h in target.holders if (h, target.round, target.digest) not in self.refused]

    def failed(self, target: agreement.Reference, error: StateDownloadError) -> Retry:
        wanted = (target.round, target.digest)
        self.tries = self.tries + 1 if wanted == self.wanted else 1
        self.wanted = wanted
        self.refused |= {(p, *wanted) for p, (r, _) in error.served.items() if r == target.round}
        return self

    def pause_s(self) -> float:
        """deadlines.CATCH_UP_POLL_S, doubling with each failure of the same state, at most
        RETRY_MAX_S; never past the deadline."""
        pause = min(deadlines.CATCH_UP_POLL_S * 2 ** (self.tries - 1), RETRY_MAX_S)
        return max(0.0, min(pause, self.deadline - time.monotonic()))


class StateSync:
    """One peer's agreement with its group and catch-up with the swarm."""

    def __init__(self, replica: Replica, swarm: Swarm, config: SwarmSection, outer_config: OuterSection):
        self.replica, self.swarm, self.config, self.outer_config = replica, swarm, config, outer_config
        self.failed_catch_up: int | None = None  # the latest round a catch-up failed to download
        self.own_round: OwnRound | None = None  # the latest round this peer trained (note_round)
        self.copied = False  # this peer's state was downloaded (_follow), not made by its own outer step
        self.gone: StateDownloadError | None = None  # why the last catch-up's holders could not serve it

    def note_round(self, round_: int, own: outer.Tensors, applied: outer.Tensors | None = None) -> None:
        """This peer trained `own` in `round_` (and applied `applied` to the round's start, if it did)."""
        self.own_round = OwnRound(round_, own, applied)
        if applied is not None:  # the outer step about to be applied makes a state of this peer's own
            self.copied = False

    # --- agreement after the outer step ----------------------------------------------------

    def agree(
        self, held: outer.GlobalState, expected: tuple[str, ...], phase: PhaseResult, made: Made
    ) -> outer.GlobalState | None:
        """Publish the digest of `held` (this round's state, made by this peer's outer step) and
        `made` (the group and outcome that made it); if the majority of `expected` holds another,
        download the majority's state. Waiting is bounded by swarm.agreement_timeout_s (I3); a peer
        that died is simply not counted. Returns the majority's verified state to adopt, or None."""
        self.replica.phase.set("agreement")
        self.gone = None
        mine = held.digest()
        self.swarm.publish_round(held.round, mine, phase.tokens, phase.mean_loss, made)
        majority, holders = self.collect(held.round, expected, mine)
        if not agreement.should_adopt(mine, majority):
            return None
        veto = not agreement.strict_majority(holders, expected)
        return self._adopt_majority(held, majority, holders, phase, veto=veto)

    def agree_later(
        self, held: outer.GlobalState, expected: tuple[str, ...], phase: PhaseResult, made: Made
    ) -> Pending[tuple[str, list[str]]]:
        """Publish the digest of `held` now and collect the others' in the background (overlapped
        rounds): the next phase need not wait for the round's slowest peer to publish."""
        round_, mine = held.round, held.digest()
        self.swarm.publish_round(round_, mine, phase.tokens, phase.mean_loss, made)
        return Pending.background(lambda: self.collect(round_, expected, mine))

    def settle(self, unsettled: Unsettled | None) -> outer.GlobalState | None:
        """The deferred agreement of the last committed round, before the next outer step is applied
        to it: if the majority holds another state, the state to adopt now (so the next update
        lands on the same θ everywhere), else None."""
        held = self.replica.state
        if unsettled is None or unsettled.round != held.round:  # the peer caught up meanwhile
            return None
        self.replica.phase.set("agreement")
        majority, holders = unsettled.collecting.join()
        if not agreement.should_adopt(held.digest(), majority):
            return None
        veto = not agreement.strict_majority(holders, unsettled.expected)
        return self._adopt_majority(held, majority, holders, unsettled.phase, latest=unsettled.round, veto=veto)

    def collect(self, round_: int, expected: tuple[str, ...], mine: str) -> tuple[str, list[str]]:
        """(majority digest, peers serving it) of round `round_` among `expected`, waiting for their
        digests at most swarm.agreement_timeout_s. Reads the swarm only: any thread."""
        me = self.replica.peer_id
        if expected == (me,):
            return mine, [me]
        digests, missing = agreement.tally(expected, self.swarm.wait_for_digests(round_, expected), me, mine)
        if missing:
            self.replica.log.info(
                "agreement: %d of %d peers published round %d within %g s (missing %s)",
                len(digests),
                len(expected),
                round_,
                self.config.agreement_timeout_s,
                ", ".join(p[-4:] for p in missing),
            )
        cannot_serve = agreement.clients(self.swarm.peers(), me, not self.swarm.serves) - self.swarm.direct_peers()
        return agreement.reference(digests, cannot_serve)

    def _adopt_majority(
        self,
        held: outer.GlobalState,
        majority: str,
        holders: list[str],
        phase: PhaseResult,
        latest: int | None = None,
        veto: bool = False,
    ) -> outer.GlobalState | None:
        """Download the majority's state of this round, asking again like a catch-up (`_follow`)
        while live peers hold it or a later one (up to round `latest`, if given): a peer that
        completed a round holds the swarm's bytes of it, or stops (I1). It keeps its own (None) only
        if nobody serves the state any more (`gone`: the run may have ended), or, with `veto` (the
        majority's holders are not more than half of the round's peers), if the majority's
        average points against its own Δ."""
        log = self.replica.log
        log.info(  # the swarm healing itself (a peer that averaged alone, a split group): nothing to do
            "digest %s differs from the group's majority %s: reloading its state", held.digest()[:12], majority[:12]
        )
        target = agreement.Reference(held.round, majority, tuple(holders))
        adopted = self._follow(target, self._mine(held), held, latest, veto)
        if adopted is None:
            log.warning("keeping this peer's own state (round %d)", held.round)
            return None
        self.replica.offer(adopted)  # served before its record says so: peers may download it from here
        self.swarm.publish_round(adopted.round, adopted.digest(), phase.tokens, phase.mean_loss, COPIED)
        return adopted

    # --- catch-up ------------------------------------------------------------------------------

    def catch_up(self, starting: bool = False) -> outer.GlobalState | None:
        """If the swarm is at a later round (or the same round with another majority digest),
        download its state. Returns the verified state to adopt, or None.

        A peer never trains on while live peers hold a later state it could not download: it asks
        the holders it knows again, and the holders of the round they publish next (in a swarm
        whose rounds are short they move on while it asks), for up to `patience_s`; then it stops
        with CatchUpFailed. If the holders left, `gone` keeps the last failure, and the peer checks
        whether the run ended (`joining.refuse_a_finished_run`): it writes no final model of its own.
        `starting`: the peer's first catch-up, which follows a state that one peer alone backs only
        after SETTLE_S."""
        self.replica.phase.set("catch-up")
        self.gone = None
        held = self.replica.state
        mine = self._mine(held)  # the peer's state does not change while it looks: hashed once
        target = self._settled(mine) if starting else self._target(mine)
        adopted = self._follow(target, mine, held)
        if adopted is not None:
            self.replica.log.info(
                "caught up with the swarm at round %d (digest %s)", adopted.round, adopted.digest()[:12]
            )
        return adopted

    def _follow(
        self,
        target: agreement.Reference | None,
        mine: RoundRecord,
        held: outer.GlobalState,
        latest: int | None = None,
        veto: bool = False,
    ) -> outer.GlobalState | None:
        """Download `target`, or, while its holders cannot serve it, the state live peers back by
        then (no later than round `latest`, if given), for up to `patience_s`: CatchUpFailed past
        it; with `veto`, not one whose average points against this peer's own Δ. Returns the
        verified state to adopt, or None; when the holders left, `gone` says why."""
        retry = Retry(time.monotonic() + self.patience_s())
        failure: StateDownloadError | None = None
        while target is not None and (latest is None or target.round <= latest):
            try:
                offered = self._download(target.round, target.digest, retry.sources(target))
            except StateDownloadError as e:
                failure = e
                self.failed_catch_up = max(self.failed_catch_up or 0, target.round)
                target = self._retry(target, retry.failed(target, e), e, mine)
                continue
            return self._accept(offered, held, list(target.holders), veto)
        if target is None:
            self.gone = failure  # the holders may have left because the run ended: the peer checks (joining.py)
        return None

    def download_s(self) -> float:
        """The deadline of one whole-state download of this model (deadlines.py)."""
        numel = sum(t.numel() for t in self.replica.state.params.values())
        return deadlines.state_download(numel, self.config.join_timeout_s, self.config.min_download_mbps).total_s

    def patience_s(self) -> float:
        """How long a peer that cannot download the swarm's state keeps trying before it stops (I3):
        CATCH_UP_JOINS download deadlines, so that the holders of the next round or two are asked too."""
        return CATCH_UP_JOINS * self.download_s()

    def _retry(
        self, failed: agreement.Reference, retry: Retry, error: StateDownloadError, mine: RoundRecord
    ) -> agreement.Reference | None:
        """After a failed download: the state to ask for next (the same, or the holders' later one), or
        None if no live peer holds a later state any more. CatchUpFailed past the deadline."""
        if time.monotonic() >= retry.deadline:
            raise CatchUpFailed(
                f"could not download the swarm's state (round {failed.round}, digest {failed.digest[:12]}) in "
                f"{self.patience_s():g} s: {error}. This peer trains nothing of its own while the swarm is ahead; "
                f"check that this machine reaches the peers' addresses, then restart it with --resume"
            )
        if retry.tries == 1:  # said once per state: the retries that follow say nothing new
            self.replica.log.info(
                "could not download round %d yet (%s): asking its holders again, or the next round's",
                failed.round,
                error,
            )
        time.sleep(retry.pause_s())  # a backoff between whole-state downloads, bounded by the deadline
        return self._target(mine)

    def _target(self, mine: RoundRecord) -> agreement.Reference | None:
        """The backed state to catch up to, if any. A peer ahead of the swarm's backed state waits
        first, at most swarm.agreement_timeout_s, for the others to reach its round
        (`agreement.runs_ahead`): then agreement at that round decides whose state goes on."""
        wait = self.config.agreement_timeout_s
        deadline = time.monotonic() + wait
        target, ahead = self._look(mine)
        if ahead:
            self.replica.log.info(
                "round %d: this peer's state is not backed by half of the live peers and some are at earlier "
                "rounds: waiting up to %g s for them to reach its round",
                mine.round,
                wait,
            )
            target, ahead = poll_until(
                lambda: self._look(mine), lambda looked: not looked[1], deadline, deadlines.CATCH_UP_POLL_S
            )
        if ahead:
            self.replica.log.info("nobody else reached round %d within %g s: going on", mine.round, wait)
        return target

    def _settled(self, mine: RoundRecord) -> agreement.Reference | None:
        """The first catch-up's target: one that a single peer backs is looked at for SETTLE_S
        first, while the peers started with this one publish their own first records."""
        deadline = time.monotonic() + SETTLE_S
        target = self._target(mine)
        if target is not None and target.backers < 2:
            self.replica.log.info(
                "one peer alone holds round %d as the swarm's state: looking at the swarm for up to %g s before "
                "following it",
                target.round,
                SETTLE_S,
            )
        return poll_until(
            lambda: self._target(mine), lambda t: t is None or t.backers >= 2, deadline, deadlines.CATCH_UP_POLL_S
        )

    def _mine(self, held: outer.GlobalState) -> RoundRecord:
        """`held` as one vote among the others' records."""
        serves = self.swarm.serves
        return RoundRecord(self.replica.peer_id, held.round, held.digest(), 0, 0.0, serves=serves, copied=self.copied)

    def _look(self, mine: RoundRecord) -> tuple[agreement.Reference | None, bool]:
        """(the backed state to catch up to, or None; whether this peer runs ahead of the swarm)."""
        seen = self.swarm.peers()
        counted = agreement.counted(seen, self.swarm.stale_peers(), self.swarm.fresh_peers())
        swarm_state = agreement.backed(seen, counted, self.replica.peer_id, mine, self.swarm.direct_peers())
        target = agreement.catch_up_target(swarm_state, mine.round, mine.digest, not mine.serves)
        return target, target is None and agreement.runs_ahead(swarm_state, seen, counted, mine.round, mine.digest)

    def _download(self, round_: int, digest: str, holders: list[str]) -> outer.GlobalState:
        """The verified state of `round_` with `digest` from one of `holders`, or StateDownloadError."""
        sources = agreement.download_sources(holders, self.replica.peer_id)
        _, (theta, momentum) = self.swarm.download_state(round_, digest, sources, self.verify_state)
        like = self.replica.state.params
        return outer.GlobalState(round_, outer.unflatten(theta, like), outer.unflatten(momentum, like))

    def _accept(
        self, offered: outer.GlobalState, held: outer.GlobalState, holders: list[str], veto: bool
    ) -> outer.GlobalState | None:
        """`offered`, unless (`veto`) the average that made it points against this peer's own Δ."""
        if veto and (cosine := self._against_own(offered, held)) is not None:
            self.replica.log.warning(
                "the state of round %d that %s hold was made with an average pointing against this peer's own "
                "pseudo-gradient (cosine %.2f): keeping this peer's own state",
                offered.round,
                ", ".join(h[-4:] for h in holders),
                cosine,
            )
            return None
        self.copied = True
        return offered

    def _against_own(self, offered: outer.GlobalState, held: outer.GlobalState) -> float | None:
        """The cosine of the average that made `offered` with this peer's own Δ of that round, if it
        points against it (`outer.against_own`). Checked only where the peer holds a state of
        that round of its own (`held`, agreement): a peer that was overtaken has none, and refusing
        the swarm's state would only make it adopt the next one, built on it, and abandon a phase
        for each (docs/design.md §6). A state of a later
        round than this peer trained is not checked either: it has no Δ of its own there."""
        noted = self.own_round
        if noted is None or noted.applied is None or offered.round != noted.round + 1:
            return None
        implied = outer.implied_average(offered, held, self.outer_config.momentum, noted.applied)
        if implied is None:
            return None
        return outer.against_own(implied, noted.own)

    def verify_state(self, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> str | None:
        """The digest of a downloaded state, or None if it is malformed: it does not even have this
        model's shape (the download names it so, and asks the next holder)."""
        return outer.served_digest(metadata, tensors, self.replica.state.params)
