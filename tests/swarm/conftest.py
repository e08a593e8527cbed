"""Real swarms on 127.0.0.1: a bootstrap node and peers, each its own process; all ended after the test."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from p2p_diloco import config
from p2p_diloco.swarm.transport import leftovers
from tests.conftest import TINY
from tests.swarm.procs import alive, descendants, signal_tree, started_at, wait_gone

CLI = [sys.executable, "-m", "p2p_diloco.cli"]
# The tiny run of tests/conftest.py, on loopback, with short swarm deadlines.
SWARM = {
    **TINY,
    "run.rounds": "4",
    "inner.steps": "3",
    "data.num_shards": "8",
    "swarm.host": "127.0.0.1",
    "swarm.matchmaking_time_s": "4",
    "swarm.averaging_timeout_s": "20",
    "swarm.agreement_timeout_s": "15",
    "swarm.join_timeout_s": "20",
    "swarm.linger_s": "0",  # no window after the end: peers still finishing are waited for anyway
}
del SWARM["data.shard"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # several peers share 2 cores


ALARM = re.compile(r"^(\d\d:\d\d:\d\d (WARN|WARNING|ERROR|CRITICAL) |.*\[(WARN|WARNING|ERROR|CRITICAL)\] )")


def alarms(log: str) -> list[str]:
    """The lines of a log that ask the user to act: ours (`HH:MM:SS WARN …`, metrics.setup_logging)
    and hivemind's or p2pd's (`[WARN]`, `[ERROR]`). A healthy swarm logs none."""
    return [line for line in log.splitlines() if ALARM.match(line)]


CLOCK = re.compile(r"^(?:\w{3} \d\d )?(\d\d):(\d\d):(\d\d)")
CONTEXT_S = (20, 5)  # the lines of every log this long before and after the first alarm
CONTEXT_LINES = 40  # at most this many of each log


def _clock(line: str) -> int | None:
    m = CLOCK.match(line)
    return None if m is None else int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])


def unexplained_alarms(logs: dict[str, str]) -> str | None:
    """None if no log holds an alarm; else the alarms, and every log's lines around the first one
    (a failure in CI shows only its output: one member's side rarely explains a group's failure)."""
    found = {name: alarms(log) for name, log in logs.items()}
    if not any(found.values()):
        return None
    first = min(t for lines in found.values() for line in lines if (t := _clock(line)) is not None)
    out = [f"alarms: { {name: len(lines) for name, lines in found.items()} }"]
    before, after = CONTEXT_S
    for name, log in logs.items():
        near = [line for line in log.splitlines() if (t := _clock(line)) is not None and -before <= t - first <= after]
        out += [f"--- {name}.log, {before} s before the first alarm to {after} s after:", *near[-CONTEXT_LINES:]]
    return "\n".join(line[:300] for line in out)


def wait_until(condition, procs, timeout_s, what):
    """Wait for condition() with a deadline; fail at once if one of `procs` exits early."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        for p in procs:
            if p.poll() is not None and p.returncode != 0:
                raise AssertionError(f"{what}: a process exited with {p.returncode}: {_log_tail(p)}")
        running = [p for p in procs if p.poll() is None]
        if not running:
            time.sleep(0.2)  # a poll interval, bounded by the deadline above
            continue
        try:  # a bounded wait that also notices the process ending. (It waited on procs[0] even
            # once that one had exited 0, and spun: a core taken from the peers still running.)
            running[0].wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass


def _log_tail(proc: subprocess.Popen, lines: int = 30) -> str:
    """The name of a peer's log (its last argument) and its last lines: in CI a failure shows only
    its own output, and a peer's early exit is explained by its log's end."""
    path = Path(proc.args[-1])
    if not path.is_file():
        return path.name
    tail = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join([f"{path.name}, its last {len(tail)} lines:", *(line[:300] for line in tail)])


