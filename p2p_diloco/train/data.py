"""Corpora, the train/held-out split, per-peer shards and packed token batches.

Every split is a pure function of a document's key, so peers agree on it without talking:
held-out by sha256 of the key alone (the same for every seed, so no run trains on another
run's evaluation data), shard by sha256 of (seed, key). A peer's train stream walks all
documents in the epoch's order and keeps its shard's train documents; its position is three
ints, which is what makes a checkpoint resume bit-exactly.

Sources: `stdlib` (the Python standard library's own source, the embedded default), `files`
(local .txt, .jsonl/.json or .parquet through `datasets`) and `hub` (a streamed `datasets` hub
dataset, e.g. allenai/c4). `datasets` is imported only by the last two: it takes a second to
import and the default run does not need it.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2p_diloco.config import DataSection
from p2p_diloco.errors import DataError

log = logging.getLogger(__name__)

KeyFilter = Callable[[str], bool] | None
Packed = tuple[int, int, list[int]]  # (epoch, position in the epoch order, tokens + eos) of one document
STDLIB_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Document:
    key: str  # stable id: a posix path under the stdlib root, or the row index of a dataset
    text: str


class Corpus:
    """A source of documents. Subclasses implement `_scan`."""

    description: str
    finite: bool

    def documents(self, epoch: int, seed: int, start: int = 0) -> Iterator[Document]:
        """All documents (train and held-out, every shard) in the epoch's order, from position `start`."""
        return (doc for _, doc in self._scan(epoch, seed, start, None))

    def _scan(self, epoch: int, seed: int, start: int, keep: KeyFilter) -> Iterator[tuple[int, Document]]:
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

    def _scan(self, epoch: int, seed: int, start: int, keep: KeyFilter) -> Iterator[tuple[int, Document]]:
        order = _epoch_order(self._keys, seed, epoch)
        for position in range(start, len(order)):
            key = order[position]
            if keep is None or keep(key):
                yield position, Document(key, self._read(key))


class StreamingCorpus(Corpus):
    """A streamed `datasets.IterableDataset`, in its natural order (no shuffle: it may be too big to
    index); `start` skips rows without decoding them."""

    finite = False

    def __init__(self, description: str, dataset: Any, text_field: str):
        self.description = description
        self._dataset = dataset
        self._text_field = text_field

    def _scan(self, epoch: int, seed: int, start: int, keep: KeyFilter) -> Iterator[tuple[int, Document]]:
        rows = self._dataset.skip(start) if start else self._dataset
        for position, row in enumerate(rows, start):
            key = str(position)
            if keep is None or keep(key):
                yield position, Document(key, _row_text(row, self._text_field, self.description))


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


def sharding(corpus: Corpus, cfg: DataSection, seed: int) -> Callable[[str], int]:
    """The run's key -> shard function: by document (`shard_of`) or by top-level folder."""
    if cfg.shard_by == "document":
        return lambda key: shard_of(key, seed, cfg.num_shards)
    sizes = getattr(corpus, "sizes", None)
    if sizes is None:
        raise DataError(
            f"data.shard_by = folder needs a corpus with folders (data.source = stdlib); "
            f"{corpus.description} has none: use data.shard_by = document"
        )
    assignment = folder_shards(sizes, cfg.num_shards)
    return lambda key: assignment[folder_of(key)]


def pick_shard(peer_id: str, seed: int, num_shards: int) -> int:
    """A shard for a peer that did not choose one (data.shard = -1). Peers draw independently, so two
    may draw the same shard (4 peers over 64 shards: ~9 %); set data.shard per peer to rule it out."""
    return _sha256(f"peer/{seed}/{peer_id}") % num_shards


