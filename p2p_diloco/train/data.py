"""Corpora, the train/held-out split, per-peer shards and packed token batches.

Every split is a pure function of keys, so peers agree on it without talking. By document
(`data.shard_by = document`): held-out by sha256 of a document's key alone (the same for every
seed, so no run trains on another run's evaluation data), shard by sha256 of (seed, key); a peer's
train stream walks all documents in the epoch's order and keeps its shard's train documents. By
file (`data.shard_by = file`, streamed files and hub datasets): held-out is whole files chosen by
sha256 of their names alone, and each shard is a set of the other files, balanced by size where
sizes are known (`plan_files`), so a peer reads only its own files. Either way a stream's position
is a few ints, which is what makes a checkpoint resume bit-exactly.

Sources: `stdlib` (the Python standard library's own source, the embedded default), `files`
(local .txt, .jsonl/.json or .parquet through `datasets`; by file, parquet through
`train/parquet.py`, which enters a file at the row group that holds its first row) and `hub` (a streamed `datasets` hub
dataset, e.g. allenai/c4, optionally pinned as name@revision). `datasets` is imported only by the
last two: it takes a second to import and the default run does not need it.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import DataSection, hub_spec
from p2p_diloco.errors import DataError

log = logging.getLogger(__name__)

KeyFilter = Callable[[str], bool] | None
Position = tuple[int, ...]  # where a document stands in an epoch's order: (index,) or (file, row)
Packed = tuple[int, Position, list[int]]  # (epoch, position, tokens + eos) of one document
FileRows = Callable[[str, int], Iterable[dict[str, Any]]]  # (file key, first row) -> its rows from there
STDLIB_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# A streamed file is read front to back; its rows are shuffled within windows of this many rows
# (a window is held in memory: ~5 MB of FineWeb-Edu text), the most order streaming allows without
# reading a file twice.
SHUFFLE_ROWS = 1024


@dataclass(frozen=True)
class Document:
    key: str  # stable id: a posix path under the stdlib root, a dataset's row index, or file:row
    text: str


class Corpus:
    """A source of documents. Subclasses implement `_scan`."""

    description: str
    finite: bool
    position_names: tuple[str, ...] = ("index",)  # the ints of a position, as a stream's state names them

    def documents(self, epoch: int, seed: int, start: int | Position = 0) -> Iterator[Document]:
        """All documents (train and held-out, every shard) in the epoch's order, from position `start`."""
        return (doc for _, doc in self._scan(epoch, seed, self.position(start), None))

    def position(self, start: int | Position = 0) -> Position:
        """`start` as a full position: an int is the first of its ints, the others 0."""
        head = (start,) if isinstance(start, int) else tuple(start)
        return head + (0,) * (len(self.position_names) - len(head))

    def _scan(self, epoch: int, seed: int, start: Position, keep: KeyFilter) -> Iterator[tuple[Position, Document]]:
        """(position, document) for the documents whose key passes `keep`; only those are read."""
        raise NotImplementedError


class FiniteCorpus(Corpus):
    """Documents that can be listed up front; `read(key)` loads one text when it is yielded."""

    finite = True

    def __init__(
        self, description: str, keys: list[str], read: Callable[[str], str], sizes: dict[str, int] | None = None
    ):
        """`sizes`: bytes of each document, where known (folder sharding balances by them)."""
        self.description = description
        self._keys = keys
        self._read = read
        self.sizes = sizes

    def _scan(self, epoch: int, seed: int, start: Position, keep: KeyFilter) -> Iterator[tuple[Position, Document]]:
        order = _epoch_order(self._keys, seed, epoch)
        for position in range(start[0], len(order)):
            key = order[position]
            if keep is None or keep(key):
                yield (position,), Document(key, self._read(key))


class StreamingCorpus(Corpus):
    """A streamed `datasets.IterableDataset`, in its natural order (no shuffle: it may be too big to
    index); `start` skips rows without decoding them."""

    finite = False

    def __init__(self, description: str, dataset: Any, text_field: str):
        self.description = description
        self._dataset = dataset
        self._text_field = text_field

    def _scan(self, epoch: int, seed: int, start: Position, keep: KeyFilter) -> Iterator[tuple[Position, Document]]:
        rows = self._dataset.skip(start[0]) if start[0] else self._dataset
        for position, row in enumerate(rows, start[0]):
            key = str(position)
            if keep is None or keep(key):
                yield (position,), Document(key, _row_text(row, self._text_field, self.description))


