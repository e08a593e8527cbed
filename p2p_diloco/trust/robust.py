"""Pure: how a reducer combines its group's parts of one span (Byzantine robustness).

Every member of a group reduces a span of the vector: it receives each sender's part of that
span, with the sender's weight (its tokens), and answers every sender with one combination of
them. A malicious sender can send any finite values with any weight. The combinations here bound
what one sender can do, and each is a function of the parts and weights alone, computed once by
the reducer, so every member still receives the same bytes (I1).

- `mean`: the weighted mean (hivemind's; no robustness).
- `clip`: each weight capped at `weight_cap` × the group's lower-median weight, each
  part scaled down to at most `clip` × the lower-median norm of the span's parts, then the
  weighted mean. One sender moves the result by at most about clip / k of an honest part's norm.
- `aligned-clip` (the default): `clip`, after dropping (weight 0) every part whose dot product with the span's
  coordinate-wise lower median is ≤ 0: a part that pulls the average back, whatever its norm.
  Honest pseudo-gradients point the same way (pairwise cosine 0.72 to 0.79 in the tiny run,
  bench/delta_alignment.py), so colluders that send −Δ count for nothing even as 2 of 5, where
  under `clip` they still cancel most of the honest step (they are only scaled to the median norm).
  Without attackers it gives clip's bytes. A peer whose data pulls against most others' (very
  non-i.i.d. shards) is dropped too.
- `centered-clip`: BTARD's CenteredClip (Gorbunov et al., 2021): starting from the coordinate-wise
  median, `CENTERED_CLIP_ITERATIONS` steps of v ← v + Σ wᵢ·clip(pᵢ − v, τ) / Σ wᵢ, with τ =
  `clip` × the lower-median distance of the parts from v.
- `trimmed-mean`: coordinate-wise, the ⌊(k−1)/2⌋ largest and smallest values dropped (for odd k
  the coordinate-wise median, for even k the mean of the middle two), among senders of positive
  weight; weights count no further.

A reducer holds all k parts of the span's current part at once: k × PART_SIZE bytes, much less than
one model copy, since parts are reduced one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Aggregator = Literal["mean", "clip", "aligned-clip", "centered-clip", "trimmed-mean"]
AGGREGATORS: tuple[Aggregator, ...] = ("mean", "clip", "aligned-clip", "centered-clip", "trimmed-mean")
CENTERED_CLIP_ITERATIONS = 5


def lower_median(values: Sequence[float]) -> float:
    """The lower median: an element of `values` (deterministic, no averaging of two middles)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def cap_weights(weights: Sequence[float], cap: float) -> list[float]:
    """Each weight at most `cap` × the lower median of the positive weights (zero stays zero)."""
    positive = [w for w in weights if w > 0]
    if not positive:
        return [0.0 for _ in weights]
    limit = cap * lower_median(positive)
    return [min(float(w), limit) if w > 0 else 0.0 for w in weights]


def weighed_tokens(tokens: Sequence[int], how: Aggregator, weight_cap: float) -> list[int]:
    """What a group's average weighed each member's tokens at, in tokens (the observer credits
    these): all of them under `mean`; at most `weight_cap` × the lower median of the positive ones
    under `clip`, `aligned-clip` and `centered-clip` (`cap_weights`, as the reducer caps them);
    under `trimmed-mean`, where every sender of positive weight counts once, at most the lower
    median. A part that aligned-clip dropped is not known here: it is credited as weighed."""
    return [int(w) for w in weighed(tokens, how, weight_cap)]


def weighed(weights: Sequence[float], how: Aggregator, weight_cap: float) -> list[float]:
    """Each member's weight as a group's reducers weigh it (`weighed_tokens`' rule, in weights)."""
    if how == "mean":
        return [max(0.0, float(w)) for w in weights]
    return cap_weights(weights, 1.0 if how == "trimmed-mean" else weight_cap)


