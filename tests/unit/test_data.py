"""The data module: corpora, splits, shards, packing and bit-exact resume."""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import re

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from p2p_diloco.config import DataSection
from p2p_diloco.errors import DataError
from p2p_diloco.train.data import (
    FileCorpus,
    FiniteCorpus,
    TrainStream,
    file_shards,
    folder_of,
    folder_shards,
    heldout_batch,
    heldout_files,
    is_heldout,
    open_corpus,
    pick_shard,
    plan_files,
    shard_of,
    shard_stream,
    sharding,
)
from p2p_diloco.train.model import ByteTokenizer


@pytest.fixture(autouse=True)
def offline_hf(tmp_path, monkeypatch):
    """No test reaches the hub or writes to ~/.cache: datasets read these at import, so patch both."""
    cache = tmp_path / "hf"
    for name, value in {
        "HF_HOME": cache,
        "HF_DATASETS_CACHE": cache / "datasets",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


class LetterTokenizer:
    """a -> 1, b -> 2, ...; eos is 0, so packed rows can be written out by hand."""

    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [ord(ch) - ord("a") + 1 for ch in text]


def hand_corpus(texts: dict[str, str]) -> FiniteCorpus:
    return FiniteCorpus("hand-made", list(texts), texts.__getitem__)


def keyed_corpus(n: int) -> FiniteCorpus:
    """n documents whose text is their key, 'd000'..: with bytes and seq_len 5, one row is one document."""
    return hand_corpus({f"d{i:03d}": f"d{i:03d}" for i in range(n)})


def row_keys(rows: torch.Tensor) -> list[str]:
    return [ByteTokenizer().decode(row[:4].tolist()) for row in rows]


def one_epoch_keys(corpus, shard: int, num_shards: int, seed: int, fraction: float) -> list[str]:
    stream = TrainStream(corpus, ByteTokenizer(), 5, shard, num_shards, seed, fraction)
    keys = []
    while stream.state_dict()["epoch"] == 0:
        keys += row_keys(stream.next_batch(1))
    return keys


def stream_of(corpus, tokenizer=None, seq_len=7, shard=1, num_shards=2, seed=3, fraction=0.1):
    return TrainStream(corpus, tokenizer or ByteTokenizer(), seq_len, shard, num_shards, seed, fraction)


def assert_resumes_bit_exactly(make_stream, batches: int, n: int) -> None:
    """At every batch boundary a fresh stream loaded with the state draws what the original draws."""
    original = make_stream()
    for _ in range(batches):
        resumed = make_stream()
        resumed.load_state_dict(original.state_dict())
        assert torch.equal(resumed.next_batch(n), original.next_batch(n))
        assert resumed.state_dict() == original.state_dict()


def write_jsonl(path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def files_corpus(path, text_field: str = "text"):
    return open_corpus(DataSection(source="files", path=str(path), text_field=text_field))


# --- packing --------------------------------------------------------------------------------


def test_epoch_order_is_a_pinned_permutation_per_seed_and_epoch():
    corpus = hand_corpus({"a": "", "b": "", "c": ""})
    order = lambda epoch, seed: [doc.key for doc in corpus.documents(epoch, seed)]  # noqa: E731
    # Golden values: sha256-based, so the same on every machine and Python version.
    assert order(0, 0) == ["b", "c", "a"]
    assert order(1, 0) == ["a", "b", "c"]
    assert order(0, 1) == ["a", "c", "b"]
    assert [doc.key for doc in corpus.documents(0, 0, start=1)] == ["c", "a"]


def test_packing_puts_eos_after_each_document_and_wraps_to_the_next_epoch():
    corpus = hand_corpus({"a": "ab", "b": "c", "c": "def"})
    stream = TrainStream(corpus, LetterTokenizer(), seq_len=4, shard=0, num_shards=1, seed=0, heldout_fraction=0)
    # epoch 0 is b, c, a: 3 0 4 5 6 0 1 2 0; epoch 1 is a, b, c: 1 2 0 3 0 4 5 6 0
    assert stream.next_batch(3).tolist() == [[3, 0, 4, 5], [6, 0, 1, 2], [0, 1, 2, 0]]
    assert stream.state_dict() == {"epoch": 1, "index": 1, "offset": 0, "tokens_consumed": 12}
    assert stream.next_batch(1).tolist() == [[3, 0, 4, 5]]
    assert stream.state_dict() == {"epoch": 1, "index": 2, "offset": 2, "tokens_consumed": 16}
    assert stream.tokens_consumed == 16


def test_next_batch_is_a_long_tensor_of_n_rows():
    batch = stream_of(keyed_corpus(20), seq_len=16).next_batch(3)
    assert batch.dtype == torch.long and batch.shape == (3, 16)


# --- splits and shards ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_shards_are_disjoint_and_with_heldout_cover_the_corpus(seed):
    corpus, fraction = keyed_corpus(100), 0.2
    shard0 = one_epoch_keys(corpus, 0, 2, seed, fraction)
    shard1 = one_epoch_keys(corpus, 1, 2, seed, fraction)
    heldout = {f"d{i:03d}" for i in range(100) if is_heldout(f"d{i:03d}", fraction)}
    assert shard0 and shard1 and heldout
    assert len(set(shard0)) == len(shard0) and len(set(shard1)) == len(shard1)  # each document once an epoch
    assert not set(shard0) & set(shard1)
    assert not (set(shard0) | set(shard1)) & heldout
    assert set(shard0) | set(shard1) | heldout == {f"d{i:03d}" for i in range(100)}


def test_heldout_batch_is_the_heldout_documents_the_same_every_call():
    corpus, fraction = keyed_corpus(100), 0.2
    heldout = {f"d{i:03d}" for i in range(100) if is_heldout(f"d{i:03d}", fraction)}
    batch = heldout_batch(corpus, ByteTokenizer(), 5, len(heldout), fraction)
    assert set(row_keys(batch)) == heldout
    assert torch.equal(batch, heldout_batch(corpus, ByteTokenizer(), 5, len(heldout), fraction))


def test_heldout_batch_too_large_names_what_fits_and_the_fix():
    corpus, fraction = keyed_corpus(100), 0.2
    count = sum(is_heldout(f"d{i:03d}", fraction) for i in range(100))
    with pytest.raises(DataError, match=rf"fill only {count} of {count + 1} .*run.eval_sequences.*heldout_fraction"):
        heldout_batch(corpus, ByteTokenizer(), 5, count + 1, fraction)


def test_split_functions_are_deterministic_and_in_range():
    keys = [f"k{i}" for i in range(2000)]
    assert not any(is_heldout(k, 0.0) for k in keys) and all(is_heldout(k, 1.0) for k in keys)
    assert 150 < sum(is_heldout(k, 0.1) for k in keys) < 250
    assert {shard_of(k, 7, 4) for k in keys} == {0, 1, 2, 3}
    assert shard_of("x", 7, 4) == shard_of("x", 7, 4)
    assert [pick_shard(f"peer{i}", 0, 64) for i in range(3)] == [pick_shard(f"peer{i}", 0, 64) for i in range(3)]
    assert all(0 <= pick_shard(f"peer{i}", 0, 8) < 8 for i in range(50))


def test_a_shard_without_training_documents_is_an_error_naming_the_fix():
    with pytest.raises(DataError, match=r"shard \d+ of 64 has no training documents.*lower data.num_shards"):
        # 3 documents over 64 shards: most shards are empty; find one.
        for shard in range(64):
            stream_of(keyed_corpus(3), shard=shard, num_shards=64, fraction=0)


# --- resume ---------------------------------------------------------------------------------


def test_resume_on_a_small_corpus_is_bit_exact_at_every_batch_across_epochs(tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", [{"text": f"doc {i} " * (i % 5 + 1)} for i in range(30)])
    corpus = files_corpus(tmp_path / "docs.jsonl")
    assert_resumes_bit_exactly(lambda: stream_of(corpus), batches=15, n=3)  # ~3 epochs of shard 1


def test_resume_on_the_stdlib_is_bit_exact():
    corpus = open_corpus(DataSection())
    assert_resumes_bit_exactly(lambda: stream_of(corpus, seq_len=1024, num_shards=4), batches=4, n=8)


def test_load_state_dict_rejects_garbage_and_keeps_its_position():
    stream = stream_of(keyed_corpus(50), seq_len=5, fraction=0)  # shard 1 of 2, seed 3
    stream.next_batch(2)
    before = stream.state_dict()
    good = dict(before)
    bad_states = [
        None,
        [],
        {},
        {**good, "extra": 0},
        {k: v for k, v in good.items() if k != "offset"},
        {**good, "epoch": "0"},
        {**good, "index": -1},
        {**good, "offset": True},
        {**good, "offset": 5},  # past the end of a 4-byte document + eos
        {**good, "index": 10_000},
    ]  # no such document
    for state in bad_states:
        with pytest.raises(DataError, match="data state"):
            stream.load_state_dict(state)
        assert stream.state_dict() == before
    next_row = stream.next_batch(1)
    corpus = keyed_corpus(50)
    in_shard_0 = next(pos for pos, doc in enumerate(corpus.documents(0, 3)) if shard_of(doc.key, 3, 2) == 0)
    with pytest.raises(DataError, match="another corpus, shard or seed"):
        stream.load_state_dict({**good, "epoch": 0, "index": in_shard_0, "offset": 0})
    stream.load_state_dict(before)
    assert torch.equal(stream.next_batch(1), next_row)


# --- sources --------------------------------------------------------------------------------


def test_stdlib_corpus_lists_python_files_in_a_deterministic_order():
    corpus = open_corpus(DataSection(source="stdlib"))
    assert corpus.finite
    first = [doc.key for _, doc in zip(range(5), corpus.documents(0, 0))]
    assert first == [doc.key for _, doc in zip(range(5), open_corpus(DataSection()).documents(0, 0))]
    assert first != [doc.key for _, doc in zip(range(5), corpus.documents(1, 0))]
    count = int(
        re.search(r"stdlib of Python 3\.\d+ \(([\d,]+) files, [\d.]+ MB\)", corpus.description)[1].replace(",", "")
    )
    keys = [doc.key for doc in corpus.documents(0, 0)]  # reads every file: ~0.4 s
    assert count == len(keys) > 500
    assert "os.py" in keys and all(k.endswith(".py") for k in keys)
    assert not any(part in k for k in keys for part in ("site-packages", "dist-packages", "__pycache__"))
    assert any("def " in doc.text for _, doc in zip(range(5), corpus.documents(0, 0)))


def test_files_folder_of_txt_gives_one_document_per_file(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("first line\nsecond line\n")
    (tmp_path / "sub" / "b.txt").write_text("another file")
    (tmp_path / "notes.md").write_text("ignored: not a supported extension")
    corpus = files_corpus(tmp_path)
    assert sorted(doc.text for doc in corpus.documents(0, 0)) == ["another file", "first line\nsecond line\n"]
    assert "2 files, 2 documents" in corpus.description


def test_files_jsonl_reads_a_custom_text_field(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"body": "hello", "id": 1}, {"body": "world", "id": 2}])
    corpus = files_corpus(tmp_path / "d.jsonl", text_field="body")
    assert sorted((doc.key, doc.text) for doc in corpus.documents(0, 0)) == [("0", "hello"), ("1", "world")]


def test_files_parquet_and_globs_load(tmp_path):
    pq.write_table(pa.table({"text": ["p0", "p1"]}), tmp_path / "x-0.parquet")
    pq.write_table(pa.table({"text": ["p2"]}), tmp_path / "x-1.parquet")
    corpus = files_corpus(tmp_path / "x-*.parquet")
    assert sorted(doc.text for doc in corpus.documents(0, 0)) == ["p0", "p1", "p2"]


@pytest.mark.parametrize(
    "setup, path, text_field, message",
    [
        (None, "missing", "text", r"missing does not exist"),
        (None, "*.jsonl", "text", r"glob .*\*\.jsonl matches no file"),
        ({"d.jsonl": '{"body": "x"}\n'}, "d.jsonl", "text", r"no column 'text' \(it has body\); set data.text_field"),
        ({"d.csv": "text\nx\n"}, "d.csv", "text", r"d\.csv has an unsupported extension"),
        ({"a.txt": "x", "b.jsonl": '{"text": "y"}\n'}, ".", "text", r"mixes file kinds \(json, text\)"),
        ({"e.jsonl": ""}, "e.jsonl", "text", r"cannot load .*e\.jsonl.*non-empty"),
        ({"notes.md": "x"}, ".", "text", r"has no \.txt/\.jsonl/\.json/\.parquet files"),
    ],
)
def test_files_errors_name_the_problem(tmp_path, setup, path, text_field, message):
    for name, text in (setup or {}).items():
        (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=message):
        files_corpus(tmp_path / path, text_field=text_field)


def test_files_without_a_path_is_an_error():
    with pytest.raises(DataError, match="needs data.path"):
        open_corpus(DataSection(source="files"))


def test_hub_source_streams_a_local_stand_in_in_natural_order_and_skips(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"text": f"row {i}"} for i in range(10)])
    corpus = open_corpus(DataSection(source="hub", name=str(tmp_path)))
    assert not corpus.finite and str(tmp_path) in corpus.description
    assert [(d.key, d.text) for d in corpus.documents(0, 0)] == [(str(i), f"row {i}") for i in range(10)]
    assert [d.key for d in corpus.documents(5, 9, start=7)] == ["7", "8", "9"]
    assert_resumes_bit_exactly(lambda: stream_of(corpus, seq_len=4, fraction=0.2), batches=8, n=2)