class FileCorpus(Corpus):
    """A dataset streamed file by file (`data.shard_by = file`). A position is (file, row): the
    file's place in the epoch's order of this corpus's files (`_epoch_order` of their keys) and the
    row's place in that file's epoch order. Rows come front to back in windows of `SHUFFLE_ROWS`,
    each window permuted by sha256(seed, epoch, key); a document's key is `file:row`, its row in
    the file. `subset` is the same dataset restricted to some files: a peer's shard, the held-out."""

    finite = False
    position_names = ("file", "row")

    def __init__(
        self,
        description: str,
        sizes: dict[str, int | None],
        open_file: FileRows,
        text_field: str,
        per_file: bool = True,
        window: int = SHUFFLE_ROWS,
    ):
        """`sizes`: bytes of each file by key (None where unknown); `open_file(key, start)`: its rows
        (dicts) from row `start` on; `per_file`: whether the run shards it by file, or (too few
        files, `plan_files`) by document."""
        self.description, self.sizes, self._open_file = description, sizes, open_file
        self._text_field, self.per_file, self._window = text_field, per_file, window

    @property
    def keys(self) -> list[str]:
        return sorted(self.sizes)

    def subset(self, keys: list[str], description: str) -> FileCorpus:
        sizes = {key: self.sizes[key] for key in keys}
        return FileCorpus(description, sizes, self._open_file, self._text_field, True, self._window)

    def _scan(self, epoch: int, seed: int, start: Position, keep: KeyFilter) -> Iterator[tuple[Position, Document]]:
        order = _epoch_order(self.keys, seed, epoch)
        for slot in range(start[0], len(order)):
            first = start[1] if slot == start[0] else 0
            for row, doc in self._file_rows(order[slot], epoch, seed, first):
                if keep is None or keep(doc.key):
                    yield (slot, row), doc

    def _file_rows(self, key: str, epoch: int, seed: int, start: int) -> Iterator[tuple[int, Document]]:
        """(row in the file's epoch order, document) from row `start`: the window holding it is read
        whole (the rows before it: not tokenized), then the windows after it."""
        base = start - start % self._window
        stream = iter(self._open_file(key, base))
        while block := list(itertools.islice(stream, self._window)):
            docs = [
                Document(f"{key}:{base + i}", _row_text(row, self._text_field, self.description))
                for i, row in enumerate(block)
            ]
            docs.sort(key=lambda doc: _sha256(f"order/{seed}/{epoch}/{doc.key}"))
            yield from ((base + i, doc) for i, doc in enumerate(docs) if base + i >= start)
            base += len(block)


def _epoch_order(keys: list[str], seed: int, epoch: int) -> list[str]:
    """The keys sorted by sha256(seed, epoch, key): a permutation that depends on nothing but the
    keys themselves (not on listing order, platform or library version), so peers and resumed
    runs agree on it."""
    return sorted(keys, key=lambda key: _sha256(f"order/{seed}/{epoch}/{key}"))


def is_heldout(key: str, fraction: float) -> bool:
    """Whether a document is held out for evaluation; depends on the key only, never the seed."""
    return _sha256(f"heldout/{key}") < fraction * 2**64


def shard_of(key: str, seed: int, num_shards: int) -> int:
    """The shard a document's training tokens belong to."""
    return _sha256(f"shard/{seed}/{key}") % num_shards


def folder_of(key: str) -> str:
    """A document's top-level folder ("asyncio" for asyncio/events.py); files at the top share "."."""
    head, sep, _ = key.partition("/")
    return head if sep else "."


