"""This peer's replica of the run: the global state θ(r), the model and trainer that train from it,
the data stream, the run's totals and the journal (metrics.jsonl and checkpoints).

The round, the catch-up and the joining checks are handed a `Replica`, never the peer. Its state
changes only through `commit` (a round this peer ended) and `adopt` (a verified state downloaded
from the swarm), each of which also writes the state's metrics record and checkpoint: a round
commits a whole new state with its record, or changes nothing (I6). `restore` loads a checkpoint,
at start only. Between its outer step and its commit, a round `offer`s the state it made: peers
that agree on the round may download it from this one before it is committed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from p2p_diloco.config import Config
from p2p_diloco.protocol import outer
from p2p_diloco.train import checkpoint
from p2p_diloco.train.inner import InnerTrainer, PhaseResult, lr_at
from p2p_diloco.train.metrics import MetricsLog, Phase, ProgressBar


@dataclass(frozen=True)
class Totals:
    """Counters over the whole run, carried through checkpoints."""

    tokens: int = 0
    inner_steps: int = 0
    compute_s: float = 0.0

    def plus(self, phase: PhaseResult) -> Totals:
        return Totals(self.tokens + phase.tokens, self.inner_steps + phase.steps, self.compute_s + phase.compute_s)


class Stream(Protocol):
    """The data stream a replica trains on (prefetch.Prefetcher): its state is what a checkpoint saves."""

    def next_batch(self) -> torch.Tensor: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Ranks(Protocol):
    """The peer's other processes (ranks.Alone, ranks.Leader): told what the leader does next."""

    def phase(self, model: torch.nn.Module, start: outer.Tensors, steps: int, step: int) -> None: ...

    def evaluating(self, model: torch.nn.Module, params: outer.Tensors) -> None: ...

    def saving(self) -> None: ...


@dataclass(frozen=True)
class Display:
    """What the peer shows of itself: its log lines (with the round they name), what it does now
    (its /metrics), and the progress bar of an inner phase."""

    log: Any  # metrics.PeerLogger: `round` and `step` name the line's place in the run
    phase: Phase
    progress: ProgressBar


