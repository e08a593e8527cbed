"""The synchronous reference DiLoCo is measured against: data-parallel training of the same model,
data and schedule, with k local worker processes that average their gradients after every step
(`torch.distributed`, gloo, through DDP). One model, k x the batch, k x the tokens per step.

    p2p-diloco baseline --workers 4 --config run.toml --run.dir runs/dp4

Worker i reads shard i of the run's shards (the shard a DiLoCo peer with data.shard = i reads), so
data-parallel with k workers and DiLoCo with k peers see the same tokens. `--workers 1` is the
paper's single-worker baseline: plain AdamW with one peer's batch and steps. The run lasts
run.rounds x inner.steps optimizer steps (the inner steps of one DiLoCo peer), and θ is evaluated
every inner.steps x run.eval_every_rounds steps, so its records line up with a peer's rounds.

Rank 0 writes `metrics.jsonl` in run.dir: one record per evaluation with the tokens of all workers
so far and the bytes each worker sent (the all-reduce of every gradient bucket, counted by a DDP
communication hook, times 2(k-1)/k: what a ring or butterfly all-reduce sends per worker). No
checkpoints: a baseline is rerun, not resumed.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from p2p_diloco import config as config_mod
from p2p_diloco.config import Config
from p2p_diloco.errors import ConfigError
from p2p_diloco.train import data
from p2p_diloco.train import model as model_mod
from p2p_diloco.train.inner import InnerTrainer
from p2p_diloco.train.metrics import MetricsLog, setup_logging
from p2p_diloco.train.ranks import ddp

logger = logging.getLogger(__name__)
INIT_TIMEOUT_S = 120  # all workers must have started and met within this


def check(config: Config, workers: int) -> None:
    """Refuse what cannot run, before any process starts."""
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {workers}")
    if config.data.shard >= 0 and workers > 1:
        raise ConfigError("data.shard names one shard, but data-parallel workers read shards 0..k-1; leave it at -1")
    if workers > config.data.num_shards:
        raise ConfigError(
            f"--workers {workers} needs at least that many shards, data.num_shards is "
            f"{config.data.num_shards}; raise it"
        )
    if (Path(config.run.dir) / "metrics.jsonl").exists():
        raise ConfigError(f"run dir {config.run.dir} already holds a metrics.jsonl; choose another --run.dir")


def run(config: Config, workers: int) -> Path:
    """Train with `workers` processes; returns the path of rank 0's metrics.jsonl."""
    check(config, workers)
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_mod.save(config, run_dir / "config.toml")
    rendezvous = run_dir / ".rendezvous"
    rendezvous.unlink(missing_ok=True)
    try:
        if workers == 1:
            _worker(0, config, 1, rendezvous)
        else:
            mp.spawn(_worker, args=(config, workers, rendezvous), nprocs=workers, join=True)
    finally:
        rendezvous.unlink(missing_ok=True)
    return run_dir / "metrics.jsonl"


def _worker(rank: int, config: Config, workers: int, rendezvous: Path) -> None:
    setup_logging(config.log.level)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    if workers > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=workers,
            timeout=timedelta(seconds=INIT_TIMEOUT_S),
        )
    try:
        _train(rank, config, workers)
    finally:
        if workers > 1:
            dist.destroy_process_group()


def _train(rank: int, config: Config, workers: int) -> None:
    tokenizer = model_mod.load_tokenizer(config.model.tokenizer)
    model = model_mod.init_model(model_mod.model_config(config.model, tokenizer.vocab_size), config.run.seed)
    corpus = data.open_corpus(config.data)
    stream = _train_stream(config, corpus, tokenizer, rank)
    steps_per_eval = config.inner.steps * max(config.run.eval_every_rounds, 1)
    total_steps = config.run.rounds * config.inner.steps
    comm = Communication(workers)
    trained = _distributed(model, comm) if workers > 1 else model
    trainer = InnerTrainer(trained, config.inner, total_steps, torch.device("cpu"))
    log = MetricsLog(Path(config.run.dir) / "metrics.jsonl") if rank == 0 else None
    heldout = None
    # Evaluates the plain module on rank 0 alone: a forward through DDP would be a collective.
    evaluator = InnerTrainer(model, config.inner, total_steps, torch.device("cpu"))
    if rank == 0 and config.run.eval_every_rounds > 0:
        heldout = data.heldout_batch(
            corpus, tokenizer, config.model.seq_len, config.run.eval_sequences, config.data.heldout_fraction
        )
    if rank == 0:
        _log_start(config, workers, model, total_steps, corpus)
    progress = _Progress(config, workers, total_steps, comm, log, evaluator, heldout)
    progress.record(0)
    for step in range(1, total_steps + 1):
        t = time.perf_counter()
        progress.losses.append(float(trainer.train_step(stream.next_batch(config.inner.batch_size))))
        progress.compute_s += time.perf_counter() - t
        if step % steps_per_eval == 0 or step == total_steps:
            progress.record(step)


