"""A fake of network.Swarm for in-process round tests: one real peer, the other peers scripted.

The test writes what the other peers published (`records`), what they serve (`states`), whose
heartbeat stopped (`stale`) and what each averaging attempt gives (`script`: one entry per call of
`average`, a function of the call that returns an AllReduced, returns None for "nobody came", or
raises AveragingError). Peers in `agreeing` move in lockstep with this peer: their records mirror
the last one it published. Everything the peer did is kept for the test to check.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from p2p_diloco.errors import StateDownloadError, SwarmError
from p2p_diloco.protocol import agreement, outer, reachability
from p2p_diloco.protocol.budget import SwarmProgress
from p2p_diloco.protocol.genesis import Genesis, Verdict
from p2p_diloco.protocol.network import STARTED, AllReduced, Made, RoundRecord, ServedState, StateCheck
from p2p_diloco.protocol.twolevel import Levels

ME = "12D3KooWfakeme"


@dataclass
class Call:
    """One call of `average`: what the peer sent."""

    delta: torch.Tensor
    exact: torch.Tensor | None
    weight: float
    round: int
    retry: bool
    expected_group: int
    levels: Levels | None = None


Step = Callable[[Call], "AllReduced | None"]


@dataclass
class FakeSwarm:
    peer_id: str = ME
    solo: bool = False
    serves: bool = True
    script: list[Step] = field(default_factory=list)
    records: dict[str, RoundRecord] = field(default_factory=dict)
    states: dict[str, ServedState] = field(default_factory=dict)
    stale: set[str] = field(default_factory=set)
    fresh: set[str] = field(default_factory=set)
    direct: set[str] = field(default_factory=set)  # private peers it holds a direct connection to
    agreeing: set[str] = field(default_factory=set)
    ahead: int | None = None  # what swarm_round() says while a phase trains (a swarm that went on)
    on_progress: Callable[[int, int], None] | None = None  # called with (round, tokens) as the peer reports
    on_download: Callable[[int], None] | None = None  # called with the round the peer asks for
    on_read: Callable[[int], None] | None = None  # called with the count of the peer's reads of peers()
    reads: int = 0
    calls: list[Call] = field(default_factory=list)
    results: list[AllReduced | None] = field(default_factory=list)
    published: list[RoundRecord] = field(default_factory=list)
    reported: list[tuple[int, int, float]] = field(default_factory=list)  # (round, tokens, tokens/s) as reported
    downloads: list[tuple[int, str, list[str]]] = field(default_factory=list)
    verdict: Verdict | None = None  # what check_config() says (default: join if others published, else new)
    final: Genesis | None = None  # what final_state() says: a run whose genesis claims its end
    finals: list[tuple[int, str]] = field(default_factory=list)  # the peer's publish_final calls
    closed: bool = False
    public_left: bool = False  # no public peer beats: wait_for_reachable_peer raises
    reachable_waits: list[int | None] = field(default_factory=list)  # its calls (None: at start)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --- what the test scripts -------------------------------------------------------------------

    def publish_other(self, peer: str, state: outer.GlobalState, serves: bool = True) -> None:
        """Another peer publishes `state` as its latest round and serves it."""
        with self._lock:
            self.records[peer] = RoundRecord(peer, state.round, state.digest(), 10, 1.0, serves=serves)
            self.states[peer] = (
                {"round": state.round, "digest": state.digest()},
                [outer.flatten(state.params), outer.flatten(state.momentum)],
            )

    def group(self, *others: str) -> Step:
        """A group of this peer and `others` whose other members sent Δ = 0 with the same weight:
        the average is this peer's Δ / (1 + len(others)). Unless `others` published records of
        their own, they move in lockstep with this peer (`agreeing`)."""

        def step(call: Call) -> AllReduced:
            k = 1 + len(others)
            exact = call.exact / k if call.exact is not None else None
            members = tuple(sorted((self.peer_id, *others)))
            self.agreeing.update(p for p in others if p not in self.records)
            return AllReduced(call.delta / k, exact, members, 0.25, 1000 * k, 2000 * k, None, 0.15, 0.05, 500 * k)

        return step

    # --- network.Swarm ---------------------------------------------------------------------------

    def check_config(self, theta0: str) -> Verdict:
        return self.verdict or Verdict("join" if self.peers() else "new")

    def publish_final(self, round_: int, digest: str) -> None:
        self.finals.append((round_, digest))

    def final_state(self) -> Genesis | None:
        # The genesis records the verdict was judged from hold the same claim (the real swarm reads both there).
        return self.final if self.final is not None or self.verdict is None else self.verdict.final

    def wait_for_reachable_peer(self, round_: int | None = None) -> None:
        self.reachable_waits.append(round_)
        if self.public_left:
            raise SwarmError(reachability.nobody_serves("fake", round_, 0))

    def publish_round(self, round_: int, digest: str, tokens: int, loss: float, made: Made = STARTED) -> None:
        record = RoundRecord(
            self.peer_id, round_, digest, tokens, loss, copied=made.copied, group=made.group, outcome=made.outcome
        )
        with self._lock:
            self.published.append(record)

    def peers(self) -> dict[str, RoundRecord]:
        self.reads += 1
        if self.on_read is not None:
            self.on_read(self.reads)
        with self._lock:
            if not self.published:
                return dict(self.records)
            last = self.published[-1]
            mirrors = {
                p: RoundRecord(p, last.round, last.digest, last.tokens, 1.0)
                for p in self.agreeing
                if p not in self.records
            }
            return {**self.records, **mirrors, self.peer_id: last}

    def stale_peers(self) -> set[str]:
        return set(self.stale)

    def fresh_peers(self) -> set[str]:
        return set(self.fresh)

    def direct_peers(self) -> set[str]:
        return set(self.direct)

    def wait_for_round(self, round_: int, timeout: float) -> bool:
        seen = self.peers()
        state = agreement.backed(seen, agreement.counted(seen, self.stale, self.fresh), self.peer_id)
        return state is not None and bool(state.holders) and state.round >= round_

    def wait_for_digests(self, round_: int, expected: tuple[str, ...]) -> dict[str, str]:
        return {p: r.digest for p, r in self.peers().items() if p in expected and r.round == round_}

    def report_progress(self, round_: int, tokens: int, tokens_per_s: float) -> None:
        self.reported.append((round_, tokens, tokens_per_s))
        if self.on_progress is not None:
            self.on_progress(round_, tokens)

    def round_progress(self, round_: int, my_tokens: int, tokens_per_peer: int) -> SwarmProgress:
        return SwarmProgress(float(my_tokens), tokens_per_peer, 1)

    def swarm_round(self) -> int | None:
        return self.ahead

    def average(
        self, delta, weight, round_, retry=False, expected_group=0, exact=None, levels=None
    ) -> AllReduced | None:
        exact = None if exact is None else exact.clone()
        call = Call(delta.clone(), exact, weight, round_, retry, expected_group, levels)
        self.calls.append(call)
        step = self.script.pop(0) if self.script else (lambda call: None)
        result = step(call)
        self.results.append(result)
        return result

    def download_state(self, round_: int, digest: str, from_peers: list[str], verify: StateCheck) -> ServedState:
        self.downloads.append((round_, digest, list(from_peers)))
        if self.on_download is not None:
            self.on_download(round_)
        mismatched = {}
        for peer in from_peers:
            served = self.states.get(peer)
            if served is None:
                continue
            actual = verify(*served)
            if served[0]["round"] == round_ and actual == digest:
                return served
            mismatched[peer] = (served[0]["round"], actual)
        raise StateDownloadError(f"no peer served round {round_} with digest {digest[:12]}", mismatched)

    def close(self) -> None:
        self.closed = True
