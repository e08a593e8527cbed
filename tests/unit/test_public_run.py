"""The public-run profile (peers/public-150m.toml) and the Hub paths it takes, on local stand-ins.

Nothing reaches the network: HF_HUB_OFFLINE=1 and every Hugging Face cache under tmp_path
(tests/unit/standins.py). A tokenizer's Hub id is resolved by transformers' own Hub code from a Hub
cache the test fills the way a first online download leaves it (refs/main -> snapshots/<commit>):
`from_pretrained` is not patched. The dataset is a local folder laid out like FineWeb-Edu's
repository (README configurations, sample/100BT/*.parquet, FineWeb-Edu's columns), opened by the
same `datasets.load_dataset(name, subset, split="train", streaming=True)` call as the real one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoTokenizer

from p2p_diloco import config
from p2p_diloco.config import DataSection, ModelSection
from p2p_diloco.errors import ModelError
from p2p_diloco.peer import Peer
from p2p_diloco.train.data import (
    TrainStream,
    heldout_batch,
    is_heldout,
    open_corpus,
    plan_files,
    shard_of,
    shard_stream,
)
from p2p_diloco.train.model import export_model, init_model, load_tokenizer, model_config, parameter_count
from tests.unit import standins

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "peers" / "public-150m.toml"
HUB_ID = "some-org/some-tokenizer"
SAMPLE = "def main(argv):\n    return parse(argv) or 0  # ünïcode, too\n"


@pytest.fixture(autouse=True)
def hub_cache(tmp_path, monkeypatch) -> Path:
    return standins.offline_hub(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    return standins.bpe_tokenizer_folder(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def fineweb(tmp_path_factory) -> Path:
    return standins.fineweb_standin(tmp_path_factory.mktemp("fineweb") / "fineweb-edu")


@pytest.fixture(scope="module")
def fineweb_files(tmp_path_factory) -> Path:
    """The stand-in in 6 parquet files of 10 documents."""
    return standins.fineweb_standin(tmp_path_factory.mktemp("fineweb6") / "fineweb-edu", files=6)


# --- tokenizers: a folder, a Hub id --------------------------------------------------------------


def test_a_tokenizer_folder_saved_by_transformers_loads_and_round_trips_text(tokenizer_folder):
    tok = load_tokenizer(str(tokenizer_folder))
    reference = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
    assert (tok.vocab_size, tok.eos_token_id) == (len(reference), reference.convert_tokens_to_ids("</s>"))
    ids = tok.encode(SAMPLE)
    assert ids == reference.encode(SAMPLE, add_special_tokens=False) and tok.eos_token_id not in ids
    assert tok.decode(ids) == SAMPLE


def test_a_hub_id_is_resolved_by_the_hub_loader_from_the_hub_cache(tokenizer_folder, hub_cache):
    standins.cache_hub_tokenizer(hub_cache, HUB_ID, tokenizer_folder)
    tok = load_tokenizer(HUB_ID)
    assert tok.encode(SAMPLE) == load_tokenizer(str(tokenizer_folder)).encode(SAMPLE)
    assert tok.vocab_size == load_tokenizer(str(tokenizer_folder)).vocab_size


def test_a_pinned_hub_id_loads_the_cached_revision_and_names_a_missing_one(tokenizer_folder, hub_cache):
    standins.cache_hub_tokenizer(hub_cache, HUB_ID, tokenizer_folder)
    expected = load_tokenizer(str(tokenizer_folder)).encode(SAMPLE)
    assert load_tokenizer(f"{HUB_ID}@main").encode(SAMPLE) == expected  # refs/main -> the snapshot
    assert load_tokenizer(f"{HUB_ID}@{standins.COMMIT}").encode(SAMPLE) == expected  # the snapshot itself
    with pytest.raises(ModelError, match=rf"cannot load tokenizer '{HUB_ID}@v9' from the Hugging Face Hub"):
        load_tokenizer(f"{HUB_ID}@v9")  # not in the cache: transformers did look for that revision


def test_a_hub_id_neither_cached_nor_reachable_fails_in_one_line_naming_both_fixes():
    with pytest.raises(ModelError) as refused:
        load_tokenizer("some-org/not-downloaded")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("cannot load tokenizer 'some-org/not-downloaded' from the Hugging Face Hub (OSError")
    assert "a local tokenizer folder or tokenizer.json, or run once with network access" in message


@pytest.mark.parametrize("spec", ["mytokenizer", "./a/b", "a/b/c", "org/tokenizer.json", "/no/such/folder"])
def test_a_missing_path_that_is_no_owner_slash_name_is_refused_as_missing(spec):
    with pytest.raises(ModelError, match=r"does not exist; set \[model\] tokenizer to 'bytes'.*Hub id"):
        load_tokenizer(spec)


def test_the_tokenizer_spec_is_a_shared_field_of_the_fingerprint():
    a = config.load(None, {"model.tokenizer": "org/a"})
    b = config.load(None, {"model.tokenizer": "org/b"})
    assert a.fingerprint() != b.fingerprint()
    assert config.diff_shared(a.shared_dict(), b.shared_dict()) == ["model.tokenizer: 'org/a' != 'org/b'"]


def test_export_writes_a_hub_tokenizer_into_the_model_folder(tokenizer_folder, hub_cache, tmp_path):
    standins.cache_hub_tokenizer(hub_cache, HUB_ID, tokenizer_folder)
    vocab = load_tokenizer(HUB_ID).vocab_size
    cfg = model_config(ModelSection(preset="tiny", tokenizer=HUB_ID, seq_len=32), vocab)
    out = export_model(init_model(cfg, seed=0).state_dict(), cfg, HUB_ID, tmp_path / "export")
    exported = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert exported.encode(SAMPLE, add_special_tokens=False) == load_tokenizer(HUB_ID).encode(SAMPLE)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == exported.eos_token_id


# --- FineWeb-Edu, streamed from parquet -----------------------------------------------------------


def fineweb_section(fineweb: Path, **changes) -> DataSection:
    return DataSection(source="hub", name=str(fineweb), subset="sample-100BT", **changes)


def test_a_fineweb_edu_shaped_repository_streams_its_subsets_text_in_file_order(fineweb):
    corpus = open_corpus(fineweb_section(fineweb))
    assert not corpus.finite and corpus.description.endswith("/sample-100BT (streamed)")
    texts = standins.stdlib_texts(60, max_chars=2000)
    assert [(d.key, d.text) for d in corpus.documents(0, 0)] == [(str(i), t) for i, t in enumerate(texts)]
    assert [d.key for d in corpus.documents(3, 7, start=57)] == ["57", "58", "59"]  # across files


def test_streamed_shards_hold_their_own_train_documents_and_the_heldout_batch_the_heldout_ones(
    fineweb, tokenizer_folder
):
    tok = load_tokenizer(str(tokenizer_folder))
    corpus = open_corpus(fineweb_section(fineweb))
    docs = list(corpus.documents(0, 0))
    fraction, seed, shards, seq_len = 0.2, 5, 3, 64
    heldout = [d for d in docs if is_heldout(d.key, fraction)]
    assert 0 < len(heldout) < len(docs)
    for shard in range(shards):
        mine = [d for d in docs if not is_heldout(d.key, fraction) and shard_of(d.key, seed, shards) == shard]
        expected = [t for d in mine for t in [*tok.encode(d.text), tok.eos_token_id]]
        stream = TrainStream(corpus, tok, seq_len, shard, shards, seed, fraction)
        rows = stream.next_batch(len(expected) // seq_len).flatten().tolist()
        assert rows == expected[: len(rows)]
    expected = [t for d in heldout for t in [*tok.encode(d.text), tok.eos_token_id]]
    assert heldout_batch(corpus, tok, seq_len, 4, fraction).flatten().tolist() == expected[: 4 * seq_len]


def test_a_streamed_shard_resumes_bit_exactly_from_its_state(fineweb, tokenizer_folder):
    tok = load_tokenizer(str(tokenizer_folder))
    corpus = open_corpus(fineweb_section(fineweb))
    whole = TrainStream(corpus, tok, 48, 1, 2, 0, 0.05)
    first = [whole.next_batch(3) for _ in range(4)]
    resumed = TrainStream(corpus, tok, 48, 1, 2, 0, 0.05)
    resumed.load_state_dict(whole.state_dict())
    assert first and all(torch.equal(whole.next_batch(3), resumed.next_batch(3)) for _ in range(30))


def test_a_pinned_dataset_revision_reaches_the_datasets_loader(fineweb_files, monkeypatch):
    asked = []
    real = datasets.load_dataset_builder

    def to_the_stand_in(path, name=None, **kwargs):  # the Hub is unreachable: the local copy answers
        asked.append((path, name, kwargs.get("revision")))
        return real(str(fineweb_files), name, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset_builder", to_the_stand_in)
    for shard_by in ("file", "document"):
        pinned = DataSection(source="hub", name="HuggingFaceFW/fineweb-edu@abc123", subset="sample-100BT")
        corpus = open_corpus(dataclasses.replace(pinned, shard_by=shard_by, num_shards=2))
        assert next(corpus.documents(0, 0)).text
    assert asked == [("HuggingFaceFW/fineweb-edu", "sample-100BT", "abc123")] * 2


def test_fineweb_sharded_by_file_gives_each_shard_its_files_rows_and_holds_out_whole_files(
    fineweb_files, tokenizer_folder
):
    tok = load_tokenizer(str(tokenizer_folder))
    cfg = fineweb_section(fineweb_files, shard_by="file", num_shards=2, heldout_fraction=0.2)
    corpus = open_corpus(cfg)
    texts = standins.stdlib_texts(60, max_chars=2000)  # file i holds documents 10i .. 10i+9
    files = [f"{i:03d}_00000.parquet" for i in range(6)]
    assert corpus.per_file and sorted(corpus.sizes) == files
    plan = plan_files(corpus.sizes, 4, 2, 0.2)
    assert len(plan.heldout) == 1  # round(0.2 x 6)
    trained = []
    for shard in range(2):
        stream = shard_stream(corpus, tok, cfg, 16, 4, shard)
        mine = [files.index(f) for f in plan.files_of(shard)]
        # One epoch of the shard: every document of its files, and nothing else.
        expected = sorted(texts[10 * i + r] for i in mine for r in range(10))
        docs = [doc for _, doc in stream._corpus._scan(0, 4, (0, 0), None)]
        assert sorted(d.text for d in docs) == expected
        trained += [d.text for d in docs]
    held = files.index(plan.heldout[0])
    assert sorted(trained) == sorted(t for i, t in enumerate(texts) if i // 10 != held)
    # The held-out batch: the held-out file's rows in epoch 0's order for seed 0 (one window: all 10).
    keys = [f"{plan.heldout[0]}:{r}" for r in range(10)]
    order = sorted(range(10), key=lambda r: hashlib.sha256(f"order/0/0/{keys[r]}".encode()).digest()[:8])
    expected = [t for r in order for t in [*tok.encode(texts[10 * held + r]), tok.eos_token_id]]
    assert heldout_batch(corpus, tok, 16, 2, 0.2).flatten().tolist() == expected[:32]


# --- the profile ----------------------------------------------------------------------------------


def test_the_public_profile_holds_the_papers_optimisers_and_its_hub_choices():
    c = config.load(PROFILE)
    i, o = c.inner, c.outer
    assert (i.lr, i.weight_decay, i.beta1, i.beta2, i.warmup_steps, i.steps) == (4e-4, 0.1, 0.9, 0.95, 1000, 500)
    assert (o.lr, o.momentum, o.nesterov) == (0.7, 0.9, True)
    assert (c.model.preset, c.model.seq_len, c.model.tokenizer) == (
        "150m",
        1024,
        "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T@main",  # a placeholder pin (the file says so)
    )
    assert (c.data.source, c.data.name, c.data.subset, c.data.text_field, c.data.shard_by) == (
        "hub",
        "HuggingFaceFW/fineweb-edu@main",
        "sample-100BT",
        "text",
        "file",
    )
    assert (i.batch_size, i.micro_batch_size, i.precision, c.swarm.compression) == (128, 8, "bf16", "int8")
    # The README's estimates count this model: the 150m preset with Llama 2's 32,000 ids.
    assert parameter_count(model_config(c.model, 32000)) == 179_853_184


def test_the_public_profile_trains_on_a_cpu_with_its_hub_parts_on_stand_ins(
    tmp_path, hub_cache, tokenizer_folder, fineweb_files
):
    # The tokenizer under the profile's own Hub id (the cache stand-in); only the dataset's name is
    # pointed at the local repository, with the profile's subset. The rest shrinks the run to seconds.
    profile = config.load(PROFILE)
    standins.cache_hub_tokenizer(hub_cache, config.hub_spec(profile.model.tokenizer)[0], tokenizer_folder)
    tiny = {
        "data.name": str(fineweb_files),
        "data.num_shards": "2",  # the stand-in's 6 files: 1 held out, 5 to train
        "run.dir": str(tmp_path / "run"),
        "run.device": "cpu",
        "run.rounds": "1",
        "run.eval_sequences": "2",
        "model.preset": "tiny",
        "model.seq_len": "64",
        "inner.steps": "2",
        "inner.batch_size": "4",
        "inner.micro_batch_size": "2",
        "inner.precision": "fp32",  # bf16 autocast is for the GPU: on a CPU it is 15x slower
        "log.progress": "false",
    }
    cfg = config.load(PROFILE, tiny)
    peer = Peer(cfg)
    try:
        peer.run()
    finally:
        peer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [0, 1]
    assert records[1]["inner_steps"] == 2 and records[1]["tokens"] == 2 * 4 * 64
    assert all(torch.isfinite(torch.tensor(r["eval_loss"])) for r in records)
    assert "hub dataset" in peer.corpus.description and peer.tokenizer.vocab_size < 1000
    assert "6 files, streamed by file" in peer.corpus.description