def test_hub_dataset_that_cannot_be_reached_says_it_needs_network():
    with pytest.raises(DataError, match=r"hub dataset 'someone/no-such-dataset'.*need network access"):
        open_corpus(DataSection(source="hub", name="someone/no-such-dataset"))


def test_hub_missing_text_field_names_the_columns(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"body": "x"}])
    corpus = open_corpus(DataSection(source="hub", name=str(tmp_path)))
    with pytest.raises(DataError, match=r"no column 'text' \(it has body\)"):
        next(corpus.documents(0, 0))


def test_unknown_source_is_an_error():
    with pytest.raises(DataError, match="unknown data.source 'ftp'"):
        open_corpus(DataSection(source="ftp"))


def test_folder_shards_put_whole_folders_largest_first_on_the_lightest_shard():
    sizes = {"a/1.py": 50, "a/2.py": 50, "b/x.py": 60, "c/y.py": 30, "top.py": 20, "other.py": 5, "d/z/w.py": 10}
    # folders by bytes: a 100, b 60, c 30, "." 25, d 10
    # a -> 0 (loads 0, 0, 0); b -> 1 (100, 0, 0); c -> 2 (100, 60, 0); "." -> 2 (100, 60, 30); d -> 2 (100, 60, 55)
    assert folder_shards(sizes, 3) == {"a": 0, "b": 1, "c": 2, ".": 2, "d": 2}
    assert [folder_of(k) for k in ("a/1.py", "top.py", "d/z/w.py")] == ["a", ".", "d"]
    with pytest.raises(DataError, match="at least data.num_shards = 6 top-level folders; the corpus has 5"):
        folder_shards(sizes, 6)


