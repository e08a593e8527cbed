"""`p2p-diloco demo`: a bootstrap node and N peer processes on 127.0.0.1, one combined view.

Each peer is a real `p2p-diloco peer` subprocess with its own run dir and log; the view reads
their metrics.jsonl and prints one line per round once every peer finished it, with the held-out
losses and whether all digests are equal. Ctrl+C stops every peer cleanly.

The demo writes only into a folder of its own: one it creates, or an empty one, marked as its own
by a MARKER file. Run again in a marked folder, it removes only what a demo writes there (OWN);
any other non-empty folder is refused, so a mistyped --dir never costs a user's files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from p2p_diloco import config as config_mod
from p2p_diloco.errors import ConfigError

DEMO = {
    "run.run_id": "demo",
    "run.eval_sequences": "32",
    "model.preset": "tiny",
    "model.seq_len": "128",
    "data.num_shards": "16",
    "inner.steps": "30",
    "inner.batch_size": "16",
    "inner.micro_batch_size": "16",
    "inner.lr": "3e-3",
    "inner.warmup_steps": "30",
    "swarm.host": "127.0.0.1",
    "swarm.matchmaking_time_s": "3",
    "swarm.linger_s": "10",  # the demo's peers leave soon after the end; they all hold the final state
    "log.progress": "false",
}
STOP_DEADLINE_S = 60
MARKER = ".p2p-diloco-demo"
# What a demo writes into its folder besides the marker: the run's config, the bootstrap node's key
# and address book (with their temporary names), each peer's run dir and log.
OWN = re.compile(r"run\.toml(\.tmp)?|bootstrap\.(key|peers(\.partial)?)|peer-\d+(\.log)?")
MARKER_TEXT = (
    "This folder was made by `p2p-diloco demo`. A demo run again with --dir here replaces what a demo\n"
    "writes (run.toml, bootstrap.key, bootstrap.peers, peer-N/, peer-N.log) and nothing else.\n"
)


def demo_config(rounds: int) -> config_mod.Config:
    return config_mod.load(None, {**DEMO, "run.rounds": str(rounds)})


def run_demo(n_peers: int, rounds: int, folder: str | Path, stop: threading.Event, emit: Callable[[str], None]) -> int:
    """Run the demo until every peer finished `rounds` or `stop` is set; 0 if all peers agreed and exited cleanly."""
    folder = Path(folder)
    prepare_folder(folder)  # before anything slow: a refused folder costs no peer and no import
    from p2p_diloco.swarm.bootstrap import Bootstrap  # imports hivemind

    cfg = demo_config(rounds)
    config_mod.save(cfg, folder / "run.toml")
    boot = Bootstrap(cfg, folder / "bootstrap.key")
    procs: list[subprocess.Popen] = []
    agreed, shown = False, -1
    watching = _Dashboard(cfg, boot, emit)
    try:
        maddrs = boot.initial_peers()
        emit(f"bootstrap node: {maddrs[0]}")
        emit(f"dashboard: {watching.url}")
        for i in range(n_peers):
            procs.append(_start_peer(i, folder, maddrs))
        emit(f"{n_peers} peers started; logs in {folder}/peer-*.log")
        agreed, shown = _watch(procs, folder, rounds, stop, emit)
    finally:
        codes = _stop_all(procs, interrupt=stop.is_set() or shown < rounds)
        watching.close()
        boot.close()
    emit(f"peers exited with {codes}")
    # Done, or stopped by the user: either way a success if every peer agreed and left cleanly.
    return 0 if agreed and (shown >= rounds or stop.is_set()) and all(code == 0 for code in codes) else 1


def stale_entries(folder: Path, names: Collection[str] | None) -> list[str]:
    """What the demo removes from `folder` before it starts, given the names in it (None: there is
    no such folder): nothing from a missing or empty folder, the entries a demo writes (OWN) from a
    folder that carries the MARKER. Any other folder is refused: it holds files the demo did not write."""
    if not names:
        return []
    if MARKER not in names:
        raise ConfigError(
            f"--dir {folder} is not empty and was not made by the demo (it has no {MARKER} file); "
            "choose a new or empty folder, e.g. --dir runs/demo-2"
        )
    return sorted(name for name in names if OWN.fullmatch(name))


def prepare_folder(folder: Path) -> None:
    """Make `folder` the demo's: create or mark it, and remove a previous demo's files from it."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--dir {folder} is a file, not a folder; choose a new or empty folder")
    names = [p.name for p in folder.iterdir()] if folder.exists() else None
    for name in stale_entries(folder, names):
        _remove(folder / name)
    folder.mkdir(parents=True, exist_ok=True)
    # Before anything else is written: a demo stopped at any later point leaves a marked folder.
    (folder / MARKER).write_text(MARKER_TEXT)


