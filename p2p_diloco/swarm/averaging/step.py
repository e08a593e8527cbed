"""One averaging step of the real swarm: matchmaking for the round's group, then the consistent
all-reduce (allreduce.py) in the averager process, each bounded by a deadline (I3).

After a successful all-reduce the members probe each other's links in the background (protocol/links.py),
while the next inner phase trains and the link is idle.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from p2p_diloco.config import SwarmSection
from p2p_diloco.errors import AveragingError, SwarmError, SwarmMovedOn
from p2p_diloco.protocol import deadlines, links, twolevel
from p2p_diloco.protocol.network import AllReduced
from p2p_diloco.protocol.twolevel import Levels
from p2p_diloco.swarm.averaging.averager import Averaged, DiLoCoAverager
from p2p_diloco.swarm.trust import records

# What a failed averaging step raises from inside hivemind; anything else is a bug and propagates.
HIVEMIND_ERRORS = (
    AllreduceException,
    MatchmakingException,
    P2PDaemonError,
    P2PHandlerError,
    TimeoutError,
    asyncio.TimeoutError,
    ConnectionError,
    asyncio.CancelledError,
)
CONVICTED_TIMEOUT_S = 5.0  # for the averager process to say whom it convicted
CANCEL_POLL_S = 0.05  # how often a cancelled step's stage is read while the averager ends it
STEP_MARGIN_S = 30.0  # the averager process's hand-over and wrap-up, beyond the step's own deadlines


def found_no_group(error: BaseException) -> bool:
    """Whether hivemind failed the step only because matchmaking found no group in time (the peer
    then averages alone: `Swarm.average` returns None), not because a group's all-reduce failed.

    hivemind says which by its message alone: when `Matchmaking.look_for_group` gives up at the
    step's deadline (it returns None), `DecentralizedAverager._step` sets
    `AllreduceException("Averaging step failed: could not find a group")` on the step: the type
    that an all-reduce that failed raises too (hivemind's runner, and allreduce.py's), with no
    attribute or subclass of its own (hivemind 1.1). The text is the only signal;
    tests/unit/test_step_wait.py runs hivemind's own `_step` so that a change of it shows."""
    return isinstance(error, AllreduceException) and "could not find a group" in str(error).lower()


class Overtook(Exception):
    """The swarm finished the round while this peer's step was still in matchmaking."""


