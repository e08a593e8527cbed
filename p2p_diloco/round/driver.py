"""The round protocol: one round of DiLoCo, top to bottom, in two steps.

    run_round:  catch up if the swarm is ahead -> inner phase -> start_averaging -> finish_round

- `start_averaging(trained)`: average this round's Δ with the swarm, now (blocking rounds) or in
  the background (overlapped rounds).
- `finish_round(in_flight)`: wait for the average, apply the outer step to θ(r) (the same bytes on
  every peer, I1), agree with the group (sync.py), record the metrics and checkpoint (I6).

An overlapped round calls the same two steps at other times: it starts averaging round r, trains
the phase of round r + 1 meanwhile, then finishes round r. What it carries from one round to the
next is named: `InFlight`, `LastRound`, `sync.Unsettled`.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, SupportsFloat

from p2p_diloco import faults
from p2p_diloco.config import Config
from p2p_diloco.protocol import agreement, outer, twolevel
from p2p_diloco.protocol.budget import SwarmProgress
from p2p_diloco.protocol.network import COPIED, Made, Swarm
from p2p_diloco.protocol.pending import Pending
from p2p_diloco.protocol.twolevel import Levels
from p2p_diloco.round import averaging, joining
from p2p_diloco.round.averaging import Applied, Outcome, Overtaken
from p2p_diloco.round.replica import Replica
from p2p_diloco.round.sync import StateSync, Unsettled
from p2p_diloco.train.inner import PhaseResult

# A speed-aware peer runs at most this many times H steps in one round: the share of a fast peer in
# a swarm of slow ones (which the round's token budget already bounds) and a guard against a bug.
MAX_ROUND_SHARE = 16
ALONE_WARN = 3  # a swarm peer that averaged alone this many rounds in a row says so, every round


class RoundEnd(enum.Enum):
    """How a call of `RoundDriver.run_round` ended."""

    COMMITTED = "committed"  # θ(r+1) by this peer's own outer step, recorded and checkpointed
    ADOPTED = "adopted"  # the group's majority held another θ(r+1): this peer adopted it instead
    CAUGHT_UP = "caught up"  # it adopted the swarm's later state, which ends the run: nothing to train
    ABANDONED = "abandoned"  # the swarm finished the round without this peer: the next starts by catching up
    STOPPED = "stopped"  # `stop` was set: the partial round is discarded, the replica is unchanged


@dataclass(frozen=True)
class Trained:
    """An inner phase that ran to its end, and its pseudo-gradient Δ = start − θ_inner."""

    phase: PhaseResult
    delta: outer.Tensors
    delta_norm: float


@dataclass(frozen=True)
class InFlight:
    """A round whose averaging has started: its phase, and the outcome on its way."""

    trained: Trained
    outcome: Pending[Outcome]


@dataclass(frozen=True)
class LastRound:
    """What the eager estimate of the next round's average needs from the last one."""

    average: outer.Tensors
    own: outer.Tensors  # this peer's Δ of that round
    share: float  # this peer's share of the group (1 / group size)


