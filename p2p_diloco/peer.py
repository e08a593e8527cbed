"""One peer's life: set-up, rounds until the run ends, checkpoints, and a clean exit.

Alone (no initial peers) the peer's swarm is `Solo`, a swarm of one: the average of one
pseudo-gradient is itself, which is DiLoCo with k = 1. With initial peers it is the real swarm;
nothing else in a round changes. The peer builds the parts and runs the loop: its replica of the
run (round/replica.py), the round (round/driver.py), agreement and catch-up (round/sync.py), and the joining
checks (round/joining.py), each handed the replica, the swarm and the config, never the peer.
"""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from transformers import PretrainedConfig

from p2p_diloco import config as config_mod
from p2p_diloco import faults
from p2p_diloco.config import Config
from p2p_diloco.errors import ConfigError
from p2p_diloco.protocol import deadlines, outer
from p2p_diloco.protocol.agreement import still_finishing
from p2p_diloco.protocol.network import COPIED, ServedState, Solo, Swarm
from p2p_diloco.round import joining
from p2p_diloco.round.driver import RoundDriver, RoundEnd
from p2p_diloco.round.replica import Display, Replica
from p2p_diloco.round.sync import StateSync
from p2p_diloco.train import checkpoint, data, ranks, sinks
from p2p_diloco.train import model as model_mod
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.metrics import MetricsLog, PeerLogger, Phase, ProgressBar
from p2p_diloco.train.prefetch import Prefetcher

logger = logging.getLogger(__name__)


def resolve_device(spec: str, model_config: PretrainedConfig) -> torch.device:
    """run.device as a torch device, or ConfigError naming the fix if this machine cannot train on it."""
    cuda = torch.cuda.is_available()
    if spec == "auto":
        parameters = 0 if cuda else model_mod.parameter_count(model_config)
        return torch.device(auto_device(cuda, parameters, torch.__version__))
    device = torch.device(spec)
    if device.type == "cuda" and not cuda:
        raise ConfigError(
            f"run.device = {spec} but torch {torch.__version__} sees no GPU; install a CUDA build of torch "
            f"(README: GPU peers) or set --run.device=cpu"
        )
    return device


def auto_device(cuda: bool, parameters: int, torch_version: str) -> str:
    """What run.device = auto means: the GPU if there is one, else the CPU, but only for a model that
    a CPU trains in useful time. A GPU-sized model would run on for days without saying why it is slow;
    an explicit run.device = cpu still trains it."""
    if cuda:
        return "cuda"
    if parameters >= model_mod.GPU_SIZED_PARAMETERS:
        raise ConfigError(
            f"run.device = auto but torch {torch_version} sees no GPU, and the model's {parameters:,} parameters "
            f"are GPU-sized ({model_mod.GPU_SIZED_PARAMETERS:,} or more: the 150m preset and up); install a CUDA "
            f"build of torch (README: GPU peers), or pass --run.device=cpu to train on the CPU anyway (slow)"
        )
    return "cpu"


def claim_run_dir(run_dir: Path, resume: bool) -> IO[str]:
    """Create the run dir and hold a lock on it: two peers writing one run dir would corrupt it."""
    existing = checkpoint.latest(run_dir)
    if existing is not None and not resume:
        raise ConfigError(
            f"run dir {run_dir} already holds checkpoints (latest {existing.name}); pass --resume to "
            f"continue that run or choose another --run.dir"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = open(run_dir / ".lock", "a+")
    except OSError as e:  # its parent is a file, a read-only disk, no permission, a full disk
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"run dir {run_dir} cannot be used ({reason}); choose another --run.dir") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ConfigError(f"another peer is running in {run_dir}; stop it or choose another --run.dir") from None
    return lock


def join_swarm(config: Config, run_dir: Path, state: outer.GlobalState, serve: Callable[[], ServedState]) -> Swarm:
    """The real swarm if the config names initial peers, else `Solo`."""
    if not config.swarm.initial_peers:
        return Solo(run_dir)
    from p2p_diloco.swarm import HivemindSwarm  # imports hivemind: only peers that join a swarm pay for it

    lossy, exact = outer.split_exact(state.params)
    return HivemindSwarm(
        config,
        run_dir,
        sum(t.numel() for t in lossy.values()),
        serve,
        exact_numel=sum(t.numel() for t in exact.values()),
    )


JoinSwarm = Callable[[Config, Path, outer.GlobalState, Callable[[], ServedState]], Swarm]


