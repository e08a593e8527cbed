"""Reading a parquet file from a row on: the rows `datasets` streams, and only the row groups that
hold them (p2p_diloco/train/parquet.py)."""

from __future__ import annotations

import json
import os

import datasets
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from p2p_diloco.config import DataSection
from p2p_diloco.errors import DataError
from p2p_diloco.train.data import open_corpus, shard_stream
from p2p_diloco.train.model import ByteTokenizer
from p2p_diloco.train.parquet import first_group, parquet_rows

GROUP_ROWS = 50
ROW_CHARS = 2000


def write_groups(path, groups: int, nulls: bool = False) -> list[str | None]:
    """`groups` row groups of GROUP_ROWS random 2,000-character rows, stored uncompressed, so that a
    row group's text is over 100 KB on disk; a `url` column of ~10 KB a group beside `text`."""
    texts: list[str | None] = [os.urandom(ROW_CHARS // 2).hex() for _ in range(groups * GROUP_ROWS)]
    if nulls:
        texts[3] = None
    table = pa.table({"text": texts, "url": [f"https://example.org/{i}/{'x' * 200}" for i in range(len(texts))]})
    pq.write_table(table, path, row_group_size=GROUP_ROWS, compression="NONE")
    return texts


class Counted:
    """An opener that counts the bytes read through the file objects it hands out."""

    def __init__(self) -> None:
        self.read = 0

    def __call__(self, path: str):
        counter = self

        class File:
            def __init__(self) -> None:
                self.file = fsspec.open(path, "rb").open()

            def read(self, size: int = -1) -> bytes:
                data = self.file.read(size)
                counter.read += len(data)
                return data

            def __getattr__(self, name):
                return getattr(self.file, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                self.file.close()

        return File()


def test_first_group_by_hand():
    sizes = [50, 50, 20]
    assert first_group(sizes, 0) == (0, 0)
    assert first_group(sizes, 49) == (0, 49)
    assert first_group(sizes, 50) == (1, 0)
    assert first_group(sizes, 119) == (2, 19)
    assert first_group(sizes, 120) == (3, 0)  # past the end
    assert first_group([], 0) == (0, 0)


def test_the_rows_from_any_start_are_the_ones_datasets_streams(tmp_path):
    path = tmp_path / "part.parquet"
    texts = write_groups(path, groups=3, nulls=True)
    streamed = datasets.load_dataset("parquet", data_files=[str(path)], split="train", streaming=True)
    assert [row["text"] for row in streamed] == texts  # datasets' order is the file's
    for start in (0, 1, 49, 50, 51, 149, 150, 400):
        rows = list(parquet_rows(str(path), start, "text"))
        assert rows == [{"text": t} for t in texts[start:]], start


def test_a_resume_reads_the_row_groups_from_its_row_only(tmp_path):
    path = tmp_path / "part.parquet"
    write_groups(path, groups=10)
    meta = pq.ParquetFile(path).metadata
    text = [meta.row_group(g).column(0).total_compressed_size for g in range(10)]
    urls = sum(meta.row_group(g).column(1).total_compressed_size for g in range(10))
    assert min(text) > 100_000 and urls > 100_000
    whole, last = Counted(), Counted()
    assert len(list(parquet_rows(str(path), 0, "text", whole))) == 500
    assert len(list(parquet_rows(str(path), 9 * GROUP_ROWS + 10, "text", last))) == 40
    footer = max(65_536, meta.serialized_size + 8)  # pyarrow reads the file's last 64 KiB for its footer
    assert sum(text) <= whole.read <= sum(text) + footer  # every row group's text, none of the urls
    assert text[9] <= last.read <= text[9] + footer  # the last row group's text only


def test_a_missing_column_and_a_broken_file_are_one_clear_line(tmp_path):
    path = tmp_path / "part.parquet"
    write_groups(path, groups=1)
    with pytest.raises(DataError, match=r"has no column 'body' \(it has text, url\); set data.text_field"):
        next(parquet_rows(str(path), 0, "body"))
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DataError, match=r"cannot read .*broken\.parquet \(ArrowInvalid: .*check the file"):
        next(parquet_rows(str(broken), 0, "text"))


def test_files_that_datasets_streams_still_shard_by_file_and_resume_bit_exactly(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for f in range(6):
        rows = [{"text": f"file {f} row {r} " * (r % 3 + 1)} for r in range(9)]
        (folder / f"part-{f}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = DataSection(source="files", path=str(folder), shard_by="file", num_shards=2, heldout_fraction=0.2)
    corpus = open_corpus(cfg)
    assert corpus.per_file

    def stream():
        return shard_stream(corpus, ByteTokenizer(), cfg, seq_len=11, seed=1, shard=0)

    whole = stream()
    batches = [whole.next_batch(2) for _ in range(12)]
    resumed = stream()
    first = stream()
    for _ in range(5):
        first.next_batch(2)
    resumed.load_state_dict(first.state_dict())
    assert first.state_dict()["row"] > 0 or first.state_dict()["file"] > 0
    for expected in batches[5:]:
        assert torch.equal(resumed.next_batch(2), expected)
