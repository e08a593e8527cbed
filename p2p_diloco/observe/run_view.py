"""What an observer makes of a run from its DHT records (pure): rounds, who counted, contributors.

The observer reads, every second or so, each peer's latest round record (signed by the peer: its
round, digest, tokens, the group it averaged with and how the round went) and progress report.
`RunLog` keeps what it saw, round by round, and `RunLog.view` answers the organiser's and the
volunteer's questions from it:
- which peers are online (a fresh progress report or round record), and their tier: public (others can
  dial it: it reduces and serves) or private (behind NAT: a client; protocol/reachability.py);
- per round: the agreed digest (most peers' digest) and whether every peer agreed, the group,
  who was counted and who was not, and why;
- contributors by verified work: a peer is credited with its tokens of round r only if its
  record of r holds the round's agreed digest and another member of its group lists it too
  (a peer's own claim alone credits nothing), and only with what its group's average weighed
  them at (`robust.weighed_tokens`: a fast peer's tokens count up to `swarm.weight_cap` × its
  group's lower median under the default aggregator), its trained tokens beside them;
- peers the organiser revoked and peers others convicted in audits, marked with why, in the
  peers, the rounds they were not counted in from then on, and the contributors;
- throughput (tokens per round, the swarm's tokens/s from each online peer's last measured
  speed), and when the current round is due (the median round's length after its start).

Records are untrusted (I4): they arrive parsed and signed by their peer, and nothing here trusts a
claim that only its peer makes. A poll reads each peer's latest record, and that record repeats the
peer's final records of its last rounds (`RoundRecord.history`): a poll every few rounds misses no
round, and a round is *closed* (its counts final) once every online peer that took part in it has
published a later round.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2p_diloco.protocol.budget import STALE_S, ProgressReport
from p2p_diloco.protocol.network import HISTORY_ROUNDS, PastRound, RoundRecord
from p2p_diloco.train.metrics import prometheus_label

# A peer with no progress report or new record for this long is offline: a peer's stale rule
# (budget.STALE_S), applied to what this log saw (see `RunLog.online`).
ONLINE_S = STALE_S
MAX_ROUNDS_SHOWN = 200  # rounds in a view (the latest)
ACTIVE_ROUNDS = 50  # at most this many rounds that started since the last poll are noted
MIN_POLL_S = 1.0  # a reader that follows fast rounds (RunLog.poll_in_s) reads the DHT at most this often
Credit = Callable[[Sequence[int]], list[int]]  # a group's tokens -> what its average weighed them at

# Why a peer known to the run was not counted in a round (the dashboard shows these words).
REASONS = {
    "alone": "averaged alone: no other peer reached its round in time",
    "failed": "its all-reduce failed: it applied its own pseudo-gradient",
    "copied": "late: it caught up with the swarm's state instead of training the round",
    "other-digest": "its state differs from the agreed one (it reloads the majority's)",
    "unconfirmed": "no other member of its group lists it",
    "skipped": "late: it skipped the round",
    "silent": "no heartbeat during the round (stopped, asleep or gone)",
    "revoked": "revoked by the organiser",
    "convicted": "convicted in reducer audits: its records count no more with the peers that convicted it",
}


@dataclass
class RoundSeen:
    """One round as the observer saw it: each peer's record of it, first seen at `started`."""

    round: int
    started: float
    records: dict[str, RoundRecord] = field(default_factory=dict)
    online: set[str] = field(default_factory=set)  # peers with a fresh heartbeat while the round was under way
    present: set[str] = field(default_factory=set)  # peers with a record in the DHT meanwhile (gone: expired)
    live: bool = True  # first seen as a peer's latest record, not in a later one's history: `started` dates it


@dataclass(frozen=True)
class Target:
    """A round whose agreed state the observer evaluates, and the reachable peers that hold it now."""

    round: int
    digest: str
    holders: tuple[str, ...]


@dataclass
class PeerSeen:
    first_seen: float
    last_seen: float  # the last progress report or new record
    record: RoundRecord | None = None
    tokens_per_s: float = 0.0  # its last measured speed (a report of 0 between two phases keeps it)


