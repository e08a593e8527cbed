"""A round's averaging, as the peer sees it: one outcome out of four.

- `Averaged`: the group's all-reduce succeeded; every member holds the same bytes (I1).
- `Alone`: nobody else reached the round within the matchmaking window (or the peer has no swarm):
  the average of one pseudo-gradient is itself.
- `Failed`: every attempt at the group's all-reduce failed, or its average pointed against this
  peer's own Δ (`AgainstOwn`: a group whose majority pulls back). Nothing of it was applied (I2):
  the peer uses its own Δ, and agreement after the outer step brings it back to the group's state
  (never to a state made with an average that points against its own Δ: sync.py).
- `Overtaken`: the swarm already published the round's result; averaging alone would only make a
  state nobody else holds, so the peer catches up instead.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from p2p_diloco.config import Config
from p2p_diloco.errors import AveragingError, SwarmMovedOn
from p2p_diloco.protocol import outer
from p2p_diloco.protocol.network import AllReduced, RoundOutcome, Swarm
from p2p_diloco.protocol.twolevel import Levels


@dataclass(frozen=True)
class CommStats:
    """What averaging one round cost this peer (fields of its metrics record)."""

    allreduce_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    dropped: bool = False  # outer.drop_rate left this peer's Δ out of the average
    link_mbit_s: float | None = None  # the link figure this peer announced, if it averaged with a group
    averaging_s: float = 0.0  # from the start of averaging to its outcome
    blocked_s: float = 0.0  # of that, how long the training loop waited for it
    from_group: bool = False  # the figures come from a group's all-reduce
    audit_s: float = 0.0  # of allreduce_s, the audit of the other reducers (a group's only)
    audit_bytes: int = 0  # what the audit's answers took, apart from bytes_received
    groups: int = 1  # a two-level round's groups (the most a sub-span counted)
    across_s: float = 0.0  # of allreduce_s, a two-level round's stages 2 and 3
    across_bytes: tuple[int, int] = (0, 0)  # their bytes (sent, received), apart from bytes_sent and bytes_received
    spans: int = 0  # a two-level round's spans a group (0: flat)

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "allreduce_s": self.allreduce_s,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }
        if self.from_group:
            out.update(link_mbit_s=self.link_mbit_s, audit_s=self.audit_s, audit_bytes=self.audit_bytes)
        if self.spans:
            out.update(groups=self.groups, spans=self.spans, across_s=self.across_s)
            out.update(across_bytes=list(self.across_bytes))
        out.update(
            dropped=self.dropped,
            averaging_s=self.averaging_s,
            blocked_s=self.blocked_s,
            wait_s=max(0.0, self.averaging_s - self.allreduce_s),
        )
        return out


@dataclass(frozen=True)
class Applied:
    """An outcome that leads to an outer step: the Δ to apply, the group it came from, its cost."""

    delta: outer.Tensors
    group: tuple[str, ...]  # peer ids, this peer included
    comm: CommStats


class Averaged(Applied):
    """The group's all-reduce succeeded: every member holds the same bytes of `delta` (I1)."""


class Alone(Applied):
    """Nobody else came (or the peer trains alone): `delta` is this peer's own Δ."""


class Failed(Applied):
    """Every attempt at the group's all-reduce failed and nothing was applied (I2): own Δ."""


@dataclass(frozen=True)
class Overtaken:
    """The swarm published this round's result while this peer was averaging it: catch up."""

    round: int


Outcome = Averaged | Alone | Failed | Overtaken


@dataclass(frozen=True)
class NobodyCame:
    """No other peer reached the round within the matchmaking window."""


@dataclass(frozen=True)
class GroupFailed:
    """Every attempt at the group's all-reduce failed (the last one's reason), or (`vetoed`) its
    average pointed against this peer's own Δ: nothing applied (I2)."""

    reason: str
    vetoed: bool = False


Attempt = AllReduced | NobodyCame | GroupFailed | Overtaken  # what the group's all-reduce came to


def outcome_kind(outcome: Applied) -> RoundOutcome:
    """The round's outcome as a round record says it (network.OUTCOMES)."""
    if isinstance(outcome, Failed):
        return "failed"
    return "averaged" if isinstance(outcome, Averaged) and len(outcome.group) > 1 else "alone"


class AgainstOwn(AveragingError):
    """A group's average that points against this peer's own pseudo-gradient."""


