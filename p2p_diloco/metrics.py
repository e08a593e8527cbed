"""Metrics are data, logs are for people.

- `MetricsLog`: `metrics.jsonl` in the run dir, one JSON record per round.
- `Progress`: the live progress bar of the inner phase (loss, tokens/s), on stderr.
- `PeerLogger`: every log line says who and when: `[peer ab12 round 7 step 120/500] ...`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm


class MetricsLog:
    """Append-only JSON lines; on resume, records past the checkpoint's round are dropped first."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()

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
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)


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


class Progress:
    """One bar per inner phase; does nothing when disabled or when stderr is not a terminal."""

    def __init__(self, enabled: bool, peer: str):
        self.enabled = enabled and sys.stderr.isatty()
        self.peer = peer
        self.bar: tqdm | None = None

    def start(self, round_: int, steps: int) -> None:
        if self.enabled:
            self.bar = tqdm(
                total=steps, desc=f"peer {self.peer} round {round_}", unit="step", leave=False, dynamic_ncols=True
            )

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.3f}  {tokens_per_s:,.0f} tok/s", refresh=False)
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
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
