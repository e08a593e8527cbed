"""A parquet file's rows from any row on, reading only the row groups that hold them.

A streamed file's position is (file, row) (data.FileCorpus). `datasets` reaches row r of a
streamed parquet file by reading and dropping the r rows before it: a peer that resumes in the
middle of a FineWeb-Edu file (about 2 GB) downloads again everything before its row, and a peer
of a 1,000-step round may resume every few rounds. A parquet file says in its footer how many rows
each row group holds, so this reader seeks to the row group that holds row r, and reads only the
column that is trained (FineWeb-Edu's rows also carry ids, URLs and scores).

The rows are the ones `datasets` yields, in the same order (tests/unit/test_parquet.py compares
them): a stream that changed reader at a resume would still train the same documents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import IO, Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from p2p_diloco.errors import DataError

BATCH_ROWS = 256  # rows decoded at once: a few MB of FineWeb-Edu text
Opener = Callable[[str], Any]  # a path -> a context manager of a binary file that can seek


def open_remote(path: str) -> Any:
    """A local path or an fsspec URL (hf://datasets/... reads the Hub's files by byte range)."""
    return fsspec.open(path, "rb")


def first_group(rows_per_group: list[int], start: int) -> tuple[int, int]:
    """(the row group that holds row `start`, rows of it before `start`); (len, 0) past the end."""
    before = 0
    for group, rows in enumerate(rows_per_group):
        if start < before + rows:
            return group, start - before
        before += rows
    return len(rows_per_group), 0


def parquet_rows(path: str, start: int, field: str, opener: Opener = open_remote) -> Iterator[dict[str, Any]]:
    """{field: value} for each row of the parquet file at `path` from row `start` (0-based) on."""
    try:
        with opener(path) as raw:
            yield from _rows(raw, path, start, field)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"cannot read {path} ({type(exc).__name__}: {exc}); check the file or the link") from exc


def _rows(raw: IO[bytes], path: str, start: int, field: str) -> Iterator[dict[str, Any]]:
    file = pq.ParquetFile(raw)
    names = file.schema_arrow.names
    if field not in names:
        raise DataError(f"{path} has no column {field!r} (it has {', '.join(names)}); set data.text_field")
    sizes = [file.metadata.row_group(g).num_rows for g in range(file.num_row_groups)]
    group, skip = first_group(sizes, start)
    if group == len(sizes):
        return
    batches = file.iter_batches(batch_size=BATCH_ROWS, row_groups=range(group, len(sizes)), columns=[field])
    for batch in batches:
        values = batch.column(0).to_pylist()
        yield from ({field: value} for value in values[skip:])
        skip = max(0, skip - len(values))
