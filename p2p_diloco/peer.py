"""One peer's life: rounds of inner phase -> pseudo-gradient -> (average) -> outer step -> checkpoint.

Alone (no initial peers), the average of one pseudo-gradient is itself: that is DiLoCo with k = 1,
which the paper reports already beats plain training. The swarm puts the network between the
pseudo-gradient and the outer step; nothing else in a round changes.
"""

from __future__ import annotations

import fcntl
import logging
import math
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from p2p_diloco import checkpoint, config as config_mod, data, model as model_mod, outer
from p2p_diloco.config import Config
from p2p_diloco.errors import AveragingError, ConfigError, RoundOvertaken, StateDownloadError
from p2p_diloco.inner import InnerTrainer, PhaseResult, lr_at
from p2p_diloco.metrics import MetricsLog, PeerLogger, Progress

logger = logging.getLogger(__name__)

# A speed-aware peer runs at most this many times H steps in one round: the share of a fast peer in
# a swarm of slow ones (which the round's token budget already bounds) and a guard against a bug.
MAX_ROUND_SHARE = 16


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"run.device = {spec} but torch {torch.__version__} sees no GPU; install a CUDA build of torch "
            f"(README: GPU peers) or set --run.device=cpu"
        )
    return device


@dataclass
class Totals:
    """Counters over the whole run, carried through checkpoints."""

    tokens: int = 0
    inner_steps: int = 0
    compute_s: float = 0.0


