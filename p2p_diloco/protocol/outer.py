"""The outer optimiser of DiLoCo, as pure functions on CPU fp32 tensors. No network, no model.

A round's state is `GlobalState(round, params, momentum)`: θ(r) and the outer Nesterov momentum,
each an ordered {name: fp32 CPU tensor}. Every function returns new tensors and never changes its
inputs, so a round either produces a whole new state or raises.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.errors import PseudoGradError

Tensors = dict[str, torch.Tensor]

# Adam moves each weight by about lr per step (|m / sqrt(v)| is near 1 at most), so the RMS of a
# round's pseudo-gradient is bounded by the sum of the round's learning rates, plus what weight
# decay takes. A Δ far above that bound comes from a bug or a bad peer, not from training.
PSEUDO_GRAD_RMS_SLACK = 10.0


@dataclass(frozen=True)
class GlobalState:
    """θ(r) and the outer momentum after r rounds; identical on every peer of the round (I1)."""

    round: int
    params: Tensors
    momentum: Tensors

    def digest(self) -> str:
        return digest(self.round, self.params, self.momentum)


def initial_state(params: Mapping[str, torch.Tensor]) -> GlobalState:
    """Round 0: θ(0) copied to CPU fp32, zero momentum."""
    theta = {name: p.detach().to("cpu", torch.float32, copy=True) for name, p in params.items()}
    return GlobalState(0, theta, {name: torch.zeros_like(p) for name, p in theta.items()})


def pseudo_gradient(global_params: Tensors, inner_params: Mapping[str, torch.Tensor]) -> Tensors:
    """Δ = θ(r) − θ_i, in fp32 on the CPU. The names of the two must match exactly."""
    if list(global_params) != list(inner_params):
        raise PseudoGradError("inner model parameters do not match the global parameters' names")
    return {name: theta - inner_params[name].detach().to("cpu", torch.float32) for name, theta in global_params.items()}


def weighted_mean(deltas: Sequence[Tensors], weights: Sequence[float]) -> Tensors:
    """Σ w_i Δ_i / Σ w_i, the swarm's average pseudo-gradient (weights: tokens of each peer)."""
    if not deltas or len(deltas) != len(weights):
        raise ValueError(f"need one weight per pseudo-gradient, got {len(deltas)} and {len(weights)}")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights must sum to > 0, got {list(weights)}")
    return {name: sum(w * d[name] for w, d in zip(weights, deltas)) / total for name in deltas[0]}


def outer_step(state: GlobalState, delta: Tensors, lr: float, momentum: float, nesterov: bool) -> GlobalState:
    """θ(r+1) from θ(r) and the averaged Δ: SGD with (Nesterov) momentum, as torch.optim.SGD does it.

    buf ← μ·buf + Δ;  step = Δ + μ·buf (Nesterov) or buf;  θ ← θ − lr·step.
    """
    params, bufs = {}, {}
    for name, theta in state.params.items():
        buf = momentum * state.momentum[name] + delta[name]
        step = delta[name] + momentum * buf if nesterov else buf
        params[name] = theta - lr * step
        bufs[name] = buf
    return GlobalState(state.round + 1, params, bufs)


def norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """L2 norm over all tensors, in float64 so large models do not overflow the sum."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


# An average "points against" a pseudo-gradient when their cosine is at most this. Honest
# pseudo-gradients point the same way early in a run (bench/delta_alignment.py) and become nearly
# orthogonal late, so an honest group's average can fall just below 0 against a peer's own Δ: a
# veto at cosine <= 0 would refuse honest states by chance (docs/design.md §6, the own-Δ veto). A group that pulls
# back is far below: -1.00 for colluders' -10 x Δ.
AGAINST_COSINE = -0.1


def points_against(cosine_: float) -> bool:
    """Whether an average with this cosine to a pseudo-gradient points against it (AGAINST_COSINE)."""
    return cosine_ <= AGAINST_COSINE


def against_own(average: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> float | None:
    """The cosine of `average` with this peer's own Δ if it points against it (a Δ of zero has no
    direction: nothing points against it), else None. The one rule behind both vetoes: an
    average not applied (round/averaging.py) and a state not adopted (round/sync.py)."""
    cosine_ = cosine(average, own)
    return cosine_ if points_against(cosine_) and norm(own) > 0 else None


def cosine(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The cosine of two updates over all their tensors (float64); 0 if either is zero."""
    dot = sum(float((a[name].double() * b[name].double()).sum()) for name in a)
    scale = norm(a) * norm(b)
    return dot / scale if scale > 0 else 0.0


def implied_average(theirs: GlobalState, mine: GlobalState, momentum: float, applied: Tensors | None) -> Tensors | None:
    """The averaged Δ another state's group applied to the round this peer applied `applied` to
    (or is still at), recovered from the momentum buffers, which every outer step updates as
    buf ← μ·buf + Δ: from the round's start, Δ = buf' − μ·buf; from the state this peer made of
    that start with `applied`, Δ = applied + (buf' − buf_mine). None if the rounds do not fit."""
    if theirs.round == mine.round + 1:
        return {n: theirs.momentum[n] - momentum * mine.momentum[n] for n in mine.momentum}
    if theirs.round == mine.round and applied is not None:
        return {n: applied[n] + theirs.momentum[n] - mine.momentum[n] for n in mine.momentum}
    return None