class RunLog:
    """Everything an observer saw of one run."""

    def __init__(self, run_id: str, fingerprint: str, rounds_total: int, credit: Credit = list):
        """`credit`: what a group's average weighed its members' tokens at (`robust.weighed_tokens`
        with the run's aggregator); by default all of them."""
        self.run_id, self.fingerprint, self.rounds_total = run_id, fingerprint, rounds_total
        self.credit = credit
        self.rounds: dict[int, RoundSeen] = {}
        self.peers: dict[str, PeerSeen] = {}
        self.convicted: dict[str, list[str]] = {}
        self.revoked: dict[str, tuple[str, float]] = {}  # peer -> (the organiser's reason, when it was issued)
        self._convicted_since: dict[str, float] = {}  # peer -> when this log first saw it convicted
        self.eval_every, self.eval_off = 0, "held-out loss off: not asked for"  # service.evaluation says more
        self.names: dict[str, str] = {}  # from certificates; otherwise a peer is named by its id's end
        self.evaluated: dict[int, tuple[str, float]] = {}  # round: (digest, held-out loss the observer computed)
        self._noted = -1  # rounds up to this one are no longer noted as under way

    def ingest(
        self,
        records: Mapping[str, RoundRecord],
        progress: Iterable[ProgressReport],
        convicted: Mapping[str, list[str]],
        names: Mapping[str, str] | None = None,
        revoked: Mapping[str, tuple[str, float]] | None = None,
        *,
        now: float,
    ) -> None:
        """One poll of the DHT: each peer's latest record and progress report, convictions, the
        names the organiser's certificates give peers, and its revocations (certified runs:
        {peer: (reason, unix time issued)})."""
        self.names.update(names or {})
        self.revoked.update(revoked or {})
        for report in progress:
            seen = self._peer(report.peer, now)
            seen.last_seen = max(seen.last_seen, min(report.time, now))  # a clock ahead of ours counts as now
            if report.tokens_per_s > 0:  # 0: between two phases (nothing to extrapolate), not a speed
                seen.tokens_per_s = report.tokens_per_s
        for peer, record in records.items():
            seen = self._peer(peer, now)
            if seen.record is not None and seen.record != record:  # a new record: alive now
                seen.last_seen = now
            seen.record = record  # a record seen for the first time may be old: only a report dates it
            self._round(record.round, now).records[peer] = record
        for peer, record in records.items():  # after the latest records: a round some peer is at is live
            for past in record.history:  # its final word on each round, also those it passed between polls
                self._round(past.round, now, live=False).records[peer] = as_record(record, past)
        self.convicted = {p: list(by) for p, by in convicted.items()}
        for peer in self.convicted:
            self._convicted_since.setdefault(peer, now)
        # The rounds that started since the last poll, and the newest (still under way), note who
        # was online and who was in the run at all (a record in the DHT) meanwhile. A round is
        # noted only while it is new: a peer that comes back later did not take part in it.
        if self.rounds:
            newest = max(self.rounds)
            online = self.online(now)
            for r in range(max(self._noted + 1, newest - ACTIVE_ROUNDS), newest + 1):
                if r in self.rounds:
                    self.rounds[r].online |= online
                    self.rounds[r].present |= set(records)
            self._noted = newest - 1  # the newest is noted again at the next poll

    def note_evaluation(self, round_: int, digest: str, loss: float) -> None:
        """The held-out loss the observer computed itself on the state of `round_` with `digest`."""
        self.evaluated[round_] = (digest, loss)

    def to_evaluate(self, every: int, now: float) -> Target | None:
        """The newest round to evaluate, at least `every` rounds after the last one evaluated, or
        the run's last round whenever it was not (the model the run ends on): one whose agreed
        digest its counted peers made (a peer's own claim alone is not enough), held now (their
        latest record) by online peers that serve their state (not in client mode): a download from
        a peer that sleeps would wait out its whole deadline."""
        last = max(self.evaluated, default=None)
        online = self.online(now)
        for r in sorted(self.rounds, reverse=True):
            if last is not None and r < last + every and not (r == self.rounds_total and r not in self.evaluated):
                return None
            agreed = self.agreed(r)
            holders = tuple(
                p
                for p, s in sorted(self.peers.items())
                if p in online
                and s.record is not None
                and s.record.serves
                and (s.record.round, s.record.digest) == (r, agreed)
            )
            if agreed and holders:
                return Target(r, agreed, holders)
        return None

    def agreed(self, round_: int) -> str:
        """The round's agreed digest if counted peers made it, else "" (not known, or nobody counted)."""
        seen = self.rounds.get(round_)
        if seen is None:
            return ""
        digest = agreed_digest(seen.records)
        return digest if counted_peers(seen.records, digest) else ""

    def name(self, peer: str) -> str:
        """The name the organiser's certificate gives `peer`, else the end of its id."""
        return self.names.get(peer) or short(peer)

    def online(self, now: float) -> set[str]:
        """Peers seen alive within ONLINE_S. Not heartbeat.stale_peers' rule (agreement.live): an
        observer reads every few seconds, not every beat, and a record changed between two of its
        reads dates a peer too."""
        return {p for p, s in self.peers.items() if now - s.last_seen < ONLINE_S}

    def _peer(self, peer: str, now: float) -> PeerSeen:
        return self.peers.setdefault(peer, PeerSeen(now, -math.inf))

    def _round(self, round_: int, now: float, live: bool = True) -> RoundSeen:
        return self.rounds.setdefault(round_, RoundSeen(round_, now, live=live))

    def closed(self, round_: int, now: float) -> bool:
        """Whether the round's records are all in: every online peer that holds a record of it or is
        listed in one of its groups has published a later round (whose history holds its final
        record of this one), or the run's last round (there is no later one). An offline peer
        publishes nothing more: it holds nobody's round open."""
        seen = self.rounds[round_]
        involved = set(seen.records) | {m for r in seen.records.values() for m in r.group}
        latest = {p: s.record.round for p, s in self.peers.items() if s.record is not None}
        done = self.rounds_total if round_ >= self.rounds_total else round_ + 1
        return all(latest.get(p, -1) >= done for p in involved & self.online(now))

    # --- the view ---------------------------------------------------------------------------------

    def view(self, now: float) -> dict[str, Any]:
        """The dashboard's and the API's JSON (docs/observer.md documents every field)."""
        rounds = [self._round_view(r, self.closed(r, now)) for r in sorted(self.rounds)[-MAX_ROUNDS_SHOWN:]]
        latest = max(self.rounds, default=0)
        training = self.online(now) - set(self.revoked)
        return {
            "run": {
                "run_id": self.run_id,
                "fingerprint": self.fingerprint,
                "rounds_total": self.rounds_total,
                "round": latest,
                "round_due_in_s": self._due_in(now),
                "finished": latest >= self.rounds_total,
                "tokens_per_s": round(sum(self.peers[p].tokens_per_s for p in training), 1),
                "eval_every": self.eval_every,
                "eval_off": self.eval_off,
                **self._latest_evaluation(),
            },
            "peers": [self._peer_view(p, s, now) for p, s in sorted(self.peers.items())],
            "rounds": rounds,
            "contributors": [
                {**c, **self._marks(c["peer"])} for c in contributors(self.rounds.values(), self.name, self.credit)
            ],
            "time": now,
        }

    def _marks(self, peer: str) -> dict[str, Any]:
        """What the organiser and the audits said of `peer`: revoked (the reason) and convicted by."""
        revoked = self.revoked.get(peer)
        return {
            "revoked": (revoked[0] or "no reason given") if revoked is not None else None,
            "convicted_by": self.convicted.get(peer, []),
        }

    def _flagged(self, peer: str, started: float) -> str | None:
        """Why `peer` is out of a round that started at `started` by another's word, if it is."""
        revoked = self.revoked.get(peer)
        if revoked is not None and revoked[1] <= started:
            return f"{REASONS['revoked']}: {revoked[0] or 'no reason given'}"
        by = self.convicted.get(peer)
        if by and self._convicted_since.get(peer, math.inf) < started:  # seen before the round began
            return f"{REASONS['convicted']} (by {len(by)} peer(s))"
        return None

    def _latest_evaluation(self) -> dict[str, Any]:
        """The latest round the observer evaluated whose state is (still) the round's agreed one."""
        valid = [r for r, (digest, _) in self.evaluated.items() if digest == self.agreed(r)]
        last = max(valid, default=None)
        return {"eval_round": last, "eval_loss": self.evaluated[last][1] if last is not None else None}

    def _peer_view(self, peer: str, seen: PeerSeen, now: float) -> dict[str, Any]:
        record = seen.record
        return {
            "peer": peer,
            "name": self.name(peer),
            "online": now - seen.last_seen < ONLINE_S,
            "reachable": record.serves if record is not None else None,
            "tier": record.tier if record is not None else None,  # public, punched or private
            "round": record.round if record is not None else None,
            "tokens_per_s": round(seen.tokens_per_s, 1),
            **self._marks(peer),
            "addrs": list(record.addrs) if record is not None else [],
        }

    def _round_view(self, r: int, closed: bool) -> dict[str, Any]:
        seen = self.rounds[r]
        agreed = agreed_digest(seen.records)
        counted = counted_peers(seen.records, agreed)
        known = seen.online | seen.present | set(seen.records)
        evaluated = self.evaluated.get(r)
        credit = credited(seen.records, counted, self.credit)
        return {
            "round": r,
            "started": seen.started,
            "closed": closed,
            "digest": agreed,
            "all_agree": len({rec.digest for rec in seen.records.values()}) <= 1,
            "group": sorted({m for rec in seen.records.values() for m in rec.group} | set(counted)),
            "counted": sorted(counted),
            "not_counted": [
                {"peer": p, "name": self.name(p), "reason": why}
                for p in sorted(known - set(counted))
                if (why := self._not_counted(p, seen, agreed, counted, closed)) is not None
            ],
            "tokens": sum(weighed for weighed, _ in credit.values()),
            "tokens_trained": sum(trained for _, trained in credit.values()),
            "train_loss": _mean(seen.records[p].loss for p in counted if seen.records[p].loss >= 0),
            "eval_loss": evaluated[1] if evaluated and evaluated[0] == agreed else None,
            "levels": levels_of(seen.records, counted),
        }

    def _not_counted(self, peer: str, seen: RoundSeen, agreed: str, counted: set[str], closed: bool) -> str | None:
        """Why `peer` was not counted in the round, in the dashboard's words, or None (`reason`)."""
        flagged = self._flagged(peer, seen.started) if closed else None
        if flagged is not None:
            return flagged
        why = reason(peer, seen, agreed, counted, not closed)
        return REASONS[why] if why is not None else None

    def _due_in(self, now: float) -> float | None:
        """Seconds until the latest round is due to end, from the median length of the last rounds."""
        lengths = self._round_lengths()
        if not lengths:
            return None
        latest = self.rounds[max(self.rounds)].started
        return round(max(0.0, latest + statistics.median(lengths) - now), 1)

    def _round_lengths(self) -> list[float]:
        """The lengths of the last rounds, oldest first: of those whose start a poll saw (a round
        learned from a later record's history was not), a gap of k rounds between two of them
        counting as k rounds of equal length."""
        live = [r for r in sorted(self.rounds) if self.rounds[r].live][-11:]
        starts = [(r, self.rounds[r].started) for r in live]
        return [(tb - ta) / (b - a) for (a, ta), (b, tb) in zip(starts, starts[1:], strict=False) if tb > ta]

    def poll_in_s(self, every_s: float) -> float:
        """When to read the DHT next, given the reader's interval `every_s`: sooner where rounds
        end faster than every_s / (HISTORY_ROUNDS / 2) (the median or the latest length, whichever
        is shorter), so that every round is still in the history of the records the next read finds
        (a record repeats its peer's last HISTORY_ROUNDS rounds), but never more often than MIN_POLL_S.
        From the first round start it saw to the second, every MIN_POLL_S: the pace is not known
        yet (before any, `every_s`: a run not training yet has no rounds to miss)."""
        lengths = self._round_lengths()
        if not lengths:
            started = any(seen.live for seen in self.rounds.values())
            return min(every_s, MIN_POLL_S) if started else every_s
        pace = min(statistics.median(lengths), lengths[-1])
        return min(every_s, max(MIN_POLL_S, pace * HISTORY_ROUNDS / 2))