def _remove(path: Path) -> None:
    # A link is removed, never followed: what it points to was not written by the demo.
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot remove {path}, left by a previous demo ({e.strerror}); remove it or choose another --dir"
        ) from None


class _Dashboard:
    """The observer's dashboard of the demo's run, fed from the bootstrap node's DHT every second
    by a thread of its own (nothing else in this process uses that DHT handle)."""

    def __init__(self, cfg: config_mod.Config, boot: Any, emit: Callable[[str], None]):
        from p2p_diloco.observe.service import Observatory, evaluation
        from p2p_diloco.swarm.run_reader import RunReader

        reader = RunReader(cfg, boot.run_dht, boot.gate)
        self.observatory = Observatory(cfg, reader.healthy, "127.0.0.1", 0)
        # The held-out loss of the agreed state of every round (the tiny model's takes milliseconds).
        self.observatory.evaluate(evaluation(cfg, reader, 1, emit), 1.0)
        self.url = self.observatory.server.url
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._feed, args=(reader,), name="demo-dashboard", daemon=True)
        self._thread.start()

    def _feed(self, reader: Any) -> None:
        while not self._done.wait(1.0):
            self.observatory.ingest(reader.poll())

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=10)
        self.observatory.close()


def _start_peer(i: int, folder: Path, maddrs: list[str]) -> subprocess.Popen:
    log = open(folder / f"peer-{i}.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "p2p_diloco.cli",
        "peer",
        "--config",
        str(folder / "run.toml"),
        "--run.dir",
        str(folder / f"peer-{i}"),
        "--data.shard",
        str(i),
        "--initial-peers",
        *maddrs,
    ]
    # One thread per peer: N peers share this machine's cores; oversubscribing them slows everyone.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _records(folder: Path, i: int) -> dict[int, dict]:
    path = folder / f"peer-{i}" / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        out[record["round"]] = record
    return out


def _watch(
    procs: list[subprocess.Popen], folder: Path, rounds: int, stop: threading.Event, emit: Callable[[str], None]
) -> tuple[bool, int]:
    """Print each round once all live peers have it; (every shown round had equal digests, last round shown)."""
    shown, agreed = -1, True  # round 0: θ(0), before any training
    while not stop.wait(0.5):
        recs = [_records(folder, i) for i in range(len(procs))]
        live = [i for i, p in enumerate(procs) if p.poll() is None or recs[i]]
        while shown + 1 <= rounds and live and all(shown + 1 in recs[i] for i in live):
            shown += 1
            agreed &= _emit_round(shown, [recs[i][shown] for i in live], emit)
        if shown >= rounds or all(p.poll() is not None for p in procs):
            break
    if shown >= 1:
        first, last = _records(folder, 0).get(0, {}), _records(folder, 0).get(shown, {})
        if first.get("eval_loss") is not None and last.get("eval_loss") is not None:
            emit(
                f"held-out loss {first['eval_loss']:.3f} -> {last['eval_loss']:.3f} over {shown} rounds; "
                f"digests {'equal on every peer in every round' if agreed else 'DIFFERED in some round'}"
            )
    return agreed, shown


def _emit_round(r: int, recs: list[dict], emit: Callable[[str], None]) -> bool:
    digests = {rec["digest"] for rec in recs}
    losses = " ".join(f"{rec['eval_loss']:.3f}" if rec.get("eval_loss") is not None else "-" for rec in recs)
    group = max(rec.get("group_size", 1) for rec in recs)
    same = "equal" if len(digests) == 1 else f"DIFFER ({len(digests)})"
    caught_up = sum("group_size" not in rec for rec in recs)  # a record of a round caught up to (README)
    comm = (
        f"group {group}  all-reduce {max(rec.get('allreduce_s', 0) for rec in recs):.2f} s"
        + (f"  ({caught_up} caught up)" if caught_up else "")
        if r
        else "theta(0)" + " " * 20
    )
    emit(f"round {r:3d}  held-out loss {losses}  {comm}  digests {same} {sorted(digests)[0][:12]}")
    return len(digests) == 1


def _stop_all(procs: list[subprocess.Popen], interrupt: bool) -> list[int]:
    """End every peer: a peer that finished its rounds exits by itself; otherwise (or past the
    deadline) SIGINT, a clean stop; SIGKILL for what is still there after another deadline."""
    if interrupt:
        _signal_live(procs, signal.SIGINT)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=STOP_DEADLINE_S))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)
            try:
                codes.append(p.wait(timeout=STOP_DEADLINE_S))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait(timeout=STOP_DEADLINE_S))
    return codes


def _signal_live(procs: list[subprocess.Popen], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signum)