def _sha256(text: str) -> int:
    """The first 8 bytes of sha256(text) as an int in [0, 2**64)."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def shard_stream(corpus: Corpus, tokenizer: Any, cfg: DataSection, seq_len: int, seed: int, shard: int) -> TrainStream:
    """The training tokens of shard `shard`, cut as the run's config says: what a peer (every rank
    of it) and a data-parallel worker read."""
    return TrainStream(
        corpus, tokenizer, seq_len, shard, cfg.num_shards, seed, cfg.heldout_fraction, sharding(corpus, cfg, seed)
    )


class TrainStream:
    """One peer's training tokens: its shard's train documents, each followed by eos, concatenated
    and cut into rows of seq_len tokens; after the last document of an epoch comes the next epoch.

    The position is always exact: `_index` is the position (in the epoch order of all documents)
    of the document holding the next token and `_offset` the next token within its packed tokens.
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
        self._docs, (self._epoch, self._index, self._tokens) = self._open(0, 0)
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
                self._epoch, self._index, self._tokens = next(self._docs)
                self._offset = 0
        self.tokens_consumed += need
        return torch.tensor(out, dtype=torch.long).view(n, self._seq_len)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "index": self._index,
            "offset": self._offset,
            "tokens_consumed": self.tokens_consumed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` of a stream of the same corpus, shard and seed. On a bad
        state it raises DataError and leaves the stream as it was."""
        _check_state(state)
        docs, (epoch, index, tokens) = self._open(state["epoch"], state["index"])
        if (epoch, index) != (state["epoch"], state["index"]) or state["offset"] >= len(tokens):
            raise DataError(
                f"data state {state} does not point into a train document of shard "
                f"{self._shard} of {self._num_shards}; the checkpoint is from another "
                f"corpus, shard or seed"
            )
        self._docs, self._epoch, self._index, self._tokens = docs, epoch, index, tokens
        self._offset, self.tokens_consumed = state["offset"], state["tokens_consumed"]

    def _open(self, epoch: int, start: int) -> tuple[Iterator[Packed], Packed]:
        """The packed-document iterator from (epoch, start) and its first item."""
        docs = self._packed_docs(epoch, start)
        return docs, next(docs)

    def _packed_docs(self, epoch: int, start: int) -> Iterator[Packed]:
        """This shard's train documents from (epoch, start) on, epoch after epoch."""
        while True:
            found = False
            for position, doc in self._corpus._scan(epoch, self._seed, start, self._is_mine):
                found = True
                yield epoch, position, list(self._tokenizer.encode(doc.text)) + [self._tokenizer.eos_token_id]
            if start == 0 and not found:  # a whole epoch without a document: it would loop forever
                raise DataError(
                    f"shard {self._shard} of {self._num_shards} has no training documents "
                    f"in {self._corpus.description}; lower data.num_shards"
                )
            epoch, start = epoch + 1, 0
            log.info("shard %d/%d: epoch %d begins", self._shard, self._num_shards, epoch)

    def _is_mine(self, key: str) -> bool:
        return not is_heldout(key, self._heldout_fraction) and self._shard_of_key(key) == self._shard


def _check_state(state: Any) -> None:
    """DataError unless `state` is exactly the four non-negative ints of `TrainStream.state_dict`."""
    names = {"epoch", "index", "offset", "tokens_consumed"}
    if not isinstance(state, dict) or set(state) != names:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise DataError(f"data state must have exactly the keys {sorted(names)}, got {keys}")
    for name, value in state.items():
        if type(value) is not int or value < 0:
            raise DataError(f"data state {name} must be an int >= 0, got {value!r}")


def heldout_batch(corpus: Corpus, tokenizer: Any, seq_len: int, n: int, heldout_fraction: float) -> torch.LongTensor:
    """The first n packed rows [n, seq_len] of the held-out documents in epoch 0, seed 0: the same for
    every peer and run, so held-out losses compare. It reads the corpus: compute it once and keep it."""
    need = n * seq_len
    tokens: list[int] = []
    for _, doc in corpus._scan(0, 0, 0, lambda key: is_heldout(key, heldout_fraction)):
        tokens += list(tokenizer.encode(doc.text)) + [tokenizer.eos_token_id]
        if len(tokens) >= need:
            return torch.tensor(tokens[:need], dtype=torch.long).view(n, seq_len)
    raise DataError(
        f"the held-out documents of {corpus.description} fill only {len(tokens) // seq_len} "
        f"of {n} sequences of {seq_len} tokens; lower run.eval_sequences or raise "
        f"data.heldout_fraction"
    )


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
    """Local files loaded (and cached) by `datasets`: a .txt file is one document, a row is one."""
    import datasets  # slow to import; only these sources need it

    files = _list_files(cfg.path)
    builder = _builder_of(files, cfg.path)
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train", **options)
    except Exception as exc:  # datasets raises many types, StopIteration for an empty .jsonl among them
        raise DataError(
            f"cannot load {cfg.path} with the datasets {builder!r} builder ({type(exc).__name__}: "
            f"{exc}); check that the files are non-empty and well-formed"
        ) from exc
    field = "text" if builder == "text" else cfg.text_field
    if field not in dataset.column_names:
        raise DataError(
            f"{cfg.path} has no column {field!r} (it has {', '.join(dataset.column_names)}); set data.text_field"
        )
    if len(dataset) == 0:
        raise DataError(f"{cfg.path} holds no documents; point data.path at non-empty files")
    rows = dataset.select_columns([field])
    description = f"files {cfg.path} ({len(files):,} files, {len(dataset):,} documents)"
    return FiniteCorpus(description, [str(i) for i in range(len(dataset))], lambda key: rows[int(key)][field] or "")


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
    """A hub dataset's train split, streamed: C4-sized corpora are never downloaded whole."""
    import datasets  # slow to import; only these sources need it

    if not cfg.name:
        raise DataError("data.source=hub needs data.name, e.g. allenai/c4")
    try:
        dataset = datasets.load_dataset(cfg.name, cfg.subset or None, split="train", streaming=True)
    except Exception as exc:  # not found, offline, gated: datasets raises many types
        raise DataError(
            f"cannot open hub dataset {cfg.name!r} ({type(exc).__name__}: {exc}); hub datasets "
            f"need network access, or use data.source=files with local copies"
        ) from exc
    subset = f"/{cfg.subset}" if cfg.subset else ""
    return StreamingCorpus(f"hub dataset {cfg.name}{subset} (streamed)", dataset, cfg.text_field)


def _row_text(row: dict, field: str, description: str) -> str:
    if field not in row:
        raise DataError(f"{description} has no column {field!r} (it has {', '.join(row)}); set data.text_field")
    return row[field] or ""
