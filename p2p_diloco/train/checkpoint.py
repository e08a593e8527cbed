"""Checkpoints at round boundaries: atomic, verified, everything needed to resume bit-exactly (I6).

A checkpoint is one file `<run dir>/checkpoints/round-NNNNNN.pt` holding the round r, θ(r), the
outer momentum, the inner AdamW state and step, the data position, the RNG states, the shared
config it was written under and the digest of (r, θ, momentum). The inner model is not stored:
at a round boundary it equals θ(r).

Writing goes to a temporary file in the same folder, fsync, then rename: a crash leaves either
the old set of checkpoints or the new one, never a half-written file under a final name. A full
disk leaves the old set too, and no temporary file.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch

from p2p_diloco.config import diff_shared
from p2p_diloco.errors import CheckpointError, WriteError
from p2p_diloco.protocol import outer

FORMAT = 1
REQUIRED = ("format", "round", "params", "momentum", "digest", "shared_config", "fingerprint", "trainer", "data", "rng")
_NAME = re.compile(r"^round-(\d{6,})\.pt$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def path_for(run_dir: str | Path, round_: int) -> Path:
    return checkpoint_dir(run_dir) / f"round-{round_:06d}.pt"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint files of a run, oldest round first (temporary files are ignored)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def round_of(path: Path) -> int:
    """The round of a checkpoint file, from its name."""
    found = _NAME.match(path.name)
    if found is None:
        raise CheckpointError(f"{path} is not named like a checkpoint (round-NNNNNN.pt)")
    return int(found.group(1))


def latest(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save(run_dir: str | Path, payload: dict[str, Any], keep: int) -> Path:
    """Write `payload` as the checkpoint of its round, atomically; keep the `keep` latest.

    A failed write (a full or read-only disk) removes its temporary file, prunes nothing and
    raises WriteError naming the checkpoint that is still intact.
    """
    path = path_for(run_dir, payload["round"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write(tmp, {"format": FORMAT, **payload})
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        raise WriteError.of(path, e, resume_line(run_dir)) from None
    finally:
        with contextlib.suppress(OSError):  # a read-only disk refuses to unlink even a file it never made
            tmp.unlink(missing_ok=True)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def resume_line(run_dir: str | Path) -> str:
    """After a failed write: the checkpoint a resume starts from, or "" if there is none yet."""
    found = latest(run_dir)
    if found is None:
        return ""
    return f"the checkpoint of round {round_of(found)} is intact, continue with --resume"


def _write(tmp: Path, payload: dict[str, Any]) -> None:
    """torch.save into `tmp`, on disk when this returns. The disk's OSError is raised as it is:
    torch turns a failed write into a RuntimeError ("unexpected pos 704 vs 598") that no longer
    says the disk is full."""
    with open(tmp, "wb") as f:
        sink = _Sink(f)
        try:
            torch.save(payload, sink)
        except RuntimeError:
            if sink.error is None:
                raise
            raise sink.error from None
        f.flush()
        os.fsync(f.fileno())


class _Sink:
    """A file for torch.save that remembers the OSError of a failed write."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def load(path: str | Path, shared_config: dict | None = None) -> dict[str, Any]:
    """Read and verify a checkpoint; CheckpointError says what is wrong and what to do.

    shared_config: the current run's `Config.shared_dict()`; a checkpoint written under other
    shared values is refused with the differing fields named.
    """
    path = Path(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} not found") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError... on damaged files
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
            f"move it away to resume from the previous round"
        ) from None
    _verify(path, payload, shared_config)
    return payload


def _verify(path: Path, payload: Any, shared_config: dict | None) -> None:
    if not isinstance(payload, dict) or any(k not in payload for k in REQUIRED):
        missing = [k for k in REQUIRED if not isinstance(payload, dict) or k not in payload]
        raise CheckpointError(f"checkpoint {path} is not a p2p-diloco checkpoint (missing {', '.join(missing)})")
    if payload["format"] != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {payload['format']}, this version reads format {FORMAT}")
    actual = outer.digest(payload["round"], payload["params"], payload["momentum"])
    if actual != payload["digest"]:
        raise CheckpointError(
            f"checkpoint {path} is corrupt: its tensors hash to {actual}, it recorded {payload['digest']}; "
            f"move it away to resume from the previous round"
        )
    if shared_config is not None:
        differs = diff_shared(payload["shared_config"], shared_config)
        if differs:
            raise CheckpointError(
                f"checkpoint {path} belongs to another run config ({'; '.join(differs)}); resume with the "
                f"config it was written under (config.toml in the run dir) or choose a new --run.dir"
            )


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable: the directory entry must reach the disk too."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
