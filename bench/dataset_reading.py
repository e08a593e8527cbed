"""What a peer reads to train its shard of a streamed dataset: by document against by file.

The public profile streams FineWeb-Edu from the Hub, which no machine here reaches. This bench
streams a local stand-in laid out like it (tests/unit/standins.py: a README naming the
`sample-100BT` configuration, `sample/100BT/*.parquet` with FineWeb-Edu's columns; the documents
are standard-library source files) through the package's real hub path (`data.open_corpus`,
`datasets.load_dataset_builder(...).as_streaming_dataset`), at the profile's 16 shards and 5 %
held out. For every shard it trains one epoch of the shard's stream (`data.shard_stream`, as a
peer does) and counts, at the boundary:
- `rchar`: the bytes this process passed through read/pread system calls (/proc/self/io), from
  opening the corpus to the epoch's end: what the datasets loader and pyarrow actually read;
- `opened`: every .parquet file Python opened, and those files' sizes summed once per opening;
- what was trained: tokens (the byte tokenizer: one per UTF-8 byte, plus eos per document) and the
  documents' text bytes.
The figure is bytes read ÷ text bytes trained (and ÷ tokens), below 1 where the files compress the
text (parquet, snappy); ÷ the bytes of the files opened, it is what reading costs beyond the files
themselves. It also measures the held-out batch by file (`run.eval_sequences` 64 of 256 tokens):
bounded by the held-out files, not the corpus. And what a resume reads: a peer restarted in the
middle of a file (`resume_cost`: a stand-in file of RESUME_ROWS rows, row groups of RESUME_GROUP)
reads from the shuffle window that holds its row, through the package's parquet reader, against
what `datasets`' streamed `skip` (the reader before) reads to reach the same window.

    python bench/dataset_reading.py          # about a minute on 2 cores
Writes bench/results/dataset_reading.json.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # before datasets is imported

import pyarrow.parquet as pq  # noqa: E402

from p2p_diloco.config import DataSection  # noqa: E402
from p2p_diloco.train import data  # noqa: E402
from p2p_diloco.train.model import ByteTokenizer  # noqa: E402
from tests.unit import standins  # noqa: E402

SHARDS = 16
FILES = 48  # 2 held out (5 %), 46 for 16 shards: 2 or 3 each
DOCUMENTS_PER_FILE = 200  # 9,600: the ~1,790 standard-library sources, over again
ROW_GROUP = 64
DOCUMENT_SHARDS = 4  # by document every shard reads the whole corpus: 4 of the 16 show it
SEQ_LEN = 256
EVAL_SEQUENCES = 64
RESUME_ROWS = 8 * data.SHUFFLE_ROWS  # a stand-in file of 8 shuffle windows; FineWeb-Edu's hold hundreds
RESUME_GROUP = 1024
OUT = ROOT / "bench" / "results" / "dataset_reading.json"


class CountingTokenizer(ByteTokenizer):
    """The byte tokenizer, counting the text bytes of the documents it encodes."""

    def __init__(self) -> None:
        self.text_bytes = 0
        self.documents = 0

    def encode(self, text: str) -> list[int]:
        self.text_bytes += len(text.encode("utf-8"))
        self.documents += 1
        return super().encode(text)


def rchar() -> int:
    """Bytes this process has read through read/pread calls, all threads (Linux /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


@contextlib.contextmanager
def opened_parquet() -> Iterator[list[str]]:
    """The .parquet paths Python opens inside the block (the datasets loader opens local files so)."""
    paths: list[str] = []
    real = builtins.open

    def spy(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith(".parquet"):
            paths.append(str(file))
        return real(file, *args, **kwargs)

    builtins.open = spy
    try:
        yield paths
    finally:
        builtins.open = real


def make_standin(root: Path) -> Path:
    """FILES parquet files of DOCUMENTS_PER_FILE standard-library sources (up to 4,000 characters;
    the sources taken in turn, over again: each row has its own id and url)."""
    standins.fineweb_standin(root, documents=FILES, files=FILES)  # the README and layout
    folder = root / "sample" / "100BT"
    for path in folder.glob("*.parquet"):
        path.unlink()
    stdlib = Path(standins.sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    texts = [p.read_text(encoding="utf-8", errors="replace")[:4000] for p in sources]
    table = standins.fineweb_rows([texts[i % len(texts)] for i in range(FILES * DOCUMENTS_PER_FILE)])
    for i in range(FILES):
        part = table.slice(i * DOCUMENTS_PER_FILE, DOCUMENTS_PER_FILE)
        pq.write_table(part, folder / f"{i:03d}_00000.parquet", row_group_size=ROW_GROUP)
    return root


def two_epochs(cfg: DataSection, shard: int) -> dict:
    """Open the corpus and train shard `shard` for two epochs: what was read and trained in each.

    A stream moves on to the next document as soon as it finishes one (its state names the next
    token), so at an epoch's end it has already read the first rows of the next: the second epoch,
    from that point to the same point one epoch later, is the steady state; the first adds the
    opening of the corpus (its README, the schema of its first file)."""
    tokenizer = CountingTokenizer()
    marks = [(rchar(), 0, 0, 0)]  # (rchar, text bytes, tokens, .parquet opens) at each boundary
    with opened_parquet() as paths:
        corpus = data.open_corpus(cfg)
        stream = data.shard_stream(corpus, tokenizer, cfg, SEQ_LEN, seed=0, shard=shard)
        for epoch in (0, 1):
            while stream.state_dict()["epoch"] == epoch:
                stream.next_batch(1)
            marks.append((rchar(), tokenizer.text_bytes, stream.tokens_consumed, len(paths)))
    return {
        "shard": shard,
        "first_epoch": _epoch(marks[0], marks[1], paths),
        "steady_epoch": _epoch(marks[1], marks[2], paths),
    }


def _epoch(start: tuple, end: tuple, paths: list[str]) -> dict:
    read, text, tokens = end[0] - start[0], end[1] - start[1], end[2] - start[2]
    opened = paths[start[3] : end[3]]
    file_bytes = sum(os.path.getsize(p) for p in opened)
    return {
        "rchar_bytes": read,
        "files_opened": len(set(opened)),
        "file_opens": len(opened),
        "opened_file_bytes": file_bytes,
        "text_bytes_trained": text,
        "tokens_trained": tokens,
        "rchar_per_text_byte": read / text,
        "rchar_per_token": read / tokens,
        "opened_file_bytes_per_text_byte": file_bytes / text,
        "rchar_per_opened_file_byte": read / file_bytes,
    }


def heldout_cost(cfg: DataSection) -> dict:
    corpus = data.open_corpus(cfg)
    before = rchar()
    with opened_parquet() as paths:
        data.heldout_batch(corpus, ByteTokenizer(), SEQ_LEN, EVAL_SEQUENCES, cfg.heldout_fraction)
    return {
        "sequences": EVAL_SEQUENCES,
        "tokens": EVAL_SEQUENCES * SEQ_LEN,
        "rchar_bytes": rchar() - before,
        "files_opened": len(set(paths)),
    }


def resume_cost(root: Path) -> dict:
    """Bytes read (rchar) to resume a shard stream in its file's last window and give one batch,
    through the package (parquet by row group), and through datasets' `skip` to the same row."""
    import datasets

    folder = root / "resume"
    folder.mkdir()
    stdlib = Path(standins.sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace")[:4000] for p in sorted(stdlib.glob("*.py"))]
    table = standins.fineweb_rows([texts[i % len(texts)] for i in range(RESUME_ROWS)])
    for i in range(4):  # 1 held out, 3 for 2 shards
        pq.write_table(table, folder / f"{i:03d}.parquet", row_group_size=RESUME_GROUP)
    cfg = DataSection(source="files", path=str(folder), shard_by="file", num_shards=2, heldout_fraction=0.25)
    corpus = data.open_corpus(cfg)
    stream = data.shard_stream(corpus, ByteTokenizer(), cfg, SEQ_LEN, seed=0, shard=0)
    while stream.state_dict()["row"] < RESUME_ROWS - data.SHUFFLE_ROWS // 2:
        stream.next_batch(8)
    state = stream.state_dict()
    before = rchar()
    with opened_parquet() as paths:
        resumed = data.shard_stream(corpus, ByteTokenizer(), cfg, SEQ_LEN, seed=0, shard=0)
        resumed.load_state_dict(state)
        resumed.next_batch(1)
    package = rchar() - before
    (path,) = set(paths)  # the file it resumed in, and no other
    window = state["row"] - state["row"] % data.SHUFFLE_ROWS
    before = rchar()
    next(iter(datasets.load_dataset("parquet", data_files=[path], split="train", streaming=True).skip(window)))
    skipped = rchar() - before
    return {
        "file_rows": RESUME_ROWS,
        "row_group_rows": RESUME_GROUP,
        "window_rows": data.SHUFFLE_ROWS,
        "resumed_at_row": state["row"],
        "file_bytes": Path(path).stat().st_size,
        "rchar_package": package,  # the whole resume: opening the file, its window, one batch
        "rchar_datasets_skip": skipped,
    }


def summary(runs: list[dict], epoch: str) -> dict:
    def spread(name: str) -> dict:
        values = [r[epoch][name] for r in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {
        "rchar_per_text_byte": spread("rchar_per_text_byte"),
        "rchar_per_token": spread("rchar_per_token"),
        "opened_file_bytes_per_text_byte": spread("opened_file_bytes_per_text_byte"),
        "rchar_per_opened_file_byte": spread("rchar_per_opened_file_byte"),
        "files_opened": spread("files_opened"),
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_HOME"] = str(Path(tmp, "hf"))
        root = make_standin(Path(tmp, "fineweb-edu"))
        base = DataSection(
            source="hub", name=str(root), subset="sample-100BT", num_shards=SHARDS, heldout_fraction=0.05
        )
        data.heldout_batch(data.open_corpus(base), ByteTokenizer(), SEQ_LEN, 1, 0.05)  # warm-up: lazy imports
        arms = {how: dataclasses.replace(base, shard_by=how) for how in ("document", "file")}
        shards = {"document": range(DOCUMENT_SHARDS), "file": range(SHARDS)}
        runs = {how: [two_epochs(cfg, shard) for shard in shards[how]] for how, cfg in arms.items()}
        result = {
            "what": "bytes read (rchar) per byte of document text trained, in a steady epoch and the first",
            "standin": {
                "files": FILES,
                "documents": FILES * DOCUMENTS_PER_FILE,
                "parquet_bytes": sum(p.stat().st_size for p in (root / "sample" / "100BT").glob("*.parquet")),
                "row_group_rows": ROW_GROUP,
            },
            "shards": SHARDS,
            "heldout_fraction": base.heldout_fraction,
            "seq_len": SEQ_LEN,
            "by": {
                how: {"steady_epoch": summary(r, "steady_epoch"), "first_epoch": summary(r, "first_epoch"), "shards": r}
                for how, r in runs.items()
            },
            "heldout_batch_by_file": heldout_cost(arms["file"]),
            "resume_mid_file": resume_cost(Path(tmp)),
            "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    for how, r in runs.items():
        for epoch in ("steady_epoch", "first_epoch"):
            s = summary(r, epoch)["rchar_per_text_byte"]
            print(
                f"by {how}, {epoch}: bytes read / text bytes trained {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"
            )
    r = result["resume_mid_file"]
    print(
        f"resume at row {r['resumed_at_row']:,} of {r['file_rows']:,} ({r['file_bytes'] / 1e6:.1f} MB file): "
        f"{r['rchar_package'] / 1e6:.2f} MB read, datasets' skip {r['rchar_datasets_skip'] / 1e6:.2f} MB"
    )
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