def agreed_digest(records: Mapping[str, RoundRecord]) -> str:
    """The round's digest most peers hold (ties: the smallest, as agreement.majority)."""
    counts = Counter(r.digest for r in records.values() if not r.copied) or Counter(r.digest for r in records.values())
    return min(counts, key=lambda d: (-counts[d], d)) if counts else ""


def counted_peers(records: Mapping[str, RoundRecord], agreed: str) -> set[str]:
    """Peers whose work went into the round's agreed state: their record holds the agreed digest,
    made by their own outer step in a group, and another member's record lists them."""
    made = {p: r for p, r in records.items() if r.digest == agreed and not r.copied and r.outcome == "averaged"}
    return {p for p in made if any(p in r.group for q, r in made.items() if q != p)}


def reason(peer: str, seen: RoundSeen, agreed: str, counted: set[str], open_: bool) -> str | None:
    """Why `peer` was not counted in the round (a key of REASONS), or None if there is nothing to
    say: it was, it only started there, the round is still open, or too little of it was seen."""
    record = seen.records.get(peer)
    if record is None:  # alive without a record of the round, or without a heartbeat at all
        return None if open_ else "skipped" if peer in seen.online else "silent"
    if record.copied:
        return "copied"
    if record.outcome == "start":  # the state it started from (θ(0), a checkpoint): no round trained
        return None
    if record.outcome in ("alone", "failed"):
        return record.outcome
    if record.digest != agreed:
        return "other-digest"
    if peer in counted or not any(m != peer and m in seen.records for m in record.group):
        return None  # counted, or no other member's record of the round was seen (expired before the observer came)
    return "unconfirmed"


