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

import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, SupportsFloat

from p2p_diloco import agreement, averaging, faults, outer
from p2p_diloco.averaging import Applied, Outcome, Overtaken
from p2p_diloco.inner import PhaseResult, lr_at
from p2p_diloco.network import Made
from p2p_diloco.pending import Pending
from p2p_diloco.rounds import SwarmProgress
from p2p_diloco.sync import Unsettled

if TYPE_CHECKING:
    from p2p_diloco.peer import Peer

# A speed-aware peer runs at most this many times H steps in one round: the share of a fast peer in
# a swarm of slow ones (which the round's token budget already bounds) and a guard against a bug.
MAX_ROUND_SHARE = 16
ALONE_WARN = 3  # a swarm peer that averaged alone this many rounds in a row says so, every round


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
    """Runs one peer's rounds. A round commits a whole new state with its metrics record and
    checkpoint, or changes nothing."""

    def __init__(self, peer: Peer):
        self.peer = peer
        cfg = peer.config
        self.rounds = cfg.run.rounds
        self.overlap = cfg.swarm.overlap if not peer.swarm.solo else "off"  # alone there is nothing to wait for
        self.phases = PhaseRunner(peer)
        self.in_flight: InFlight | None = None  # the all-reduce in flight (overlapped rounds)
        self.last: LastRound | None = None
        self.unsettled: Unsettled | None = None  # an agreement settled one phase late
        self.alone = 0  # rounds in a row this swarm peer averaged alone and kept its own state

    def run_round(self, stop: threading.Event) -> bool:
        """One round: commits a new state, metrics record and checkpoint, or (if stopped) changes nothing durable.

        Returns False if `stop` ended it. A round the swarm finished without this peer (it hung, or
        slept) is abandoned too, but returns True: the next round starts by catching up.
        """
        started = time.perf_counter()
        if self.in_flight is None and self.peer.catch_up():
            if self.peer.state.round >= self.rounds:
                return True
        if self.overlap != "off":
            return self._run_overlapped(stop, started)
        trained = self.phases.run(self.peer.state.params, stop)
        if trained is None:
            return self._abandon(stop)
        self.finish_round(self.start_averaging(trained, in_background=False), started)
        return True

    def _run_overlapped(self, stop: threading.Event, started: float) -> bool:
        """One round whose all-reduce runs while the next inner phase trains.

        In flight on entry: the all-reduce of this round's Δ (started by the previous call, or by a
        first phase here). This call trains the next phase from an estimate of the round's result
        (eager) or from θ(r) (delayed), then finishes the round on the agreed θ(r) (so every peer
        still holds the same bytes, I1), and starts averaging the next.
        """
        if self.in_flight is None:  # nothing in flight: the first round, after a resume or a catch-up
            trained = self.phases.run(self.peer.state.params, stop)
            if trained is None:
                return self._abandon(stop)
            self.in_flight = self.start_averaging(trained, in_background=True)
        following = None
        if self.peer.state.round + 1 < self.rounds:
            following = self.phases.run(self._start_point(self.in_flight), stop, lead=1)
            if following is None:
                return self._abandon(stop)
        in_flight, self.in_flight = self.in_flight, None
        if self.finish_round(in_flight, started, defer=following is not None) and following is not None:
            self.in_flight = self.start_averaging(following, in_background=True)
        return True

    def start_averaging(self, trained: Trained, in_background: bool) -> InFlight:
        """Step 1: average this round's Δ with the peers at the same round (averaging.py)."""
        peer = self.peer
        peer.phase.set("averaging")
        round_, expected = peer.state.round, self._expected_group()

        def work() -> Outcome:
            tokens = trained.phase.tokens
            return averaging.average(peer.swarm, peer.config, round_, trained.delta, tokens, expected, peer.log)

        return InFlight(trained, Pending(work, in_background))

    def finish_round(self, in_flight: InFlight, started: float, defer: bool = False) -> bool:
        """Step 2: wait for the round's average and commit θ(r+1). Returns False if the swarm
        finished the round without this peer: the next round starts by catching up."""
        pending = in_flight.outcome
        self.peer.phase.set("averaging")  # overlapped rounds: waiting for the all-reduce that ran meanwhile
        blocked_from = time.perf_counter() if pending.in_background else pending.started
        outcome = pending.join()
        if isinstance(outcome, Overtaken):
            self.peer.sync.note_round(self.peer.state.round, in_flight.trained.delta)
            self.peer.load_theta()  # the next round starts by catching up with the round's result
            return False
        now = time.perf_counter()
        comm = replace(outcome.comm, averaging_s=now - pending.started, blocked_s=now - blocked_from)
        if pending.in_background:
            self.last = LastRound(outcome.delta, in_flight.trained.delta, 1.0 / len(outcome.group))
            unsettled, self.unsettled = self.unsettled, None
            self.peer.sync.settle(unsettled)
        self._commit(in_flight.trained, replace(outcome, comm=comm), started, defer)
        return True

    def _commit(self, trained: Trained, outcome: Applied, started: float, defer: bool) -> None:
        """θ(r+1) from the round's average: outer step, agreement, metrics, checkpoint.

        `defer` (overlapped rounds): publish the digest and collect the others' in the background
        while the next phase trains; `sync.settle` acts on them before the next outer step.
        """
        peer, r = self.peer, self.peer.state.round
        # Who should agree on the round's result: the group, and every live peer that was at this round.
        seen = agreement.live_at(peer.swarm.peers(), peer.swarm.stale_peers() | peer.swarm.fresh_peers(), r, r + 1)
        expected = agreement.whom_to_wait_for(peer.peer_id, outcome.group, seen)
        oc = peer.config.outer
        peer.sync.note_round(r, trained.delta, outcome.delta)  # a state offered for r + 1 must agree with it
        peer.state = outer.outer_step(peer.state, outcome.delta, oc.lr, oc.momentum, oc.nesterov)
        peer.load_theta()
        made = Made(outcome.group, averaging.outcome_kind(outcome))
        collecting = peer.sync.agree_later(expected, trained.phase, made) if defer else None
        adopted = not defer and peer.sync.agree(expected, trained.phase, made)
        if not defer and peer.sync.gone is not None:  # nobody serves the majority's state: has the run ended?
            peer.refuse_a_finished_run()
        self.alone = self.alone + 1 if len(outcome.group) == 1 and not adopted else 0
        record = self._record(trained, outcome, started)
        if adopted:
            record["adopted"] = True
        peer.metrics.append(record)
        if collecting is not None:
            self.unsettled = Unsettled(peer.state.round, collecting, trained.phase, record, expected)
        peer.save()
        peer.log.round = peer.state.round
        log_round(peer, record)
        if self.alone >= ALONE_WARN and not peer.swarm.solo:
            peer.log.warning(
                "no other peer of run %r at round %d: %d rounds in a row alone. Is the bootstrap node up, and are "
                "this peer's run id and config the organiser's? (`p2p-diloco config --config run.toml` prints "
                "the fingerprint to compare)",
                peer.config.run.run_id,
                r,
                self.alone,
            )

    def _record(self, trained: Trained, outcome: Applied, started: float) -> dict[str, Any]:
        """The round's metrics record; adds the round to the peer's totals."""
        peer, phase = self.peer, trained.phase
        peer.totals.tokens += phase.tokens
        peer.totals.inner_steps += phase.steps
        peer.totals.compute_s += phase.compute_s
        record = {
            **round_fields(peer, phase, trained.delta_norm),
            "group_size": len(outcome.group),
            **outcome.comm.record(),
        }
        if self.phases.speed_aware:
            record["swarm_peers"] = self.phases.view.peers if self.phases.view else 1
        if not peer.swarm.solo:
            record["alone_rounds"] = self.alone
        record["wall_s"] = time.perf_counter() - started
        record["time"] = time.time()  # when the round was committed (unix s)
        return record

    def _abandon(self, stop: threading.Event) -> bool:
        """An inner phase ended early: Ctrl+C (False), or the swarm finished the round without us."""
        if stop.is_set():  # an all-reduce still in flight ends when the peer leaves the swarm
            return False
        peer = self.peer
        if self.in_flight is not None:  # the swarm moved on: its all-reduce is moot; let it end
            try:
                self.in_flight.outcome.join()
            except Exception as e:  # whatever it ended with, its result is not used
                peer.log.debug("abandoned all-reduce: %s", e)
            self.in_flight = None
        peer.log.info(  # a slow peer overtaken: it heals by catching up, nothing for the user to do
            "the swarm finished round %d without this peer (it is at round %s): abandoning the inner phase to catch up",
            peer.state.round,
            peer.swarm.swarm_round(),
        )
        peer.load_theta()
        return True

    def _start_point(self, in_flight: InFlight) -> outer.Tensors:
        """Where the phase after an in-flight all-reduce starts: θ(r) itself (delayed), or θ(r)
        moved by the outer step of an estimate of the round's average (eager)."""
        state = self.peer.state
        if self.overlap == "delayed":
            return state.params
        last = self.last
        own = in_flight.trained.delta
        estimate = outer.eager_estimate(own, last.average, last.own, last.share) if last else dict(own)
        oc = self.peer.config.outer
        return outer.outer_step(state, estimate, oc.lr, oc.momentum, oc.nesterov).params

    def _expected_group(self) -> int:
        peer, r = self.peer, self.peer.state.round
        in_round = self.phases.view.peers if self.phases.view is not None else 0
        return agreement.expected_group(
            in_round, agreement.live_at(peer.swarm.peers(), peer.swarm.stale_peers(), r - 1, r)
        )