def test_folder_sharding_of_the_stdlib_is_non_iid_and_covers_every_document():
    cfg = DataSection(num_shards=4, shard_by="folder")
    corpus = open_corpus(cfg)
    shard = sharding(corpus, cfg, seed=0)
    by_folder = {}
    for key in corpus.sizes:
        by_folder.setdefault(folder_of(key), set()).add(shard(key))
    assert all(len(shards) == 1 for shards in by_folder.values()), "a folder is split over shards"
    assert {s for shards in by_folder.values() for s in shards} == {0, 1, 2, 3}
    # The stdlib's test suite is its biggest folder: it gets a shard to itself.
    assert [f for f, shards in by_folder.items() if shards == by_folder["test"]] == ["test"]
    # The document sharding is the per-document hash, as before.
    iid = sharding(corpus, DataSection(num_shards=4), seed=0)
    assert all(iid(k) == shard_of(k, 0, 4) for k in list(corpus.sizes)[:50])


def test_folder_sharding_needs_a_corpus_with_folders():
    corpus = FiniteCorpus("rows", ["0", "1"], lambda key: "x")
    with pytest.raises(DataError, match="data.shard_by = folder needs a corpus with folders"):
        sharding(corpus, DataSection(num_shards=2, shard_by="folder"), seed=0)


