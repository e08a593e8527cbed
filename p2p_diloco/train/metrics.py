"""Metrics are data, logs are for people.

- `MetricsLog`: `metrics.jsonl` in the run dir, one JSON record per round (copied to TensorBoard or
  W&B when configured: sinks.py).
- `Phase`: what the peer is doing now (inner, averaging, agreement, catch-up, idle), for its /metrics.
- `ProgressBar`: the live progress bar of the inner phase (loss, tokens/s), on stderr.
- `PeerLogger`: every log line says who and when: `[peer ab12 round 7 step 120/500] ...`.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, SupportsFloat, get_args

from tqdm import tqdm

from p2p_diloco.errors import WriteError

if TYPE_CHECKING:
    from p2p_diloco.train.sinks import Sinks


class MetricsLog:
    """Append-only JSON lines; on resume, records past the checkpoint's round are dropped first.
    Each appended record also goes to `sinks` (TensorBoard, W&B), if any."""

    def __init__(self, path: str | Path, sinks: Sinks | None = None):
        self.path = Path(path)
        self.latest: dict[str, Any] | None = None  # the last record appended (this peer's /metrics)
        self.sinks = sinks

    def append(self, record: dict[str, Any]) -> None:
        """Add one line. A failed write (a full disk) cuts the file back to its whole lines and
        raises WriteError: a half line would make every later read of the file fail."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        line = (json.dumps(clean) + "\n").encode()
        try:
            with open(self.path, "ab", buffering=0) as f:  # unbuffered: no retry of a failed write at close
                _append_whole(f, line)
        except OSError as e:
            raise self._write_error(e) from None
        self.latest = clean
        if self.sinks is not None:
            self.sinks.write(clean)

    def records(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with open(self.path) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

    def truncate_after(self, round_: int) -> None:
        """Drop records of rounds after `round_` (they were computed after the checkpoint we resume from)."""
        if not self.path.exists():
            return
        kept = [r for r in self.records() if r.get("round", 0) <= round_]
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        except OSError as e:
            raise self._write_error(e) from None
        finally:
            with contextlib.suppress(OSError):  # a read-only disk refuses to unlink even a file it never made
                tmp.unlink(missing_ok=True)

    def _write_error(self, error: OSError) -> WriteError:
        from p2p_diloco.train import checkpoint  # imports torch: only a failed write pays for it

        return WriteError.of(self.path, error, checkpoint.resume_line(self.path.parent))


def _append_whole(f: io.FileIO, line: bytes) -> None:
    """Write all of `line` at the end of `f`, or raise with `f` cut back to its size before."""
    size = f.seek(0, os.SEEK_END)
    try:
        done = 0
        while done < len(line):  # a full disk first takes what fits, then fails
            done += f.write(line[done:])
    except OSError:
        f.truncate(size)
        raise


PhaseName = Literal["inner", "averaging", "agreement", "catch-up", "idle"]
PHASES: tuple[PhaseName, ...] = get_args(PhaseName)


class Phase:
    """What the peer is doing now, and since when: set by the round's code, read by /metrics (any thread)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._name, self._since = "idle", clock()

    def set(self, name: PhaseName) -> None:
        """Enter phase `name` (one of PHASES); entering the current phase again keeps its start."""
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; one of {', '.join(PHASES)}")
        with self._lock:
            if name != self._name:
                self._name, self._since = name, self._clock()

    def now(self) -> tuple[str, float]:
        """(the current phase, seconds in it)."""
        with self._lock:
            return self._name, self._clock() - self._since


class PeerLogger(logging.LoggerAdapter):
    """Prefixes each message with the peer, the round and, inside the inner phase, the step."""

    def __init__(self, logger: logging.Logger, peer: str):
        super().__init__(logger, {})
        self.peer, self.round = peer, 0
        self.step: int | None = None  # inside an inner phase: the step, of `steps`
        self.steps: int | None = None

    def process(self, msg: str, kwargs: Any) -> tuple[str, Any]:
        where = f"peer {self.peer} round {self.round}"
        if self.step is not None:
            where += f" step {self.step}/{self.steps}"
        return f"[{where}] {msg}", kwargs


class ProgressBar:
    """One bar per inner phase; does nothing when disabled or when stderr is not a terminal."""

    LOSS_EVERY_S = 0.5  # how often the bar reads the loss: each read waits for the GPU's step

    def __init__(self, enabled: bool, peer: str):
        self.enabled = enabled and sys.stderr.isatty()
        self.peer = peer
        self.bar: tqdm | None = None
        self._loss_read = -math.inf  # time.monotonic() of the last read

    def start(self, round_: int, steps: int) -> None:
        self._loss_read = -math.inf
        if self.enabled:
            self.bar = tqdm(
                total=steps, desc=f"peer {self.peer} round {round_}", unit="step", leave=False, dynamic_ncols=True
            )

    def update(self, loss: SupportsFloat, tokens_per_s: float) -> None:
        """One step done. `loss` may be a tensor on the GPU: it is read at most every LOSS_EVERY_S."""
        if self.bar is None:
            return
        now = time.monotonic()
        if now - self._loss_read >= self.LOSS_EVERY_S:
            self._loss_read = now
            self.bar.set_postfix_str(f"loss {float(loss):.3f}  {tokens_per_s:,.0f} tok/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class TqdmHandler(logging.StreamHandler):
    """A log handler that writes through tqdm, so log lines do not tear the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never kill the peer; report through logging's own channel
            self.handleError(record)


def setup_logging(level: str) -> None:
    handler = TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    handler.addFilter(not_written_already)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def tag_process_logs(tag: str) -> None:
    """In a process of a peer's own (its averager): every line of this package's loggers starts
    with `[tag]`, as the peer's main process names itself (PeerLogger)."""

    def tagged(record: logging.LogRecord) -> bool:
        if record.name.startswith("p2p_diloco") and not str(record.msg).startswith("["):
            record.msg = f"[{tag}] {record.msg}"
        return True

    for handler in logging.getLogger().handlers:
        handler.addFilter(tagged)


def not_written_already(record: logging.LogRecord) -> bool:
    """False for a record that a handler of a logger below the root has written to the console already.

    huggingface_hub and datasets give their top logger a stderr handler of their own when they are
    imported, and still pass every record on to the root: without this check each of their warnings
    (a hub request retried while offline, say) would reach stderr twice, bare and through ours.
    Theirs is the copy kept: datasets is imported lazily, after this handler is set up.
    """
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger is not logging.root:
        if any(_writes_to_the_console(h, record) for h in logger.handlers):
            return False
        logger = logger.parent if logger.propagate else None
    return True


def _writes_to_the_console(handler: logging.Handler, record: logging.LogRecord) -> bool:
    """A NullHandler, a log file or a handler above the record's level does not count: dropping our
    copy for them would lose the record."""
    stream = getattr(handler, "stream", None)
    consoles = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    return record.levelno >= handler.level and stream is not None and any(stream is c for c in consoles)


# A peer's /metrics (log.metrics_port): the latest round record's figures, as Prometheus gauges.
PEER_GAUGES = {
    "round": "the round of this peer's state",
    "total_tokens": "tokens this peer trained in the run",
    "tokens_per_s": "this peer's training throughput in its last round",
    "train_loss": "mean training loss of this peer's last inner phase",
    "eval_loss": "held-out loss of this peer's state, when evaluated",
    "group_size": "peers in the group of this peer's last all-reduce (1: alone)",
    "allreduce_s": "seconds of this peer's last all-reduce",
    "bytes_sent": "bytes this peer sent in its last all-reduce",
    "bytes_received": "bytes this peer received in its last all-reduce",
    "audit_s": "seconds of its last all-reduce spent auditing the other reducers",
    "audit_bytes": "bytes the audit of its last all-reduce took, apart from bytes_received",
    "alone_rounds": "rounds in a row this peer averaged alone",
}


def peer_prometheus(record: dict[str, Any] | None, run_id: str, peer: str, phase: Phase | None = None) -> str:
    """Prometheus text (0.0.4) of one peer: its latest round record, whether it agreed, and its phase now."""
    labels = f'run_id="{prometheus_label(run_id)}",peer="{prometheus_label(peer)}"'
    lines = []
    for key, help_ in PEER_GAUGES.items():
        value = (record or {}).get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            lines += [f"# HELP p2p_diloco_peer_{key} {help_}", f"# TYPE p2p_diloco_peer_{key} gauge"]
            lines.append(f"p2p_diloco_peer_{key}{{{labels}}} {value}")
    if record is not None:
        adopted = int(bool(record.get("adopted")) or "group_size" not in record)
        lines += [
            "# HELP p2p_diloco_peer_adopted 1 if this peer's last state was downloaded (agreement or catch-up)",
            "# TYPE p2p_diloco_peer_adopted gauge",
            f"p2p_diloco_peer_adopted{{{labels}}} {adopted}",
        ]
    if phase is not None:
        lines += phase_prometheus(phase.now(), labels)
    return "\n".join(lines) + "\n"


def phase_prometheus(now: tuple[str, float], labels: str) -> list[str]:
    """The peer's phase as one gauge per phase (1: the current one) and the seconds spent in it."""
    current, seconds = now
    lines = [
        f"# HELP p2p_diloco_peer_phase 1 for the phase this peer is in now ({', '.join(PHASES)})",
        "# TYPE p2p_diloco_peer_phase gauge",
    ]
    lines += [f'p2p_diloco_peer_phase{{{labels},phase="{name}"}} {int(name == current)}' for name in PHASES]
    return lines + [
        "# HELP p2p_diloco_peer_phase_seconds seconds this peer has been in its current phase",
        "# TYPE p2p_diloco_peer_phase_seconds gauge",
        f"p2p_diloco_peer_phase_seconds{{{labels}}} {seconds:.3f}",
    ]


def prometheus_label(text: str) -> str:
    """A Prometheus label value, escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
