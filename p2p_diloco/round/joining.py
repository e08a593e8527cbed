"""What a starting peer makes of the run it found, carried out: it refuses to train a finished run
alone, and says whom it joined (a new run, a dormant one, or the swarm). genesis.py decides."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2p_diloco.errors import RunFinished, StateDownloadError
from p2p_diloco.protocol import agreement
from p2p_diloco.protocol.genesis import Genesis, Verdict
from p2p_diloco.protocol.network import RoundRecord, Swarm
from p2p_diloco.protocol.outer import GlobalState

if TYPE_CHECKING:
    from p2p_diloco.round.replica import Replica


def refuse_a_finished_run(
    replica: Replica, held: GlobalState, swarm: Swarm, run_id: str, failure: StateDownloadError | None = None
) -> None:
    """A run whose genesis says it ended is never trained on from an earlier state (alone, from
    θ(0) or from a round the peer slept through): RunFinished, exit 0, with the reason when this
    peer tried to download the final state (`failure`) and could not. Nothing is written. A peer
    that downloaded the final state goes on to the end.

    The claim is read afresh (the run may have ended while this peer settled or slept), but only
    when no other live peer trains at or behind this peer's round: in a healthy swarm, no DHT read.
    While other peers are live, the end counts only if it is their backed state (`end_is_backed`):
    one peer's record of the last round and its "finished" genesis send nobody home. `held`: the
    state this peer holds (its replica's, or the one its round just made)."""
    records = swarm.peers()
    live = agreement.live(records, swarm.stale_peers()) - {replica.peer_id}
    seen = {p: r for p, r in records.items() if p in live}
    if failure is None and any(r.round <= held.round for r in seen.values()):
        return
    final = swarm.final_state()
    # No end, this peer holds it, or a claim the live peers do not back (anyone may publish a claim).
    # A state of the final round with another digest is not the end: it is this peer's own (its
    # group was the minority and the majority's holders left).
    if (
        final is None
        or final.final_round is None
        or held.round > final.final_round
        or (held.round == final.final_round and held.digest() == final.final_digest)
        or not end_is_backed(seen, swarm.fresh_peers(), final, _own_record(replica.peer_id, held))
    ):
        if failure is not None:
            replica.log.info("the peers ahead of this one left before it could download their state: going on")
        return
    digest = final.final_digest[:12]
    ended = f"run {run_id!r} finished at round {final.final_round} (final digest {digest})"
    if failure is not None:  # an end, not a failure (exit 0): a supervisor must not restart it into the same end
        raise RunFinished(
            f"{ended}; the final state could not be downloaded: {failure}. This peer writes no final model of its "
            f"own: export the model from a peer's run dir (p2p-diloco export)"
        )
    raise RunFinished(
        f"{ended} and no peer serves its final state any more: nothing to train. Ask the organiser for the model, "
        f"or start a new run with another run.run_id"
    )


def end_is_backed(seen: dict[str, RoundRecord], fresh: set[str], final: Genesis, mine: RoundRecord) -> bool:
    """Whether the run's claimed end counts: nobody else is live (the genesis is all there is), or
    the backed state of the live peers and this one (`mine`: agreement.backed, at least half of
    the counted peers made it) is the end. One peer's claim sends no joiner of a live run home:
    beside one honest trainer and the joiner it is a third of the votes (threat model)."""
    if not seen:
        return True
    state = agreement.backed(seen, agreement.counted(seen, set(), fresh), mine.peer, mine)
    return state is not None and (state.round, state.digest) == (final.final_round, final.final_digest)


def _own_record(peer_id: str, held: GlobalState) -> RoundRecord:
    return RoundRecord(peer_id, held.round, held.digest(), 0, float("nan"))


def say_whom_it_joined(replica: Replica, swarm: Swarm, verdict: Verdict, theta0: str, run_id: str) -> None:
    """One line: the swarm this peer found, or that it found none (a solo peer says nothing).
    `theta0`: the digest of this peer's own θ(0)."""
    if swarm.solo:
        return
    if verdict.theta0 and verdict.theta0 != theta0:
        replica.log.warning(
            "this peer's theta(0) (digest %s) is not the run's (%s): another torch build? It trains from the "
            "swarm's state, never from its own theta(0)",
            theta0[:12],
            verdict.theta0[:12],
        )
    others = {p: r.round for p, r in swarm.peers().items() if p != replica.peer_id}
    if not others:
        _say_alone(replica, verdict, run_id)
        return
    rounds = sorted(set(others.values()))
    replica.log.info(
        "joined the swarm of run %r: %d other peer(s), at round %s",
        run_id,
        len(others),
        ", ".join(map(str, rounds[-3:])),
    )


def _say_alone(replica: Replica, verdict: Verdict, run_id: str) -> None:
    if verdict.kind == "new":
        seen = f"; runs seen in the swarm: {', '.join(verdict.nearby)}" if verdict.nearby else ""
        replica.log.info(
            "no run %r found in the swarm: starting it as a new run from round %d. To join an existing run "
            "instead, pass --config with its run.toml%s",
            run_id,
            replica.state.round,
            seen,
        )
        return
    replica.log.info(
        "run %r exists (its genesis has %d publisher(s)) but no other peer of it is live now: training from "
        "round %d, averaging with peers as they come",
        run_id,
        verdict.publishers,
        replica.state.round,
    )