def levels_of(records: Mapping[str, RoundRecord], counted: set[str]) -> dict[str, Any] | None:
    """A two-level round's groups as its counted peers published them: each stage-1 group (its
    members), the most groups a sub-span of the result counted, and the spans a group; None for a
    flat round (nobody counted says it averaged in two levels)."""
    two_level = [records[p] for p in sorted(counted) if records[p].spans > 0]
    if not two_level:
        return None
    groups = sorted({tuple(sorted(rec.group)) for rec in two_level}, key=lambda g: (-len(g), g))
    return {
        "groups": [list(g) for g in groups],
        "counted": max(rec.groups for rec in two_level),
        "spans": max(rec.spans for rec in two_level),
    }


def credited(records: Mapping[str, RoundRecord], counted: set[str], credit: Credit) -> dict[str, tuple[int, int]]:
    """{counted peer: (the tokens its group's average weighed, the tokens it trained)}: `credit`
    over the tokens of the members of its group whose records of the round were seen."""
    found: dict[str, tuple[int, int]] = {}
    for peer in counted:
        members = [m for m in dict.fromkeys((peer, *records[peer].group)) if m in records]
        weighed = credit([records[m].tokens for m in members])[0]
        found[peer] = (weighed, records[peer].tokens)
    return found


def contributors(
    rounds: Iterable[RoundSeen], name: Callable[[str], str] = lambda p: short(p), credit: Credit = list
) -> list[dict[str, Any]]:
    """Verified work per peer, most first: in the rounds where it was counted, the tokens its
    group's average weighed (`tokens`) and those it trained (`tokens_trained`)."""
    tokens: Counter[str] = Counter()
    trained: Counter[str] = Counter()
    counted_rounds: Counter[str] = Counter()
    for seen in rounds:
        counted = counted_peers(seen.records, agreed_digest(seen.records))
        for peer, (weighed, own) in credited(seen.records, counted, credit).items():
            tokens[peer] += weighed
            trained[peer] += own
            counted_rounds[peer] += 1
    return [
        {"peer": p, "name": name(p), "tokens": tokens[p], "tokens_trained": trained[p], "rounds": counted_rounds[p]}
        for p in sorted(counted_rounds, key=lambda p: (-tokens[p], p))
    ]