class Background:
    """Swarm work of one round (its all-reduce, or collecting its digests) running in a thread while
    the next inner phase trains. The work's deadlines are the swarm's, so `join` ends."""

    def __init__(self, work: Callable[[], Any], phase: PhaseResult | None = None, delta: outer.Tensors | None = None,
                 delta_norm: float = 0.0):
        self.phase, self.delta, self.delta_norm = phase, delta, delta_norm
        self.started = time.perf_counter()
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="overlapped-average", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Any]) -> None:
        try:
            self._result = work()
        except BaseException as e:  # handed to the training loop at join
            self._error = e

    def join(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


class Peer:
    """Builds everything a peer needs from a Config, then runs rounds until the run ends or `stop` is set."""

    def __init__(self, config: Config, resume: bool = False):
        self.config = config
        self.run_dir = Path(config.run.dir)
        # Everything that can fail on bad input is built before the run dir is touched: an error
        # leaves nothing behind and overwrites nothing.
        self.tokenizer = model_mod.load_tokenizer(config.model.tokenizer)
        self.model_config = model_mod.model_config(config.model, self.tokenizer.vocab_size)
        self.corpus = data.open_corpus(config.data)
        self.device = resolve_device(config.run.device)
        if config.swarm.initial_peers:
            from p2p_diloco.swarm.node import parse_initial_peers  # imports hivemind: swarm peers only

            parse_initial_peers(config.swarm.initial_peers)
        self._lock = self._claim_run_dir(resume)
        self.swarm = None
        self.progress = Progress(False, "")
        self._speed_aware = bool(config.swarm.initial_peers) and config.swarm.speed_aware
        self._round_view = None  # the swarm's progress in this round when the inner phase ended
        self._tokens_per_s = 0.0  # this peer's speed in its last inner phase
        self._failed_catch_up = -1  # the latest round a catch-up failed to download
        # Overlapped rounds need a swarm: alone there is nothing to wait for.
        self._overlap = config.swarm.overlap if config.swarm.initial_peers else "off"
        self._pending: Background | None = None  # the all-reduce in flight (overlapped rounds)
        self._previous: tuple[outer.Tensors, outer.Tensors, float] | None = None  # (average, own Δ, share) of the last round
        self._unsettled: tuple[int, Background, PhaseResult, dict] | None = None  # an agreement settled one phase late
        try:
            self._build(resume)
        except BaseException:
            self.close()
            raise

    def _build(self, resume: bool) -> None:
        config = self.config
        self.model = model_mod.init_model(self.model_config, config.run.seed).to(self.device)
        self.state = outer.initial_state(dict(self.model.named_parameters()))
        if config.swarm.initial_peers:
            from p2p_diloco.swarm import Swarm  # imports hivemind: only peers that join a swarm pay for it

            lossy, exact = outer.split_exact(self.state.params)
            self.swarm = Swarm(config, self.run_dir, sum(t.numel() for t in lossy.values()), self._serve_state,
                               exact_numel=sum(t.numel() for t in exact.values()))
        self.peer_id = self.swarm.peer_id if self.swarm else self._peer_id()
        self.log = PeerLogger(logger, self.peer_id[-4:])
        self.total_steps = config.run.rounds * config.inner.steps
        self.trainer = InnerTrainer(self.model, config.inner, self.total_steps, self.device)
        shard = config.data.shard if config.data.shard >= 0 else data.pick_shard(self.peer_id, config.run.seed, config.data.num_shards)
        self.stream = data.TrainStream(
            self.corpus, self.tokenizer, config.model.seq_len, shard, config.data.num_shards,
            config.run.seed, config.data.heldout_fraction, data.sharding(self.corpus, config.data, config.run.seed),
        )
        self.heldout = None
        if config.run.eval_every_rounds > 0:
            self.heldout = data.heldout_batch(
                self.corpus, self.tokenizer, config.model.seq_len, config.run.eval_sequences, config.data.heldout_fraction
            )
        self.totals = Totals()
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.progress = Progress(config.log.progress, self.peer_id[-4:])
        self._start(resume, shard)
        config_mod.save(config, self.run_dir / "config.toml")

    # --- setup -------------------------------------------------------------------------------

    def _claim_run_dir(self, resume: bool) -> Any:
        """Create the run dir and hold a lock on it: two peers writing one run dir would corrupt it."""
        existing = checkpoint.latest(self.run_dir)
        if existing is not None and not resume:
            raise ConfigError(
                f"run dir {self.run_dir} already holds checkpoints (latest {existing.name}); pass --resume to "
                f"continue that run or choose another --run.dir"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.run_dir / ".lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ConfigError(f"another peer is running in {self.run_dir}; stop it or choose another --run.dir") from None
        return lock

    def _peer_id(self) -> str:
        """A random id made on first start and kept in the run dir, so a resumed peer keeps its data shard."""
        path = self.run_dir / "peer_id"
        if path.exists():
            return path.read_text().strip()
        peer_id = secrets.token_hex(8)
        path.write_text(peer_id + "\n")
        return peer_id

    def _start(self, resume: bool, shard: int) -> None:
        params = model_mod.count_parameters(self.model)
        self.log.info(
            "%s: %s parameters, %s, device %s, shard %d of %d, config %s",
            self.config.run.run_id, f"{params:,}", self.corpus.description, self.device, shard,
            self.config.data.num_shards, self.config.fingerprint(),
        )
        path = checkpoint.latest(self.run_dir) if resume else None
        if path is not None:
            self._restore(checkpoint.load(path, self.config.shared_dict()))
            self.log.info("resumed from %s (digest %s)", path, self.state.digest())
        elif resume:
            self.log.info("no checkpoint in %s: starting at round 0", checkpoint.checkpoint_dir(self.run_dir))
        caught_up = False
        if self.swarm is not None:
            self.swarm.check_config()
            if self.config.swarm.client_mode:
                # Announce first, so reachable peers know to wait for this one at the next matchmaking.
                self.swarm.publish_round(self.state.round, self.state.digest(), 0, float("nan"))
                self.swarm.wait_for_reachable_peer()
            caught_up = self._catch_up()
        if path is None:
            self.metrics.truncate_after(-1)
        if path is None or caught_up:
            self._record_start()
            self._save()
        if self.swarm is not None:
            self.swarm.publish_round(self.state.round, self.state.digest(), 0, float("nan"))

    def _record_start(self) -> None:
        """The metrics record of the state this peer starts from: θ(0), or the round it caught up to."""
        record: dict[str, Any] = {"round": self.state.round, "tokens": 0, "digest": self.state.digest()}
        if self.heldout is not None:
            record.update(self._eval_record())
            self.log.info("held-out loss of theta(%d): %.4f", self.state.round, record["eval_loss"])
        self.metrics.append(record)

    def _restore(self, payload: dict[str, Any]) -> None:
        self.state = outer.GlobalState(payload["round"], payload["params"], payload["momentum"])
        self._load_theta()
        self.trainer.load_state_dict(payload["trainer"])
        self.stream.load_state_dict(payload["data"])
        self.totals = Totals(**payload["totals"])
        torch.set_rng_state(payload["rng"]["torch"])
        self.log.round = self.state.round
        self.metrics.truncate_after(self.state.round)

    # --- rounds ------------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Run rounds until config.run.rounds are done or `stop` is set (e.g. by Ctrl+C).

        A round interrupted by `stop` is discarded: the peer's state stays at the last round
        boundary, which is already checkpointed, so a resume repeats that round exactly.
        """
        stop = stop or threading.Event()
        while self.state.round < self.config.run.rounds:
            if stop.is_set() or not self.run_round(stop):
                self.log.info("stopped: the partial round was discarded; the checkpoint of round %d is on disk, "
                              "continue with --resume", self.state.round)
                return
        self.log.info("run complete: %d rounds, digest %s", self.state.round, self.state.digest())
        if self.swarm is not None:
            self._linger(stop)

    def _linger(self, stop: threading.Event) -> None:
        """Stay a while after the last round so that a peer still finishing it can download the
        final state from us: until every live peer of the last two rounds holds our final digest,
        or swarm.agreement_timeout_s + swarm.join_timeout_s, or Ctrl+C."""
        final, mine = self.state.round, self.state.digest()
        deadline = time.monotonic() + self.config.swarm.agreement_timeout_s + self.config.swarm.join_timeout_s
        while not stop.is_set() and time.monotonic() < deadline:
            behind = [p for p, rec in self.swarm.peers().items()
                      if rec.round in (final - 1, final) and rec.digest != mine and p not in self.swarm.stale_peers()]
            if not behind:
                return
            stop.wait(0.5)  # a DHT poll interval, bounded by the deadline
        self.log.info("left with peers still finishing the last round: they keep their own state")

    def run_round(self, stop: threading.Event) -> bool:
        """One round: commits a new state, metrics record and checkpoint, or (if stopped) changes nothing durable.

        Returns False if `stop` ended it. A round the swarm finished without this peer (it hung, or
        slept) is abandoned too, but returns True: the next round starts by catching up.
        """
        started = time.perf_counter()
        if self.swarm is not None and self._pending is None and self._catch_up():
            # The caught-up state is this peer's round now: published at once (peers of the round
            # may be waiting for this peer's digest), recorded and checkpointed like any.
            self.swarm.publish_round(self.state.round, self.state.digest(), 0, float("nan"))
            self._record_start()
            self._save()
            if self.state.round >= self.config.run.rounds:
                return True
        if self._overlap != "off":
            return self._run_round_overlapped(stop, started)
        done = self._phase_from(self.state.params, stop)
        if done is None:
            return self._abandon(stop)
        phase, delta, delta_norm = done
        averaging_started = time.perf_counter()
        try:
            averaged, group, comm = self._average(delta, phase.tokens, self._expected_group())
        except RoundOvertaken:
            self._load_theta()  # the next round starts by catching up with the round's result
            return True
        comm["averaging_s"] = comm["blocked_s"] = time.perf_counter() - averaging_started
        comm["wait_s"] = max(0.0, comm["averaging_s"] - comm["allreduce_s"])
        self._commit(phase, delta_norm, averaged, group, comm, started)
        return True

    def _run_round_overlapped(self, stop: threading.Event, started: float) -> bool:
        """One round whose all-reduce runs while the next inner phase trains.

        In flight on entry: the all-reduce of this round's Δ (started by the previous call, or by a
        first phase here). This call trains the next phase from an estimate of the round's result
        (eager) or from θ(r) (delayed), then joins the all-reduce, applies the outer step to the
        agreed θ(r) (so every peer still holds the same bytes, I1), and starts the next all-reduce.
        """
        if self._pending is None:  # nothing in flight: the first round, after a resume or a catch-up
            done = self._phase_from(self.state.params, stop)
            if done is None:
                return self._abandon(stop)
            self._launch(*done)
        following = None
        if self.state.round + 1 < self.config.run.rounds:
            following = self._phase_from(self._start_point(), stop, lead=1)
            if following is None:
                return self._abandon(stop)
        pending, self._pending = self._pending, None
        blocked_from = time.perf_counter()
        try:
            averaged, group, comm = pending.join()
        except RoundOvertaken:
            self._load_theta()  # the next round starts by catching up; the following phase is lost
            return True
        comm["blocked_s"] = time.perf_counter() - blocked_from
        comm["averaging_s"] = time.perf_counter() - pending.started
        comm["wait_s"] = max(0.0, comm["averaging_s"] - comm["allreduce_s"])
        self._previous = (averaged, pending.delta, 1.0 / len(group))
        self._settle_agreement()
        self._commit(pending.phase, pending.delta_norm, averaged, group, comm, started, defer=following is not None)
        if following is not None:
            self._launch(*following)
        return True

    def _phase_from(self, start: outer.Tensors, stop: threading.Event,
                    lead: int = 0) -> tuple[PhaseResult, outer.Tensors, float] | None:
        """An inner phase from `start`: (phase, Δ = start − θ_inner, |Δ|), or None if it was abandoned.
        `lead`: how many rounds past this peer's state the phase trains for (1 when overlapped)."""
        if self._speed_aware:
            # The lr schedule follows the swarm's rounds: a fast peer that ran more than H steps in
            # a round, or a slow one that ran fewer, is back on the schedule at the next.
            self.trainer.step = (self.state.round + lead) * self.config.inner.steps
        self.log.round = self.state.round + lead
        self._load(start)
        phase = self._inner_phase(stop, lead)
        if phase.stopped:
            return None
        delta = outer.pseudo_gradient(start, dict(self.model.named_parameters()))
        return phase, delta, outer.check_pseudo_gradient(delta, phase.lr_sum, self.config.inner.weight_decay)

    def _abandon(self, stop: threading.Event) -> bool:
        """An inner phase ended early: Ctrl+C (False), or the swarm finished the round without us."""
        if stop.is_set():  # an all-reduce still in flight ends when the peer leaves the swarm
            return False
        if self._pending is not None:  # the swarm moved on: its all-reduce is moot; let it end
            try:
                self._pending.join()
            except Exception as e:  # whatever it ended with, its result is not used
                self.log.debug("abandoned all-reduce: %s", e)
            self._pending = None
        self.log.warning("the swarm finished round %d without this peer (it is at round %s): abandoning the "
                         "inner phase to catch up", self.state.round, self.swarm.swarm_round())
        self._load_theta()
        return True

    def _start_point(self) -> outer.Tensors:
        """Where the phase after an in-flight all-reduce starts: θ(r) itself (delayed), or θ(r)
        moved by the outer step of an estimate of the round's average (eager)."""
        if self._overlap == "delayed":
            return self.state.params
        previous = self._previous or (None, None, 1.0)
        estimate = outer.eager_estimate(self._pending.delta, *previous)
        oc = self.config.outer
        return outer.outer_step(self.state, estimate, oc.lr, oc.momentum, oc.nesterov).params

    def _launch(self, phase: PhaseResult, delta: outer.Tensors, delta_norm: float) -> None:
        """Start averaging this round's Δ in the background."""
        expected = self._expected_group()
        self._pending = Background(lambda: self._average(delta, phase.tokens, expected), phase, delta, delta_norm)

    def _commit(self, phase: PhaseResult, delta_norm: float, averaged: outer.Tensors, group: tuple[str, ...],
                comm: dict[str, Any], started: float, defer: bool = False) -> None:
        """θ(r+1) from the round's average: outer step, agreement, metrics, checkpoint.

        `defer` (overlapped rounds): publish the digest and collect the others' in the background
        while the next phase trains; `_settle_agreement` acts on them before the next outer step.
        The next phase need not wait for the round's slowest peer to publish.
        """
        # Who should agree on the round's result: the group, and every live peer that was at this round.
        r = self.state.round
        peers = set(group) | (self.swarm.peers_at(r, r + 1) if self.swarm is not None else set())
        oc = self.config.outer
        self.state = outer.outer_step(self.state, averaged, oc.lr, oc.momentum, oc.nesterov)
        self._load_theta()
        if self.swarm is not None and defer:
            mine = self.state.digest()
            self.swarm.publish_round(self.state.round, mine, phase.tokens, phase.mean_loss)
            collecting = Background(lambda: self._majority(self.state.round, peers, mine))
        elif self.swarm is not None:
            self._agree(peers, phase)
        self.totals.tokens += phase.tokens
        self.totals.inner_steps += phase.steps
        self.totals.compute_s += phase.compute_s
        record = {**self._round_record(phase, delta_norm), "group_size": len(group), **comm}
        if self._speed_aware:
            record["swarm_peers"] = self._round_view.peers if self._round_view else 1
        record["wall_s"] = time.perf_counter() - started
        self.metrics.append(record)
        if defer:
            self._unsettled = (self.state.round, collecting, phase, record)
        self._save()
        self.log.round = self.state.round
        self._log_round(record)

    # --- the swarm's part of a round ----------------------------------------------------------

    def _expected_group(self) -> int:
        """The group to expect: every peer training this round, or finishing the one before (a peer
        that died lingers in the records for a while; then the matchmaking window runs out instead)."""
        if self.swarm is None:
            return 1
        r = self.state.round
        return max(self._round_view.peers if self._round_view is not None else 0, len(self.swarm.peers_at(r - 1, r)))

    def _average(self, delta: outer.Tensors, tokens: int,
                 expected: int) -> tuple[outer.Tensors, tuple[str, ...], dict[str, Any]]:
        """The round's average pseudo-gradient, the group it came from, and what it cost.

        Alone (no swarm, or nobody else reached this round in time) the average is this peer's own Δ.
        A failed all-reduce applies nothing of it (I2): this peer then uses its own Δ, and the
        digest check after the outer step brings it back to the group's state if they differ.
        """
        dropped = outer.is_dropped(self.config.outer.drop_rate, self.config.run.seed, self.peer_id, self.state.round)
        if dropped:  # the paper's dropped pseudo-gradient: this peer's Δ counts for nothing this round
            self.log.info("round %d: this peer's pseudo-gradient is dropped (outer.drop_rate %g)",
                          self.state.round, self.config.outer.drop_rate)
        own = {name: torch.zeros_like(t) for name, t in delta.items()} if dropped else delta
        alone = (own, (self.peer_id,), {"allreduce_s": 0.0, "bytes_sent": 0, "bytes_received": 0, "dropped": dropped})
        if self.swarm is None:
            return alone
        lossy, exact = outer.split_exact(delta)
        result = self._average_with_retries(outer.flatten(lossy), outer.flatten(exact) if exact else None,
                                            0 if dropped else tokens, expected)
        if (result is None or result is False) and self.swarm.wait_for_round(self.state.round + 1, 0.0):
            # Averaging alone now would only make a state nobody else holds: catch up instead.
            self.log.info("the swarm is already past round %d: catching up instead of averaging alone", self.state.round)
            raise RoundOvertaken()
        if result is False:
            return alone
        if result is None:
            self.log.info("no other peer reached round %d within the matchmaking window: averaging alone", self.state.round)
            return alone
        comm = {"allreduce_s": result.allreduce_s, "bytes_sent": result.bytes_sent, "bytes_received": result.bytes_received,
                "link_mbit_s": round(result.link_bps * 8e-6, 2) if result.link_bps else None, "dropped": dropped}
        averaged = {**outer.unflatten(result.delta, lossy), **(outer.unflatten(result.exact, exact) if exact else {})}
        return {name: averaged[name] for name in delta}, result.group, comm

    def _average_with_retries(self, flat_delta: torch.Tensor, flat_exact: torch.Tensor | None, tokens: int,
                              expected_group: int) -> Any:
        """The swarm's average, None if nobody else came, False if every attempt failed.

        A failed all-reduce applied nothing and left `flat_delta` as it was (I2), so the survivors,
        who all saw the failure, match again for the same round and retry with the same Δ.
        """
        attempts = 1 + self.config.swarm.averaging_retries
        for attempt in range(1, attempts + 1):
            try:
                return self.swarm.average(flat_delta, tokens, self.state.round, retry=attempt > 1,
                                          expected_group=expected_group if attempt == 1 else 0, exact=flat_exact)
            except AveragingError as e:
                # A member whose all-reduce completed publishes the round's result within moments
                # (a reducer may answer one member and fail before the next): adopt it rather than
                # retry, so that both end the round with the same state.
                if self.swarm.wait_for_round(self.state.round + 1, self.config.swarm.matchmaking_time_s / 2):
                    self.log.warning("%s; peers already finished round %d: adopting their result", e, self.state.round)
                    raise RoundOvertaken() from None
                more = "retrying among the survivors" if attempt < attempts else "using this peer's own pseudo-gradient"
                self.log.warning("%s (attempt %d of %d); %s", e, attempt, attempts, more)
        return False

    def _settle_agreement(self) -> None:
        """The deferred agreement of the last committed round (overlapped rounds), before the next
        outer step is applied to it: if the majority holds another state, adopt it now, so the
        next update lands on the same θ everywhere. Its record and checkpoint are rewritten."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is None or unsettled[0] != self.state.round:  # the peer caught up meanwhile
            return
        _, collecting, phase, record = unsettled
        majority, holders = collecting.join()
        if majority != self.state.digest() and self._adopt_majority(majority, holders, phase):
            self.metrics.append({**record, "digest": self.state.digest(), "adopted": True})
            self._save()

    def _agree(self, peers: set[str], phase: PhaseResult) -> bool:
        """Publish this round's digest; if the majority of `peers` holds another, reload the majority's state.

        `peers` are the round's group and every peer seen at this round: a peer that missed the
        group (it averaged alone) thus rejoins the majority's state in the same round. Waiting is
        bounded by swarm.agreement_timeout_s (I3); a peer that died is simply not counted.
        Returns whether this peer adopted the majority's state.
        """
        mine = self.state.digest()
        self.swarm.publish_round(self.state.round, mine, phase.tokens, phase.mean_loss)
        majority, holders = self._majority(self.state.round, peers, mine)
        return majority != mine and self._adopt_majority(majority, holders, phase)

    def _majority(self, round_: int, peers: set[str], mine: str) -> tuple[str, list[str]]:
        """(majority digest, peers serving it) of round `round_` among `peers` and this peer, waiting
        for their digests at most swarm.agreement_timeout_s. Reads the swarm only: any thread."""
        if peers <= {self.peer_id}:
            return mine, [self.peer_id]
        expected = tuple(sorted(peers | {self.peer_id}))
        digests = self.swarm.wait_for_digests(round_, expected)
        digests[self.peer_id] = mine  # our own record may not be readable yet: we know our digest
        missing = [p[-4:] for p in expected if p not in digests]
        if missing:
            self.log.info("agreement: %d of %d peers published round %d within %g s (missing %s)", len(digests),
                          len(expected), round_, self.config.swarm.agreement_timeout_s, ", ".join(missing))
        return self.swarm.majority(digests)

    def _adopt_majority(self, majority: str, holders: list[str], phase: PhaseResult) -> bool:
        self.log.warning("digest %s differs from the group's majority %s: reloading its state",
                         self.state.digest()[:12], majority[:12])
        if not self._try_adopt(self.state.round, majority, holders):
            return False
        self.swarm.publish_round(self.state.round, self.state.digest(), phase.tokens, phase.mean_loss)
        return True

    def _catch_up(self) -> bool:
        """If the swarm is at a later round (or the same round with another majority digest), download its state."""
        latest = self.swarm.latest()
        if latest is None:
            return False
        round_, digest, holders = latest
        if round_ == self.state.round and digest == self.state.digest():
            return False
        # A client-mode peer follows the reachable peers even when it ran ahead of them alone.
        if round_ < self.state.round and not self.config.swarm.client_mode:
            return False
        if not self._try_adopt(round_, digest, holders):
            self._failed_catch_up = max(self._failed_catch_up, round_)
            return False
        # The inner lr schedule follows the swarm's round, not this peer's own step count.
        self.trainer.step = max(self.trainer.step, round_ * self.config.inner.steps)
        self.log.info("caught up with the swarm at round %d (digest %s)", round_, digest[:12])
        return True

    def _try_adopt(self, round_: int, digest: str, holders: list[str]) -> bool:
        """Download and adopt a verified state; on failure keep this peer's own and say so.

        The holders may all be gone (their records outlive them for a while): the peer then
        carries on with its own state, and the next round's catch-up or agreement tries again.
        """
        try:
            self._adopt(round_, digest, holders)
            return True
        except StateDownloadError as e:
            self.log.warning("%s; keeping this peer's own state (round %d)", e, self.state.round)
            return False

    def _adopt(self, round_: int, digest: str, holders: list[str]) -> None:
        _, (theta, momentum) = self.swarm.download_state(round_, digest, holders, self._verify_state)
        like = self.state.params
        self.state = outer.GlobalState(round_, outer.unflatten(theta, like), outer.unflatten(momentum, like))
        self._load_theta()
        self.log.round = round_

    def _verify_state(self, metadata: dict, tensors: list[torch.Tensor]) -> str:
        """The digest of a downloaded state, or "malformed" if it does not even have this model's shape."""
        try:
            theta, momentum = tensors
            like = self.state.params
            return outer.digest(int(metadata["round"]), outer.unflatten(theta.float(), like), outer.unflatten(momentum.float(), like))
        except (ValueError, KeyError, TypeError):
            return "malformed"

    def _serve_state(self) -> tuple[dict, list[torch.Tensor]]:
        """(round, digest) and [θ, momentum] for a peer that downloads our state; runs in a background thread.
        GlobalState is immutable and replaced whole, so one read of self.state is a consistent snapshot."""
        state = self.state
        return {"round": state.round, "digest": state.digest()}, [outer.flatten(state.params), outer.flatten(state.momentum)]

    def _inner_phase(self, stop: threading.Event, lead: int = 0) -> PhaseResult:
        """H inner steps; in a speed-aware swarm, until the swarm's tokens reach the round's budget.

        A speed-aware peer reports its progress and ends the phase when the live peers together
        trained H x batch tokens each (rounds.py). It abandons the phase if the swarm published a
        round past the one this phase trains for (state's round + `lead`) meanwhile: this peer was
        stopped or asleep while the others went on.
        """
        steps, round_ = self.config.inner.steps, self.state.round + lead
        tokens_per_peer = steps * self.config.inner.batch_size * self.config.model.seq_len
        speed_aware = self._speed_aware
        self._round_view = None
        self.progress.start(round_, steps)
        started = time.perf_counter()
        if speed_aware:
            self.swarm.report_progress(round_, 0, self._tokens_per_s)

        def on_step(step: int, loss: float, tokens: int) -> None:
            self.log.step, self.log.steps = step, steps
            self.progress.update(loss, tokens / max(time.perf_counter() - started, 1e-9))
            if step % max(steps // 4, 1) == 0:
                self.log.debug("loss %.4f", loss)

        def should_stop() -> bool:
            if stop.is_set():
                return True
            if not speed_aware:
                return False
            ahead = self.swarm.swarm_round()
            return ahead is not None and ahead > round_ and ahead > self._failed_catch_up

        def should_end(done: int, tokens: int) -> bool:
            self.swarm.report_progress(round_, tokens, tokens / max(time.perf_counter() - started, 1e-9))
            self._round_view = self.swarm.round_progress(round_, tokens, tokens_per_peer)
            return self._round_view.done

        try:
            if not speed_aware:
                return self.trainer.run_phase(self._next_batch, steps, stop.is_set, on_step)
            phase = self.trainer.run_phase(self._next_batch, steps * MAX_ROUND_SHARE, should_stop, on_step, should_end)
            if phase.steps:
                self._tokens_per_s = phase.tokens / max(phase.compute_s, 1e-9)
            # The phase is over: report the final tokens at rate 0, so nobody extrapolates more.
            self.swarm.report_progress(round_, phase.tokens, 0.0)
            return phase
        finally:
            self.log.step = None
            self.progress.close()

    def _next_batch(self) -> torch.Tensor:
        return self.stream.next_batch(self.config.inner.batch_size)

    def _load_theta(self) -> None:
        """Copy θ(r) into the inner model: the start of an inner phase, and what is evaluated."""
        self._load(self.state.params)

    def _load(self, params: outer.Tensors) -> None:
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(params[name])

    def _round_record(self, phase: PhaseResult, delta_norm: float) -> dict[str, Any]:
        record: dict[str, Any] = {
            "round": self.state.round,
            "inner_steps": phase.steps,
            "tokens": phase.tokens,
            "total_tokens": self.totals.tokens,
            "train_loss": phase.mean_loss,
            "lr": lr_at(self.trainer.step - 1, self.config.inner, self.total_steps),
            "pseudo_grad_norm": delta_norm,
            "digest": self.state.digest(),
            "compute_s": phase.compute_s,
            "tokens_per_s": phase.tokens / max(phase.compute_s, 1e-9),
        }
        every = self.config.run.eval_every_rounds
        if self.heldout is not None and (self.state.round % every == 0 or self.state.round == self.config.run.rounds):
            record.update(self._eval_record())
        return record

    def _eval_record(self) -> dict[str, float]:
        loss = self.trainer.evaluate(self.heldout)
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def _log_round(self, record: dict[str, Any]) -> None:
        evaluated = f", held-out loss {record['eval_loss']:.4f}" if "eval_loss" in record else ""
        self.log.info(
            "round done: train loss %.4f%s, %s tokens at %s tok/s, |delta| %.3g, digest %s",
            record["train_loss"], evaluated, f"{record['tokens']:,}", f"{record['tokens_per_s']:,.0f}",
            record["pseudo_grad_norm"], record["digest"][:12],
        )

    def _save(self) -> None:
        payload = {
            "round": self.state.round,
            "params": self.state.params,
            "momentum": self.state.momentum,
            "digest": self.state.digest(),
            "shared_config": self.config.shared_dict(),
            "config": self.config.to_dict(),
            "fingerprint": self.config.fingerprint(),
            "peer_id": self.peer_id,
            "trainer": self.trainer.state_dict(),
            "data": self.stream.state_dict(),
            "totals": vars(self.totals).copy(),
            "rng": {"torch": torch.get_rng_state()},
        }
        checkpoint.save(self.run_dir, payload, self.config.checkpoint.keep)

    def close(self) -> None:
        """Leave the swarm and release the run dir; safe to call on a half-built peer."""
        self.progress.close()
        if self.swarm is not None:
            self.swarm.close()
            self.swarm = None
        self._lock.close()