def folder_shards(sizes: dict[str, int], num_shards: int) -> dict[str, int]:
    """Whole top-level folders to shards (non-i.i.d. shards): the largest folder first, each onto the
    shard with the fewest bytes so far (ties: the lowest shard). Depends only on the keys and sizes."""
    folders: dict[str, int] = {}
    for key, size in sizes.items():
        folder = folder_of(key)
        folders[folder] = folders.get(folder, 0) + size
    if len(folders) < num_shards:
        raise DataError(
            f"data.shard_by = folder needs at least data.num_shards = {num_shards} top-level folders; "
            f"the corpus has {len(folders)}: lower data.num_shards"
        )
    load = [0] * num_shards
    assignment = {}
    for folder, size in sorted(folders.items(), key=lambda item: (-item[1], item[0])):
        shard = min(range(num_shards), key=lambda i: (load[i], i))
        assignment[folder] = shard
        load[shard] += size
    return assignment


def heldout_files(keys: list[str], fraction: float) -> list[str]:
    """The held-out files of `data.shard_by = file`: round(fraction x files), at least one, those of
    lowest sha256 of their key alone, so the same for every seed (as `is_heldout` for documents)."""
    count = max(1, round(fraction * len(keys)))
    return sorted(keys, key=lambda key: _sha256(f"heldout-file/{key}"))[:count]


def file_shards(sizes: dict[str, int | None], seed: int, num_shards: int) -> dict[str, int]:
    """Training files to shards: the largest first, each onto the shard with the fewest bytes so far
    (ties: the lowest shard). Where any size is unknown (a hub dataset) every file counts as one, so
    shards get equal counts. Files of one size go in the order of sha256(seed, key): round-robin in a
    per-seed order. Depends only on the keys, sizes and seed."""
    known = all(size is not None for size in sizes.values())
    weight = {key: (size or 0) if known else 1 for key, size in sizes.items()}
    load = [0] * num_shards
    assignment = {}
    for key in sorted(weight, key=lambda key: (-weight[key], _sha256(f"shard/{seed}/{key}"))):
        shard = min(range(num_shards), key=lambda i: (load[i], i))
        assignment[key] = shard
        load[shard] += weight[key]
    return assignment


@dataclass(frozen=True)
class FilePlan:
    """Who reads which file: the held-out files and each training file's shard."""

    heldout: tuple[str, ...]
    shards: dict[str, int]

    def files_of(self, shard: int) -> list[str]:
        return sorted(key for key, owner in self.shards.items() if owner == shard)


def plan_files(sizes: dict[str, int | None], seed: int, num_shards: int, fraction: float) -> FilePlan | None:
    """The per-file split, or None when the files do not give every shard one beside the held-out
    ones (then the corpus is sharded by document: every peer reads every file). Whether it is None
    depends on the file count, data.num_shards and data.heldout_fraction only, never the seed."""
    heldout = heldout_files(sorted(sizes), fraction)
    train = {key: size for key, size in sizes.items() if key not in heldout}
    if len(train) < num_shards:
        return None
    return FilePlan(tuple(heldout), file_shards(train, seed, num_shards))


def file_of(key: str) -> str:
    """The file of a `FileCorpus` document key (`file:row`)."""
    return key.rpartition(":")[0]


def sharding(corpus: Corpus, cfg: DataSection, seed: int) -> Callable[[str], int]:
    """The run's key -> shard function: by document (`shard_of`), by top-level folder, or by file
    (a held-out file's documents are in no shard: -1; too few files: by document)."""
    if cfg.shard_by == "folder":
        if not isinstance(corpus, FiniteCorpus) or corpus.sizes is None:
            raise _no_such_units(corpus, "folder", "stdlib")
        assignment = folder_shards(corpus.sizes, cfg.num_shards)
        return lambda key: assignment[folder_of(key)]
    plan = None
    if cfg.shard_by == "file":
        if not isinstance(corpus, FileCorpus):
            raise _no_such_units(corpus, "file", "files or hub")
        plan = plan_files(corpus.sizes, seed, cfg.num_shards, cfg.heldout_fraction)
    if plan is None:
        return lambda key: shard_of(key, seed, cfg.num_shards)
    return lambda key: plan.shards.get(file_of(key), -1)


def _no_such_units(corpus: Corpus, unit: str, sources: str) -> DataError:
    return DataError(
        f"data.shard_by = {unit} needs a corpus with {unit}s (data.source = {sources}); "
        f"{corpus.description} has none: use data.shard_by = document"
    )


