"""A training swarm on emulated internet links: `p2p-diloco peer` processes, each on a host of a
NetLab (its own network namespace, rate-limited veth), and a bootstrap node on an unlimited host.

    with NetLab([(100, 100), (100, 100), (None, None)]) as lab:
        swarm = NetSwarm(lab, folder, overrides, bootstrap_host=2)
        swarm.run_peers([0, 1], timeout_s=900)
        swarm.records(0)   # metrics.jsonl of the peer on host 0, by round

Everything runs in the lab's namespaces; NetLab.close() ends it all and deletes the namespaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from p2p_diloco import config

if __package__:  # imported as bench.netswarm (the tests)
    from .netlab import NetLab, line_reader, next_line
else:  # run as a script, bench/ on sys.path
    from netlab import NetLab, line_reader, next_line

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}  # peers share the machine's cores
CLI = [sys.executable, "-m", "p2p_diloco.cli"]


class NetSwarm:
    def __init__(
        self, lab: NetLab, folder: Path, overrides: dict[str, str], bootstrap_host: int, more_entry_hosts: tuple = ()
    ):
        """A bootstrap node on `bootstrap_host`, and one more on each of `more_entry_hosts` (joined
        through the first): every peer gets them all as its initial peers (`entries`)."""
        self.lab, self.folder = lab, Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run_toml = self.folder / "run.toml"
        config.save(config.load(None, {"log.progress": "false", **overrides}), self.run_toml)
        self.maddr = self._bootstrap(bootstrap_host)
        self.entries = [self.maddr] + [self._bootstrap(host, self.maddr) for host in more_entry_hosts]
        # host -> FAULT of tests/swarm/faulty_peer.py: that host's peer fails on purpose (its exit code is its own)
        self.faults: dict[int, str] = {}
        self.codes: dict[int, int] = {}  # host -> the exit code of its peer, once it ended

    def _bootstrap(self, host: int, entry: str = "") -> str:
        name = "bootstrap" if not entry else f"bootstrap{host}"
        proc = self.lab.popen(
            host,
            [
                *CLI,
                "bootstrap",
                "--host",
                self.lab.hosts[host].ip,
                "--port",
                "0",
                "--identity",
                str(self.folder / f"{name}.key"),
                "--config",
                str(self.run_toml),
                *(["--initial-peers", entry] if entry else []),
            ],
            stdout=subprocess.PIPE,
            stderr=open(self.folder / f"{name}.log", "w"),
            text=True,
            env=ENV,
            cwd=ROOT,
        )
        lines = line_reader(proc)
        deadline = time.monotonic() + 60
        while True:  # the node prints its address as soon as it is up
            line = next_line(lines, max(0.0, deadline - time.monotonic()), "bootstrap node's address").strip()
            if line.startswith("--initial-peers"):
                return line.split()[1]

    def peer_dir(self, host: int) -> Path:
        return self.folder / f"peer{host}"

    def run_peers(self, hosts: list[int], timeout_s: float, late: dict | None = None) -> float:
        """Start one peer per host, wait until all exit (each must succeed); returns the wall time.
        `late`: {host: condition}: that host's peer starts once condition() holds (polled)."""
        started = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        procs = [self._start(host) for host in hosts if host not in (late or {})]
        for host, condition in (late or {}).items():
            while not condition():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the late peer on host {host} was never due within {timeout_s:g} s")
                time.sleep(0.2)  # a poll of the others' files, bounded by the deadline above
            procs.append(self._start(host))
        hosts = [h for h in hosts if h not in (late or {})] + list(late or {})
        for host, proc in zip(hosts, procs):
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"peer on host {host} did not finish within {timeout_s:g} s; see {self.folder}/peer{host}.log"
                ) from None
            self.codes[host] = code
            if code != 0 and host not in self.faults:
                raise RuntimeError(f"peer on host {host} exited with {code}; see {self.folder}/peer{host}.log")
        return time.perf_counter() - started

    def _start(self, host: int) -> subprocess.Popen:
        fault = self.faults.get(host)
        cli = [sys.executable, "-m", "tests.swarm.faulty_peer"] if fault else CLI
        cmd = [
            *cli,
            "peer",
            "--config",
            str(self.run_toml),
            f"--run.dir={self.peer_dir(host)}",
            f"--swarm.host={self.lab.hosts[host].ip}",
            "--initial-peers",
            *self.entries,
        ]
        log = open(self.folder / f"peer{host}.log", "w")
        env = {**ENV, "FAULT": fault} if fault else ENV
        return self.lab.popen(host, cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def records(self, host: int) -> dict[int, dict]:
        path = self.peer_dir(host) / "metrics.jsonl"
        return {r["round"]: r for r in map(json.loads, path.read_text().splitlines())}