class RoundDriver:
    """Runs one peer's rounds on its replica. A round commits a whole new state with its metrics
    record and checkpoint (`Replica.commit`, `Replica.adopt`), or changes nothing."""

    def __init__(self, replica: Replica, swarm: Swarm, sync: StateSync, config: Config):
        self.replica, self.swarm, self.sync, self.config = replica, swarm, sync, config
        self.rounds = config.run.rounds
        self.overlap = config.swarm.overlap if not swarm.solo else "off"  # alone there is nothing to wait for
        self.phases = PhaseRunner(replica, swarm, sync, config)
        self.in_flight: InFlight | None = None  # the all-reduce in flight (overlapped rounds)
        self.last: LastRound | None = None
        self.unsettled: Unsettled | None = None  # an agreement settled one phase late
        self.alone = 0  # rounds in a row this swarm peer averaged alone and kept its own state

    def run_round(self, stop: threading.Event) -> RoundEnd:
        """One round: commits a new state, metrics record and checkpoint, or changes nothing durable.

        STOPPED if `stop` ended it. A round the swarm finished without this peer (it hung, or
        slept) is ABANDONED: the next round starts by catching up.
        """
        started = time.perf_counter()
        if self.in_flight is None and self.catch_up():
            if self.replica.state.round >= self.rounds:
                return RoundEnd.CAUGHT_UP
        if self.overlap != "off":
            return self._run_overlapped(stop, started)
        trained = self.phases.run(self.replica.state.params, stop)
        if trained is None:
            return self._abandon(stop)
        return self.finish_round(self.start_averaging(trained, in_background=False), started)

    def catch_up(self) -> bool:
        """Between rounds: if the swarm is ahead, adopt its state. The caught-up state is this
        peer's round now: published at once (peers of the round may be waiting for this peer's
        digest), recorded and checkpointed like any. Returns whether it adopted one."""
        state = self.sync.catch_up()
        if state is None:
            self.refuse_a_finished_run(self.replica.state)
            return False
        self.replica.offer(state)  # served before its record says so: peers may download it from here
        self.swarm.publish_round(state.round, state.digest(), 0, float("nan"), COPIED)
        self.replica.adopt(state, self.replica.start_record(state))
        return True

    def refuse_a_finished_run(self, held: outer.GlobalState) -> None:
        """After a download that found nobody to serve it: RunFinished if the run ended meanwhile."""
        joining.refuse_a_finished_run(self.replica, held, self.swarm, self.config.run.run_id, self.sync.gone)

    def _run_overlapped(self, stop: threading.Event, started: float) -> RoundEnd:
        """One round whose all-reduce runs while the next inner phase trains.

        In flight on entry: the all-reduce of this round's Δ (started by the previous call, or by a
        first phase here). This call trains the next phase from an estimate of the round's result
        (eager) or from θ(r) (delayed), then finishes the round on the agreed θ(r) (so every peer
        still holds the same bytes, I1), and starts averaging the next.
        """
        if self.in_flight is None:  # nothing in flight: the first round, after a resume or a catch-up
            trained = self.phases.run(self.replica.state.params, stop)
            if trained is None:
                return self._abandon(stop)
            self.in_flight = self.start_averaging(trained, in_background=True)
        following = None
        if self.replica.state.round + 1 < self.rounds:
            following = self.phases.run(self._start_point(self.in_flight), stop, lead=1)
            if following is None:
                return self._abandon(stop)
        in_flight, self.in_flight = self.in_flight, None
        ended = self.finish_round(in_flight, started, defer=following is not None)
        if ended is not RoundEnd.ABANDONED and following is not None:
            self.in_flight = self.start_averaging(following, in_background=True)
        return ended

    def start_averaging(self, trained: Trained, in_background: bool) -> InFlight:
        """Step 1: average this round's Δ with the peers at the same round (averaging.py)."""
        self.replica.phase.set("averaging")
        # Before the group to expect is read: a test's gate that holds here (tests/swarm/round_gate.py)
        # held after it once, and its peers then formed the group they had read before the hold.
        faults.reached(faults.FaultPoint.MATCHMAKING, window_s=self.config.swarm.matchmaking_time_s)
        round_, (levels, expected) = self.replica.state.round, self._levels(self._expected_group())
        swarm, config, log = self.swarm, self.config, self.replica.log

        def work() -> Outcome:
            tokens = trained.phase.tokens
            return averaging.average(swarm, config, round_, trained.delta, tokens, expected, log, levels)

        return InFlight(trained, Pending(work, in_background))

    def finish_round(self, in_flight: InFlight, started: float, defer: bool = False) -> RoundEnd:
        """Step 2: wait for the round's average and commit θ(r+1). ABANDONED if the swarm
        finished the round without this peer: the next round starts by catching up."""
        pending = in_flight.outcome
        self.replica.phase.set("averaging")  # overlapped rounds: waiting for the all-reduce that ran meanwhile
        blocked_from = time.perf_counter() if pending.in_background else pending.started
        outcome = pending.join()
        if isinstance(outcome, Overtaken):
            self.sync.note_round(self.replica.state.round, in_flight.trained.delta)
            self.replica.rewind()  # the next round starts by catching up with the round's result
            return RoundEnd.ABANDONED
        now = time.perf_counter()
        comm = replace(outcome.comm, averaging_s=now - pending.started, blocked_s=now - blocked_from)
        if pending.in_background:
            self.last = LastRound(outcome.delta, in_flight.trained.delta, 1.0 / len(outcome.group))
            self._settle()
        return self._commit(in_flight.trained, replace(outcome, comm=comm), started, defer)

    def _settle(self) -> None:
        """Act on the last round's deferred agreement (overlapped rounds): if the majority held
        another state, adopt it, its record rewritten, before the next outer step lands on it."""
        unsettled, self.unsettled = self.unsettled, None
        state = self.sync.settle(unsettled)
        if state is not None and unsettled is not None:
            self.replica.adopt(state, {**unsettled.record, "digest": state.digest(), "adopted": True})

    def _commit(self, trained: Trained, outcome: Applied, started: float, defer: bool) -> RoundEnd:
        """θ(r+1) from the round's average: outer step, agreement, metrics, checkpoint.

        `defer` (overlapped rounds): publish the digest and collect the others' in the background
        while the next phase trains; `_settle` acts on them before the next outer step.
        """
        replica, swarm, r = self.replica, self.swarm, self.replica.state.round
        # Who should agree on the round's result: the group, and every live peer that was at this round.
        seen = agreement.live(swarm.peers(), swarm.stale_peers() | swarm.fresh_peers(), r, r + 1)
        expected = agreement.whom_to_wait_for(replica.peer_id, outcome.group, seen)
        oc = self.config.outer
        self.sync.note_round(r, trained.delta, outcome.delta)  # a state offered for r + 1 must agree with it
        stepped = outer.outer_step(replica.state, outcome.delta, oc.lr, oc.momentum, oc.nesterov)
        replica.offer(stepped)  # served to the round's peers from now on: they may download it as the majority's
        comm = outcome.comm
        made = Made(outcome.group, averaging.outcome_kind(outcome), groups=comm.groups, spans=comm.spans)
        collecting = self.sync.agree_later(stepped, expected, trained.phase, made) if defer else None
        adopted = None if defer else self.sync.agree(stepped, expected, trained.phase, made)
        if not defer and self.sync.gone is not None:  # nobody serves the majority's state: has the run ended?
            self.refuse_a_finished_run(stepped)
        self.alone = self.alone + 1 if len(outcome.group) == 1 and adopted is None else 0
        state = adopted or stepped
        record = self._record(state, trained, outcome, started, adopted is not None)
        if adopted is not None:
            replica.adopt(adopted, record, trained.phase)
        else:
            replica.commit(stepped, record, trained.phase)
        if collecting is not None:
            self.unsettled = Unsettled(state.round, collecting, trained.phase, record, expected)
        log_round(replica, swarm, record)
        self._warn_alone(r)
        return RoundEnd.ADOPTED if adopted is not None else RoundEnd.COMMITTED

    def _warn_alone(self, r: int) -> None:
        if self.alone >= ALONE_WARN and not self.swarm.solo:
            self.replica.log.warning(
                "no other peer of run %r at round %d: %d rounds in a row alone. Is the bootstrap node up, and are "
                "this peer's run id and config the organiser's? (`p2p-diloco config --config run.toml` prints "
                "the fingerprint to compare)",
                self.config.run.run_id,
                r,
                self.alone,
            )

    def _record(
        self, state: outer.GlobalState, trained: Trained, outcome: Applied, started: float, adopted: bool
    ) -> dict[str, Any]:
        """The round's metrics record, of `state` (`adopted`: downloaded from the group's majority)."""
        record = {
            **round_fields(self.replica, self.config, state, trained, adopted),
            "group_size": len(outcome.group),
            **outcome.comm.record(),
        }
        if self.phases.speed_aware:
            record["swarm_peers"] = self.phases.view.peers if self.phases.view else 1
        if not self.swarm.solo:
            record["alone_rounds"] = self.alone
        record["wall_s"] = time.perf_counter() - started
        record["time"] = time.time()  # when the round was committed (unix s)
        if adopted:
            record["adopted"] = True
        return record

    def _abandon(self, stop: threading.Event) -> RoundEnd:
        """An inner phase ended early: Ctrl+C (STOPPED), or the swarm finished the round without us."""
        if stop.is_set():  # an all-reduce still in flight ends when the peer leaves the swarm
            return RoundEnd.STOPPED
        replica = self.replica
        if self.in_flight is not None:  # the swarm moved on: its all-reduce is moot; let it end
            try:
                self.in_flight.outcome.join()
            except Exception as e:  # whatever it ended with, its result is not used
                replica.log.debug("abandoned all-reduce: %s", e)
            self.in_flight = None
        replica.log.info(  # a slow peer overtaken: it heals by catching up, nothing for the user to do
            "the swarm finished round %d without this peer (it is at round %s): abandoning the inner phase to catch up",
            replica.state.round,
            self.swarm.swarm_round(),
        )
        replica.rewind()
        return RoundEnd.ABANDONED

    def _start_point(self, in_flight: InFlight) -> outer.Tensors:
        """Where the phase after an in-flight all-reduce starts: θ(r) itself (delayed), or θ(r)
        moved by the outer step of an estimate of the round's average (eager)."""
        state = self.replica.state
        if self.overlap == "delayed":
            return state.params
        last = self.last
        own = in_flight.trained.delta
        estimate = outer.eager_estimate(own, last.average, last.own, last.share) if last else dict(own)
        oc = self.config.outer
        return outer.outer_step(state, estimate, oc.lr, oc.momentum, oc.nesterov).params

    def _levels(self, expected: int) -> tuple[Levels | None, int]:
        """This round's two levels and the group this peer expects in it, where the live peers at the
        round are enough for more than one group (twolevel.levels_for); else (None, `expected`)."""
        swarm, r, size = self.swarm, self.replica.state.round, self.config.swarm.group_size
        records = swarm.peers()
        at = agreement.live(records, swarm.stale_peers(), r - 1, r) | {swarm.peer_id}
        if twolevel.group_count(len(at), size) < 2:
            return None, expected
        key = bytes.fromhex(self.replica.state.digest())  # θ(r)'s: every peer of the round holds it (I1)
        dialable = {p for p in at if p not in records or records[p].serves}
        return twolevel.levels_for(swarm.peer_id, sorted(at), r, key, size, dialable.__contains__)

    def _expected_group(self) -> int:
        swarm, r = self.swarm, self.replica.state.round
        in_round = self.phases.view.peers if self.phases.view is not None else 0
        return agreement.expected_group(in_round, agreement.live(swarm.peers(), swarm.stale_peers(), r - 1, r))


