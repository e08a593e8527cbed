"""What a starting peer makes of the run it found, carried out: it refuses to train a finished run
alone, and says whom it joined (a new run, a dormant one, or the swarm). genesis.py decides."""

from __future__ import annotations

from typing import TYPE_CHECKING

from p2p_diloco.errors import RunFinished, StateDownloadError
from p2p_diloco.genesis import Verdict

if TYPE_CHECKING:
    from p2p_diloco.peer import Peer


def refuse_a_finished_run(peer: Peer, failure: StateDownloadError | None = None) -> None:
    """A run whose genesis says it ended is never trained on from an earlier state (alone, from
    θ(0) or from a round the peer slept through): RunFinished, exit 0, with the reason when this
    peer tried to download the final state (`failure`) and could not. Nothing is written. A peer
    that downloaded the final state goes on to the end.

    The claim is read afresh (the run may have ended while this peer settled or slept), but only
    when no other live peer trains at or behind this peer's round: in a healthy swarm, no DHT read."""
    stale = peer.swarm.stale_peers()
    live = [r.round for p, r in peer.swarm.peers().items() if p not in stale and p != peer.peer_id]
    if failure is None and any(r <= peer.state.round for r in live):
        return
    final = peer.swarm.final_state()
    # No end, this peer holds it, or a false claim of one: live peers still train the run (anyone may
    # publish a claim). A state of the final round with another digest is not the end: it is this
    # peer's own (its group was the minority and the majority's holders left).
    if (
        final is None
        or peer.state.round > final.final_round
        or (peer.state.round == final.final_round and peer.state.digest() == final.final_digest)
        or max(live, default=final.final_round) < final.final_round
    ):
        if failure is not None:
            peer.log.info("the peers ahead of this one left before it could download their state: going on")
        return
    run_id, digest = peer.config.run.run_id, final.final_digest[:12]
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


def say_whom_it_joined(peer: Peer) -> None:
    """One line: the swarm this peer found, or that it found none (a solo peer says nothing)."""
    if peer.swarm.solo:
        return
    verdict, run_id = peer.verdict, peer.config.run.run_id
    if verdict.theta0 and verdict.theta0 != peer.theta0:
        peer.log.warning(
            "this peer's theta(0) (digest %s) is not the run's (%s): another torch build? It trains from the "
            "swarm's state, never from its own theta(0)",
            peer.theta0[:12],
            verdict.theta0[:12],
        )
    others = {p: r.round for p, r in peer.swarm.peers().items() if p != peer.peer_id}
    if not others:
        _say_alone(peer, verdict, run_id)
        return
    rounds = sorted(set(others.values()))
    peer.log.info(
        "joined the swarm of run %r: %d other peer(s), at round %s",
        run_id,
        len(others),
        ", ".join(map(str, rounds[-3:])),
    )


def _say_alone(peer: Peer, verdict: Verdict, run_id: str) -> None:
    if verdict.kind == "new":
        seen = f"; runs seen in the swarm: {', '.join(verdict.nearby)}" if verdict.nearby else ""
        peer.log.info(
            "no run %r found in the swarm: starting it as a new run from round %d. To join an existing run "
            "instead, pass --config with its run.toml%s",
            run_id,
            peer.state.round,
            seen,
        )
        return
    peer.log.info(
        "run %r exists (its genesis has %d publisher(s)) but no other peer of it is live now: training from "
        "round %d, averaging with peers as they come",
        run_id,
        verdict.publishers,
        peer.state.round,
    )
