"""`p2p-diloco observe` and `p2p-diloco status`: a run's view, served or printed.

`Observatory` keeps a `RunLog` (run_view.py) fed by polls of the run's DHT records and serves it
(web.py). The caller drives the polls: the `observe` command in its own loop, a bootstrap node
with `--observe-port` in its status loop (one thread uses the DHT handle). `status` polls for a
few seconds and prints the swarm at a glance, and one peer's rounds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from p2p_diloco.config import Config
from p2p_diloco.errors import StateDownloadError
from p2p_diloco.observe.run_view import RunLog, Target, last_closed
from p2p_diloco.observe.web import ObserverServer
from p2p_diloco.protocol import deadlines
from p2p_diloco.protocol.network import StateSource
from p2p_diloco.trust import robust

if TYPE_CHECKING:  # evaluate.py imports transformers: `status` does without it
    from p2p_diloco.observe.evaluate import Agreed, Evaluations, HeldOut, RunModel

Poll = tuple[dict, list, dict, dict, dict]  # swarm/run_reader.py's Poll


def run_log(config: Config) -> RunLog:
    """An empty log of the run, crediting work as the run's aggregator weighs it."""
    how, cap = config.swarm.aggregator, config.swarm.weight_cap
    return RunLog(
        config.run.run_id,
        config.fingerprint(),
        config.run.rounds,
        lambda tokens: robust.weighed_tokens(tokens, how, cap),
    )


class Observatory:
    """A run's log and the HTTP server that shows it."""

    reader: Any = None  # what feeds it, for a caller that keeps the two together (a bootstrap node)
    poll_s = 1.0  # how often it is fed (sooner while rounds are fast: poll_in_s)

    def __init__(self, config: Config, healthy: Callable[[], tuple[bool, str]], host: str, port: int):
        self.log = run_log(config)
        self._lock = threading.Lock()  # polls write the log; the server's threads read it
        self.server = ObserverServer(self.view, healthy, host, port)
        self._evaluations: Evaluations | None = None

    def ingest(self, poll: Poll) -> None:
        with self._lock:
            self.log.ingest(*poll, now=time.time())

    def poll_in_s(self) -> float:
        """When its feeder reads the DHT next: every `poll_s`, sooner while rounds end faster
        than a record's history covers (RunLog.poll_in_s)."""
        with self._lock:
            return self.log.poll_in_s(self.poll_s)

    def view(self) -> dict[str, Any]:
        with self._lock:
            return self.log.view(time.time())

    # --- for Evaluations (evaluate.py), from its own thread ---

    def pick(self, every: int) -> Target | None:
        with self._lock:
            return self.log.to_evaluate(every, time.time())

    def accepts(self, round_: int, digest: str) -> bool:
        """Whether (round, digest) is the round's agreed state. A holder may serve a round newer
        than the log knows (it moved on meanwhile): the polls that feed the log get AGREED_WAIT_S
        to learn that round's agreed digest."""
        return settled(lambda: self.log.agreed(round_), self._lock, lambda: None) == digest != ""

    def note_evaluation(self, round_: int, digest: str, loss: float) -> None:
        with self._lock:
            self.log.note_evaluation(round_, digest, loss)

    def evaluate(self, plan: Evaluate | str | None, every_s: float) -> None:
        """Compute the held-out loss of the agreed state too, looking every `every_s` seconds; or,
        given why not (a line from `evaluation`), show that on the dashboard."""
        if isinstance(plan, Evaluate):
            with self._lock:
                self.log.eval_every, self.log.eval_off = plan.every, ""
            self._evaluations = plan.start(self, every_s)
        elif plan:
            with self._lock:
                self.log.eval_off = plan

    def close(self) -> None:
        if self._evaluations is not None:
            self._evaluations.close()
        self.server.close()


def observe(
    config: Config,
    poll: Callable[[], Poll],
    healthy: Callable[[], tuple[bool, str]],
    host: str,
    port: int,
    stop: threading.Event,
    emit: Callable[[str], None],
    poll_s: float = 1.0,
    evaluate: Evaluate | str | None = None,
) -> None:
    """Serve the run's view until `stop` is set, polling the DHT every `poll_s` seconds; with
    `evaluate`, the held-out loss of the agreed state too (evaluate.py), in a thread of its own."""
    observatory = Observatory(config, healthy, host, port)
    observatory.poll_s = poll_s
    emit(
        f"observer of run {config.run.run_id!r}: dashboard {observatory.server.url}, "
        f"JSON {observatory.server.url}api/v1/run, Prometheus {observatory.server.url}metrics"
    )
    try:
        observatory.evaluate(evaluate, poll_s)
        while True:
            observatory.ingest(poll())
            if stop.wait(observatory.poll_in_s()):
                return
    finally:
        observatory.close()