def as_record(latest: RoundRecord, past: PastRound) -> RoundRecord:
    """A peer's past round, repeated in its `latest` record, as a record of that round."""
    return RoundRecord(
        latest.peer,
        past.round,
        past.digest,
        past.tokens,
        past.loss,
        serves=latest.serves,
        copied=past.copied,
        group=past.group,
        outcome=past.outcome,
    )


def short(peer: str) -> str:
    return peer[-8:]


def _mean(values: Iterable[float]) -> float | None:
    found = [v for v in values if math.isfinite(v)]
    return sum(found) / len(found) if found else None


def prometheus(view: Mapping[str, Any]) -> str:
    """The view as Prometheus text exposition (version 0.0.4)."""
    run = view["run"]
    label = f'run_id="{prometheus_label(run["run_id"])}"'
    lines = _run_metrics(view, label) + _evaluation(run, label)
    lines += [
        "# HELP p2p_diloco_peer_verified_tokens tokens of one peer in rounds where it was counted, as the averages "
        "weighed them",
        "# TYPE p2p_diloco_peer_verified_tokens counter",
    ]
    lines += [
        f'p2p_diloco_peer_verified_tokens{{{label},peer="{prometheus_label(c["peer"])}"}} {c["tokens"]}'
        for c in view["contributors"]
    ]
    return "\n".join(lines) + "\n"