class AveragingStep:
    """Runs averaging steps on this peer's averager process."""

    def __init__(
        self,
        averager: DiLoCoAverager,
        sc: SwarmSection,
        peer_id: str,
        residual: torch.Tensor | None,
        payload_bytes: int,
        credentials: dict[str, Any],
        reach: Callable[[], dict[str, Any]] = dict,
    ):
        """`credentials`: what this peer shows the group in the all-gather (its certificate, if any);
        `reach()`: what it shows of whom it can be reached by, read at each step (gathered.Entry)."""
        self.averager, self.sc, self.peer_id, self.residual = averager, sc, peer_id, residual
        self._credentials, self._reach = credentials, reach
        self._payload_bytes = payload_bytes
        self._probed_round: int | None = None  # the round after whose all-reduce this peer last probed
        self.probes: Any = None  # the latest probe sweep (an MPFuture of {peer: rate}); benchmarks wait on it

    def run(
        self,
        delta: torch.Tensor,
        weight: float,
        round_: int,
        retry: bool,
        expected_group: int,
        exact: torch.Tensor | None,
        overtaken: Callable[[], bool] = lambda: False,
        levels: Levels | None = None,
    ) -> AllReduced | None:
        """See `Swarm.average`. `overtaken()`: whether the swarm finished the round meanwhile; while
        no all-reduce has begun, the step then ends at once (SwarmMovedOn), checked every second."""
        self.check_averager()
        self._load(delta, exact, round_, expected_group, levels)
        timeout = self._matchmaking_timeout(retry)
        # The whole step, matchmaking and all-reduce, is bounded (I3); hivemind's own step() would
        # wait forever on an averager process that died or hung.
        deadline = timeout + self.sc.averaging_timeout_s + STEP_MARGIN_S
        link_bps, seen = self._link_report()
        self.averager.bandwidth = link_bps  # announced in the group's all-gather; None = no claim
        try:
            control = self.averager.start_step(
                float(weight),
                timeout,
                {"round": round_, "seen": seen, "weight": float(weight), **self._credentials, **self._reach()},
                init_timeout=STEP_MARGIN_S,
            )
        except TimeoutError as e:
            self.check_averager()
            raise AveragingError(f"round {round_}: {e}") from None
        result = self._outcome(control, round_, timeout, deadline, overtaken)
        return None if result is None else self._collect(result, round_, link_bps)

    def _load(
        self, delta: torch.Tensor, exact: torch.Tensor | None, round_: int, expected_group: int, levels: Levels | None
    ) -> None:
        """This round's Δ (plus what the codec lost of the last one: error feedback) into the
        averager's shared buffers, the round's matchmaking key (its bucket's, in a two-level round)
        and its levels."""
        with self.averager.get_tensors() as buffers:
            buffers[0].copy_(delta if self.residual is None else delta + self.residual)
            if exact is not None:
                buffers[1].copy_(exact)
        try:  # after the last step's look for a group ended (bounded: that look's own deadline)
            bits = records.round_bits(round_)
            if levels is not None and levels.groups > 1:
                bucket = (
                    levels.bucket
                    if levels.bucket is not None
                    else twolevel.bucket_of(levels.seed, self.peer_id, levels.groups)
                )
                bits += records.bucket_bits(bucket, levels.groups)
            self.averager.set_round_key(bits, self._matchmaking_timeout(True) + STEP_MARGIN_S)
        except FuturesTimeout:
            self.check_averager()
            raise AveragingError(
                f"round {round_}: the last step's look for a group did not end; nothing averaged"
            ) from None
        self.averager.set_levels(levels)
        if expected_group >= 2:
            self.averager.set_target_group_size(expected_group)

    def _matchmaking_timeout(self, retry: bool) -> float:
        timeout = self.sc.matchmaking_time_s * 3
        if retry:
            # Survivors notice a failed all-reduce at different moments: a reducer that drops a
            # sender at once, a sender only when its reducer's timeout (half the averaging
            # deadline) runs out. Wait that much longer so they still meet.
            timeout += self.sc.averaging_timeout_s / 2
        return timeout

    def _outcome(
        self, control: Any, round_: int, timeout: float, deadline: float, overtaken: Callable[[], bool]
    ) -> Averaged | None:
        """hivemind's result of the step; None if no group formed; AveragingError if it failed."""
        try:
            return self._wait_for(control, deadline, overtaken)
        except Overtook:
            raise SwarmMovedOn(f"the swarm finished round {round_} while this peer looked for its group") from None
        except HIVEMIND_ERRORS as e:
            if not control.done():  # this method's deadline, not hivemind's
                control.cancel()
                raise AveragingError(
                    f"round {round_}: the averaging step did not end within {deadline:g} s "
                    f"(matchmaking {timeout:g} s + all-reduce {self.sc.averaging_timeout_s:g} s); "
                    f"nothing applied"
                ) from None
            if found_no_group(e) or isinstance(e, TimeoutError):  # nobody to average with in time
                return None
            raise AveragingError(f"round {round_} all-reduce failed: {type(e).__name__}: {str(e)[:200]}") from None

    def _collect(self, result: Averaged, round_: int, link_bps: float | None) -> AllReduced:
        """The averaged buffers, once every member is known to have averaged this same round."""
        gathered = result.gathered
        bad = [str(p) for p, g in gathered.items() if not isinstance(g, dict) or g.get("round") != round_]
        if bad:
            raise AveragingError(f"round {round_}: group members {bad} averaged another round; result dropped")
        with self.averager.get_tensors() as buffers:
            averaged = [b.clone() for b in buffers]
        members = sorted(str(p) for p in gathered)
        at = members.index(self.peer_id) if self.peer_id in members else 0
        # Each member starts with the one after it: while they all probe at once, no receiver gets two.
        self._probe_links(round_, members[at + 1 :] + members[:at])
        return AllReduced(
            averaged[0],
            averaged[1] if len(averaged) > 1 else None,
            tuple(members),
            result.allreduce_s,
            result.stats.bytes_sent,
            result.stats.bytes_received,
            link_bps,
            result.stats.butterfly_s,
            result.stats.audit_s,
            result.stats.audit_bytes,
            result.stats.groups,
            result.stats.across_s,
            (result.stats.across_sent, result.stats.across_received),
            result.stats.spans,
        )

    def _link_report(self) -> tuple[float | None, dict[str, float]]:
        """This peer's link figure and what it measured of others' probes (protocol/links.py), or nothing
        (no claim, no vouches) if probing is off or the averager process does not answer in time."""
        if not self.sc.probe_links:
            return None, {}
        try:
            return self.averager.link_report(timeout=STEP_MARGIN_S)
        except FuturesTimeout:
            self.check_averager()
            return None, {}

    def _probe_links(self, round_: int, others: list[str]) -> None:
        """After an all-reduce, every links.PROBE_EVERY rounds: probe the group's other members in the
        background (the averager process), while the next inner phase trains and the link is idle."""
        if not self.sc.probe_links or not others:
            return
        if self._probed_round is not None and round_ - self._probed_round < links.PROBE_EVERY:
            return
        self._probed_round = round_
        self.probes = self.averager.probe(
            others, links.probe_size(self._payload_bytes), timeout=self.sc.averaging_timeout_s
        )

    def _wait_for(self, control: Any, deadline: float, overtaken: Callable[[], bool]) -> Averaged:
        """The step's result within `deadline` s, checking every second that the averager lives,
        and that the swarm did not finish the round while this peer still looks for a group (then
        Overtook, the step cancelled). A member whose all-reduce failed while the others' completed
        (a reducer answered their audit, then hung) would otherwise retry for the whole matchmaking
        deadline while the others wait for its digest."""
        end = time.monotonic() + deadline
        while True:
            try:
                return control.result(timeout=min(1.0, max(0.0, end - time.monotonic())))
            except FuturesTimeout:
                if control.done() or time.monotonic() >= end:
                    raise
                self.check_averager()
                if not control.began_allreduce and overtaken():
                    control.cancel()
                    self._until_ended(control)
                    raise Overtook() from None

    def _until_ended(self, control: Any) -> None:
        """Wait (bounded) until the averager process ended a cancelled step and its look for a
        group. `cancel()` returns at once, while hivemind's look lingers in its clean-up; the next
        round's step then changed the group key under it ("Another look_for_group is already in
        progress"), and a member of the next round joined a group of this one (measured under a CPU
        hog: "group members [...] averaged another round; result dropped", a 14-s round)."""

        def ended() -> bool:
            try:
                return control.stage == AveragingStage.FINISHED and self.averager.matchmaking_idle(STEP_MARGIN_S)
            except FuturesTimeout:
                return False

        deadlines.poll_until(ended, bool, time.monotonic() + 3 * self.sc.matchmaking_time_s, CANCEL_POLL_S)

    def convicted(self) -> frozenset[str]:
        """The peers this peer's averager convicted (none if it is gone or does not answer in time)."""
        if not self.averager.is_alive():
            return frozenset()
        try:
            return self.averager.convicted_peers(timeout=CONVICTED_TIMEOUT_S)
        except FuturesTimeout:
            return frozenset()

    def check_averager(self) -> None:
        """The averager runs in a child process; if it died, no round can be averaged again."""
        if not self.averager.is_alive():
            raise SwarmError(
                f"this peer's averaging process died (exit code {self.averager.exitcode}); "
                f"the last round's checkpoint is on disk: restart the peer with --resume"
            )