class ProcessSwarm:
    """Starts processes and remembers them, so the fixture can end every one of them."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: list[subprocess.Popen] = []
        self.sessions: set[int] = set()  # process groups we started, ended as a whole at the end
        self.fault_sessions: set[int] = set()  # of those, the fault subjects (maybe stopped)
        self.maddr = None
        self.nodes: dict[str, subprocess.Popen] = {}  # bootstrap nodes by name

    def bootstrap(
        self,
        name: str = "bootstrap",
        port: int = 0,
        initial_peers: tuple[str, ...] = (),
        run: dict | None = None,
        observe: bool = False,
        observe_poll_s: float = 1.0,
    ) -> str:
        """A bootstrap node (`name` keeps its key and log; the same name and port restart it):
        its address; the first one's is what peers are given. It watches the run of SWARM + `run`;
        with `observe` it serves the observer too, polling every `observe_poll_s` (the next line of
        its stdout has the URL)."""
        log = open(self.folder / f"{name}.log", "a")
        run_toml = self.folder / ("run.toml" if name == "bootstrap" else f"{name}.toml")
        config.save(config.load(None, {**SWARM, **(run or {})}), run_toml)  # it reports this run's rounds
        proc = subprocess.Popen(
            [
                *CLI,
                *("bootstrap", "--host", "127.0.0.1", "--port", str(port), "--report-every", "2"),
                "--identity",
                str(self.folder / f"{name}.key"),
                "--config",
                str(run_toml),
                *(["--initial-peers", *initial_peers] if initial_peers else []),
                *(["--observe-port", "0", "--observe-eval-every", "1"] if observe else []),
                *(["--observe-poll-s", str(observe_poll_s)] if observe else []),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=ENV,
            start_new_session=True,
        )
        proc.args = [*proc.args, str(self.folder / f"{name}.log")]  # its log last, as a peer's
        self.procs.append(proc)
        self.sessions.add(proc.pid)
        self.nodes[name] = proc
        deadline = time.monotonic() + 60
        for line in proc.stdout:  # the node prints its address as soon as it is up
            if line.strip().startswith("--initial-peers"):
                self.maddr = self.maddr or line.split()[1]
                return line.split()[1]
            assert time.monotonic() < deadline, "bootstrap node did not print its address"
        raise AssertionError(f"bootstrap node exited: {proc.wait(timeout=10)}")

    def peer(
        self,
        name: str,
        extra: dict | None = None,
        script: list[str] | None = None,
        fault: str | None = None,
        resume: bool = False,
        env: dict | None = None,
        entries: tuple[str, ...] = (),
    ) -> subprocess.Popen:
        """A peer process; with `fault` (see faulty_peer.py) one that fails on purpose, in its own
        session. `entries`: its initial peers (default: the first bootstrap node)."""
        entries = entries or (self.maddr,)
        options = {**SWARM, **(extra or {}), "run.dir": str(self.folder / name)}
        if fault:
            script = [sys.executable, "-m", "tests.swarm.faulty_peer"]
        cmd = [*(script or CLI), "peer", *[f"--{k}={v}" for k, v in options.items()], "--initial-peers", *entries]
        if resume:
            cmd.append("--resume")
        log = open(self.folder / f"{name}.log", "a")
        env = {**ENV, **(env or {}), **({"FAULT": fault} if fault else {})}
        # Its own session, so that its DHT and averager processes and their p2pd can be ended as a group.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        proc.args = [*cmd, str(self.folder / f"{name}.log")]
        self.procs.append(proc)
        self.sessions.add(proc.pid)
        if fault:
            self.fault_sessions.add(proc.pid)
        return proc

    def records(self, name: str) -> dict[int, dict]:
        path = self.folder / name / "metrics.jsonl"
        if not path.exists():
            return {}
        out = {}
        for line in path.read_text().splitlines():
            if line.endswith("}"):
                record = json.loads(line)
                out[record["round"]] = record
        return out

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def end_all(self) -> None:
        # Every process below the ones we started, noted now: once a peer's main process is gone,
        # its p2pd (in a session of its own) hangs from init, and a stopped one never ends by itself.
        trees = {(pid, started_at(pid)) for pgid in self.sessions for pid in descendants(pgid)}
        for pgid in self.fault_sessions:  # fault subjects (maybe stopped): no clean exit to wait for
            _end_session(pgid)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        # The test is over: a peer still busy after Ctrl+C (in an all-reduce or agreement, whose
        # deadlines are tens of seconds) is killed with its group after one shared grace period.
        # (What a clean stop leaves is asserted by the tests that stop peers, not here.)
        deadline = time.monotonic() + 3
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        for pgid in self.sessions:  # whatever a peer left behind: its DHT, averager, p2pd
            _end_session(pgid)
        for pid, started in trees:
            if alive(pid) and started_at(pid) == started:  # the same process, not a reused pid
                os.kill(pid, signal.SIGKILL)
        wait_gone([pid for pid, _ in trees], deadline_s=10)
        # The shared memory of the processes killed (leftovers.py): the peers', and the bootstrap
        # nodes' (hivemind's futures, 80 bytes each), whose run dirs note nothing.
        leftovers.sweep_below(self.folder)
        leftovers.remove_gone([pid for pid, _ in trees])


def _end_session(pgid: int) -> None:
    """A process started in its own session (a fault-injection worker) leaves its DHT process and
    p2pd behind when it is SIGKILLed: end its whole process group, whose id is the pid we started.
    SIGKILL also ends stopped processes."""
    signal_tree(pgid, signal.SIGKILL)  # p2pd too: a stopped one would not notice its parent died


# Timing chaos for chosen swarm tests (bench/chaos_kinds.py, docs/benchmarks.md "Timing chaos"):
# P2P_DILOCO_CHAOS=hog a CPU hog on core 0 for the test's duration; quota: the test's first peer
# in 15 % of a core (cgroup v1); pauses: its process tree stopped 0.1-3 s at random moments
# (seed P2P_DILOCO_CHAOS_SEED). Comma-separated; unset (the default) costs nothing.
CHAOS = {kind for kind in os.environ.get("P2P_DILOCO_CHAOS", "").split(",") if kind}
CHAOS_KINDS = {"hog", "quota", "pauses"}


def _with_chaos(s: ProcessSwarm, stack: ExitStack) -> None:
    from bench.chaos_kinds import CpuQuota, Hog, Pauses  # only when asked for

    if CHAOS - CHAOS_KINDS:
        raise pytest.UsageError(f"P2P_DILOCO_CHAOS: unknown {sorted(CHAOS - CHAOS_KINDS)}; use {sorted(CHAOS_KINDS)}")
    if "hog" in CHAOS:
        stack.enter_context(Hog(core=0))
    start, subjects = s.peer, []

    def peer(name, *args, **kwargs):
        proc = start(name, *args, **kwargs)
        if not subjects and CHAOS & {"quota", "pauses"}:  # the test's first peer, from its start
            subjects.append(proc)
            if "quota" in CHAOS:
                stack.enter_context(CpuQuota(name, 0.15)).add(proc.pid)
            if "pauses" in CHAOS:
                rng = random.Random(int(os.environ.get("P2P_DILOCO_CHAOS_SEED", "0")))
                stack.enter_context(Pauses(proc.pid, rng))
        return proc

    s.peer = peer  # type: ignore[method-assign]


@pytest.fixture
def swarm(tmp_path):
    s = ProcessSwarm(tmp_path)
    with ExitStack() as chaos:  # ended after end_all: SIGCONT, the hog killed, the cgroup removed
        if CHAOS:
            _with_chaos(s, chaos)
        s.bootstrap()
        try:
            yield s
        finally:
            s.end_all()
