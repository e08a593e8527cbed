"""A swarm on 127.0.0.1 for benchmarks: a bootstrap node and real `p2p-diloco peer` processes,
each in a session of its own so it can be throttled, stopped, killed or restarted as a whole.

    with LocalSwarm(folder, overrides) as lab:
        lab.start("a"); lab.start("b")
        lab.wait(lambda: lab.done("a") and lab.done("b"), 600, "both finish")

Everything this starts is ended on exit, also on errors, by process group id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from p2p_diloco import config
from p2p_diloco.swarm.transport import leftovers

CLI = [sys.executable, "-m", "p2p_diloco.cli"]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.swarm.procs import descendants, signal_tree, wait_gone  # noqa: E402  (a peer's tree, p2pd included)

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # several peers share the machine's cores
# The issue-13/14 benchmarks' run: the tiny preset, H = 20 fixed (no speed-aware rounds, so every
# run trains the same tokens), short deadlines.
TINY_FIXED_H = {
    "run.eval_sequences": "32",
    "model.preset": "tiny",
    "model.seq_len": "128",
    "data.num_shards": "8",
    "inner.steps": "20",
    "inner.batch_size": "16",
    "inner.micro_batch_size": "16",
    "inner.lr": "3e-3",
    "inner.warmup_steps": "20",
    "swarm.speed_aware": "false",
    "swarm.matchmaking_time_s": "3",
    "swarm.averaging_timeout_s": "30",
    "swarm.agreement_timeout_s": "10",
    "swarm.join_timeout_s": "10",
}


class LocalSwarm:
    def __init__(self, folder: Path, overrides: dict[str, str]):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        # No linger window after the end (swarm.linger_s): a benchmark measures the run, and a
        # peer still finishing is waited for anyway; a scenario that needs late peers sets it.
        self.overrides = {"swarm.host": "127.0.0.1", "log.progress": "false", "swarm.linger_s": "0", **overrides}
        self.run_toml = self.folder / "run.toml"
        config.save(config.load(None, self.overrides), self.run_toml)
        self.procs: dict[str, subprocess.Popen] = {}
        self.groups: set[int] = set()
        self._throttles: dict[str, threading.Event] = {}
        self.maddr = self._bootstrap()

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _bootstrap(self) -> str:
        log = open(self.folder / "bootstrap.log", "w")
        proc = subprocess.Popen(
            [
                *CLI,
                "bootstrap",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--report-every",
                "5",
                "--identity",
                str(self.folder / "bootstrap.key"),
                "--config",
                str(self.run_toml),
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=ENV,
            start_new_session=True,
        )
        self.procs["bootstrap"] = proc
        self.groups.add(proc.pid)
        for line in proc.stdout:  # the node prints its address as soon as it is up
            if line.strip().startswith("--initial-peers"):
                return line.split()[1]
        raise RuntimeError(f"bootstrap node exited with {proc.wait(timeout=10)}; see {self.folder}/bootstrap.log")

    def start(
        self,
        name: str,
        extra: dict[str, str] | None = None,
        resume: bool = False,
        fault: str | None = None,
        attack: str | None = None,
    ) -> subprocess.Popen:
        """A peer; with `fault` (tests/swarm/faulty_peer.py: phase:n:KILL|STOP) one that fails on
        purpose, with `attack` (tests/swarm/attacker_peer.py: kind:x) one that lies."""
        options = {**(extra or {}), "run.dir": str(self.folder / name)}
        program = [sys.executable, "-m", f"tests.swarm.{'faulty' if fault else 'attacker'}_peer"]
        program = program if fault or attack else CLI
        cmd = [
            *program,
            "peer",
            "--config",
            str(self.run_toml),
            *[f"--{k}={v}" for k, v in options.items()],
            "--initial-peers",
            self.maddr,
            *(["--resume"] if resume else []),
        ]
        log = open(self.folder / f"{name}.log", "a")
        env = ENV
        if fault or attack:
            env = {**ENV, "PYTHONPATH": str(ROOT), **({"FAULT": fault} if fault else {"ATTACK": str(attack)})}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name] = proc
        self.groups.add(proc.pid)
        return proc

    def throttle(self, name: str, share: float, period_s: float = 0.3) -> None:
        """Let the peer's main process (its trainer) run only `share` of the time: SIGSTOP/SIGCONT
        in a duty cycle, a slower GPU made real. Its DHT and averager processes run at full speed."""
        stopped = threading.Event()
        self._throttles[name] = stopped
        pid = self.procs[name].pid

        def cycle() -> None:
            while not stopped.is_set():
                try:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.wait(period_s * (1 - share))
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    return
                stopped.wait(period_s * share)

        threading.Thread(target=cycle, daemon=True).start()

    def kill(self, name: str, signum: int = signal.SIGKILL) -> None:
        """Signal the whole peer, p2pd included: SIGKILL is a crash, SIGSTOP a hang."""
        signal_tree(self.procs[name].pid, signum)

    def interrupt(self, name: str, timeout_s: float = 60) -> int:
        """Ctrl+C: the peer leaves cleanly; returns its exit code."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=timeout_s)

    def records(self, name: str) -> dict[int, dict]:
        path = self.folder / name / "metrics.jsonl"
        out = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.endswith("}"):
                    record = json.loads(line)
                    out[record["round"]] = record
        return out

    def running(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout_s:g} s (logs in {self.folder})")
            time.sleep(0.5)  # a poll interval, bounded by the deadline

    def close(self) -> None:
        for stopped in self._throttles.values():
            stopped.set()
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name, signal.SIGCONT)
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        trees = [pid for pgid in self.groups for pid in descendants(pgid)]
        for pgid in self.groups:  # whatever is left: a peer's DHT and averager processes, p2pd
            signal_tree(pgid, signal.SIGKILL)
        wait_gone(trees, deadline_s=10)
        leftovers.sweep_below(self.folder)  # the shared memory of the peers killed (leftovers.py)