def check_pseudo_gradient(delta: Tensors, lr_sum: float, weight_decay: float = 0.0) -> float:
    """Raise PseudoGradError unless Δ is finite and its RMS is plausible for the round; return its norm.

    lr_sum: the sum of the inner learning rates over the round's steps (see PSEUDO_GRAD_RMS_SLACK).
    """
    for name, t in delta.items():
        if not bool(torch.isfinite(t).all()):
            raise PseudoGradError(f"pseudo-gradient of {name} is not finite (nan or inf): the inner phase diverged")
    total = norm(delta)
    numel = sum(t.numel() for t in delta.values())
    rms = total / math.sqrt(max(numel, 1))
    limit = PSEUDO_GRAD_RMS_SLACK * lr_sum * (1.0 + weight_decay)
    if rms > limit:
        raise PseudoGradError(
            f"pseudo-gradient RMS {rms:.3g} exceeds {limit:.3g} ({PSEUDO_GRAD_RMS_SLACK:g} x the round's summed lr "
            f"{lr_sum:.3g}): the inner phase did not come from AdamW at this lr"
        )
    return total


def digest(round_: int, params: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the round number, names, shapes, dtypes and bytes of θ and momentum (32 hex digits).

    Two peers agree (I1) exactly when their digests are equal: this hashes the raw bytes, so a
    difference in the last bit of one weight shows.
    """
    h = hashlib.sha256(struct.pack("<q", round_))
    for kind, tensors in (("params", params), ("momentum", momentum)):
        h.update(kind.encode())
        for name, t in tensors.items():
            t = t.detach().to("cpu").contiguous()
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def served_digest(
    metadata: Mapping[str, Any], tensors: Sequence[torch.Tensor], like: Mapping[str, torch.Tensor]
) -> str | None:
    """The digest of a state another peer served ({"round": r, ...}, [θ, momentum] flat), shaped like
    `like`; None if it is malformed: it does not even have this model's shape (untrusted, I4)."""
    try:
        theta, momentum = tensors
        return digest(int(metadata["round"]), unflatten(theta.float(), like), unflatten(momentum.float(), like))
    except (ValueError, KeyError, TypeError, OverflowError, RuntimeError, IndexError, struct.error):
        return None


def flatten(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """All tensors as one flat fp32 vector, in the mapping's order (what the swarm averages and sends)."""
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors.values()])


def unflatten(flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> Tensors:
    """The inverse of `flatten`, shaped like `like`; the sizes must match exactly."""
    total = sum(t.numel() for t in like.values())
    if flat.dim() != 1 or flat.numel() != total:
        raise ValueError(f"flat vector of {tuple(flat.shape)} does not hold the {total} values expected")
    out, offset = {}, 0
    for name, t in like.items():
        out[name] = flat[offset : offset + t.numel()].view(t.shape).clone()
        offset += t.numel()
    return out


def split_exact(tensors: Mapping[str, torch.Tensor]) -> tuple[Tensors, Tensors]:
    """(matrices, vectors): what may travel through a lossy codec, and what always travels exact.

    Norm weights and biases are a tiny share of the values, and a coarse codec hurts them most
    (a norm's scale error multiplies a whole layer's activations), so they are never compressed.
    """
    lossy = {name: t for name, t in tensors.items() if t.dim() >= 2}
    return lossy, {name: t for name, t in tensors.items() if t.dim() < 2}


def eager_estimate(
    own: Tensors, previous_average: Tensors | None, previous_own: Tensors | None, share: float
) -> Tensors:
    """The eager estimate of a round's average Δ while its all-reduce is still running (overlapped
    rounds, arXiv 2502.12996): this peer's fresh Δ for its own share, the others' part of the
    previous round's average for theirs.

        estimate = share·Δ_own(r) + (avg(r−1) − share·Δ_own(r−1))

    Without a previous round (the first overlapped one) the estimate is this peer's own Δ.
    """
    if previous_average is None or previous_own is None:
        return dict(own)
    return {name: share * own[name] + previous_average[name] - share * previous_own[name] for name in own}


def is_dropped(rate: float, seed: int, peer: str, round_: int) -> bool:
    """Whether `peer`'s pseudo-gradient of `round_` is dropped from the average (the paper's
    dropped-pseudo-gradient experiment, outer.drop_rate): a pure function of its arguments, so a
    resumed run drops the same rounds."""
    if rate <= 0:
        return False
    draw = int.from_bytes(hashlib.sha256(f"drop/{seed}/{peer}/{round_}".encode()).digest()[:8], "big")
    return draw < rate * 2**64
