"""Local STAND-INS for what the public-run profile (peers/public-150m.toml) fetches from the Hugging
Face Hub, which no machine here reaches: a tokenizer repository in the Hub cache, and a dataset
repository laid out like FineWeb-Edu's, as a local folder of parquet shards.

They are not the Hub: the tokenizer is a small byte-level BPE trained here, the documents are the
standard library's own source files. What they stand in for is the *shape*: the cache layout that
a first online `AutoTokenizer.from_pretrained(hub_id)` leaves behind (refs/main -> snapshots/<commit>),
and a dataset repository whose README names its configurations (`sample-100BT` ->
`sample/100BT/*.parquet`) with FineWeb-Edu's columns, so the package runs its real code paths on them.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import tokenizers
from transformers import LlamaConfig, PreTrainedTokenizerFast

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the snapshot's (made-up) commit hash


def offline_hub(tmp_path: Path, monkeypatch) -> Path:
    """HF_HUB_OFFLINE=1 and every Hugging Face cache under tmp_path; returns the Hub cache folder.

    huggingface_hub and datasets read these at import, so their module constants are patched too.
    """
    home = tmp_path / "hf"
    for name, value in {
        "HF_HOME": home,
        "HF_HUB_CACHE": home / "hub",
        "HF_DATASETS_CACHE": home / "datasets",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return home / "hub"


def stdlib_texts(n: int, max_chars: int = 4000) -> list[str]:
    """The first n standard-library source files (sorted by path), each cut to max_chars."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.glob("*.py"))[:n]
    return [p.read_text(encoding="utf-8", errors="replace")[:max_chars] for p in paths]


def bpe_tokenizer_folder(folder: Path, vocab_size: int = 400) -> Path:
    """A transformers tokenizer folder: a byte-level BPE (GPT-2 style) trained on stdlib source, with
    Llama's special tokens (<s>, </s>) as the first ids."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_texts(20), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return folder


def cache_hub_tokenizer(cache: Path, hub_id: str, folder: Path) -> Path:
    """Put a tokenizer folder into the Hub cache as `hub_id`, as a first online from_pretrained leaves
    it: the files in snapshots/<commit>/ beside the repository's config.json, refs/main naming the commit."""
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(folder, snapshot)
    vocab = len(PreTrainedTokenizerFast.from_pretrained(folder))
    LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def fineweb_standin(root: Path, documents: int = 60, subset: str = "sample-100BT", files: int = 2) -> Path:
    """A dataset repository laid out like HuggingFaceFW/fineweb-edu: its README's YAML names the
    configurations, `subset` reads sample/<size>/*.parquet; rows have FineWeb-Edu's columns."""
    size = subset.removeprefix("sample-")
    shards = root / "sample" / size
    shards.mkdir(parents=True)
    (root / "data" / "CC-MAIN-2024-10").mkdir(parents=True)
    (root / "README.md").write_text(
        "---\nlicense: odc-by\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        f"    path: data/*/*\n- config_name: {subset}\n  data_files:\n  - split: train\n"
        f"    path: sample/{size}/*\n---\n# A local stand-in for FineWeb-Edu (tests only)\n"
    )
    table = fineweb_rows(stdlib_texts(documents, max_chars=2000))
    per_file = -(-documents // files)
    for i in range(files):
        # Small row groups, so that streaming crosses row-group and file boundaries.
        pq.write_table(table.slice(i * per_file, per_file), shards / f"{i:03d}_00000.parquet", row_group_size=8)
    pq.write_table(table.slice(0, 1), root / "data" / "CC-MAIN-2024-10" / "000_00000.parquet")
    return root


def fineweb_rows(texts: list[str]) -> pa.Table:
    """Rows with FineWeb-Edu's columns (`text` is the one the profile trains on)."""
    n = len(texts)
    return pa.table(
        {
            "text": texts,
            "id": [f"<urn:uuid:{i:08d}-0000-0000-0000-000000000000>" for i in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{i}" for i in range(n)],
            "file_path": [f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/{i}.warc.gz" for i in range(n)],
            "language": ["en"] * n,
            "language_score": [0.95] * n,
            "token_count": [len(t) // 4 for t in texts],
            "score": [3.2] * n,
            "int_score": [3] * n,
        }
    )