EVAL_NOT_ASKED = "held-out loss off: not asked for (observe --eval-every ROUNDS, bootstrap --observe-eval-every ROUNDS)"
CERTIFICATE_FIX = "--identity KEY --certificate FILE, with KEY's peer id admitted by the organiser"


@dataclass(frozen=True)
class Evaluate:
    """What the observer needs to evaluate the agreed state every `every` rounds."""

    held: HeldOut
    source: StateSource  # downloads peers' served states (swarm/state_client.py)
    every: int
    timeout: float

    def start(self, observatory: Observatory, poll_s: float) -> Evaluations:
        from p2p_diloco.observe.evaluate import Evaluations

        evaluations = Evaluations(
            self.held,
            self.source,
            lambda: observatory.pick(self.every),
            observatory.accepts,
            observatory.note_evaluation,
            self.timeout,
        )
        evaluations.start(poll_s)
        return evaluations


def evaluation(
    config: Config, reader: Any, every: int, warn: Callable[[str], None], fix: str = CERTIFICATE_FIX
) -> Evaluate | str:
    """What an observer over `reader` (swarm/run_reader.py) needs to compute the held-out loss of
    the agreed state every `every` rounds, or the line that says why it does not: never asked for
    (0), or not possible here, also said by `warn` (the rest of the observer runs). `fix`: how
    this observer is given a certificate (a bootstrap node's options differ)."""
    if every == 0:
        return EVAL_NOT_ASKED
    if config.admission.mode == "certified" and not config.admission.certificate:
        off = (
            "held-out loss off: a certified run's peers serve their state to admitted peers only "
            f"(give the observer a certificate: {fix})"
        )
        warn(off)
        return off
    from p2p_diloco.errors import DataError

    try:
        from p2p_diloco.observe.evaluate import HeldOut
    except ImportError as e:  # a node-only install (bootstrap/Dockerfile) has no transformers or datasets
        off = (
            f"held-out loss off: this install has no training stack ({e.name or e}): evaluating needs p2p-diloco "
            "installed with its dependencies (pip install p2p-diloco), not the node-only image"
        )
        warn(off)
        return off
    try:
        held = HeldOut(config)
    except DataError as e:
        warn(f"held-out loss off: {e}")
        return f"held-out loss off: {e}"
    return Evaluate(held, reader.state_client(held.numel), every, download_s(config, held.numel))


AGREED_WAIT_S = 3.0  # how long a newer round's agreed digest is waited for (rounds end at once for all)
AGREED_POLL_S = 0.25  # how often that wait looks again (the log; with `poll`, the DHT first)


def settled(agreed: Callable[[], str], lock: threading.Lock, poll: Callable[[], None]) -> str:
    """`agreed()` under `lock` once it is known (not ""), or "" after AGREED_WAIT_S; `poll` between
    looks (a caller whose log no other thread feeds)."""
    looked = False

    def look() -> str:
        nonlocal looked
        if looked:
            poll()
        looked = True
        with lock:
            return agreed()

    return deadlines.poll_until(look, bool, time.monotonic() + AGREED_WAIT_S, AGREED_POLL_S)


def gather(config: Config, poll: Callable[[], Poll], seconds: float, poll_s: float = 1.0) -> dict[str, Any]:
    """The run's view after polling for `seconds` (at least one poll)."""
    log = run_log(config)
    deadlines.poll_until(
        lambda: log.ingest(*poll(), now=time.time()), lambda _: False, time.monotonic() + seconds, poll_s
    )
    return log.view(time.time())


def download_s(config: Config, numel: int) -> float:
    """The deadline of one whole-state download of a model of `numel` values (protocol/deadlines.py)."""
    return deadlines.state_download(numel, config.swarm.join_timeout_s, config.swarm.min_download_mbps).total_s


