"""The inner loop: H steps of AdamW on one peer's own data, with warm-up + cosine schedule,
gradient accumulation, clipping and mixed precision. Knows nothing of the network.

The trainer takes a model that is already on its device and never moves it. On a peer of several
processes (`run.nproc`, ranks.py) every rank runs the same trainer: `RankGroup` wraps the model in
DDP, cuts each rank's rows out of the peer's batch, and has rank 0 decide, before each step, whether
the phase goes on; alone (`ONE`) all three do nothing.

Speed (bench/inner_speed.py measures it against a bare PyTorch loop): fused AdamW on CUDA,
`inner.compile` (torch.compile of the training forward), and no CPU-GPU sync in the step loop:
the step losses stay on the device until the phase ends.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from p2p_diloco.config import InnerSection
from p2p_diloco.errors import ConfigError

GO, END, STOP = 0, 1, 2  # before each inner step: train it, end the phase complete, or abandon the phase


class RankGroup(Protocol):
    """The processes of one peer, as one of them sees them (ranks.py; `ONE` for a single process)."""

    rank: int
    world: int

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` as the inner steps call it: DDP across the ranks."""
        ...

    def agree(self, code: int) -> int:
        """Rank 0's GO, END or STOP for the next step, on every rank."""
        ...

    def finish(self, loss: float, model: torch.nn.Module) -> float:
        """After a phase: the ranks' mean loss; raises if their parameters differ."""
        ...

    def load(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
        """θ (whole tensors) into the model: this rank's rows of a sharded parameter."""
        ...

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The trained parameters whole (sharded ones gathered, by every rank at once)."""
        ...

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """AdamW's whole state, on rank 0 (every rank calls this)."""
        ...

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load AdamW's whole state (every rank, the same state)."""
        ...


class OneRank:
    """A peer of one process."""

    rank, world = 0, 1

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def agree(self, code: int) -> int:
        return code

    def finish(self, loss: float, model: torch.nn.Module) -> float:
        return loss

    def load(self, model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
        copy_params(model, params)

    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return dict(model.named_parameters())

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


ONE = OneRank()


def copy_params(model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Copy `params` into the model's parameters of the same names, in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])


def lr_at(step: int, cfg: InnerSection, total_steps: int) -> float:
    """Learning rate of inner step `step` (0-based): linear warm-up, then cosine decay to min_lr_ratio·lr.

    The schedule spans the whole run (rounds × H steps), not one round, as in the paper.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA for `auto`, full fp32 on the CPU (bf16 matmuls are slow there)."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def adamw(model: torch.nn.Module, cfg: InnerSection, device: torch.device) -> torch.optim.AdamW:
    """AdamW on the model's trainable parameters. On CUDA the fused kernel (one launch for all of
    them); elsewhere foreach, which on the CPU gives the per-parameter loop's bits exactly and is no
    slower; the fused CPU kernel is faster there but rounds differently, and CPU runs keep their
    bits (see docs/benchmarks.md, Inner-loop speed)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    cuda = device.type == "cuda"
    # Norm gains are not decayed: pulling them toward 0 only hurts (nanoGPT, Chinchilla).
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=True if cuda else None,
        foreach=None if cuda else True,
    )


def compiled(model: torch.nn.Module) -> tuple[Callable[..., Any], tuple[type[Exception], ...]]:
    """`model` under torch.compile, for the inner steps, and what a failed compilation raises.

    The compiled model shares the model's parameters and its code reads them at every call, so θ
    copied into them in place (`Peer.load`) is what the next step trains. It compiles at the first
    step (forward) and the first backward; `compile_failed` words their errors.
    """
    import torch._dynamo  # 1.6 s to import: only a peer with inner.compile pays for it

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError(
            f"inner.compile = true but torch {torch.__version__} cannot compile on this Python or platform; "
            f"set [inner] compile = false in run.toml or --inner.compile=false"
        )
    return torch.compile(model), (torch._dynamo.exc.TorchDynamoException,)


def compile_failed(error: Exception) -> ConfigError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ConfigError(
        f"inner.compile = true but torch.compile failed on this machine ({type(error).__name__}: {reason}); "
        f"set [inner] compile = false in run.toml or --inner.compile=false"
    )


def mean_loss(losses: list[torch.Tensor]) -> float:
    """The mean of a phase's step losses (0-d tensors on the device), summed as Python floats in step
    order: the same bits as reading each loss at its step, with one copy to the CPU instead of H."""
    if not losses:
        return float("nan")
    values = torch.stack(losses).tolist()
    return sum(values) / len(values)


@dataclass(frozen=True)
class PhaseResult:
    """What one inner phase did. `stopped` means it was abandoned (Ctrl+C, or the swarm moved on)."""

    steps: int
    tokens: int
    mean_loss: float
    compute_s: float
    lr_sum: float
    stopped: bool


class InnerTrainer:
    """AdamW on the inner model; its state (moments, step) stays on this peer across rounds."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: InnerSection,
        total_steps: int,
        device: torch.device,
        ranks: RankGroup = ONE,
    ):
        self.model, self.cfg, self.total_steps, self.device = model, cfg, total_steps, device
        self.ranks = ranks
        self.amp_dtype = autocast_dtype(cfg.precision, device)
        # What the inner steps call: the model, in DDP across the peer's ranks or sharded (FSDP, in
        # place: before the optimizer takes its parameters), maybe compiled. Evaluation calls the
        # eager model, so its losses are the same bits with or without inner.compile (an observer
        # evaluates the run's states eagerly); under DDP rank 0 evaluates alone.
        self.parallel = ranks.wrap(model)
        self.optimizer = adamw(model, cfg, device)
        self.train_model: Callable[..., Any] = self.parallel
        self.compile_errors: tuple[type[Exception], ...] = ()
        if cfg.compile:
            self.train_model, self.compile_errors = compiled(self.parallel)
        self.step = 0

    def train_step(self, batch: torch.Tensor) -> torch.Tensor:
        """One optimizer step on `batch` [batch_size, seq_len], accumulated over micro-batches. On a
        peer of several ranks `batch` is the peer's whole batch and this rank trains its share of it.

        Returns this rank's mean loss as a 0-d tensor on the device (no CPU sync here).
        """
        lr = lr_at(self.step, self.cfg, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        if self.ranks.world > 1:
            batch = batch.tensor_split(self.ranks.world)[self.ranks.rank]
        micro_batches = batch.split(self.cfg.micro_batch_size)
        total = torch.zeros((), device=self.device)
        parallel = self.parallel
        for i, mb in enumerate(micro_batches):
            mb = mb.to(self.device, non_blocking=True)
            # A data-parallel model (DDP) syncs gradients on the last micro-batch only.
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or not hasattr(parallel, "no_sync") else parallel.no_sync()
            if hasattr(parallel, "set_requires_gradient_sync"):  # FSDP: reduce-scatter after the last only
                parallel.set_requires_gradient_sync(last)
            with sync:
                total += self._forward_backward(mb, len(micro_batches))
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return total

    def _forward_backward(self, mb: torch.Tensor, parts: int) -> torch.Tensor:
        """The loss of micro-batch `mb` / parts, its gradient accumulated into the parameters."""
        try:
            with self._autocast():
                loss = self.train_model(input_ids=mb, labels=mb).loss / parts
            loss.backward()
        except self.compile_errors as e:  # () without inner.compile: nothing is caught
            raise compile_failed(e) from e
        return loss.detach().float()

    def run_phase(
        self,
        next_batch: Callable[[], torch.Tensor],
        steps: int,
        should_stop: Callable[[], bool] = lambda: False,
        on_step: Callable[[int, torch.Tensor, int], None] = lambda step, loss, tokens: None,
        should_end: Callable[[int, int], bool] = lambda steps, tokens: False,
    ) -> PhaseResult:
        """Up to `steps` inner steps.

        should_stop() true: the phase is abandoned (stopped=True; the caller discards it).
        should_end(steps_done, tokens) true: the phase is complete early (the swarm's round ended);
        asked only after the first step, so every phase has a pseudo-gradient to contribute.
        on_step(step_in_phase, loss, tokens_so_far) is called after every step with the loss as a 0-d
        tensor on the device. Reading it (float(loss)) is a CPU-GPU sync point: the CPU waits for the
        step to finish instead of queueing the next, so read it only to show it, not every step.
        On a peer of several ranks, rank 0's should_stop and should_end decide for all of them, and
        tokens and the mean loss are the peer's.
        """
        start = time.perf_counter()
        losses: list[torch.Tensor] = []  # on the device until the phase ends: no sync per step
        tokens, lr_sum, stopped = 0, 0.0, False
        for i in range(steps):
            code = STOP if should_stop() else END if i > 0 and should_end(i, tokens) else GO
            code = self.ranks.agree(code)
            if code == STOP:
                stopped = True
                break
            if code == END:
                break
            batch = next_batch()
            lr_sum += lr_at(self.step, self.cfg, self.total_steps)
            losses.append(self.train_step(batch))
            tokens += batch.numel()
            on_step(i + 1, losses[-1], tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        mean = self.ranks.finish(mean_loss(losses), self.model)
        return PhaseResult(len(losses), tokens, mean, time.perf_counter() - start, lr_sum, stopped)

    @torch.no_grad()
    def evaluate(self, batch: torch.Tensor) -> float:
        """Mean loss of the current model on `batch` [n, seq_len] (held-out sequences)."""
        self.model.eval()
        total = 0.0
        for mb in batch.split(self.cfg.micro_batch_size):
            mb = mb.to(self.device)
            with self._autocast():
                total += float(self.model(input_ids=mb, labels=mb).loss) * len(mb)
        return total / len(batch)

    def state_dict(self) -> dict:
        """AdamW's whole state and the step (sharded: gathered to rank 0, by every rank at once)."""
        return {"optimizer": self.ranks.optimizer_state(self.model, self.optimizer), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`, with this device's AdamW kernel: a checkpoint records the
        kernel it was saved with (none before fused and foreach were chosen), and a run dir may move
        to another device."""
        saved = state["optimizer"]
        kernel = {key: self.optimizer.param_groups[0][key] for key in ("fused", "foreach")}
        saved = {**saved, "param_groups": [{**g, **kernel} for g in saved["param_groups"]]}
        self.ranks.load_optimizer_state(self.model, self.optimizer, saved)
        self.step = int(state["step"])

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)