def _run_metrics(view: Mapping[str, Any], label: str) -> list[str]:
    run = view["run"]
    last = last_closed(view["rounds"]) or {}
    return [
        *_metric("p2p_diloco_round", "gauge", "the latest round any peer published", label, run["round"]),
        *_metric("p2p_diloco_rounds_total", "gauge", "rounds in the run", label, run["rounds_total"]),
        *_metric("p2p_diloco_peers_online", "gauge", "peers online", label, sum(p["online"] for p in view["peers"])),
        *_metric("p2p_diloco_peers_known", "gauge", "peers seen since the observer started", label, len(view["peers"])),
        *_metric(
            "p2p_diloco_round_counted_peers",
            "gauge",
            "peers counted in the latest closed round",
            label,
            len(last.get("counted", [])),
        ),
        *_levels_metrics(last.get("levels") or {}, label),
        *_metric(
            "p2p_diloco_round_all_agree",
            "gauge",
            "1 if every peer of the latest closed round holds one digest",
            label,
            int(last.get("all_agree", True)),
        ),
        *_metric(
            "p2p_diloco_verified_tokens_total",
            "counter",
            "tokens in rounds where their peer was counted, as the averages weighed them",
            label,
            sum(c["tokens"] for c in view["contributors"]),
        ),
        *_metric(
            "p2p_diloco_tokens_per_s",
            "gauge",
            "the swarm's speed: each online, unrevoked peer's last measured tokens/s, summed",
            label,
            run.get("tokens_per_s", 0.0),
        ),
        *_metric(
            "p2p_diloco_peers_revoked",
            "gauge",
            "peers the organiser revoked",
            label,
            sum(p.get("revoked") is not None for p in view["peers"]),
        ),
    ]


def _levels_metrics(levels: Mapping[str, Any], label: str) -> list[str]:
    """The latest closed round's groups (`levels_of`; a flat round is one group)."""
    return [
        *_metric(
            "p2p_diloco_round_groups",
            "gauge",
            "stage-1 groups of the latest closed round (1: one flat group; more: two levels)",
            label,
            len(levels.get("groups", [])) or 1,
        ),
        *_metric(
            "p2p_diloco_round_groups_counted",
            "gauge",
            "the most groups a sub-span of the latest closed round's result counted",
            label,
            levels.get("counted", 1),
        ),
    ]


def last_closed(rounds: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The latest closed round of a view's rounds: its counts are final (`RunLog.closed`). A round
    still open is still being published: read meanwhile, it would say "0 counted" of a healthy swarm."""
    return next((r for r in reversed(rounds) if r["closed"]), None)


def _evaluation(run: Mapping[str, Any], label: str) -> list[str]:
    if run.get("eval_loss") is None:
        return []
    what = "held-out loss of the latest agreed state the observer evaluated (downloaded, verified)"
    return [
        *_metric("p2p_diloco_eval_loss", "gauge", what, label, run["eval_loss"]),
        *_metric("p2p_diloco_eval_round", "gauge", "the round of p2p_diloco_eval_loss", label, run["eval_round"]),
    ]


def _metric(name: str, kind: str, help_: str, labels: str, value: float) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{{{labels}}} {value}"]