def pick_shard(peer_id: str, seed: int, num_shards: int) -> int:
    """A shard for a peer that did not choose one (data.shard = -1). Peers draw independently, so two
    may draw the same shard (4 peers over 64 shards: ~9 %); set data.shard per peer to rule it out."""
    return _sha256(f"peer/{seed}/{peer_id}") % num_shards


def _sha256(text: str) -> int:
    """The first 8 bytes of sha256(text) as an int in [0, 2**64)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def shard_stream(corpus: Corpus, tokenizer: Any, cfg: DataSection, seq_len: int, seed: int, shard: int) -> TrainStream:
    """The training tokens of shard `shard`, cut as the run's config says: what a peer (every rank
    of it) and a data-parallel worker read. By file, the stream opens only the shard's own files."""
    if isinstance(corpus, FileCorpus) and corpus.per_file and cfg.shard_by == "file":
        plan = plan_files(corpus.sizes, seed, cfg.num_shards, cfg.heldout_fraction)
        if plan is not None:
            mine = plan.files_of(shard)
            log.info(
                "shard %d/%d: %d of %d files (%d held out), the only ones this peer reads",
                shard, cfg.num_shards, len(mine), len(corpus.sizes), len(plan.heldout),
            )  # fmt: skip
            own = corpus.subset(mine, f"{corpus.description}, the {len(mine)} files of shard {shard}")
            # Every document of these files is the shard's: no held-out row among them to skip.
            return TrainStream(own, tokenizer, seq_len, shard, cfg.num_shards, seed, 0.0, lambda key: shard)
    return TrainStream(
        corpus, tokenizer, seq_len, shard, cfg.num_shards, seed, cfg.heldout_fraction, sharding(corpus, cfg, seed)
    )