class Peer:
    """Builds everything a peer needs from a Config, then runs rounds until the run ends or `stop` is set."""

    swarm: Swarm

    def __init__(self, config: Config, resume: bool = False, join: JoinSwarm = join_swarm):
        """`join` makes the peer's swarm (tests pass a fake one)."""
        self.config = config
        self._join = join
        self.run_dir = Path(config.run.dir)
        # Everything that can fail on bad input is built before the run dir is touched: an error
        # leaves nothing behind and overwrites nothing.
        self.tokenizer = model_mod.load_tokenizer(config.model.tokenizer)
        self.model_config = model_mod.model_config(config.model, self.tokenizer.vocab_size)
        self.corpus = data.open_corpus(config.data)
        device = resolve_device(config.run.device, self.model_config)
        count = torch.cuda.device_count() if device.type == "cuda" else 0
        self.devices = ranks.rank_devices(device, config.run.nproc, count)  # run.nproc: one per rank
        self.device = self.devices[0]
        if config.swarm.initial_peers:
            from p2p_diloco.swarm.transport.node import parse_initial_peers  # imports hivemind: swarm peers only

            parse_initial_peers(config.swarm.initial_peers)
            parse_initial_peers(config.swarm.relays, "relay")
        sinks.require_packages(config.log)
        self._lock = claim_run_dir(self.run_dir, resume)
        self.progress = ProgressBar(False, "")
        self.phase = Phase()  # what it does now (its /metrics): set by round/driver.py and round/sync.py
        self.sinks = sinks.Sinks([])
        self.ranks: ranks.Alone | ranks.Leader = ranks.Alone()
        self._swarm: Swarm | None = None
        self._prefetcher: Prefetcher | None = None
        self._metrics_server: Any = None
        try:
            self._build(resume)
        except BaseException:
            self.close()
            raise

    def _build(self, resume: bool) -> None:
        config = self.config
        self.ranks = ranks.start(config, self.devices)  # the other ranks build while this one joins
        self.model = model_mod.init_model(self.model_config, config.run.seed).to(self.device)
        state = outer.initial_state(dict(self.model.named_parameters()))
        self.theta0 = state.digest()  # the run's genesis names it (protocol/genesis.py)
        self._served: Callable[[], outer.GlobalState] = lambda: state  # until the replica is built
        self.swarm = self._swarm = self._join(config, self.run_dir, state, self.serve_state)
        self.peer_id = self.swarm.peer_id
        self.log = PeerLogger(logger, self.peer_id[-4:])
        total_steps = config.run.rounds * config.inner.steps
        self.trainer = InnerTrainer(self.model, config.inner, total_steps, self.device, self.ranks.meet())
        d = config.data
        shard = d.shard if d.shard >= 0 else data.pick_shard(self.peer_id, config.run.seed, d.num_shards)
        stream = data.shard_stream(self.corpus, self.tokenizer, d, config.model.seq_len, config.run.seed, shard)
        # Batches made ahead by a thread; its state (what a checkpoint saves) is the last batch trained on.
        pin = self.device.type == "cuda"
        self.stream = self._prefetcher = Prefetcher(stream, config.inner.batch_size, pin_memory=pin)
        heldout = None
        if config.run.eval_every_rounds > 0:
            heldout = data.heldout_batch(
                self.corpus, self.tokenizer, config.model.seq_len, config.run.eval_sequences, d.heldout_fraction
            )
        self.sinks = sinks.open_sinks(config, self.run_dir, self.peer_id)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl", self.sinks)
        self._serve_metrics()
        self.progress = ProgressBar(config.log.progress, self.peer_id[-4:])
        display = Display(self.log, self.phase, self.progress)
        self.replica = Replica(
            state, self.trainer, self.stream, self.ranks, self.metrics, config, self.peer_id, display, heldout
        )
        self._served = lambda: self.replica.served
        self.sync = StateSync(self.replica, self.swarm, config.swarm, config.outer)
        self.rounds = RoundDriver(self.replica, self.swarm, self.sync, config)
        self._start(resume, shard)
        config_mod.save(config, self.run_dir / "config.toml", checkpoint.resume_line(self.run_dir))

    @property
    def state(self) -> outer.GlobalState:
        """This peer's global state θ(r) (its replica's)."""
        return self.replica.state

    # --- start -------------------------------------------------------------------------------

    def _start(self, resume: bool, shard: int) -> None:
        params = model_mod.count_parameters(self.model)
        self.log.info(
            "%s: %s parameters, %s, device %s, shard %d of %d, config %s",
            self.config.run.run_id,
            f"{params:,}",
            self.corpus.description,
            self.device,
            shard,
            self.config.data.num_shards,
            self.config.fingerprint(),
        )
        path = checkpoint.latest(self.run_dir) if resume else None
        payload = checkpoint.load(path, self.config.shared_dict()) if path is not None else None
        self.ranks.set_up(shard, path)  # a checkpoint is checked before the other ranks load it too
        if payload is not None:
            self.replica.restore(payload)
            self.log.info("resumed from %s (digest %s)", path, self.state.digest())
        elif resume:
            self.log.info("no checkpoint in %s: starting at round 0", checkpoint.checkpoint_dir(self.run_dir))
        faults.reached(faults.FaultPoint.START)
        self.verdict = self.swarm.check_config(self.theta0)
        if self.verdict.kind != "join":  # nobody is live to download its end from
            joining.refuse_a_finished_run(self.replica, self.state, self.swarm, self.config.run.run_id)
        self._look_at_the_swarm(fresh=path is None)
        joining.say_whom_it_joined(self.replica, self.swarm, self.verdict, self.theta0, self.config.run.run_id)

    def _look_at_the_swarm(self, fresh: bool) -> None:
        """Announce this peer, and beat while settling and downloading: peers that finished the run
        linger for a live peer without their final state, and reachable peers wait for a client at
        matchmaking. Then catch up with the swarm, or record the state this peer starts from
        (`fresh`: θ(0), no checkpoint)."""
        replica, swarm = self.replica, self.swarm
        swarm.publish_round(self.state.round, self.state.digest(), 0, float("nan"))
        if not swarm.serves:
            swarm.wait_for_reachable_peer()
        faults.reached(faults.FaultPoint.LOOK)
        caught_up = self.sync.catch_up(starting=True)
        if caught_up is None:
            self.rounds.refuse_a_finished_run(self.state)  # the run may have ended meanwhile
        if fresh:
            self.metrics.truncate_after(-1)
        if caught_up is not None:
            replica.adopt(caught_up, replica.start_record(caught_up))
            swarm.publish_round(caught_up.round, caught_up.digest(), 0, float("nan"), COPIED)
        elif fresh:
            replica.commit(self.state, replica.start_record(self.state))

    def _serve_metrics(self) -> None:
        """log.metrics_port: this peer's Prometheus /metrics (its latest round record)."""
        if self.config.log.metrics_port == 0:
            return
        from p2p_diloco.observe.web import serve_peer_metrics

        self._metrics_server = serve_peer_metrics(self.config, self.peer_id, lambda: self.metrics.latest, self.phase)
        self.log.info("Prometheus metrics of this peer: %smetrics", self._metrics_server.url)

    # --- rounds ------------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Run rounds until config.run.rounds are done or `stop` is set (e.g. by Ctrl+C).

        A round interrupted by `stop` is discarded: the peer's state stays at the last round
        boundary, which is already checkpointed, so a resume repeats that round exactly. A failure
        that comes from one of the peer's other processes dying is said as that (`RankLost`).
        """
        try:
            self._run(stop or threading.Event())
        except Exception as e:
            self.ranks.raise_if_lost(e, self.state.round)
            raise

    def _run(self, stop: threading.Event) -> None:
        while self.state.round < self.config.run.rounds:
            if stop.is_set() or self.rounds.run_round(stop) is RoundEnd.STOPPED:
                self.phase.set("idle")
                self.log.info(
                    "stopped: the partial round was discarded; the checkpoint of round %d is on disk, "
                    "continue with --resume",
                    self.state.round,
                )
                return
        self.phase.set("idle")
        self.log.info("run complete: %d rounds, digest %s", self.state.round, self.state.digest())
        self.log.info("export the model: p2p-diloco export %s <folder>", self.run_dir)
        self.swarm.publish_final(self.state.round, self.state.digest())
        self._linger(stop)

    def _linger(self, stop: threading.Event) -> None:
        """Stay after the last round so that late peers and `export --initial-peers` can download the
        final state: at least swarm.linger_s, and then while a live peer still lacks our final digest
        (one finishing the last round, or starting up), up to agreement_timeout_s + one state
        download's deadline after the end; Ctrl+C leaves at once. A peer of no swarm has nobody to serve."""
        swarm = self.config.swarm
        if self.swarm.solo:
            return
        final, mine, now = self.state.round, self.state.digest(), time.monotonic()
        floor = now + swarm.linger_s
        deadline = now + max(swarm.linger_s, swarm.agreement_timeout_s + self.sync.download_s())
        if swarm.linger_s > 0:
            self.log.info(
                "serving the final state for %g s (swarm.linger_s) for late peers and exports; Ctrl+C leaves now",
                swarm.linger_s,
            )

        def finishing() -> bool:
            return bool(still_finishing(self.swarm.peers(), self.swarm.stale_peers(), final, mine))

        waiting = deadlines.poll_until(
            lambda: time.monotonic() < floor or finishing(), lambda w: not w, deadline, 0.5, stop
        )
        if waiting and not stop.is_set() and finishing():
            self.log.info("left with peers still finishing the last round: they keep their own state")

    def serve_state(self) -> ServedState:
        """(round, digest) and [θ, momentum] for a peer that downloads our state; runs in a background thread.
        GlobalState is immutable and replaced whole, so one read of it is a consistent snapshot."""
        faults.reached(faults.FaultPoint.SERVE)
        state = self._served()
        return {"round": state.round, "digest": state.digest()}, [
            outer.flatten(state.params),
            outer.flatten(state.momentum),
        ]

    def close(self) -> None:
        """Leave the swarm and release the run dir; safe to call on a half-built peer."""
        self.progress.close()
        self.sinks.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        self.ranks.close()
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        if self._swarm is not None:
            self._swarm.close()
            self._swarm = None
        self._lock.close()
