"""Optional copies of `metrics.jsonl`: TensorBoard and Weights & Biases, off by default.

Each sink receives every record `MetricsLog.append` writes (its numbers, at step = the round). The
packages are extras (`pip install 'p2p-diloco[tensorboard]'`, `'p2p-diloco[wandb]'`), imported only
when configured: a configured one that is not installed is a ConfigError at start. A sink that
fails later never stops training: it is turned off with one warning, and `metrics.jsonl` still
holds every round.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from p2p_diloco.config import Config, LogSection
from p2p_diloco.errors import ConfigError

logger = logging.getLogger(__name__)


class MetricSink(Protocol):
    name: str

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A record's numbers (booleans as 0 or 1), but its round (the step) and any value that is not finite."""
    out = {}
    for key, value in record.items():
        if key != "round" and isinstance(value, int | float) and math.isfinite(value):
            out[key] = float(value)
    return out


def _extra(module: str, extra: str, key: str) -> ModuleType:
    """Import an optional package, or ConfigError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"log.{key} is set but {extra} is not installed: pip install 'p2p-diloco[{extra}]', or unset log.{key}"
        ) from None


def require_packages(log: LogSection) -> None:
    """ConfigError at start if a configured sink's package is missing (before the run dir is touched)."""
    if log.tensorboard_dir:
        _extra("tensorboard", "tensorboard", "tensorboard_dir")
    if log.wandb_project:
        _extra("wandb", "wandb", "wandb_project")


class TensorBoardSink:
    """Scalars of each record in an event file of `logdir`, flushed at once (TensorBoard reads it live)."""

    name = "TensorBoard"

    def __init__(self, logdir: Path):
        _extra("tensorboard", "tensorboard", "tensorboard_dir")
        SummaryWriter = _extra("torch.utils.tensorboard", "tensorboard", "tensorboard_dir").SummaryWriter

        try:
            self.writer = SummaryWriter(str(logdir))
        except OSError as e:  # its parent is a file, a read-only disk, no permission
            reason = e.strerror or type(e).__name__
            raise ConfigError(f"log.tensorboard_dir {logdir} cannot be written ({reason}); choose another") from None

    def write(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, int(record["round"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per peer process, in the run's group (its run id); its local files under `run_dir`/wandb."""

    name = "W&B"

    def __init__(self, config: Config, run_dir: Path, peer_id: str):
        wandb = _extra("wandb", "wandb", "wandb_project")
        log = config.log
        try:
            self.run = wandb.init(
                project=log.wandb_project,
                mode=log.wandb_mode,
                dir=str(run_dir),
                group=config.run.run_id,
                name=f"peer-{peer_id[-4:]}",
                config={**config.to_dict(), "peer_id": peer_id},
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as e:  # no API key, W&B unreachable: said at start, with the way out
            raise ConfigError(
                f"log.wandb_project: W&B could not start a run ({type(e).__name__}: {e}); run `wandb login`, "
                f"or set --log.wandb_mode=offline"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=int(record["round"]))

    def close(self) -> None:
        self.run.finish()


class Sinks:
    """The configured sinks, fed each record; one that raises is closed and dropped, with a warning."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = list(sinks)

    def write(self, record: dict[str, Any]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(record)
            except Exception as e:  # a dashboard's failure must never stop training
                logger.warning(
                    "%s logging failed (%s: %s): turned off for the rest of this run; metrics.jsonl keeps every round",
                    sink.name,
                    type(e).__name__,
                    e,
                )
                self.sinks.remove(sink)
                with contextlib.suppress(Exception):
                    sink.close()

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            try:
                sink.close()
            except Exception as e:  # the peer is stopping anyway: say so, close the others
                logger.warning("%s logging could not be closed (%s: %s)", sink.name, type(e).__name__, e)


def open_sinks(config: Config, run_dir: Path, peer_id: str) -> Sinks:
    """The sinks `config.log` asks for (none by default)."""
    log, sinks = config.log, Sinks([])
    try:
        if log.tensorboard_dir:
            sinks.sinks.append(TensorBoardSink(run_dir / log.tensorboard_dir))
        if log.wandb_project:
            sinks.sinks.append(WandbSink(config, run_dir, peer_id))
    except BaseException:
        sinks.close()
        raise
    return sinks
