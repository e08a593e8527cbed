"""The swarm: the only package that imports hivemind. `HivemindSwarm` implements network.Swarm for real peers.

A peer's swarm has three kinds of traffic:
- **records** in the DHT, signed by their owner (I4): the run's configs (so a peer with another
  config is told which fields differ, I5), each peer's latest round (round, digest, tokens, loss)
  and its progress in the round (heartbeat.py);
- **averaging**: matchmaking for the round's group, then the consistent all-reduce (swarm/averaging/step.py,
  swarm/averaging/allreduce.py);
- **state download**: a joiner or a peer that disagrees with its group fetches (round, θ, momentum)
  from a peer, checked against the digest the swarm published.
Every wait has a deadline from the config (I3). What to make of what it reads is decided by
protocol/agreement.py: this class only does the I/O.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import Config
from p2p_diloco.errors import AveragingError, SwarmError
from p2p_diloco.protocol import agreement, budget, codecs, deadlines, reachability
from p2p_diloco.protocol.budget import SwarmProgress
from p2p_diloco.protocol.genesis import Genesis, Verdict
from p2p_diloco.protocol.network import (
    STARTED,
    AllReduced,
    Made,
    RoundRecord,
    ServedState,
    StateCheck,
    download_chunked,
    download_verified,
    history_after,
    published_loss,
)
from p2p_diloco.protocol.twolevel import Levels
from p2p_diloco.swarm.averaging.allreduce import WireCodec
from p2p_diloco.swarm.averaging.averager import DiLoCoAverager
from p2p_diloco.swarm.averaging.step import AveragingStep
from p2p_diloco.swarm.heartbeat import Entries, Heartbeat
from p2p_diloco.swarm.punching import Punching
from p2p_diloco.swarm.run_identity import RunIdentity
from p2p_diloco.swarm.transport import entry, leftovers
from p2p_diloco.swarm.transport.identity import load_identity, make_validator, peer_id_of, public_key_bytes
from p2p_diloco.swarm.transport.node import relays, start_dht
from p2p_diloco.swarm.transport.processes import children_started, stop_process
from p2p_diloco.swarm.trust import records
from p2p_diloco.swarm.trust.gate import Gate
from p2p_diloco.swarm.trust.run_dht import RunDHT

logger = logging.getLogger(__name__)

PART_SIZE_BYTES = 2 * 1024 * 1024  # faster than hivemind's 512 KiB default (docs/design.md §7)
STAGE2_WAITS = 12  # a two-level round's stage-2 wait: this part of the all-reduce's deadline (about 8 at worst)


class HivemindSwarm:
    """One peer's membership of a run's swarm."""

    solo = False
    _last_record: RoundRecord | None = None  # the latest record it published: the next one repeats it (history)

    def __init__(
        self, config: Config, run_dir: Path, numel: int, state_provider: Callable[[], ServedState], exact_numel: int = 0
    ):
        """`numel` values travel through the run's codec, `exact_numel` more (norms, biases) exact."""
        sc = config.swarm
        self.config, self._run_dir = config, run_dir
        _sweep_leftovers(run_dir)
        identity = Path(sc.identity_path) if sc.identity_path else run_dir / "identity.key"
        # Admission first: a peer that a certified run would refuse stops before it touches the network.
        self.gate = Gate(config, peer_id_of(identity))
        validator = make_validator(identity)  # the peer id signs its records: one key, one id
        self._signer = load_identity(identity)  # ... and every part and average it sends (swarm/averaging/ledger.py)
        # The entry nodes given, then the peers this run dir saw last time (swarm/transport/entry.py): a peer finds
        # the swarm even if its entry nodes are down when it restarts.
        initial = list(dict.fromkeys([*sc.initial_peers, *entry.remembered(identity)]))
        self.dht = start_dht(sc, identity, initial, sc.reachability, [validator])
        self._started: list[Any] = [self.dht]  # what close() stops, last started first
        try:
            # The run's records: this peer's threads take turns with them (RunDHT's lock discipline).
            self.run_dht = RunDHT.of_run(self.dht, validator, config)
            self._join(config, identity, numel, exact_numel, state_provider)
            leftovers.note(run_dir, [os.getpid(), self.dht.pid, self.averager.pid])  # for the next start's sweep
        except BaseException:  # also Ctrl+C during start-up: never leave a child process behind
            self.close()
            raise

    def _join(
        self, config: Config, identity: Path, numel: int, exact_numel: int, state_provider: Callable[[], ServedState]
    ) -> None:
        sc = config.swarm
        self.peer_id = str(self.dht.peer_id)
        self.reachability = self.dht.reachability
        logger.info(reachability.line(self.reachability, sc.hole_punching))
        self.download = deadlines.state_download(numel + exact_numel, sc.join_timeout_s, sc.min_download_mbps)
        self.buffer = torch.zeros(numel, dtype=torch.float32)
        self.exact_buffer = torch.zeros(exact_numel, dtype=torch.float32) if exact_numel else None
        # Error feedback: what the codec lost of this peer's last pseudo-gradient, added to its next.
        # Shared memory: the averager process writes it after each successful all-reduce.
        lossy = sc.compression in codecs.LOSSY and sc.error_feedback
        self.residual = torch.zeros(numel, dtype=torch.float32).share_memory_() if lossy else None
        self.gate.attach(self.run_dht)
        self.run = RunIdentity(config, self.run_dht, self.gate, self.peer_id)
        # A private peer under hole punching reduces for the members it holds direct connections to.
        self.punching = None
        if sc.hole_punching and not self.serves:
            self.punching = Punching(self.run_dht, relays(sc, sc.initial_peers), self._private_peers)
            self._started.insert(0, self.punching)  # (its thread starts with the heartbeat's)
        entries = Entries(self.dht, list(sc.initial_peers), identity)
        self.heartbeat = Heartbeat(self.run_dht, self.peer_id, self.gate, entries)
        self._started.insert(0, self.heartbeat)
        self.averager = self._start_averager(state_provider)
        self._started.insert(0, self.averager)
        self.heartbeat.convictions.verify = self.averager.verify_accusation
        payload_bytes = codecs.get(sc.compression).encoded_size(numel) + 4 * exact_numel
        shown = {**self.gate.gather(), "key": public_key_bytes(self._signer)}  # in the group's all-gather
        self.step = AveragingStep(
            self.averager, sc, self.peer_id, self.residual, payload_bytes, shown, self._shown_reach
        )
        self.heartbeat.start()
        if self.punching is not None:
            self.punching.start()

    def _start_averager(self, state_provider: Callable[[], ServedState]) -> DiLoCoAverager:
        tensors = [self.buffer] + ([self.exact_buffer] if self.exact_buffer is not None else [])
        try:
            with children_started():  # a signal to the peer's group leaves the averager to the peer
                return self._averager(tensors, state_provider)
        except Exception as e:  # the averager process failed to start
            raise SwarmError(f"could not start the averager: {e}") from None

    def _averager(self, tensors: list[torch.Tensor], state_provider: Callable[[], ServedState]) -> DiLoCoAverager:
        sc = self.config.swarm
        return DiLoCoAverager(
            tensors,
            self.dht,
            start=True,
            prefix=self.run_dht.prefix,
            min_group_size=2,
            min_matchmaking_time=sc.matchmaking_time_s,
            request_timeout=min(3.0, sc.matchmaking_time_s / 2),
            allreduce_timeout=sc.averaging_timeout_s,
            stage2_wait_s=sc.averaging_timeout_s / STAGE2_WAITS,
            assembly_patience_s=3 * sc.matchmaking_time_s,  # the groups' stage-1 ends spread over the slack
            next_chunk_timeout=sc.averaging_timeout_s / 4,
            compression=WireCodec(sc.compression),
            part_size_bytes=PART_SIZE_BYTES,
            client_mode=not self.serves and self.punching is None,
            leads_only_direct=self.punching is not None,
            declare_state_period=60,
            state_provider=state_provider,
            signer=self._signer,
            shutdown_timeout=5,
            residual=self.residual,
            admission=self.gate.averager_check(),
            aggregation=(sc.aggregator, sc.clip, sc.weight_cap),
            max_reduce_share=sc.max_reduce_share,
        )

    @property
    def probes(self) -> Any:
        """The latest link-probe sweep (an MPFuture of {peer: rate}); benchmarks wait on it."""
        return self.step.probes

    @probes.setter
    def probes(self, value: Any) -> None:
        self.step.probes = value

    # --- progress of the round (memory, kept fresh by the heartbeat) ---------------------------

    def report_progress(self, round_: int, tokens: int, tokens_per_s: float) -> None:
        self.heartbeat.report_progress(round_, tokens, tokens_per_s)

    def round_progress(self, round_: int, my_tokens: int, tokens_per_peer: int) -> SwarmProgress:
        cap = budget.claim_cap(self.config.swarm.claim_cap, self.config.admission.mode == "certified")
        return self.heartbeat.round_progress(round_, my_tokens, tokens_per_peer, cap)

    def stale_peers(self) -> set[str]:
        return self.heartbeat.stale_peers()

    def fresh_peers(self) -> set[str]:
        return self.heartbeat.fresh_peers()

    def swarm_round(self) -> int | None:
        return self.heartbeat.swarm_round()

    # --- records -----------------------------------------------------------------------------

    def visible_maddrs(self) -> list[str]:
        """This node's addresses as p2pd has them now: a port the router mapped (swarm.upnp) comes
        seconds after the start. A mapping that failed shows as port 0: not an address."""
        with self.run_dht.turn() as dht:
            return [str(m) for m in dht.get_visible_maddrs(latest=True) if "/tcp/0/" not in f"{m}/"]

    def check_config(self, theta0: str) -> Verdict:
        return self.run.check(theta0)

    def publish_final(self, round_: int, digest: str) -> None:
        self.run.publish_final(round_, digest)

    def final_state(self) -> Genesis | None:
        return self.run.final_state()

    @property
    def serves(self) -> bool:
        """Others can dial this peer: it reduces and serves its state (its tier, decided at start)."""
        return self.reachability.serves

    def publish_round(self, round_: int, digest: str, tokens: int, loss: float, made: Made = STARTED) -> None:
        addrs, history = tuple(self.visible_maddrs()), history_after(self._last_record, round_)
        record = RoundRecord(
            *(self.peer_id, round_, digest, tokens, published_loss(loss), addrs, self.serves, made.copied),
            *(tuple(sorted(made.group)), made.outcome, history, self.punching is not None, made.groups, made.spans),
        )
        self.run_dht.publish_round(record)
        self._last_record = record
        self.heartbeat.published(record)

    def peers(self) -> dict[str, RoundRecord]:
        """The latest round record of every live peer of this run, by peer id."""
        (entries,) = self.run_dht.read(records.rounds_key)
        return records.rounds_from(entries, self.gate.admitted)  # admitted peers' only, none else parsed

    def wait_for_round(self, round_: int, timeout: float) -> bool:
        """Whether the swarm's backed state (agreement.backed) reaches round `round_` (or later)
        within `timeout` s, with a peer that serves it."""

        def backed() -> agreement.Reference | None:
            seen = self.peers()
            counted = agreement.counted(seen, self.stale_peers(), self.fresh_peers())
            return agreement.backed(seen, counted, self.peer_id, reachable=self.direct_peers())

        def reached(state: agreement.Reference | None) -> bool:
            return state is not None and bool(state.holders) and state.round >= round_

        return reached(deadlines.round_poll(backed, reached, time.monotonic() + timeout))

    def wait_for_digests(self, round_: int, expected: tuple[str, ...]) -> dict[str, str]:
        """Digests of round `round_` published by `expected`, waiting until all are in (a peer whose
        heartbeat stopped is not waited for) or swarm.agreement_timeout_s."""

        def read() -> tuple[dict[str, str], bool]:
            seen = self.peers()
            found = {p: r.digest for p, r in seen.items() if p in expected and r.round == round_}
            # One record per peer: one already past the round will never show its digest of it.
            past = {p for p, r in seen.items() if r.round > round_}
            return found, not agreement.still_waiting(expected, found, self.stale_peers() | past)

        deadline = time.monotonic() + self.config.swarm.agreement_timeout_s
        return deadlines.round_poll(read, lambda got: got[1], deadline)[0]

    def wait_for_reachable_peer(self, round_: int | None = None) -> None:
        """A private peer cannot reduce or serve: it needs a live public peer of the run to train
        with, at start and (`round_`) whenever it found no group. Waits until one beats, up to
        swarm.join_timeout_s."""
        before = self.heartbeat.beats()

        def beating() -> bool:
            serving = {p for p, r in self.peers().items() if r.serves and p != self.peer_id}
            if reachability.beaten_since(serving - self.stale_peers(), before, self.heartbeat.beats()):
                return True
            if self.punching is None:  # else a private peer it holds a direct connection to will do
                return False
            punched = self.direct_peers() & self._private_peers()  # (its thread punches)
            return reachability.beaten_since(punched, before, self.heartbeat.beats())

        timeout = self.config.swarm.join_timeout_s
        if not deadlines.round_poll(beating, bool, time.monotonic() + timeout):
            unpunched = len(self._private_peers()) if self.punching is not None else 0
            raise SwarmError(reachability.nobody_serves(self.config.run.run_id, round_, timeout, unpunched))

    # --- averaging and state download ---------------------------------------------------------

    def average(
        self,
        delta: torch.Tensor,
        weight: float,
        round_: int,
        retry: bool = False,
        expected_group: int = 0,
        exact: torch.Tensor | None = None,
        levels: Levels | None = None,
    ) -> AllReduced | None:
        """All-reduce this round's pseudo-gradient with the peers that reached the same round.

        `delta` travels through the run's codec, plus what the codec lost of this peer's last
        successful one (error feedback); `exact` (norms, biases) travels exact.

        `retry`: this round's all-reduce failed before; wait long enough for the other survivors.
        `expected_group`: how many peers are at the round; a group that size starts at once.
        `levels`: a two-level round (docs/design.md §3, "Past one group"): this peer averages with its
        bucket's group, then across groups (swarm/averaging/across.py); None: one group.
        Returns None when no other peer showed up within the matchmaking window (the peer then
        averages alone). Raises AveragingError if a group formed but its all-reduce failed, or if
        the swarm finished the round while this peer still looked for a group: the caller's
        `delta` is untouched and nothing was applied (I2).
        """
        self.gate.check_self()
        self.averager.set_revoked(self.gate.revoked)
        if self.punching is not None:
            # While a public peer is live it leads: a private one leading too could split the round.
            public = {p for p, r in self.peers().items() if r.serves and p != self.peer_id} - self.stale_peers()
            self.averager.set_leading(not public)
        try:
            overtaken = partial(self.wait_for_round, round_ + 1, 0.0)
            return self.step.run(delta, weight, round_, retry, expected_group, exact, overtaken, levels)
        except AveragingError:
            # This peer may have convicted a reducer (swarm/averaging/auditor.py), or met a bad signature:
            # before anything else reads the swarm's records, theirs count no more.
            self.gate.convict(self.step.convicted())
            raise

    def direct_peers(self) -> set[str]:
        """The peers this one holds a direct connection to, under hole punching (none without):
        the private ones among them it punched to. (No read of the records: callers hold them.)"""
        return self.punching.direct() if self.punching is not None else set()

    def _private_peers(self) -> set[str]:
        """The live private peers of the run, this one aside."""
        private = {p for p, r in self.peers().items() if not r.serves and p != self.peer_id}
        return private - self.stale_peers()

    def _shown_reach(self) -> dict[str, Any]:
        """What this peer shows its group of how it is reached (links.reachable_reducers)."""
        return {"serves": self.serves} if self.punching is None else self.punching.shown(self.punching.direct())

    def download_state(self, round_: int, digest: str, from_peers: list[str], verify: StateCheck) -> ServedState:
        """(metadata, [θ, momentum]) of round `round_` from `from_peers`, checked by `verify` (which
        returns the digest of what arrived): in chunks from all of them at once (`download_chunked`),
        or, from holders that serve no chunks, whole from one at a time. A peer that sends anything
        else is skipped.
        A revoked peer stops here too (AdmissionError, exit 2): one that is behind only ever asks
        for states, and the others refuse to serve it."""
        self.gate.check_self()
        return download_from(self.averager, self.download, (round_, digest), from_peers, verify)

    def close(self) -> None:
        """Leave the swarm: stop the averager and the DHT processes, in that order (also on errors
        and on a half-built swarm), then unlink the shared memory they and this process made."""
        for part in self._started:
            if isinstance(part, Heartbeat | Punching):
                part.stop()
            else:
                stop_process(part, "averaging process" if part is not self.dht else "DHT process")
        self._started = []
        _release_shared_memory(self._run_dir)