def fetch_agreed(
    config: Config, poll: Callable[[], Poll], source: StateSource, model: RunModel, wait_s: float
) -> Agreed:
    """The newest agreed state of the run, downloaded from a peer that holds it and verified,
    within `wait_s` seconds: what `export --initial-peers` writes. StateDownloadError says why not."""
    from p2p_diloco.observe.evaluate import download_agreed

    log = run_log(config)
    why = (
        "no round that counted peers agreed on was seen: is the run training? (A finished run's records "
        "leave the DHT 90 s after its end: then export from a peer's run dir, p2p-diloco export RUN_DIR OUT)"
    )

    def accepts(round_: int, digest: str) -> bool:  # polling here: no other thread feeds this log
        return (
            settled(lambda: log.agreed(round_), threading.Lock(), lambda: log.ingest(*poll(), now=time.time()))
            == digest
            != ""
        )

    def newer(round_: int) -> Target | None:  # one more poll: the holders of `round_` moved on
        log.ingest(*poll(), now=time.time())
        return log.to_evaluate(1, time.time())

    def attempt() -> Agreed | None:
        """One poll, and a download of the newest agreed state if one is held; None if none came."""
        nonlocal why
        log.ingest(*poll(), now=time.time())
        target = log.to_evaluate(1, time.time())
        if target is None and (final := log.agreed(config.run.rounds)):
            raise StateDownloadError(
                f"run {config.run.run_id!r} finished at round {config.run.rounds} (final digest {final[:12]}); no "
                "peer serves it any more (they linger swarm.linger_s after the end): export from a peer's run dir, "
                "p2p-diloco export RUN_DIR OUT"
            )
        if target is None:
            return None
        try:
            return download_agreed(model, source, target, accepts, download_s(config, model.numel), newer)
        except StateDownloadError as e:
            why = str(e)
            return None

    deadline = time.monotonic() + wait_s
    found = deadlines.poll_until(attempt, lambda got: got is not None, deadline, deadlines.COMMAND_POLL_S)
    if found is None:
        raise StateDownloadError(f"no agreed state of run {config.run.run_id!r} downloaded in {wait_s:g} s: {why}")
    return found


def status_lines(view: dict[str, Any], peer: str | None = None) -> list[str]:
    """The swarm at a glance, then (with `peer`) that peer's rounds: counted or not, and why."""
    run, rounds, peers = view["run"], view["rounds"], view["peers"]
    online = [p for p in peers if p["online"]]
    last = last_closed(rounds)  # a round still being published would undercount (run_view.RunLog.closed)
    lines = [
        f"run {run['run_id']!r} (config {run['fingerprint']}): round {run['round']} of {run['rounds_total']}"
        + (", finished" if run["finished"] else ""),
        f"peers online: {len(online)} ({sum(1 for p in online if p['tier'] == 'private')} private: behind NAT, "
        f"clients; {sum(1 for p in online if p['tier'] == 'punched')} punched: behind NAT, hole punching)",
    ]
    if last is not None:
        agree = "every peer agrees" if last["all_agree"] else "peers DISAGREE"
        loss = f", train loss {last['train_loss']:.4f}" if last["train_loss"] is not None else ""
        lines.append(
            f"round {last['round']}: digest {last['digest'][:12]}, {agree}, {len(last['counted'])} counted{loss}"
        )
        if (levels := last.get("levels")) is not None:
            sizes = "+".join(str(len(g)) for g in levels["groups"])
            lines.append(
                f"  two levels: {len(levels['groups'])} groups ({sizes} peers), {levels['spans']} spans a group; "
                f"the result counted at most {levels['counted']} groups a sub-span"
            )
    if peer is not None:
        lines += _peer_lines(view, peer)
    return lines


def _peer_lines(view: dict[str, Any], peer: str) -> list[str]:
    matches = [p["peer"] for p in view["peers"] if p["peer"] == peer or p["peer"].endswith(peer)]
    if not matches:
        return [f"peer {peer}: not seen in the run (is it running, with this run's config?)"]
    who = matches[0]
    credit = next((c for c in view["contributors"] if c["peer"] == who), {"tokens": 0, "tokens_trained": 0})
    seen = next(p for p in view["peers"] if p["peer"] == who)
    lines = [
        f"peer {seen['name']}: {credit['tokens']:,} tokens credited in the rounds seen (as its groups' averages "
        f"weighed them; {credit['tokens_trained']:,} trained in the rounds it was counted in)"
    ]
    if seen["revoked"] is not None:
        lines.append(f"  revoked by the organiser: {seen['revoked']}")
    if seen["convicted_by"]:
        lines.append(f"  convicted in reducer audits by {len(seen['convicted_by'])} peer(s)")
    for r in view["rounds"][-10:]:
        why = next((n["reason"] for n in r["not_counted"] if n["peer"] == who), None)
        if who in r["counted"]:
            lines.append(f"  round {r['round']}: counted")
        elif why is not None:
            lines.append(f"  round {r['round']}: not counted: {why}")
    return lines
