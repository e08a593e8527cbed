"""The swarm: the only package that imports hivemind. `Swarm` is the one seam the peer talks to.

A peer's swarm has three kinds of traffic:
- **records** in the DHT, signed by their owner (I4): the run's configs (so a peer with another
  config is told which fields differ, I5) and each peer's latest round (round, digest, tokens, loss);
- **averaging**: matchmaking for the round's group, then the consistent all-reduce (allreduce.py);
- **state download**: a joiner or a peer that disagrees with its group fetches (round, θ, momentum)
  from a peer and checks it against the digest the swarm published.
Every wait has a deadline from the config (I3).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
from hivemind.averaging.allreduce import AllreduceException
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PDaemonError, P2PHandlerError

from p2p_diloco import codecs
from p2p_diloco.config import Config, diff_shared
from p2p_diloco import links
from p2p_diloco.rounds import Progress, SwarmProgress, swarm_progress
from p2p_diloco.errors import AveragingError, RunConfigMismatch, StateDownloadError, SwarmError
from p2p_diloco.swarm import records
from p2p_diloco.swarm.allreduce import DiLoCoAverager, WireCodec
from p2p_diloco.swarm.node import make_validator, start_dht

logger = logging.getLogger(__name__)

# What a failed averaging step raises from inside hivemind; anything else is a bug and propagates.
HIVEMIND_ERRORS = (AllreduceException, MatchmakingException, P2PDaemonError, P2PHandlerError, TimeoutError,
                   asyncio.TimeoutError, ConnectionError, asyncio.CancelledError)
PART_SIZE_BYTES = 2 * 1024 * 1024  # 25-30 % faster than hivemind's 512 KiB default, measured here
PROGRESS_INTERVAL_S = 1.0  # how often a peer publishes its progress and reads everyone's
STEP_MARGIN_S = 30.0  # the averager process's hand-over and wrap-up, beyond the step's own deadlines
STALE_S = 10.0  # a peer whose progress report is older than this no longer counts in the round


@dataclass(frozen=True)
class Averaged:
    """The round's average and what it cost."""

    delta: torch.Tensor  # flat fp32, identical bytes on every member of the group
    exact: torch.Tensor | None  # the exact part (norms, biases), if the swarm has one
    group: tuple[str, ...]  # peer ids of the group, this peer included
    allreduce_s: float
    bytes_sent: int
    bytes_received: int
    link_bps: float | None = None  # the link figure this peer announced (bytes/s, links.LinkMeter), if any