def _release_shared_memory(run_dir: Path) -> None:
    """At a clean end, once the averager and DHT processes ended: unlink what they made (the
    run dir's noted processes that are gone) and what this process made (leftovers.py)."""
    leftovers.sweep(run_dir)
    leftovers.release_own()


def _sweep_leftovers(run_dir: Path) -> None:
    """Remove the shared memory this run dir's last peer left if it was killed (leftovers.py)."""
    count, size = leftovers.sweep(run_dir)
    if count:
        logger.info(
            "removed %d shared-memory segments (%.0f MB) in %s that this run dir's last peer left when it was killed",
            count,
            size / 1e6,
            leftovers.SHM,
        )


def download_from(
    averager: DiLoCoAverager,
    download: deadlines.Download,
    wanted: tuple[int, str],
    holders: list[str],
    verify: StateCheck,
) -> ServedState:
    """The state `wanted` (round, digest) from `holders`, through this peer's averager process.
    In chunks, every manifest tried shares one download deadline (I3): a majority's manifest of
    another state leaves the next one what is left, at least `stall_s`, and the catch-up asks again."""
    (round_, digest), stall_s = wanted, download.stall_s
    deadline = time.monotonic() + download.total_s
    chunked = download_chunked(
        lambda peers: averager.state_manifests(peers, wanted, stall_s),
        lambda manifest, some: averager.download_chunks(
            manifest, some, max(stall_s, deadline - time.monotonic()), stall_s
        ),
        holders,
        verify,
        wanted,
    )
    if chunked is not None:
        logger.info("downloaded round %d (digest %s) in chunks from %d holder(s)", round_, digest[:12], len(chunked[0]))
        return chunked[1]
    # No holder serves chunks (peers of an older version): the whole state from one at a time.
    _, state = download_verified(
        lambda peer, timeout: averager.download_state_from(peer, timeout, stall_s),
        holders,
        download.total_s,
        verify,
        lambda r, d: (r, d) == wanted,
        f"the published round {round_} with digest {digest[:12]}",
    )
    return state


__all__ = ["HivemindSwarm"]
