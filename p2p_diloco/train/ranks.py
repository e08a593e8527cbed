"""A peer on several GPUs: `run.nproc` processes (ranks) train each inner phase together with DDP,
and are still one member of the swarm.

    p2p-diloco peer --nproc 2 --config run.toml        (rank r trains on cuda:r)

The command's own process is rank 0, the peer: it speaks to the swarm, averages, applies the outer
step, evaluates and checkpoints, as a peer of one process does. It starts ranks 1..N-1 (followers,
`follow`) and tells them, over a gloo group of their own:

- at start: DDP's copy of θ(0) to every rank; then the shard the peer reads and the checkpoint it
  resumed from, if any (each follower loads the same one);
- before each inner phase: at most how many steps, the schedule's step, and θ to start from;
- before each inner step: go on, end (the swarm's round is done) or stop (Ctrl+C, or the swarm went
  on without this peer), so a speed-aware round never leaves a rank waiting in an all-reduce;
- after each phase: every rank's mean loss and a checksum of its parameters, which must be equal;
- at the end: exit.

Every rank takes the peer's whole batch from its own copy of the peer's data stream and trains rows
[r·B/N, (r+1)·B/N) of it; DDP averages the gradients. So N ranks train exactly what one process
trains with inner.micro_batch_size = B/N (tests/e2e/test_ranks.py: the same digests, bit for bit),
the stream's position is the same on every rank, and rank 0's checkpoint holds the whole peer: a
resumed peer of N ranks goes on bit-exactly. The price: every rank tokenises the whole batch.

Only rank 0 handles Ctrl+C (followers ignore SIGINT and wait for its word). A follower whose rank 0
died exits within a second; rank 0 logs a follower's death at once, and its next collective fails
(gloo: at once; NCCL: after STEP_TIMEOUT).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from p2p_diloco.config import Config
from p2p_diloco.errors import ConfigError, RankLost
from p2p_diloco.train.inner import ONE, RankGroup, copy_params

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # a follower imports torch, builds the model and reports ready within this
STEP_TIMEOUT = timedelta(minutes=30)  # one collective of training: DDP's all-reduce, θ's copy
# Followers wait this long for rank 0's next word: it may average, catch up or linger for long.
COMMAND_TIMEOUT = timedelta(days=7)
EXIT_TIMEOUT_S = 30.0  # followers told to exit end within this, or are terminated
LOST_WAIT_S = 5.0  # after a failed collective: how long a follower may take to be seen dead
PARENT_POLL_S = 1.0


class RanksDiverged(RuntimeError):
    """The ranks of one peer hold different parameters after an inner phase: a bug, never expected."""


def rank_devices(device: torch.device, nproc: int, cuda_count: int) -> list[torch.device]:
    """The device of each rank: `device` (the peer's, resolved from run.device) for one process;
    cuda:r for rank r of several on CUDA; the CPU for all of them on the CPU."""
    if nproc == 1:
        return [device]
    if device.type == "cpu":
        return [device] * nproc
    if cuda_count < nproc:
        fix = f"pass --nproc {cuda_count}" if cuda_count else "install a CUDA build of torch, or pass --run.device=cpu"
        raise ConfigError(
            f"run.nproc = {nproc} trains on {nproc} GPUs (rank r on cuda:r), but torch sees {cuda_count}; {fix}"
        )
    return [torch.device("cuda", r) for r in range(nproc)]


def ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` in DDP (the default process group) on `device`."""
    ids = [device.index] if device.type == "cuda" else None
    # Buffers (rotary frequencies) are the same on every rank: no need to copy them every step.
    with warnings.catch_warnings():  # newer torch renames the option; the old name still works
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum(model: torch.nn.Module) -> list[int]:
    """Two sums over the bits of every parameter, as integers (the bits, and the product of their
    high and low halves; neither overflows below 2^30 parameters): equal on ranks that hold the same
    bits, unequal with near certainty otherwise.
    Integer sums do not depend on the order of addition; float sums do, and a rank with fewer
    threads sums in another order (seen: two equal models 1 ulp apart in a float64 sum)."""
    with torch.no_grad():
        total, mixed = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        for p in model.parameters():
            bits = p.detach().contiguous().view(BITS[p.element_size()]).to(torch.int64)
            total += bits.sum().cpu()
            mixed += ((bits >> 16) * (bits & 0xFFFF)).sum().cpu()
        return [int(total), int(mixed)]


class Ranks:
    """The peer's processes, as rank `rank` sees them: the `RankGroup` its trainer uses, and the words
    rank 0 sends the followers. Collectives of training go over the default group (NCCL on CUDA,
    gloo on the CPU), words over a gloo group."""

    def __init__(self, rank: int, world: int, device: torch.device, rendezvous: Path, sharded: bool = False):
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        init = f"file://{rendezvous}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=STEP_TIMEOUT)
        self.words = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
        self.rank, self.world, self.device, self.sharded = rank, world, device, sharded
        self.idle = False  # rank 0: the followers wait for its next word (set up, and between phases)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.sharded:
            return ddp(model, self.device)
        from p2p_diloco.train import fsdp  # 2 s to import: only a sharded peer pays for it

        return fsdp.shard(model)

    def agree(self, code: int) -> int:
        word = torch.tensor([code], dtype=torch.int64)
        dist.broadcast(word, 0, group=self.words)
        return int(word)

    def finish(self, loss: float, model: torch.nn.Module) -> float:
        # Replicated ranks must hold the same bits; sharded ones hold different rows.
        sums = self._every(torch.tensor([0, 0] if self.sharded else checksum(model), dtype=torch.int64))
        losses = self._every(torch.tensor([loss], dtype=torch.float64))
        if len({tuple(t.tolist()) for t in sums}) > 1:
            raise RanksDiverged(
                f"the ranks of this peer hold different parameters after the inner phase: {[t.tolist() for t in sums]}"
            )
        self.idle = True
        return float(torch.stack(losses).mean())

    def _every(self, mine: torch.Tensor) -> list[torch.Tensor]:
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.words)
        return every

    def send(self, word: dict[str, Any]) -> None:
        dist.broadcast_object_list([word], 0, group=self.words)

    def receive(self) -> dict[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, 0, group=self.words)
        return box[0]

    def load(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
        if not self.sharded:
            return copy_params(model, params)
        from p2p_diloco.train import fsdp

        fsdp.load_params(model, params)

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        if not self.sharded:
            return dict(model.named_parameters())
        from p2p_diloco.train import fsdp

        return fsdp.gather(model, keep=self.rank == 0)  # the others take part and keep nothing

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not self.sharded:
            return optimizer.state_dict()
        from p2p_diloco.train import fsdp

        return fsdp.optimizer_state(model, optimizer)

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        if not self.sharded:
            return optimizer.load_state_dict(state)
        from p2p_diloco.train import fsdp

        fsdp.load_optimizer_state(model, optimizer, state)

    def share(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor] | None = None) -> None:
        """Rank 0's `params` (θ, whole, on the CPU) into every rank's model; others pass None. One
        parameter at a time: a sharded model never holds all of θ whole on the device."""
        if self.sharded:
            from p2p_diloco.train import fsdp

            fsdp.resharded(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if params is None:
                    t = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                else:
                    t = params[name].to(self.device, p.dtype)
                dist.broadcast(t, 0)
                if self.sharded:
                    fsdp.load_param(p, t)
                else:
                    p.copy_(t)

    def close(self) -> None:
        if not dist.is_initialized():
            return
        try:
            dist.destroy_process_group()
        except Exception as e:  # a group whose member died may fail to end; the process ends anyway
            logger.warning("could not end this peer's process group cleanly: %s", e)


class Alone:
    """A peer of one process: nothing to tell anyone."""

    def meet(self) -> RankGroup:
        return ONE

    def set_up(self, shard: int, restored: Path | None) -> None:
        pass

    def phase(self, model: torch.nn.Module, start: Mapping[str, torch.Tensor], steps: int, step: int) -> None:
        pass

    def evaluating(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
        pass

    def saving(self) -> None:
        pass

    def raise_if_lost(self, error: Exception, round_: int) -> None:
        pass

    def close(self) -> None:
        pass


class Leader:
    """Rank 0 of a peer of several processes: starts the followers, tells them what to do, ends them.

    Made before the peer joins the swarm, it starts the followers at once, so they build their
    models meanwhile; `meet` (before the trainer is made) waits for them."""

    def __init__(self, config: Config, devices: list[torch.device]):
        self.nproc, self._device, self._sharded = len(devices), devices[0], config.run.fsdp
        self._folder = Path(tempfile.mkdtemp(prefix="p2p-diloco-ranks-"))
        self._rendezvous = self._folder / "rendezvous"
        self._followers: list[Any] = []
        self._pipes: list[Connection] = []
        self._closing = threading.Event()
        # Followers that died, by name, with their exit codes: read by `_watch`, the only thread that
        # reaps them (two threads reaping one child race: the loser's waitpid gets ECHILD and its
        # exitcode stays None, and a dead follower passed for a live one in `raise_if_lost`).
        self._exits: dict[str, int | None] = {}
        self._exited = threading.Event()
        self._ranks: Ranks | None = None
        try:
            self._spawn(config, devices)
        except BaseException:
            self.close()
            raise

    def _spawn(self, config: Config, devices: list[torch.device]) -> None:
        """Start ranks 1..N-1."""
        context = multiprocessing.get_context("spawn")
        threads = max(1, torch.get_num_threads() // self.nproc)
        for r in range(1, self.nproc):
            receiving, sending = context.Pipe(duplex=False)
            args = (r, self.nproc, config, str(devices[r]), self._rendezvous, os.getpid(), threads, sending)
            process = context.Process(target=follow, args=args, name=f"rank-{r}", daemon=True)
            process.start()
            sending.close()
            self._followers.append(process)
            self._pipes.append(receiving)
            logger.info("rank %d of %d started on %s (pid %d)", r, self.nproc, devices[r], process.pid)

    def meet(self) -> RankGroup:
        """Wait until every follower has built its model, then form the process group."""
        for r, (process, pipe) in enumerate(zip(self._followers, self._pipes), start=1):
            _await_ready(r, process, pipe)
        self._ranks = Ranks(0, self.nproc, self._device, self._rendezvous, self._sharded)
        threading.Thread(target=self._watch, name="ranks-watch", daemon=True).start()
        return self._ranks

    @property
    def ranks(self) -> Ranks:
        assert self._ranks is not None, "meet() first"
        return self._ranks

    def set_up(self, shard: int, restored: Path | None) -> None:
        self.ranks.send({"shard": shard, "restore": str(restored) if restored else None})
        self.ranks.idle = True

    def phase(self, model: torch.nn.Module, start: Mapping[str, torch.Tensor], steps: int, step: int) -> None:
        """Start the followers on an inner phase of at most `steps` from θ = `start`; the phase's
        last collective (`Ranks.finish`, or the gather of a sharded model) leaves them waiting for
        the next word."""
        self.ranks.idle = False
        self.ranks.send({"phase": True, "steps": steps, "step": step})
        self.ranks.share(model, start)

    def evaluating(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
        """Before rank 0 evaluates θ = `params`: a sharded model's forward needs every rank."""
        if self.ranks.sharded:
            self.ranks.send({"evaluate": True})
            self.ranks.share(model, params)

    def saving(self) -> None:
        """Before rank 0 takes AdamW's state for a checkpoint: sharded, every rank gathers it."""
        if self.ranks.sharded:
            self.ranks.send({"save": True})

    def close(self) -> None:
        """Tell the followers to exit, or terminate them if they are in the middle of something
        (rank 0 stopped by a second Ctrl+C, or by an error, within a phase or while starting)."""
        if self._closing.is_set():
            return
        self._closing.set()
        idle = self._ranks is not None and self._ranks.idle
        if idle:
            # From a thread: a follower that is not listening (rank 0 failed within a collective)
            # is terminated after the grace period instead of holding rank 0 here.
            threading.Thread(target=self._say_exit, name="ranks-exit", daemon=True).start()
        _end(self._followers, EXIT_TIMEOUT_S if idle else 0.0)
        if self._ranks is not None:
            self._ranks.close()
        shutil.rmtree(self._folder, ignore_errors=True)

    def raise_if_lost(self, error: Exception, round_: int) -> None:
        """Raise RankLost if `error` (a collective that failed) came from a follower that died: it
        is dead, or dies within LOST_WAIT_S (as `_watch` saw it). Otherwise return, and the caller
        raises `error`."""
        if not self._exited.wait(LOST_WAIT_S):
            return
        name, code = next(iter(self._exits.items()))
        raise RankLost(
            f"{name} of this peer exited with code {code} ({type(error).__name__}: "
            f"{str(error).strip().splitlines()[0] if str(error).strip() else '-'}); the checkpoint of "
            f"round {round_} is on disk, continue with --resume"
        ) from error

    def _say_exit(self) -> None:
        try:
            self.ranks.send({"exit": True})
        except Exception as e:  # a follower died: the others are terminated
            logger.debug("could not tell the ranks to exit: %s", e)

    def _watch(self) -> None:
        """Say at once when a follower dies: rank 0's next collective fails, or (NCCL) waits."""
        alive = {p.sentinel: p for p in self._followers}
        while alive and not self._closing.is_set():
            for sentinel in wait(list(alive), timeout=PARENT_POLL_S):
                process = alive.pop(sentinel)
                process.join(LOST_WAIT_S)  # its pipe closes as it exits, a moment before it can be reaped
                self._exits[process.name] = process.exitcode
                self._exited.set()
                if not self._closing.is_set():
                    logger.error(
                        "%s of this peer exited with code %s: this peer stops at its next step; the checkpoint "
                        "of its last round is on disk (--resume)",
                        process.name,
                        process.exitcode,
                    )


def _await_ready(rank: int, process: Any, pipe: Connection) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if pipe.poll(PARENT_POLL_S):
            try:
                kind, text = pipe.recv()
            except EOFError:  # it died before it could say why
                process.join(5)
                kind, text = "error", f"it exited with code {process.exitcode}"
            if kind == "ready":
                return
            raise ConfigError(f"rank {rank} of this peer could not start: {text}")
        if not process.is_alive():
            raise ConfigError(f"rank {rank} of this peer exited with code {process.exitcode} while starting")
    raise ConfigError(f"rank {rank} of this peer did not start within {START_TIMEOUT_S:.0f} s")


def _end(processes: list[Any], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()


def start(config: Config, devices: list[torch.device]) -> Alone | Leader:
    """The peer's ranks as its own process sees them: `Alone`, or the `Leader` of the others."""
    return Alone() if len(devices) == 1 else Leader(config, devices)


def follow(
    rank: int,
    world: int,
    config: Config,
    device: str,
    rendezvous: Path,
    parent: int,
    threads: int,
    ready: Connection,
) -> None:
    """A follower process: build, report ready, meet the others, then train what rank 0 says."""
    from p2p_diloco.train.follower import Follower  # the model and data: imported in the child only
    from p2p_diloco.train.metrics import setup_logging

    setup_logging(config.log.level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is rank 0's to handle: it tells us
    threading.Thread(target=_exit_with, args=(parent,), name="parent-watch", daemon=True).start()
    torch.set_num_threads(threads)
    try:
        follower = Follower(config, torch.device(device), rank)
    except Exception as e:
        ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    ready.send(("ready", None))
    ranks = Ranks(rank, world, torch.device(device), rendezvous, config.run.fsdp)
    try:
        follower.run(ranks)
    finally:
        follower.close()
        ranks.close()


def _exit_with(parent: int) -> None:
    """End this follower when rank 0 is gone (killed, or crashed without ending it)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)  # a watchdog's poll, not a synchronisation
    os._exit(1)