class PhaseRunner:
    """The inner phase as a swarm peer runs it: H steps, or (speed-aware rounds) until the live
    peers together trained the round's token budget (rounds.py)."""

    def __init__(self, peer: Peer):
        self.peer = peer
        cfg = peer.config
        self.speed_aware = not peer.swarm.solo and cfg.swarm.speed_aware
        self.steps = cfg.inner.steps
        self.tokens_per_peer = self.steps * cfg.inner.batch_size * cfg.model.seq_len
        self.view: SwarmProgress | None = None  # the swarm's progress in the round when the last phase ended
        self.tokens_per_s = 0.0  # this peer's speed in its last inner phase

    def run(self, start: outer.Tensors, stop: threading.Event, lead: int = 0) -> Trained | None:
        """An inner phase from `start`, or None if it was abandoned (Ctrl+C, or the swarm moved on).
        `lead`: how many rounds past this peer's state the phase trains for (1 when overlapped)."""
        peer = self.peer
        if self.speed_aware:
            # The lr schedule follows the swarm's rounds: a fast peer that ran more than H steps in
            # a round, or a slow one that ran fewer, is back on the schedule at the next.
            peer.trainer.step = (peer.state.round + lead) * self.steps
        peer.log.round = peer.state.round + lead
        peer.load(start)
        phase = self._phase(stop, peer.state.round + lead, start)
        if phase.stopped:
            return None
        # Sharded (run.fsdp): every rank gathers the trained parameters whole.
        delta = outer.pseudo_gradient(start, peer.trainer.ranks.gather(peer.model))
        return Trained(phase, delta, outer.check_pseudo_gradient(delta, phase.lr_sum, peer.config.inner.weight_decay))

    def _phase(self, stop: threading.Event, round_: int, start: outer.Tensors) -> PhaseResult:
        faults.reached(faults.FaultPoint.INNER)
        peer = self.peer
        self.view = None
        peer.phase.set("inner")
        steps = self.steps * MAX_ROUND_SHARE if self.speed_aware else self.steps
        peer.ranks.phase(peer.model, start, steps, peer.trainer.step)  # the peer's other ranks train it too
        peer.progress.start(round_, self.steps)
        started = time.perf_counter()

        def on_step(step: int, loss: SupportsFloat, tokens: int) -> None:
            # `loss` is a tensor on the device: the bar reads it twice a second, the debug line when on.
            peer.log.step, peer.log.steps = step, self.steps
            peer.progress.update(loss, tokens / max(time.perf_counter() - started, 1e-9))
            if step % max(self.steps // 4, 1) == 0:
                peer.log.debug("loss %.4f", loss)

        try:
            if not self.speed_aware:
                return self._fixed_phase(stop, round_, on_step)
            return self._speed_aware_phase(stop, round_, started, on_step)
        finally:
            peer.log.step = None
            peer.progress.close()

    def _fixed_phase(self, stop: threading.Event, round_: int, on_step: Any) -> PhaseResult:
        """H steps. The speed of the last phase is reported at the start, the tokens at the end at
        rate 0, as in speed-aware rounds: nobody waits on them here, but observers show the speed."""
        peer = self.peer
        peer.swarm.report_progress(round_, 0, self.tokens_per_s)
        phase = peer.trainer.run_phase(peer.next_batch, self.steps, stop.is_set, on_step)
        if phase.steps:
            self.tokens_per_s = phase.tokens / max(phase.compute_s, 1e-9)
        peer.swarm.report_progress(round_, phase.tokens, 0.0)
        return phase

    def _speed_aware_phase(self, stop: threading.Event, round_: int, started: float, on_step: Any) -> PhaseResult:
        """Train until the swarm's tokens reach the round's budget. Abandoned if the swarm published
        a round past `round_` meanwhile: this peer was stopped or asleep while the others went on."""
        peer, swarm = self.peer, self.peer.swarm
        swarm.report_progress(round_, 0, self.tokens_per_s)

        def should_stop() -> bool:
            if stop.is_set():
                return True
            ahead = swarm.swarm_round()
            return ahead is not None and ahead > round_ and ahead > peer.sync.failed_catch_up

        def should_end(done: int, tokens: int) -> bool:
            swarm.report_progress(round_, tokens, tokens / max(time.perf_counter() - started, 1e-9))
            self.view = swarm.round_progress(round_, tokens, self.tokens_per_peer)
            return self.view.done

        phase = peer.trainer.run_phase(peer.next_batch, self.steps * MAX_ROUND_SHARE, should_stop, on_step, should_end)
        if phase.steps:
            self.tokens_per_s = phase.tokens / max(phase.compute_s, 1e-9)
        # The phase is over: report the final tokens at rate 0, so nobody extrapolates more.
        swarm.report_progress(round_, phase.tokens, 0.0)
        return phase


def round_fields(peer: Peer, phase: PhaseResult, delta_norm: float) -> dict[str, Any]:
    """A round's metrics record as the peer knows it after the outer step (and the held-out loss
    of θ(r+1) on the rounds run.eval_every_rounds names, and the last)."""
    cfg = peer.config
    record: dict[str, Any] = {
        "round": peer.state.round,
        "inner_steps": phase.steps,
        "tokens": phase.tokens,
        "total_tokens": peer.totals.tokens,
        "train_loss": phase.mean_loss,
        "lr": lr_at(peer.trainer.step - 1, cfg.inner, peer.total_steps),
        "pseudo_grad_norm": delta_norm,
        "digest": peer.state.digest(),
        "compute_s": phase.compute_s,
        "tokens_per_s": phase.tokens / max(phase.compute_s, 1e-9),
    }
    every = cfg.run.eval_every_rounds
    if peer.heldout is not None and (peer.state.round % every == 0 or peer.state.round == cfg.run.rounds):
        record.update(peer.eval_record())
    return record


def log_round(peer: Peer, record: dict[str, Any]) -> None:
    evaluated = f", held-out loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""
    size = record.get("group_size", 1)
    group = "" if peer.swarm.solo else " (averaged alone)" if size == 1 else f" (group of {size})"
    peer.log.info(
        "round done%s: train loss %.4f%s, %s tokens at %s tok/s, |delta| %.3g, digest %s",
        group,
        record["train_loss"],
        evaluated,
        f"{record['tokens']:,}",
        f"{record['tokens_per_s']:,.0f}",
        record["pseudo_grad_norm"],
        record["digest"][:12],
    )