def _train_stream(config: Config, corpus: data.Corpus, tokenizer: Any, rank: int) -> data.TrainStream:
    """This worker's training batches: shard `rank` of the run's shards, unless data.shard names one."""
    shard = config.data.shard if config.data.shard >= 0 else rank
    return data.shard_stream(corpus, tokenizer, config.data, config.model.seq_len, config.run.seed, shard)


def _distributed(model: torch.nn.Module, comm: Communication) -> torch.nn.Module:
    """`model` wrapped in DDP, its gradient buckets all-reduced (and counted) by `comm`."""
    trained = ddp(model, torch.device("cpu"))
    trained.register_comm_hook(comm, Communication.hook)
    return trained


def _log_start(config: Config, workers: int, model: torch.nn.Module, total_steps: int, corpus: data.Corpus) -> None:
    logger.info(
        "data-parallel baseline: %d worker(s), %s parameters, %d steps of %d x %d tokens each, %s",
        workers,
        f"{model_mod.count_parameters(model):,}",
        total_steps,
        config.inner.batch_size * workers,
        config.model.seq_len,
        corpus.description,
    )


@dataclass
class _Progress:
    """What rank 0 records at each evaluation: the mean train loss since the last one, the tokens and
    bytes so far, the compute and wall time since the start (made just before the first step)."""

    config: Config
    workers: int
    total_steps: int
    comm: Communication
    log: MetricsLog | None  # None on ranks other than 0: they record nothing
    evaluator: InnerTrainer
    heldout: torch.Tensor | None
    started: float = field(default_factory=time.perf_counter)
    compute_s: float = 0.0
    losses: list[float] = field(default_factory=list)  # train losses since the last record

    def record(self, step: int) -> None:
        if self.log is None:
            return
        config = self.config
        entry: dict[str, Any] = {
            "round": step // config.inner.steps,
            "step": step,
            "workers": self.workers,
            "total_tokens": step * config.inner.batch_size * config.model.seq_len * self.workers,
            "train_loss": sum(self.losses) / len(self.losses) if self.losses else None,
            "bytes_sent": self.comm.bytes_sent(),
            "compute_s": self.compute_s,
            "wall_s": time.perf_counter() - self.started,
        }
        if self.heldout is not None:
            loss = self.evaluator.evaluate(self.heldout)
            entry.update(eval_loss=loss, eval_ppl=math.exp(min(loss, 50.0)))
        self.log.append(entry)
        self.losses.clear()
        if step:
            logger.info(
                "step %d/%d: train loss %.4f, held-out loss %s",
                step,
                self.total_steps,
                entry["train_loss"],
                f"{entry['eval_loss']:.4f}" if "eval_loss" in entry else "-",
            )


class Communication:
    """A DDP communication hook that all-reduces (mean) each gradient bucket and counts its bytes."""

    def __init__(self, workers: int):
        self.workers = workers
        self.payload = 0  # gradient bytes all-reduced so far

    def bytes_sent(self) -> int:
        """What each worker sent: 2(k-1)/k of the payload, the volume of a ring or butterfly all-reduce."""
        return int(self.payload * 2 * (self.workers - 1) / self.workers) if self.workers > 1 else 0

    def hook(self, bucket):  # no annotations: DDP checks them, and they are strings in this module
        tensor = bucket.buffer()
        self.payload += tensor.numel() * tensor.element_size()
        tensor.div_(self.workers)
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])