class TrainStream:
    """One peer's training tokens: its shard's train documents, each followed by eos, concatenated
    and cut into rows of seq_len tokens; after the last document of an epoch comes the next epoch.

    The position is always exact: `_position` is the position (in the corpus's epoch order: the
    index of a document, or the file and row of a `FileCorpus`) of the document holding the next
    token, and `_offset` the next token within its packed tokens.
    """

    def __init__(
        self,
        corpus: Corpus,
        tokenizer: Any,
        seq_len: int,
        shard: int,
        num_shards: int,
        seed: int,
        heldout_fraction: float,
        shard_of_key: Callable[[str], int] | None = None,
    ):
        """`shard_of_key`: the run's sharding (`sharding()`); by default each document's own hash."""
        if seq_len < 1 or not 0 <= shard < num_shards:
            raise DataError(
                f"need seq_len >= 1 and 0 <= shard < num_shards, got seq_len={seq_len}, "
                f"shard={shard}, num_shards={num_shards}; fix model.seq_len or data.shard"
            )
        self._corpus, self._tokenizer, self._seq_len = corpus, tokenizer, seq_len
        self._shard, self._num_shards, self._seed = shard, num_shards, seed
        self._heldout_fraction = heldout_fraction
        self._shard_of_key = shard_of_key or (lambda key: shard_of(key, seed, num_shards))
        self.tokens_consumed = 0
        self._docs, (self._epoch, self._position, self._tokens) = self._open(0, corpus.position())
        self._offset = 0

    def next_batch(self, n: int) -> torch.LongTensor:
        """The next n packed rows, [n, seq_len]."""
        need = n * self._seq_len
        out: list[int] = []
        while len(out) < need:
            chunk = self._tokens[self._offset : self._offset + need - len(out)]
            out += chunk
            self._offset += len(chunk)
            if self._offset == len(self._tokens):
                # Move on at once, so that state_dict() names the document of the next token.
                self._epoch, self._position, self._tokens = next(self._docs)
                self._offset = 0
        self.tokens_consumed += need
        return torch.tensor(out, dtype=torch.long).view(n, self._seq_len)

    def state_dict(self) -> dict:
        """{epoch, index, offset, tokens_consumed}; by file, {epoch, file, row, offset, tokens_consumed}."""
        return {
            "epoch": self._epoch,
            **dict(zip(self._corpus.position_names, self._position, strict=True)),
            "offset": self._offset,
            "tokens_consumed": self.tokens_consumed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` of a stream of the same corpus, shard and seed. On a bad
        state it raises DataError and leaves the stream as it was."""
        _check_state(state, self._corpus.position_names)
        position = tuple(state[name] for name in self._corpus.position_names)
        docs, (epoch, found, tokens) = self._open(state["epoch"], position)
        if (epoch, found) != (state["epoch"], position) or state["offset"] >= len(tokens):
            raise DataError(
                f"data state {state} does not point into a train document of shard "
                f"{self._shard} of {self._num_shards}; the checkpoint is from another "
                f"corpus, shard or seed"
            )
        self._docs, self._epoch, self._position, self._tokens = docs, epoch, position, tokens
        self._offset, self.tokens_consumed = state["offset"], state["tokens_consumed"]

    def _open(self, epoch: int, start: Position) -> tuple[Iterator[Packed], Packed]:
        """The packed-document iterator from (epoch, start) and its first item."""
        docs = self._packed_docs(epoch, start)
        return docs, next(docs)

    def _packed_docs(self, epoch: int, start: Position) -> Iterator[Packed]:
        """This shard's train documents from (epoch, start) on, epoch after epoch."""
        beginning = self._corpus.position()
        while True:
            found = False
            for position, doc in self._corpus._scan(epoch, self._seed, start, self._is_mine):
                found = True
                yield epoch, position, list(self._tokenizer.encode(doc.text)) + [self._tokenizer.eos_token_id]
            if start == beginning and not found:  # a whole epoch without a document: it would loop forever
                raise DataError(
                    f"shard {self._shard} of {self._num_shards} has no training documents "
                    f"in {self._corpus.description}; lower data.num_shards"
                )
            epoch, start = epoch + 1, beginning
            log.info("shard %d/%d: epoch %d begins", self._shard, self._num_shards, epoch)

    def _is_mine(self, key: str) -> bool:
        return not is_heldout(key, self._heldout_fraction) and self._shard_of_key(key) == self._shard


def _check_state(state: Any, position_names: tuple[str, ...]) -> None:
    """DataError unless `state` is exactly the non-negative ints of `TrainStream.state_dict`."""
    names = {"epoch", *position_names, "offset", "tokens_consumed"}
    if not isinstance(state, dict) or set(state) != names:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise DataError(f"data state must have exactly the keys {sorted(names)}, got {keys}")
    for name, value in state.items():
        if type(value) is not int or value < 0:
            raise DataError(f"data state {name} must be an int >= 0, got {value!r}")


def heldout_batch(corpus: Corpus, tokenizer: Any, seq_len: int, n: int, heldout_fraction: float) -> torch.LongTensor:
    """The first n packed rows [n, seq_len] of the held-out documents in epoch 0, seed 0: the same for
    every peer and run, so held-out losses compare. It reads the corpus (by file: the held-out files
    only, up to the window holding the last row it needs): compute it once and keep it."""
    need = n * seq_len
    tokens: list[int] = []
    source, keep = _heldout_source(corpus, heldout_fraction)
    for _, doc in source._scan(0, 0, source.position(), keep):
        tokens += list(tokenizer.encode(doc.text)) + [tokenizer.eos_token_id]
        if len(tokens) >= need:
            return torch.tensor(tokens[:need], dtype=torch.long).view(n, seq_len)
    raise DataError(
        f"the held-out documents of {corpus.description} fill only {len(tokens) // seq_len} "
        f"of {n} sequences of {seq_len} tokens; lower run.eval_sequences or raise "
        f"data.heldout_fraction"
    )


def _heldout_source(corpus: Corpus, fraction: float) -> tuple[Corpus, KeyFilter]:
    """Where the held-out documents are: whole files of a corpus sharded by file, else documents
    of any file, picked by their key."""
    if isinstance(corpus, FileCorpus) and corpus.per_file:
        files = heldout_files(corpus.keys, fraction)
        return corpus.subset(files, f"{corpus.description}, its {len(files)} held-out files"), None
    return corpus, lambda key: is_heldout(key, fraction)


def open_corpus(cfg: DataSection) -> Corpus:
    openers = {"stdlib": _open_stdlib, "files": _open_files, "hub": _open_hub}
    if cfg.source not in openers:
        raise DataError(f"unknown data.source {cfg.source!r}; use one of {', '.join(openers)}")
    corpus = openers[cfg.source](cfg)
    log.debug("corpus: %s", corpus.description)
    return corpus


def _open_stdlib(cfg: DataSection) -> Corpus:
    """Every .py file of this Python's standard library, by path relative to its root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sizes = {}
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in STDLIB_SKIP_DIRS]
        for name in names:
            if name.endswith(".py"):
                path = Path(folder, name)
                sizes[path.relative_to(root).as_posix()] = path.stat().st_size
    if not sizes:
        raise DataError(f"no .py files under the standard library at {root}; use data.source=files")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    description = f"stdlib of Python {version} ({len(sizes):,} files, {sum(sizes.values()) / 1e6:.1f} MB)"
    return FiniteCorpus(
        description, sorted(sizes), lambda key: (root / key).read_text(encoding="utf-8", errors="replace"), sizes
    )


def _open_files(cfg: DataSection) -> Corpus:
    """Local files loaded (and cached) by `datasets`: a .txt file is one document, a row is one. By
    file (`data.shard_by = file`) they are streamed instead, file by file, never cached whole."""
    import datasets  # slow to import; only these sources need it

    files = _list_files(cfg.path)
    builder = _builder_of(files, cfg.path)
    options = {"sample_by": "document"} if builder == "text" else {}
    field = "text" if builder == "text" else cfg.text_field
    what = f"cannot load {cfg.path} with the datasets {builder!r} builder"
    if cfg.shard_by == "file":
        with _load_error(what, "check the files"):
            loader = datasets.load_dataset_builder(builder, data_files=[str(f) for f in files], **options)
        return _streamed_files(cfg, f"files {cfg.path}", loader, field)
    with _load_error(what, "check that the files are non-empty and well-formed"):
        dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **options)
    if field not in dataset.column_names:
        raise DataError(
            f"{cfg.path} has no column {field!r} (it has {', '.join(dataset.column_names)}); set data.text_field"
        )
    if len(dataset) == 0:
        raise DataError(f"{cfg.path} holds no documents; point data.path at non-empty files")
    rows = dataset.select_columns([field])
    description = f"files {cfg.path} ({len(files):,} files, {len(dataset):,} documents)"
    return FiniteCorpus(description, [str(i) for i in range(len(dataset))], lambda key: rows[int(key)][field] or "")


@contextlib.contextmanager
def _load_error(what: str, fix: str) -> Iterator[None]:
    """datasets raises many types (StopIteration for an empty .jsonl, OSError offline...): one DataError."""
    try:
        yield
    except Exception as exc:
        raise DataError(f"{what} ({type(exc).__name__}: {exc}); {fix}") from exc


def _streamed_files(cfg: DataSection, description: str, loader: Any, text_field: str) -> FileCorpus:
    """A `datasets` builder's train split streamed file by file. Parquet files are read by row
    group (`parquet.parquet_rows`: a resume reads from the row group that holds its row); other
    files as `datasets` streams them, file i being `shard(n, i)` of the stream, as datasets hands
    one file to each of n workers. Sizes from the files where local."""
    with _load_error(f"cannot stream {description}", "check the files, or use data.shard_by = document"):
        files = [str(f) for f in loader.config.data_files["train"]]
    keys = _file_keys(files)
    sizes = {key: os.path.getsize(path) if os.path.isfile(path) else None for key, path in zip(keys, files)}
    per_file = plan_files(sizes, 0, cfg.num_shards, cfg.heldout_fraction) is not None
    if not per_file:
        log.warning(
            "data.shard_by = file: %s has %d files, too few for data.num_shards = %d beside the "
            "held-out ones: sharding by document instead, so every peer reads every file (about "
            "%dx the bytes it trains); lower data.num_shards for a peer to read its own files only",
            description, len(files), cfg.num_shards, cfg.num_shards,
        )  # fmt: skip
    description = f"{description} ({len(files):,} files, streamed by file)"
    opener = _file_opener(description, loader, files, keys, text_field)
    return FileCorpus(description, sizes, opener, text_field, per_file)


def _file_opener(description: str, loader: Any, files: list[str], keys: list[str], field: str) -> FileRows:
    """`open_file(key, start)` for FileCorpus: parquet by row group, the rest through `datasets`."""
    from p2p_diloco.train.parquet import parquet_rows  # pyarrow: only these sources need it

    path = dict(zip(keys, files))
    if all(f.endswith(".parquet") for f in files):
        return lambda key, start: parquet_rows(path[key], start, field)
    with _load_error(f"cannot stream {description}", "check the files, or use data.shard_by = document"):
        dataset = loader.as_streaming_dataset(split="train")
    if dataset.n_shards != len(files):
        raise DataError(
            f"{description} streams as {dataset.n_shards} pieces, not its {len(files)} files; "
            "use data.shard_by = document"
        )
    index = {key: i for i, key in enumerate(keys)}

    def open_file(key: str, start: int) -> Any:
        rows = dataset.shard(num_shards=len(files), index=index[key])
        return rows.skip(start) if start else rows  # read from the file's start: datasets cannot seek

    return open_file


def _file_keys(paths: list[str]) -> list[str]:
    """Each file's path below the files' deepest common folder, so that a local folder and the Hub
    repository it copies (hf://datasets/org/name@rev/...) name the same file alike."""
    parts = [path.split("/") for path in paths]
    common = 0
    while all(len(p) > common + 1 and p[common] == parts[0][common] for p in parts):
        common += 1
    return ["/".join(p[common:]) for p in parts]


def _list_files(path: str) -> list[Path]:
    """The files data.path names: itself, the supported files in a folder, or a glob's matches."""
    if not path:
        raise DataError("data.source=files needs data.path: a file, a folder or a glob")
    if glob.has_magic(path):
        files = sorted(Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file())
        if not files:
            raise DataError(f"data.path glob {path} matches no file; fix the pattern")
        return files
    if Path(path).is_dir():
        files = sorted(p for p in Path(path).rglob("*") if p.suffix in BUILDERS and p.is_file())
        if not files:
            raise DataError(f"data.path folder {path} has no {'/'.join(BUILDERS)} files")
        return files
    if Path(path).is_file():
        return [Path(path)]
    raise DataError(f"data.path {path} does not exist; set it to a file, a folder or a glob")


def _builder_of(files: list[Path], path: str) -> str:
    """The one `datasets` builder that reads all the files."""
    unsupported = [f for f in files if f.suffix not in BUILDERS]
    if unsupported:
        raise DataError(f"{unsupported[0]} has an unsupported extension; data.path takes {', '.join(BUILDERS)} files")
    builders = sorted({BUILDERS[f.suffix] for f in files})
    if len(builders) > 1:
        raise DataError(f"data.path {path} mixes file kinds ({', '.join(builders)}); point it at files of one kind")
    return builders[0]


def _open_hub(cfg: DataSection) -> Corpus:
    """A hub dataset's train split, streamed: C4-sized corpora are never downloaded whole. A name
    `org/name@rev` pins the dataset's revision (a commit, tag or branch)."""
    import datasets  # slow to import; only these sources need it

    if not cfg.name:
        raise DataError("data.source=hub needs data.name, e.g. allenai/c4")
    name, revision = hub_spec(cfg.name)
    fix = "hub datasets need network access, or use data.source=files with local copies"
    with _load_error(f"cannot open hub dataset {cfg.name!r}", fix):  # not found, offline, gated
        loader = datasets.load_dataset_builder(name, cfg.subset or None, revision=revision)
    description = f"hub dataset {cfg.name}{'/' + cfg.subset if cfg.subset else ''}"
    if cfg.shard_by == "file":
        return _streamed_files(cfg, description, loader, cfg.text_field)
    with _load_error(f"cannot open hub dataset {cfg.name!r}", fix):
        dataset = loader.as_streaming_dataset(split="train")
    return StreamingCorpus(f"{description} (streamed)", dataset, cfg.text_field)


def _row_text(row: dict, field: str, description: str) -> str:
    if field not in row:
        raise DataError(f"{description} has no column {field!r} (it has {', '.join(row)}); set data.text_field")
    return row[field] or ""