def trim_count(k: int) -> int:
    """Values dropped at each end per coordinate by `trimmed-mean`: as many as a group of k can hold
    attackers while they stay a minority (f < k/2), leaving at least one value."""
    return max(0, (k - 1) // 2)


def weighted_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    total = float(sum(weights))
    out = torch.zeros_like(parts[0], dtype=torch.float32)
    if total <= 0:
        return out  # every sender gave weight 0 (all dropped their Δ): no update, not 0/0
    for part, weight in zip(parts, weights):
        if weight > 0:
            out.add_(part.float(), alpha=weight / total)
    return out


def clipped(
    parts: Sequence[torch.Tensor], clip: float, norms: Sequence[float] | None = None
) -> tuple[list[torch.Tensor], list[bool]]:
    """Each part scaled down to at most `clip` × the lower-median norm of the parts, and which were.
    `norms`: the norms of the whole parts these are chunks of (the audit's, trust/audit.py), else
    the parts' own."""
    norms = [float(p.float().norm()) for p in parts] if norms is None else list(norms)
    limit = clip * lower_median(norms)
    return [p.float() * (limit / n) if n > limit else p.float() for p, n in zip(parts, norms)], [
        n > limit for n in norms
    ]


def centered_clip(parts: Sequence[torch.Tensor], weights: Sequence[float], clip: float) -> torch.Tensor:
    stacked = torch.stack([p.float() for p in parts])
    v = stacked.median(dim=0).values  # torch's median is the lower median: an element per coordinate
    total = float(sum(weights))
    if total <= 0:
        return torch.zeros_like(v)
    for _ in range(CENTERED_CLIP_ITERATIONS):
        diffs = stacked - v
        distances = [float(d.norm()) for d in diffs]
        tau = clip * lower_median(distances)
        step = torch.zeros_like(v)
        for diff, distance, weight in zip(diffs, distances, weights):
            if weight > 0 and distance > 0:
                step.add_(diff, alpha=(weight / total) * min(1.0, tau / distance))
        v = v + step
    return v


def trimmed_mean(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Coordinate-wise trimmed mean of the parts whose sender gave a positive weight."""
    kept = [p.float() for p, w in zip(parts, weights) if w > 0]
    if not kept:
        return torch.zeros_like(parts[0], dtype=torch.float32)
    trim = trim_count(len(kept))
    ordered = torch.stack(kept).sort(dim=0).values
    return ordered[trim : len(kept) - trim].mean(dim=0)


def aligned(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> list[float]:
    """`weights`, with 0 for every part that does not point the way of the span's coordinate-wise
    (lower) median of the parts of positive weight (a dot product ≤ 0 with it): a sign flip, a
    zero update, anything that pulls the average back, whatever its norm."""
    kept = [p.float() for p, w in zip(parts, weights) if w > 0]
    if not kept:
        return [0.0 for _ in weights]
    reference = torch.stack(kept).median(dim=0).values
    return [
        float(w) if w > 0 and float(torch.dot(p.float().reshape(-1), reference.reshape(-1))) > 0 else 0.0
        for p, w in zip(parts, weights)
    ]


def aggregate(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    how: Aggregator,
    clip: float,
    weight_cap: float,
    norms: Sequence[float] | None = None,
) -> torch.Tensor:
    """What a reducer answers for one part of its span, given every sender's part and weight (in
    the group's sender order). `norms`: see `clipped`."""
    return combine(parts, weights, how, clip, weight_cap, norms)[0]


Fate = Literal["", "clipped", "dropped"]


def combine(
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    how: Aggregator,
    clip: float,
    weight_cap: float,
    norms: Sequence[float] | None = None,
) -> tuple[torch.Tensor, list[Fate]]:
    """`aggregate`, and what it did to each sender's part: "dropped" (aligned-clip: it pointed
    against the median), "clipped" (clip, aligned-clip: scaled down to the clip norm), or ""."""
    untouched: list[Fate] = ["" for _ in parts]
    if how == "mean":
        return weighted_mean(parts, weights), untouched
    capped = cap_weights(weights, weight_cap)
    if how in ("clip", "aligned-clip"):
        scaled, scaled_down = clipped(parts, clip, norms)
        kept = aligned(parts, capped) if how == "aligned-clip" else capped
        fates: list[Fate] = [
            "dropped" if w > 0 and k == 0 else "clipped" if down else ""
            for w, k, down in zip(capped, kept, scaled_down)
        ]
        return weighted_mean(scaled, kept), fates
    if how == "centered-clip":
        return centered_clip(parts, capped, clip), untouched
    if how == "trimmed-mean":
        return trimmed_mean(parts, capped), untouched
    raise ValueError(f"unknown aggregator {how!r}; choose one of {', '.join(AGGREGATORS)}")