class Replica:
    """One peer's replica of the run. Read `state`; change it with `commit` or `adopt`."""

    def __init__(
        self,
        state: outer.GlobalState,
        trainer: InnerTrainer,
        stream: Stream,
        ranks: Ranks,
        metrics: MetricsLog,
        config: Config,
        peer_id: str,
        display: Display,
        heldout: torch.Tensor | None = None,
    ):
        """`heldout`: the held-out batch its states are evaluated on (None: never evaluated)."""
        self._state = state
        self._offered: outer.GlobalState | None = None
        self._trainer, self._stream, self._ranks, self._metrics = trainer, stream, ranks, metrics
        self._config, self.peer_id, self.heldout = config, peer_id, heldout
        self.log, self.phase, self.progress = display.log, display.phase, display.progress
        self._totals = Totals()
        self._total_steps = config.run.rounds * config.inner.steps

    @property
    def state(self) -> outer.GlobalState:
        """θ(r) and the outer momentum. Immutable and replaced whole: one read is a consistent
        snapshot (the swarm's serving thread reads it)."""
        return self._state

    @property
    def served(self) -> outer.GlobalState:
        """What a peer that downloads this one's state gets: the state offered to the round's
        agreement (`offer`) until it is committed, else `state`."""
        return self._offered or self._state

    def offer(self, state: outer.GlobalState) -> None:
        """Serve `state` from now on, before it is committed: the state of this peer's outer step
        while the group agrees on the round, or a verified download about to be adopted. Its
        record is published first, and a peer that reads it may download the state from this one
        at once. Not committed: a crash here leaves the last checkpoint; `commit` or `adopt` ends
        the offer."""
        self._offered = state

    @property
    def totals(self) -> Totals:
        return self._totals

    @property
    def schedule_step(self) -> int:
        """The inner lr schedule's step: where the next inner phase starts on it."""
        return self._trainer.step

    def lr(self, adopting: int | None = None) -> float:
        """The inner lr of the last step trained; `adopting`: once a downloaded state of that round
        is adopted (`adopt`: the schedule follows the swarm's round)."""
        step = self._trainer.step if adopting is None else self._step_following(adopting)
        return lr_at(step - 1, self._config.inner, self._total_steps)

    def _step_following(self, round_: int) -> int:
        return max(self._trainer.step, round_ * self._config.inner.steps)

    # --- training ----------------------------------------------------------------------------

    def train(
        self,
        start: outer.Tensors,
        round_: int,
        steps: int,
        should_stop: Callable[[], bool],
        on_step: Callable[[int, Any, int], None],
        should_end: Callable[[int, int], bool] = lambda done, tokens: False,
    ) -> tuple[PhaseResult, outer.Tensors | None]:
        """Up to `steps` inner steps from `start` for round `round_`: the phase, and the parameters
        it trained (gathered whole from the ranks), or None if it was stopped."""
        self.log.round = round_
        self._load(start)
        self._ranks.phase(self._trainer.model, start, steps, self._trainer.step)  # the other ranks train it too

        def step_shown(step: int, loss: Any, tokens: int) -> None:
            self.log.step, self.log.steps = step, self._config.inner.steps
            on_step(step, loss, tokens)

        try:
            phase = self._trainer.run_phase(self._stream.next_batch, steps, should_stop, step_shown, should_end)
        finally:
            self.log.step = None
        if phase.stopped:
            return phase, None
        return phase, self._trainer.ranks.gather(self._trainer.model)  # sharded (run.fsdp): every rank gathers

    def set_schedule(self, round_: int) -> None:
        """Put the lr schedule at the start of `round_` (speed-aware rounds follow the swarm's
        rounds: a fast peer that ran more than H steps, or a slow one that ran fewer, is back on it)."""
        self._trainer.step = round_ * self._config.inner.steps

    def rewind(self) -> None:
        """θ(r) back into the inner model: a phase was abandoned, its training is discarded."""
        self._load(self._state.params)

    def evaluate(self, state: outer.GlobalState) -> dict[str, float]:
        """The held-out loss of `state` (loaded into the inner model to evaluate it)."""
        assert self.heldout is not None
        self._load(state.params)
        self._ranks.evaluating(self._trainer.model, state.params)  # sharded (run.fsdp): every rank evaluates
        loss = self._trainer.evaluate(self.heldout)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def start_record(self, state: outer.GlobalState) -> dict[str, Any]:
        """The metrics record of a state this peer starts from (θ(0), or a round it caught up to)."""
        record: dict[str, Any] = {"round": state.round, "tokens": 0, "digest": state.digest()}
        record["time"] = time.time()  # when this peer came to hold the state (unix s)
        if self.heldout is not None:
            record.update(self.evaluate(state))
            self.log.info("held-out loss of theta(%d): %.4f", state.round, record["eval_loss"])
        return record

    # --- the only changes of state ----------------------------------------------------------

    def commit(self, state: outer.GlobalState, record: dict[str, Any], trained: PhaseResult | None = None) -> None:
        """This peer holds `state` now, made by its own outer step (or the state it starts from):
        `record` goes to metrics.jsonl, then the checkpoint. `trained`: the phase that made it,
        added to the totals."""
        if trained is not None:
            self._totals = self._totals.plus(trained)
        self._become(state, record)

    def adopt(self, state: outer.GlobalState, record: dict[str, Any], trained: PhaseResult | None = None) -> None:
        """This peer holds `state` now, a verified download of the swarm's: like `commit`, and the
        lr schedule follows the swarm's round, not this peer's own step count."""
        self._trainer.step = self._step_following(state.round)
        self.commit(state, record, trained)

    def _become(self, state: outer.GlobalState, record: dict[str, Any]) -> None:
        self._state, self._offered = state, None
        self._load(state.params)
        self._metrics.append(record)
        self._save()
        self.log.round = state.round

    # --- the journal ------------------------------------------------------------------------

    def records(self) -> Iterator[dict[str, Any]]:
        return self._metrics.records()

    def restore(self, payload: dict[str, Any]) -> None:
        """At start only: the replica of a checkpoint (checkpoint.load), to continue bit-exactly."""
        self._state = outer.GlobalState(payload["round"], payload["params"], payload["momentum"])
        self._load(self._state.params)
        self._trainer.load_state_dict(payload["trainer"])
        self._stream.load_state_dict(payload["data"])
        self._totals = Totals(**payload["totals"])
        torch.set_rng_state(payload["rng"]["torch"])
        self.log.round = self._state.round
        self._metrics.truncate_after(self._state.round)

    def _save(self) -> None:
        self._ranks.saving()  # sharded (run.fsdp): every rank gathers AdamW's state
        state, config = self._state, self._config
        payload = {
            "round": state.round,
            "params": state.params,
            "momentum": state.momentum,
            "digest": state.digest(),
            "shared_config": config.shared_dict(),
            "config": config.to_dict(),
            "fingerprint": config.fingerprint(),
            "peer_id": self.peer_id,
            "trainer": self._trainer.state_dict(),
            "data": self._stream.state_dict(),
            "totals": vars(self._totals).copy(),
            "rng": {"torch": torch.get_rng_state()},
        }
        checkpoint.save(Path(config.run.dir), payload, config.checkpoint.keep)

    def _load(self, params: outer.Tensors) -> None:
        self._trainer.ranks.load(self._trainer.model, params)  # sharded (run.fsdp): this rank's rows