# --- sharded by file ------------------------------------------------------------------------


def write_parquet_files(folder, files: int, rows: int, sizes: dict[int, int] | None = None):
    """files x rows documents; row r of file f reads 'ffrr' (4 bytes): one row of seq_len 5 each.
    `sizes`: extra rows (a bigger file) by file number."""
    folder.mkdir(exist_ok=True)
    for f in range(files):
        texts = [f"{f:02d}{r:02d}" for r in range(rows + (sizes or {}).get(f, 0))]
        pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), folder / f"part-{f:02d}.parquet")
    return folder


def file_section(folder, **changes) -> DataSection:
    return DataSection(source="files", path=str(folder), shard_by="file", **changes)


@pytest.fixture
def opened(monkeypatch):
    """The paths of the .parquet files Python opened, as datasets streams them (its local `open`)."""
    paths: list[str] = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        if str(file).endswith(".parquet"):
            paths.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    return paths


def hash_order(keys, text: str) -> list[str]:
    return sorted(keys, key=lambda key: int.from_bytes(hashlib.sha256(f"{text}{key}".encode()).digest()[:8], "big"))


def test_heldout_files_are_the_lowest_hashes_of_their_names_whatever_the_seed():
    keys = [f"part-{i:02d}.parquet" for i in range(20)]
    assert heldout_files(keys, 0.1) == hash_order(keys, "heldout-file/")[:2]
    assert heldout_files(keys, 0.01) == hash_order(keys, "heldout-file/")[:1]  # at least one
    assert heldout_files(list(reversed(keys)), 0.1) == heldout_files(keys, 0.1)  # not the listing order


