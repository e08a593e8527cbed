"""Inner batches made ahead of time: a background thread tokenises and packs the next batches of a
`TrainStream` while the current step trains, so the step never waits for data. On CUDA they come
in pinned memory, whose copy to the GPU does not hold up the CPU.

The position stays exact. Each batch comes with the stream's state after it, and the state a
`Prefetcher` reports (what a checkpoint saves) is that of the last batch *taken*, not of those
queued: a resumed peer goes on from the first batch it did not train on, as without prefetching.

Only the thread touches the stream while it runs; `load_state_dict` and `close` stop it first.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time

import torch

from p2p_diloco.errors import DataError
from p2p_diloco.train.data import TrainStream

log = logging.getLogger(__name__)

DEPTH = 4  # batches made ahead: absorbs a slow document or two; 4 MiB a batch of 512 x 1,024 tokens
POLL_S = 0.5  # how often a waiting side checks whether the other one stopped or died
# How long the trainer waits for one batch before it calls the data source hung. A streamed hub
# dataset retries its reads for minutes; a stdlib batch takes milliseconds.
BATCH_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0  # a batch in the making is finished before the thread sees the stop

Item = tuple[torch.Tensor, dict[str, int]] | Exception  # a batch and the stream's state after it, or an error


class Prefetcher:
    """Batches of `batch_size` rows from `stream`, made by a background thread up to `depth` ahead.

    The thread starts at the first `next_batch`, so a resumed peer loads its state before any
    batch is made. An error of the stream (a `DataError`, a read that failed) is raised by the
    `next_batch` that would have returned its batch, and by every one after it.
    """

    def __init__(self, stream: TrainStream, batch_size: int, pin_memory: bool = False, depth: int = DEPTH):
        self._stream, self._batch_size, self._pin, self._depth = stream, batch_size, pin_memory, depth
        self._state = stream.state_dict()  # after the last batch taken
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue[Item] = queue.Queue(depth)
        self._error: Exception | None = None

    def next_batch(self) -> torch.Tensor:
        """The next batch [batch_size, seq_len]: the one `stream.next_batch(batch_size)` would give."""
        if self._error is not None:
            raise self._error
        if self._thread is None:
            self._start()
        batch, self._state = self._take()
        return batch

    def state_dict(self) -> dict[str, int]:
        """The stream's state after the last batch taken."""
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (a `TrainStream.state_dict`); the batches made ahead are dropped. On
        a bad state it raises DataError and goes on from where it was."""
        self._halt(rewind=True)
        self._stream.load_state_dict(state)
        self._state = self._stream.state_dict()

    def close(self) -> None:
        """Stop the thread (within STOP_TIMEOUT_S); safe to call twice."""
        try:
            self._halt(rewind=False)
        except DataError as e:  # closing goes on; the thread is a daemon and dies with the process
            log.warning("%s", e)

    def _start(self) -> None:
        # A fresh event and queue per thread: a stopped thread that is still finishing a batch
        # can never hand it to its successor.
        self._stop, self._queue = threading.Event(), queue.Queue(self._depth)
        self._thread = threading.Thread(
            target=self._produce, args=(self._stop, self._queue), name="p2p-diloco-prefetch", daemon=True
        )
        self._thread.start()

    def _produce(self, stop: threading.Event, out: queue.Queue[Item]) -> None:
        """The thread: batches, each with the stream's state after it, until stopped or failed."""
        try:
            while not stop.is_set():
                batch = self._stream.next_batch(self._batch_size)
                if self._pin:
                    batch = batch.pin_memory()
                if not put(out, (batch, self._stream.state_dict()), stop):
                    return
        except Exception as e:  # handed to the trainer, which raises it where it wanted the batch
            put(out, e, stop)

    def _take(self) -> tuple[torch.Tensor, dict[str, int]]:
        assert self._thread is not None
        try:
            item = self._queue.get(timeout=POLL_S)
        except queue.Empty:
            item = self._when_empty(self._thread, time.monotonic() + BATCH_TIMEOUT_S)
        if isinstance(item, Exception):
            self._error = item
            raise item
        return item

    def _when_empty(self, thread: threading.Thread, deadline: float) -> Item:
        """No batch yet: wait on while the thread lives and the deadline is ahead."""
        while True:
            alive = thread.is_alive()
            try:  # again: the thread may have put its last item and ended since the last look
                return self._queue.get(timeout=POLL_S if alive else 0)
            except queue.Empty:
                pass
            if not alive:  # it hands on its errors, so only a stop ends it early
                return DataError("the data thread ended without a batch: the prefetcher was closed")
            if time.monotonic() > deadline:
                return DataError(
                    f"no training batch for {BATCH_TIMEOUT_S:.0f} s: the data source hangs "
                    f"(a streamed dataset offline?); check the network or use data.source = files"
                )

    def _halt(self, rewind: bool) -> None:
        """Stop the thread and drop the batches made ahead; `rewind`: put the stream back at the
        last batch taken (it was ahead of it), so that it can be read again."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        with contextlib.suppress(queue.Empty):  # room for a put it waits in, so that it sees the stop now
            self._queue.get_nowait()
        thread.join(STOP_TIMEOUT_S)
        if thread.is_alive():  # it still reads the stream: nobody else may touch it
            raise DataError(f"the data thread did not stop within {STOP_TIMEOUT_S:.0f} s (a corpus read hangs)")
        self._thread, self._error = None, None
        if rewind:
            self._stream.load_state_dict(self._state)


def put(out: queue.Queue[Item], item: Item, stop: threading.Event) -> bool:
    """Put `item` into `out` once there is room; False if `stop` came first."""
    while not stop.is_set():
        try:
            out.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False