def average(
    swarm: Swarm,
    config: Config,
    round_: int,
    delta: outer.Tensors,
    tokens: int,
    expected: int,
    log: logging.LoggerAdapter,
    levels: Levels | None = None,
) -> Outcome:
    """The round's average pseudo-gradient, the group it came from, and what it cost."""
    dropped = outer.is_dropped(config.outer.drop_rate, config.run.seed, swarm.peer_id, round_)
    if dropped:  # the paper's dropped pseudo-gradient: this peer's Δ counts for nothing this round
        log.info(
            "round %d: this peer's pseudo-gradient is dropped (outer.drop_rate %g)", round_, config.outer.drop_rate
        )
    own = {name: torch.zeros_like(t) for name, t in delta.items()} if dropped else delta
    alone = CommStats(dropped=dropped)
    if swarm.solo:
        return Alone(own, (swarm.peer_id,), alone)
    lossy, exact = outer.split_exact(delta)
    flat, flat_exact = outer.flatten(lossy), (outer.flatten(exact) if exact else None)
    result = _with_retries(swarm, config, round_, flat, flat_exact, 0 if dropped else tokens, expected, log, levels)
    match result:
        case Overtaken():
            return result
        case AllReduced():
            return Averaged(_unflatten(result, delta, lossy, exact), result.group, _group_stats(result, dropped))
    if not swarm.serves:
        # A private peer's own state is one nobody can download: it goes on alone only beside a
        # live public peer, whose state agreement then brings it to (else SwarmError: it stops).
        swarm.wait_for_reachable_peer(round_)
    if isinstance(result, GroupFailed) and result.vetoed:  # the group's own state is not caught up to either
        return Failed(own, (swarm.peer_id,), alone)
    if swarm.wait_for_round(round_ + 1, 0.0):
        # Averaging alone now would only make a state nobody else holds: catch up instead.
        log.info("the swarm is already past round %d: catching up instead of averaging alone", round_)
        return Overtaken(round_)
    if isinstance(result, GroupFailed):
        return Failed(own, (swarm.peer_id,), alone)
    log.info("no other peer reached round %d within the matchmaking window: averaging alone", round_)
    return Alone(own, (swarm.peer_id,), alone)


def _with_retries(
    swarm: Swarm,
    config: Config,
    round_: int,
    flat: torch.Tensor,
    flat_exact: torch.Tensor | None,
    tokens: int,
    expected: int,
    log: logging.LoggerAdapter,
    levels: Levels | None,
) -> Attempt:
    """What the group's all-reduce came to: its average; nobody came; every attempt failed (the
    last one's reason), or at once, vetoed, if the average points against this peer's own Δ; or
    the swarm finished the round meanwhile.

    A failed all-reduce applied nothing and left `flat` as it was (I2), so the survivors, who all
    saw the failure, match again for the same round and retry with the same Δ.
    """
    attempts = 1 + config.swarm.averaging_retries
    failed = GroupFailed(f"round {round_}: no attempt")
    for attempt in range(1, attempts + 1):
        try:
            got = swarm.average(
                flat,
                tokens,
                round_,
                retry=attempt > 1,
                expected_group=expected if attempt == 1 else 0,
                exact=flat_exact,
                levels=None if levels is None else dataclasses.replace(levels, attempt=attempt),
            )
            return NobodyCame() if got is None else _not_against_own(got, flat, flat_exact, round_)
        except AgainstOwn as e:
            # INFO: honest averages late in a run do this too (docs/design.md §6); agreement heals it
            log.info("%s: using this peer's own pseudo-gradient", e)
            return GroupFailed(str(e), vetoed=True)  # not retried; no state of that group is adopted (sync.py)
        except SwarmMovedOn as e:  # a slow peer, or one whose group failed for it alone: it heals
            log.info("%s: catching up with its result", e)
            return Overtaken(round_)
        except AveragingError as e:
            failed = GroupFailed(str(e))
            # A member whose all-reduce completed publishes the round's result within moments
            # (a reducer may answer one member and fail before the next): adopt it rather than
            # retry, so that both end the round with the same state.
            if swarm.wait_for_round(round_ + 1, config.swarm.matchmaking_time_s / 2):
                log.warning("%s; peers already finished round %d: adopting their result", e, round_)
                return Overtaken(round_)
            more = "retrying among the survivors" if attempt < attempts else "using this peer's own pseudo-gradient"
            log.warning("%s (attempt %d of %d); %s", e, attempt, attempts, more)
    return failed


def _not_against_own(got: AllReduced, flat: torch.Tensor, flat_exact: torch.Tensor | None, round_: int) -> AllReduced:
    """The group's average, unless it points against this peer's own Δ (`outer.against_own`:
    cosine ≤ -0.1): honest pseudo-gradients point the same way, or are nearly orthogonal late in a
    run, so such an average comes from a group whose majority pulls back (attackers that met fewer
    honest members than themselves). It is not applied (I2): the round goes on as a failed all-reduce."""
    mine, theirs = {"lossy": flat}, {"lossy": got.delta}
    if flat_exact is not None and got.exact is not None:
        mine["exact"], theirs["exact"] = flat_exact, got.exact
    if (cosine := outer.against_own(theirs, mine)) is not None:
        raise AgainstOwn(
            f"round {round_}: the group's average points against this peer's own pseudo-gradient "
            f"(cosine {cosine:.2f}); nothing applied"
        )
    return got


def _unflatten(result: AllReduced, delta: outer.Tensors, lossy: outer.Tensors, exact: outer.Tensors) -> outer.Tensors:
    """The flat average back in `delta`'s names, shapes and order."""
    averaged = {**outer.unflatten(result.delta, lossy)}
    if exact and result.exact is not None:
        averaged.update(outer.unflatten(result.exact, exact))
    return {name: averaged[name] for name in delta}


def _group_stats(result: AllReduced, dropped: bool) -> CommStats:
    link = round(result.link_bps * 8e-6, 2) if result.link_bps else None
    return CommStats(
        result.allreduce_s,
        result.bytes_sent,
        result.bytes_received,
        dropped,
        link,
        from_group=True,
        audit_s=result.audit_s,
        audit_bytes=result.audit_bytes,
        groups=result.groups,
        across_s=result.across_s,
        across_bytes=result.across_bytes,
        spans=result.spans,
    )