def test_file_shards_balance_bytes_largest_first_or_counts_when_sizes_are_unknown():
    sizes = {"a": 100, "b": 60, "c": 30, "d": 25, "e": 10}
    # a -> 0; b -> 1 (loads 100, 0, 0); c -> 2 (100, 60, 0); d -> 2 (100, 60, 30); e -> 2 (100, 60, 55)
    assert file_shards(sizes, seed=0, num_shards=3) == {"a": 0, "b": 1, "c": 2, "d": 2, "e": 2}
    unknown = {f"f{i}": None for i in range(7)}
    by_seed = [file_shards(unknown, seed, 3) for seed in range(4)]
    for assignment in by_seed:  # counts 3, 2, 2 in the order sha256(seed, key): round-robin
        order = hash_order(unknown, f"shard/{by_seed.index(assignment)}/")
        assert [assignment[key] for key in order] == [0, 1, 2, 0, 1, 2, 0]
    assert len({tuple(sorted(a.items())) for a in by_seed}) > 1  # the seed changes who reads what


def test_plan_files_needs_a_file_per_shard_beside_the_heldout_ones():
    sizes = {f"f{i}": 10 for i in range(5)}  # 0.2 x 5 = 1 held out, 4 to train
    plan = plan_files(sizes, seed=0, num_shards=4, fraction=0.2)
    assert plan is not None and len(plan.heldout) == 1
    assert sorted(k for s in range(4) for k in plan.files_of(s)) == sorted(set(sizes) - set(plan.heldout))
    assert all(len(plan.files_of(s)) == 1 for s in range(4))
    assert plan_files(sizes, seed=0, num_shards=5, fraction=0.2) is None


def test_a_file_shard_opens_only_its_own_files_and_the_shards_cover_the_train_files(tmp_path, opened):
    folder = write_parquet_files(tmp_path / "data", files=9, rows=4, sizes={0: 8})
    cfg = file_section(folder, num_shards=4, heldout_fraction=0.1)  # round(0.9) = 1 held-out file
    corpus = open_corpus(cfg)
    plan = plan_files(corpus.sizes, 3, 4, 0.1)
    assert corpus.per_file and "9 files, streamed by file" in corpus.description and len(plan.heldout) == 1
    assert corpus.sizes == {p.name: p.stat().st_size for p in folder.iterdir()}  # what file_shards balances
    owner = sharding(corpus, cfg, seed=3)  # the run's key -> shard function agrees; held-out files: none
    assert all(owner(f"{key}:0") == shard for key, shard in plan.shards.items())
    assert owner(f"{plan.heldout[0]}:0") == -1
    seen: dict[int, list[str]] = {}
    for shard in range(4):
        opened.clear()
        stream = shard_stream(corpus, ByteTokenizer(), cfg, seq_len=5, seed=3, shard=shard)
        while stream.state_dict()["epoch"] == 0:
            seen.setdefault(shard, []).extend(row_keys(stream.next_batch(1)))
        mine = {str(folder / key) for key in plan.files_of(shard)}
        assert set(opened) == mine, f"shard {shard} opened other files"
        rows = {key: 12 if key == "part-00.parquet" else 4 for key in plan.files_of(shard)}
        assert sorted(seen[shard]) == sorted(f"{key[5:7]}{r:02d}" for key, n in rows.items() for r in range(n))
    held = int(plan.heldout[0][5:7])
    every = [key for keys in seen.values() for key in keys]
    assert len(every) == len(set(every)) == 12 + 8 * 4 - (12 if held == 0 else 4)
    assert all(int(key[:2]) != held for key in every)