class Swarm:
    """One peer's membership of a run's swarm."""

    def __init__(self, config: Config, run_dir: Path, numel: int, state_provider: Callable[[], tuple[dict, list]],
                 exact_numel: int = 0):
        """`numel` values travel through the run's codec, `exact_numel` more (norms, biases) exact."""
        sc = config.swarm
        self.config = config
        self.prefix = records.run_prefix(config.run.run_id, config.fingerprint())
        identity = Path(sc.identity_path) if sc.identity_path else run_dir / "identity.key"
        self.validator = make_validator()
        self.dht = start_dht(sc, identity, sc.initial_peers, sc.client_mode, [self.validator])
        self.peer_id = str(self.dht.peer_id)
        self.buffer = torch.zeros(numel, dtype=torch.float32)
        self.exact_buffer = torch.zeros(exact_numel, dtype=torch.float32) if exact_numel else None
        # Error feedback: what the codec lost of this peer's last pseudo-gradient, added to its next.
        # Shared memory: the averager process writes it after each successful all-reduce.
        lossy = sc.compression in codecs.LOSSY and sc.error_feedback
        self.residual = torch.zeros(numel, dtype=torch.float32).share_memory_() if lossy else None
        self._payload_bytes = codecs.get(sc.compression).encoded_size(numel) + 4 * exact_numel
        self._probed_round: int | None = None  # the round after whose all-reduce this peer last probed
        self.probes = None  # the latest probe sweep (an MPFuture of {peer: rate}); benchmarks wait on it
        # hivemind's DHT handle is one pipe: the heartbeat thread and the peer's thread take turns.
        self._dht_lock = threading.Lock()
        self._last_record: records.RoundRecord | None = None
        self._last_refresh = 0.0
        # The progress of this peer's round (published) and of everyone's (read), kept fresh by one
        # background thread so that the training loop only ever reads memory.
        self._my_progress: Progress | None = None
        self._reports: list[Progress] = []
        self._rounds_seen: dict[str, records.RoundRecord] = {}
        self._stop_heartbeat = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="swarm-heartbeat", daemon=True)
        try:
            self.averager = DiLoCoAverager(
                [self.buffer] + ([self.exact_buffer] if self.exact_buffer is not None else []), self.dht,
                start=True, prefix=self.prefix,
                min_group_size=2, min_matchmaking_time=sc.matchmaking_time_s,
                request_timeout=min(3.0, sc.matchmaking_time_s / 2), allreduce_timeout=sc.averaging_timeout_s,
                next_chunk_timeout=sc.averaging_timeout_s / 4, compression=WireCodec(sc.compression),
                part_size_bytes=PART_SIZE_BYTES, client_mode=sc.client_mode, declare_state_period=60,
                state_provider=state_provider, shutdown_timeout=5, residual=self.residual,
            )
        except Exception as e:  # the averager process failed to start: never leave the DHT running
            self.dht.shutdown()
            raise SwarmError(f"could not start the averager: {e}") from None
        self._heartbeat.start()

    def _heartbeat_loop(self) -> None:
        """Every PROGRESS_INTERVAL_S: publish this peer's progress in its round and read everyone's.
        Every REFRESH_S: re-publish this peer's round record, which expires after RECORD_TTL_S, so a
        peer that died drops out of everyone's view within a minute and a half."""
        while not self._stop_heartbeat.wait(PROGRESS_INTERVAL_S):
            try:
                self._beat()
            except Exception as e:  # a failed beat is retried at the next one; never kill the peer
                logger.debug("heartbeat failed: %s", e)

    def _beat(self) -> None:
        now = time.time()
        mine = self._my_progress
        with self._dht_lock:
            if self._last_record is not None and now - self._last_refresh >= records.REFRESH_S:
                records.publish_round(self.dht, self.validator, self.prefix, self._last_record)
                self._last_refresh = now
            if mine is not None:
                records.publish_progress(self.dht, self.validator, self.prefix, replace(mine, time=now))
            reports = records.read_progress(self.dht, self.prefix)
            rounds_seen = records.read_rounds(self.dht, self.prefix)
        self._reports, self._rounds_seen = reports, rounds_seen

    # --- progress of the round ----------------------------------------------------------------

    def report_progress(self, round_: int, tokens: int, tokens_per_s: float) -> None:
        """This peer's progress in its round; the heartbeat publishes it (with rate 0 once the
        inner phase ended, so nobody extrapolates tokens that will never come)."""
        self._my_progress = Progress(self.peer_id, round_, tokens, tokens_per_s, time.time())

    def round_progress(self, round_: int, my_tokens: int, tokens_per_peer: int) -> SwarmProgress:
        """The swarm's progress in `round_` as of the last heartbeat; reads memory only."""
        return swarm_progress(self.peer_id, round_, my_tokens, self._reports, time.time(), tokens_per_peer, STALE_S)

    def stale_peers(self) -> set[str]:
        """Peers whose heartbeat stopped more than STALE_S ago: dead, hung, or asleep. Nobody waits
        for them. (A peer not heard of at all is not stale: it may have just started.)"""
        now = time.time()
        return {r.peer for r in self._reports if now - r.time > STALE_S}

    def swarm_round(self) -> int | None:
        """The latest round a peer that serves its state has published, as of the last heartbeat."""
        served = [r.round for r in self._rounds_seen.values() if r.serves]
        return max(served) if served else None

    def visible_maddrs(self) -> list[str]:
        with self._dht_lock:
            return [str(m) for m in self.dht.get_visible_maddrs()]

    # --- records -----------------------------------------------------------------------------

    def check_config(self) -> None:
        """Publish this peer's shared config; refuse to join a run whose peers hold another (I5)."""
        mine = self.config.shared_dict()
        with self._dht_lock:
            others = records.read_configs(self.dht, self.config.run.run_id)
            records.publish_config(self.dht, self.validator, self.config.run.run_id, self.config.fingerprint(), mine)
        if others and self.config.fingerprint() not in others:
            fp, shared = next(iter(others.values()))
            raise RunConfigMismatch(
                f"run {self.config.run.run_id!r} is running with another config (fingerprint {fp}); fields that "
                f"differ (swarm != this peer): {'; '.join(diff_shared(shared, mine))}; use the run's config file"
            )

    def publish_round(self, round_: int, digest: str, tokens: int, loss: float) -> None:
        record = records.RoundRecord(
            peer=self.peer_id, round=round_, digest=digest, tokens=tokens, loss=loss if math.isfinite(loss) else -1.0,
            addrs=tuple(self.visible_maddrs()), serves=not self.config.swarm.client_mode)
        with self._dht_lock:
            records.publish_round(self.dht, self.validator, self.prefix, record)
        self._last_record, self._last_refresh = record, time.time()
        mine = self._my_progress
        if mine is None or mine.round < round_:  # a new round: no tokens in it yet
            self._my_progress = Progress(self.peer_id, round_, 0, 0.0, time.time())

    def peers(self) -> dict[str, records.RoundRecord]:
        """The latest round record of every live peer of this run, by peer id."""
        with self._dht_lock:
            return records.read_rounds(self.dht, self.prefix)

    def peers_at(self, *rounds: int) -> set[str]:
        """Live peer ids whose latest record is at one of `rounds`."""
        return {p for p, r in self.peers().items() if r.round in rounds} - self.stale_peers()

    def latest(self) -> tuple[int, str, list[str]] | None:
        """(round, majority digest, peers holding it) of the swarm's latest round, or None if nobody is there."""
        return records.latest_majority(self.peers().values())

    def wait_for_round(self, round_: int, timeout: float) -> bool:
        """Whether a peer that serves its state publishes round `round_` (or later) within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            latest = self.latest()
            if latest is not None and latest[0] >= round_:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)  # a DHT poll interval, bounded by the deadline above

    def wait_for_digests(self, round_: int, group: tuple[str, ...]) -> dict[str, str]:
        """Digests of round `round_` published by the group's members, waiting until all are in (a
        member whose heartbeat stopped is not waited for) or the deadline."""
        deadline = time.monotonic() + self.config.swarm.agreement_timeout_s
        while True:
            found = {p: r.digest for p, r in self.peers().items() if p in group and r.round == round_}
            waiting = set(group) - set(found) - self.stale_peers()
            if not waiting or time.monotonic() > deadline:
                return found
            time.sleep(0.2)  # a DHT poll interval, bounded by the deadline above

    def majority(self, digests: dict[str, str]) -> tuple[str, list[str]]:
        """The majority digest among `digests` (ties: the smallest) and the peers holding it that
        can serve it (client-mode peers cannot)."""
        clients = {p for p, r in self.peers().items() if not r.serves}
        if self.config.swarm.client_mode:
            clients.add(self.peer_id)
        # Client-mode peers follow the reachable ones: their digests count only if nobody else's is in.
        counted = {p: d for p, d in digests.items() if p not in clients} or digests
        winner = records.majority(counted)
        return winner, sorted(p for p, d in digests.items() if d == winner and p not in clients)

    def wait_for_reachable_peer(self) -> None:
        """A client-mode peer cannot reduce or serve: it needs a reachable peer of the run to train with."""
        deadline = time.monotonic() + self.config.swarm.join_timeout_s
        while not any(r.serves for r in self.peers().values()):
            if time.monotonic() > deadline:
                raise SwarmError(
                    f"no reachable peer of run {self.config.run.run_id!r} within {self.config.swarm.join_timeout_s:g} s: "
                    f"a client-mode peer needs at least one peer that others can connect to; start one, or turn "
                    f"swarm.client_mode off if this peer is reachable")
            time.sleep(0.5)  # a DHT poll interval, bounded by the deadline above

    # --- averaging ---------------------------------------------------------------------------

    def average(self, delta: torch.Tensor, weight: float, round_: int, retry: bool = False,
                expected_group: int = 0, exact: torch.Tensor | None = None) -> Averaged | None:
        """All-reduce this round's pseudo-gradient with the peers that reached the same round.

        `delta` travels through the run's codec, plus what the codec lost of this peer's last
        successful one (error feedback); `exact` (norms, biases) travels exact.

        `retry`: this round's all-reduce failed before; wait long enough for the other survivors.
        `expected_group`: how many peers are at the round; a group that size starts at once.
        Returns None when no other peer showed up within the matchmaking window (the peer then
        averages alone). Raises AveragingError if a group formed but its all-reduce failed: the
        caller's `delta` is untouched and nothing was applied (I2).
        """
        self._check_averager()
        with self.averager.get_tensors() as buffers:
            buffers[0].copy_(delta if self.residual is None else delta + self.residual)
            if exact is not None:
                buffers[1].copy_(exact)
        self.averager.set_group_bits(records.round_bits(round_))
        if expected_group >= 2:
            self.averager.set_target_group_size(expected_group)
        sc = self.config.swarm
        timeout = sc.matchmaking_time_s * 3
        if retry:
            # Survivors notice a failed all-reduce at different moments: a reducer that drops a
            # sender at once, a sender only when its reducer's timeout (half the averaging
            # deadline) runs out. Wait that much longer so they still meet.
            timeout += sc.averaging_timeout_s / 2
        # The whole step, matchmaking and all-reduce, is bounded (I3); hivemind's own step() would
        # wait forever on an averager process that died or hung.
        deadline = timeout + sc.averaging_timeout_s + STEP_MARGIN_S
        link_bps, seen = self._link_report()
        self.averager.bandwidth = link_bps  # announced in the group's all-gather; None = no claim
        try:
            control = self.averager.start_step(float(weight), timeout, {"round": round_, "seen": seen},
                                               init_timeout=STEP_MARGIN_S)
        except TimeoutError as e:
            self._check_averager()
            raise AveragingError(f"round {round_}: {e}") from None
        try:
            result = self._wait_for(control, deadline)
        except HIVEMIND_ERRORS as e:
            if not control.done():  # this method's deadline, not hivemind's
                control.cancel()
                raise AveragingError(f"round {round_}: the averaging step did not end within {deadline:g} s "
                                     f"(matchmaking {timeout:g} s + all-reduce {sc.averaging_timeout_s:g} s); "
                                     f"nothing applied") from None
            if "could not find a group" in str(e).lower() or isinstance(e, TimeoutError):
                return None
            raise AveragingError(f"round {round_} all-reduce failed: {type(e).__name__}: {str(e)[:200]}") from None
        if result is None:
            return None
        gathered = result["gathered"]
        bad = [str(p) for p, g in gathered.items() if not isinstance(g, dict) or g.get("round") != round_]
        if bad:
            raise AveragingError(f"round {round_}: group members {bad} averaged another round; result dropped")
        with self.averager.get_tensors() as buffers:
            averaged = [b.clone() for b in buffers]
        members = sorted(str(p) for p in gathered)
        at = members.index(self.peer_id) if self.peer_id in members else 0
        # Each member starts with the one after it: while they all probe at once, no receiver gets two.
        self._probe_links(round_, members[at + 1:] + members[:at])
        return Averaged(averaged[0], averaged[1] if len(averaged) > 1 else None, tuple(members), result["allreduce_s"],
                        result.get("bytes_sent", 0), result.get("bytes_received", 0), link_bps)

    def _link_report(self) -> tuple[float | None, dict[str, float]]:
        """This peer's link figure and what it measured of others' probes (links.py), or nothing
        (no claim, no vouches) if probing is off or the averager process does not answer in time."""
        if not self.config.swarm.probe_links:
            return None, {}
        try:
            return self.averager.link_report(timeout=STEP_MARGIN_S)
        except FuturesTimeout:
            self._check_averager()
            return None, {}

    def _probe_links(self, round_: int, others: list[str]) -> None:
        """After an all-reduce, every links.PROBE_EVERY rounds: probe the group's other members in the
        background (the averager process), while the next inner phase trains and the link is idle."""
        if not self.config.swarm.probe_links or not others:
            return
        if self._probed_round is not None and round_ - self._probed_round < links.PROBE_EVERY:
            return
        self._probed_round = round_
        self.probes = self.averager.probe(others, links.probe_size(self._payload_bytes),
                                          timeout=self.config.swarm.averaging_timeout_s)

    def _wait_for(self, control: Any, deadline: float) -> Any:
        """The step's result within `deadline` s, checking every second that the averager lives."""
        end = time.monotonic() + deadline
        while True:
            try:
                return control.result(timeout=min(1.0, max(0.0, end - time.monotonic())))
            except FuturesTimeout:
                if control.done() or time.monotonic() >= end:
                    raise
                self._check_averager()

    def _check_averager(self) -> None:
        """The averager runs in a child process; if it died, no round can be averaged again."""
        if not self.averager.is_alive():
            raise SwarmError(f"this peer's averaging process died (exit code {self.averager.exitcode}); "
                             f"the last round's checkpoint is on disk: restart the peer with --resume")

    # --- state download ----------------------------------------------------------------------

    def download_state(self, round_: int, digest: str, from_peers: list[str],
                       verify: Callable[[dict, list[torch.Tensor]], str]) -> tuple[dict, list[torch.Tensor]]:
        """(metadata, [θ, momentum]) of round `round_` from one of `from_peers`, checked by `verify`
        (which returns the digest of what arrived). A peer that sends anything else is skipped."""
        problems = []
        for peer in from_peers:
            if peer == self.peer_id:
                continue
            try:
                got = self.averager.download_state_from(peer, timeout=self.config.swarm.join_timeout_s)
            except Exception as e:  # a dead, slow or refusing peer: try the next one
                problems.append(f"{peer[-6:]}: {type(e).__name__} {str(e)[:80]}")
                continue
            if got is None:
                problems.append(f"{peer[-6:]}: sent nothing")
                continue
            metadata, tensors = got
            actual = verify(metadata, tensors)
            if metadata.get("round") == round_ and actual == digest:
                return metadata, tensors
            problems.append(f"{peer[-6:]}: state of round {metadata.get('round')} digest {actual[:12]} "
                            f"does not match the published {digest[:12]} (rejected)")
            logger.warning("rejected the state offered by %s: digest %s, the swarm published %s", peer, actual, digest)
        raise StateDownloadError(f"no peer served round {round_} with digest {digest[:12]}: {'; '.join(problems) or 'no peers'}")

    def close(self) -> None:
        """Leave the swarm: stop the averager and the DHT processes (also on errors)."""
        self._stop_heartbeat.set()
        if self._heartbeat.is_alive():
            self._heartbeat.join(timeout=10)
        for part in (self.averager, self.dht):
            try:
                part.shutdown()
            except Exception as e:  # a part that already died: nothing left to stop
                logger.debug("shutdown of %s: %s", type(part).__name__, e)


__all__ = ["Averaged", "Swarm"]
