"""Real small disks for the tests of writes that fail: a tmpfs of a chosen size, filled for real.

A mocked `open` that raises ENOSPC would not show what a full disk does to a file: a write first
takes what still fits, then fails, and leaves a half-written file unless the writer cleans up.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

PAGE = 4096  # tmpfs counts whole pages of this size: a file of 1 byte takes one


@contextmanager
def tmpfs(folder: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted at `folder` (made here), unmounted when the block ends."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root: the tests of a full disk fill a real one")
    folder.mkdir(parents=True)
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)], capture_output=True, text=True
        )
    except FileNotFoundError:
        pytest.skip("no `mount` command: the tests of a full disk mount a small tmpfs")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {folder} ({mounted.stderr.strip()}): the full-disk tests need one")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True, capture_output=True)


def remount(folder: Path, option: str) -> None:
    """Remount the tmpfs at `folder` with `option`: `ro` (a disk gone read-only), `size=N` (space freed)."""
    subprocess.run(["mount", "-o", f"remount,{option}", str(folder)], check=True, capture_output=True)


def fill(folder: Path, leave_bytes: int = 0) -> None:
    """Fill the disk of `folder` to the last page, then free `leave_bytes` of it again (whole pages)."""
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * PAGE)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
        f.truncate(f.tell() - leave_bytes)