def test_the_heldout_batch_of_a_file_corpus_reads_the_heldout_files_only(tmp_path, opened):
    folder = write_parquet_files(tmp_path / "data", files=9, rows=4)
    corpus = open_corpus(file_section(folder, num_shards=4, heldout_fraction=0.1))
    (held,) = heldout_files(corpus.keys, 0.1)
    opened.clear()
    batch = heldout_batch(corpus, ByteTokenizer(), 5, 3, 0.1)
    assert set(opened) == {str(folder / held)}
    assert {key[:2] for key in row_keys(batch)} == {held[5:7]} and len(set(row_keys(batch))) == 3
    assert torch.equal(
        batch, heldout_batch(open_corpus(file_section(folder, num_shards=2)), ByteTokenizer(), 5, 3, 0.1)
    )
    with pytest.raises(DataError, match="fill only 4 of 5 sequences"):
        heldout_batch(corpus, ByteTokenizer(), 5, 5, 0.1)


def test_a_file_epoch_permutes_the_files_and_the_rows_within_each_window(tmp_path):
    folder = write_parquet_files(tmp_path / "data", files=3, rows=7)
    whole = open_corpus(file_section(folder, num_shards=1, heldout_fraction=0.01))
    corpus = FileCorpus("windows of 3", whole.sizes, whole._open_file, "text", window=3)
    files = sorted(whole.sizes)
    for epoch, seed in [(0, 0), (1, 0), (0, 5)]:
        expected = []
        for key in hash_order(files, f"order/{seed}/{epoch}/"):
            for start in (0, 3, 6):  # windows of rows 0-2, 3-5 and 6
                window = [f"{key}:{r}" for r in range(start, min(start + 3, 7))]
                expected += hash_order(window, f"order/{seed}/{epoch}/")
        assert [doc.key for doc in corpus.documents(epoch, seed)] == expected
        assert [doc.key for doc in corpus.documents(epoch, seed, start=(1, 4))] == expected[7 + 4 :]
    first = [d.key for d in corpus.documents(0, 0)]
    assert first != [d.key for d in corpus.documents(1, 0)] and first != [d.key for d in corpus.documents(0, 5)]
    assert [d.text for d in corpus.documents(0, 0)][:1] == [
        f"{int(first[0][5:7]):02d}{int(first[0].split(':')[1]):02d}"
    ]


def test_a_file_shard_resumes_bit_exactly_across_windows_files_and_epochs(tmp_path):
    folder = write_parquet_files(tmp_path / "data", files=7, rows=5)
    cfg = file_section(folder, num_shards=2, heldout_fraction=0.1)
    whole = open_corpus(cfg)
    corpus = FileCorpus(whole.description, whole.sizes, whole._open_file, "text", window=2)
    stream = shard_stream(corpus, ByteTokenizer(), cfg, seq_len=7, seed=1, shard=1)
    assert set(stream.state_dict()) == {"epoch", "file", "row", "offset", "tokens_consumed"}
    assert_resumes_bit_exactly(lambda: shard_stream(corpus, ByteTokenizer(), cfg, 7, 1, 1), batches=14, n=2)
    with pytest.raises(DataError, match="data state must have exactly the keys"):
        stream.load_state_dict({"epoch": 0, "index": 0, "offset": 0, "tokens_consumed": 0})


def test_too_few_files_for_the_shards_fall_back_to_document_sharding_in_one_warning(tmp_path, caplog, opened):
    folder = write_parquet_files(tmp_path / "data", files=3, rows=10)
    cfg = file_section(folder, num_shards=4, heldout_fraction=0.2)
    with caplog.at_level(logging.WARNING, logger="p2p_diloco.train.data"):
        corpus = open_corpus(cfg)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "has 3 files, too few for data.num_shards = 4" in line and "every peer reads every file" in line
    assert not corpus.per_file
    opened.clear()
    keys = []
    stream = shard_stream(corpus, ByteTokenizer(), cfg, seq_len=5, seed=2, shard=1)
    while stream.state_dict()["epoch"] == 0:
        keys += row_keys(stream.next_batch(1))
    assert len(set(opened)) == 3  # every file
    doc_keys = [f"part-{f:02d}.parquet:{r}" for f in range(3) for r in range(10)]
    mine = {k for k in doc_keys if not is_heldout(k, 0.2) and shard_of(k, 2, 4) == 1}
    assert sorted(keys) == sorted(f"{int(k[5:7]):02d}{int(k.split(':')[1]):02d}" for k in mine)


def test_file_sharding_needs_a_corpus_of_files():
    with pytest.raises(DataError, match="data.shard_by = file needs a corpus with files"):
        sharding(keyed_corpus(3), DataSection(num_shards=2, shard_by="file"), seed=0)
