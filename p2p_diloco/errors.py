"""The package's exceptions. Each message names the problem and, where there is one, the fix."""

from __future__ import annotations

import errno
import os
from pathlib import Path


class P2PDilocoError(Exception):
    """Base class: the CLI prints these as one line and exits non-zero."""

    exit_code = 1
    then: str = ""  # what the user can do next, added by whoever knows it (the CLI prints it on the same line)

    def line(self) -> str:
        return f"{self}; {self.then}" if self.then else str(self)


class ConfigError(P2PDilocoError):
    """A config file, override or CLI argument is invalid."""

    exit_code = 2


class DataError(P2PDilocoError):
    """A corpus cannot be found, read or split."""


class ModelError(P2PDilocoError):
    """An unknown preset, an unreadable model config or tokenizer."""


class CheckpointError(P2PDilocoError):
    """A checkpoint is missing, truncated, corrupt or from another run."""


class ExportError(P2PDilocoError):
    """An export's own input (a contributors file) is malformed, or its upload to the Hub failed."""


class WriteError(P2PDilocoError):
    """A file of the run dir cannot be written: a full or read-only disk, no permission.

    The writers leave nothing half-written behind (a temporary file is removed, a cut-off line
    is cut away again), so the run dir stays what it was before the failed write.
    """

    @classmethod
    def of(cls, path: str | Path, error: OSError, then: str = "") -> WriteError:
        """The error for `path`, naming the reason, the fix and (`then`) what is still safe."""
        path = Path(path)
        reason = error.strerror or type(error).__name__
        message = f"cannot write {path} ({reason}); {_fix(path, error)} or choose another --run.dir"
        return cls(f"{message}; {then}" if then else message)


def _fix(path: Path, error: OSError) -> str:
    """What makes the write possible again: space on the disk, a writable mount, the folder's rights."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on {_mount_of(path)}"
    if error.errno == errno.EROFS:
        return f"remount {_mount_of(path)} read-write"
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"make {path.parent} writable"
    return f"check the disk behind {_mount_of(path)}"


def _mount_of(path: str | Path) -> Path:
    """The mount point that holds `path`: the disk to free space on (`df` names the same)."""
    found = Path(os.path.realpath(path))
    while not os.path.ismount(found):
        found = found.parent
    return found


class PseudoGradError(P2PDilocoError):
    """A pseudo-gradient failed its local checks (not finite, implausibly large)."""


class SwarmError(P2PDilocoError):
    """The swarm cannot be joined or served: addresses, ports, identity, peers, another run config."""


class EntryUnreachable(SwarmError):
    """None of the entry nodes (initial peers) could be reached: a wrong address or a network that
    blocks it, so the exit code of a problem in the input."""

    exit_code = 2


class RunConfigMismatch(SwarmError):
    """The run's peers hold another config (I5): a config problem, so the exit code of one."""

    exit_code = 2


class AveragingError(P2PDilocoError):
    """A round's all-reduce failed or was incomplete; nothing of it was applied (I2)."""


class SwarmMovedOn(AveragingError):
    """The swarm finished the round while this peer still looked for its group: nothing averaged;
    the peer catches up with the round's result (not an error)."""


class RunFinished(P2PDilocoError):
    """The run this peer would join has ended: nothing is left to train (not an error: exit 0)."""

    exit_code = 0


class CatchUpFailed(SwarmError):
    """Live peers hold a later state that this peer could not download in time: it stops rather
    than train on a state the swarm did not agree on (I1)."""


class RankLost(P2PDilocoError):
    """A process of this peer of several (run.nproc) exited unbidden: the peer stops."""


class StateDownloadError(P2PDilocoError):
    """No peer served a state that matches the digest the swarm published. `served`: what each peer
    that sent a state sent instead, (round, digest) by peer id (a liar, or a holder that moved on);
    the digest is None where the state was malformed (not even this model's shape)."""

    def __init__(self, message: str, served: dict[str, tuple[int, str | None]] | None = None):
        super().__init__(message)
        self.served = dict(served or {})


class AdmissionError(P2PDilocoError):
    """A run key, certificate or admission setting is missing, malformed or does not admit this peer."""

    exit_code = 2