class PhaseRunner:
    """The inner phase as a swarm peer runs it: H steps, or (speed-aware rounds) until the live
    peers together trained the round's token budget (budget.py)."""

    def __init__(self, replica: Replica, swarm: Swarm, sync: StateSync, config: Config):
        self.replica, self.swarm, self.sync = replica, swarm, sync
        self.speed_aware = not swarm.solo and config.swarm.speed_aware
        self.steps = config.inner.steps
        self.tokens_per_peer = self.steps * config.inner.batch_size * config.model.seq_len
        self.weight_decay = config.inner.weight_decay
        self.view: SwarmProgress | None = None  # the swarm's progress in the round when the last phase ended
        self.tokens_per_s = 0.0  # this peer's speed in its last inner phase

    def run(self, start: outer.Tensors, stop: threading.Event, lead: int = 0) -> Trained | None:
        """An inner phase from `start`, or None if it was abandoned (Ctrl+C, or the swarm moved on).
        `lead`: how many rounds past this peer's state the phase trains for (1 when overlapped)."""
        round_ = self.replica.state.round + lead
        if self.speed_aware:
            # The lr schedule follows the swarm's rounds: a fast peer that ran more than H steps in
            # a round, or a slow one that ran fewer, is back on the schedule at the next.
            self.replica.set_schedule(round_)
        faults.reached(faults.FaultPoint.INNER)
        self.view = None
        self.replica.phase.set("inner")
        progress = self.replica.progress
        progress.start(round_, self.steps)
        try:
            if not self.speed_aware:
                phase, trained = self._fixed_phase(start, stop, round_)
            else:
                phase, trained = self._speed_aware_phase(start, stop, round_)
        finally:
            progress.close()
        if trained is None:
            return None
        delta = outer.pseudo_gradient(start, trained)
        return Trained(phase, delta, outer.check_pseudo_gradient(delta, phase.lr_sum, self.weight_decay))

    def _on_step(self, started: float) -> Any:
        replica = self.replica

        def on_step(step: int, loss: SupportsFloat, tokens: int) -> None:
            # `loss` is a tensor on the device: the bar reads it twice a second, the debug line when on.
            replica.progress.update(loss, tokens / max(time.perf_counter() - started, 1e-9))
            if step % max(self.steps // 4, 1) == 0:
                replica.log.debug("loss %.4f", loss)

        return on_step

    def _fixed_phase(
        self, start: outer.Tensors, stop: threading.Event, round_: int
    ) -> tuple[PhaseResult, outer.Tensors | None]:
        """H steps. The speed of the last phase is reported at the start, the tokens at the end at
        rate 0, as in speed-aware rounds: nobody waits on them here, but observers show the speed."""
        self.swarm.report_progress(round_, 0, self.tokens_per_s)
        on_step = self._on_step(time.perf_counter())
        phase, trained = self.replica.train(start, round_, self.steps, stop.is_set, on_step)
        if phase.steps:
            self.tokens_per_s = phase.tokens / max(phase.compute_s, 1e-9)
        self.swarm.report_progress(round_, phase.tokens, 0.0)
        return phase, trained

    def _speed_aware_phase(
        self, start: outer.Tensors, stop: threading.Event, round_: int
    ) -> tuple[PhaseResult, outer.Tensors | None]:
        """Train until the swarm's tokens reach the round's budget. Abandoned if the swarm published
        a round past `round_` meanwhile: this peer was stopped or asleep while the others went on."""
        swarm, started = self.swarm, time.perf_counter()
        swarm.report_progress(round_, 0, self.tokens_per_s)

        def should_stop() -> bool:
            if stop.is_set():
                return True
            ahead, failed = swarm.swarm_round(), self.sync.failed_catch_up
            return ahead is not None and ahead > round_ and (failed is None or ahead > failed)

        def should_end(done: int, tokens: int) -> bool:
            swarm.report_progress(round_, tokens, tokens / max(time.perf_counter() - started, 1e-9))
            self.view = swarm.round_progress(round_, tokens, self.tokens_per_peer)
            return self.view.done

        steps = self.steps * MAX_ROUND_SHARE
        phase, trained = self.replica.train(start, round_, steps, should_stop, self._on_step(started), should_end)
        if phase.steps:
            self.tokens_per_s = phase.tokens / max(phase.compute_s, 1e-9)
        # The phase is over: report the final tokens at rate 0, so nobody extrapolates more.
        swarm.report_progress(round_, phase.tokens, 0.0)
        return phase, trained


def round_fields(
    replica: Replica, config: Config, state: outer.GlobalState, trained: Trained, adopted: bool
) -> dict[str, Any]:
    """A round's metrics record as the peer knows it after the outer step: of `state`, θ(r+1)
    (and its held-out loss on the rounds run.eval_every_rounds names, and the last)."""
    phase = trained.phase
    record: dict[str, Any] = {
        "round": state.round,
        "inner_steps": phase.steps,
        "tokens": phase.tokens,
        "total_tokens": replica.totals.tokens + phase.tokens,
        "train_loss": phase.mean_loss,
        "lr": replica.lr(adopting=state.round if adopted else None),
        "pseudo_grad_norm": trained.delta_norm,
        "digest": state.digest(),
        "compute_s": phase.compute_s,
        "tokens_per_s": phase.tokens / max(phase.compute_s, 1e-9),
    }
    every = config.run.eval_every_rounds
    if replica.heldout is not None and (state.round % every == 0 or state.round == config.run.rounds):
        record.update(replica.evaluate(state))
    return record


def log_round(replica: Replica, swarm: Swarm, record: dict[str, Any]) -> None:
    evaluated = f", held-out loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""
    size = record.get("group_size", 1)
    group = "" if swarm.solo else " (averaged alone)" if size == 1 else f" (group of {size})"
    replica.log.info(
        "round done%s: train loss %.4f%s, %s tokens at %s tok/s, |delta| %.3g, digest %s",
        group,
        record["train_loss"],
        evaluated,
        f"{record['tokens']:,}",
        f"{record['tokens_per_s']:,.0f}",
        record["pseudo_grad_norm"],
        record["digest"][:12],
    )
