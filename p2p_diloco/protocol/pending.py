"""A result on its way: computed now (blocking rounds) or by a thread in the background (overlapped
rounds, where a round's all-reduce or agreement runs while the next inner phase trains)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Pending(Generic[T]):
    """`join` returns the work's result or raises its error, in the caller's thread. The work's
    deadlines are the swarm's (I3), so `join` ends."""

    def __init__(self, work: Callable[[], T], in_background: bool):
        self.in_background = in_background
        self.started = time.perf_counter()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if in_background:
            self._thread = threading.Thread(target=self._run, args=(work,), name="overlapped-average", daemon=True)
            self._thread.start()
        else:
            self._run(work)

    @classmethod
    def now(cls, work: Callable[[], T]) -> Pending[T]:
        return cls(work, in_background=False)

    @classmethod
    def background(cls, work: Callable[[], T]) -> Pending[T]:
        return cls(work, in_background=True)

    def _run(self, work: Callable[[], T]) -> None:
        try:
            self._result = work()
        except BaseException as e:  # handed to the caller at join
            if self._thread is None:
                raise
            self._error = e

    def join(self) -> T:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]  # set by _run before join can return
