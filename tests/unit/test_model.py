"""Model presets, θ(0) initialisation, tokenizers and export (p2p_diloco.train.model).

Everything here is local: configs and tokenizers are written to tmp_path, and every
from_pretrained call is given a local folder with local_files_only=True.
"""

from __future__ import annotations

import json

import pytest
import tokenizers
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, PreTrainedTokenizerFast, T5Config

from p2p_diloco.config import ModelSection
from p2p_diloco.errors import ModelError
from p2p_diloco.train.model import (
    PRESETS,
    ByteTokenizer,
    count_parameters,
    export_model,
    init_model,
    load_tokenizer,
    model_config,
    parameter_count,
)

SEQ_LEN = 32
TRICKY_TEXTS = [
    "",
    "plain ASCII, with punctuation!",
    "accents: é à ü ñ ø Å",
    "emoji 🎉 and a family 👩‍👩‍👧 (zero-width joiners)",
    "new\nline\r\n\ttab  double  space   ",
    "  leading spaces",
    "literal <eos><bos><pad> text is bytes",
    "control \x00\x01\x7f bytes",
    "中文 日本語 한국어",
    "Ġ Ċ symbols that ByteLevel uses internally",
]


@pytest.fixture(scope="module")
def tiny_model_config():
    return model_config(ModelSection(preset="tiny", seq_len=SEQ_LEN), ByteTokenizer.vocab_size)


def fixed_batch(vocab_size: int = 259) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1234))


def write_gpt2_config(path, vocab_size=300, n_positions=64):
    GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=vocab_size, n_positions=n_positions, bos_token_id=0, eos_token_id=0
    ).to_json_file(path)
    return path


def write_word_tokenizer(path, specials=("</s>",)):
    """A 4-word tokenizer.json with the given special tokens after the words."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return path


def meta_parameter_count(preset: str, vocab_size: int = ByteTokenizer.vocab_size) -> int:
    return parameter_count(model_config(ModelSection(preset=preset, seq_len=2048), vocab_size))


# --- init_model -------------------------------------------------------------------------------


def test_same_seed_gives_bit_identical_parameters(tiny_model_config):
    a, b = init_model(tiny_model_config, seed=7).state_dict(), init_model(tiny_model_config, seed=7).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_different_seeds_give_different_parameters(tiny_model_config):
    a, b = init_model(tiny_model_config, seed=7).state_dict(), init_model(tiny_model_config, seed=8).state_dict()
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])


def test_init_model_leaves_the_global_rng_state_untouched(tiny_model_config):
    torch.manual_seed(99)
    before = torch.get_rng_state()
    init_model(tiny_model_config, seed=7)
    assert torch.equal(torch.get_rng_state(), before)


def test_init_model_is_fp32_with_sdpa_attention(tiny_model_config):
    model = init_model(tiny_model_config, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa"


# --- model_config -----------------------------------------------------------------------------


def test_preset_config_rounds_vocab_up_to_a_multiple_of_8_and_uses_seq_len(tiny_model_config):
    assert tiny_model_config.vocab_size == 264
    assert tiny_model_config.max_position_embeddings == SEQ_LEN
    assert tiny_model_config.tie_word_embeddings is False
    assert tiny_model_config.attention_dropout == 0.0


def test_unknown_preset_is_refused_with_the_list_of_presets():
    with pytest.raises(ModelError, match="unknown model preset 'huge'") as error:
        model_config(ModelSection(preset="huge", seq_len=SEQ_LEN), 259)
    assert all(name in str(error.value) for name in PRESETS)


def test_missing_config_path_is_refused_naming_the_path(tmp_path):
    missing = tmp_path / "nowhere" / "config.json"
    with pytest.raises(ModelError, match="does not exist") as error:
        model_config(ModelSection(config_path=str(missing), seq_len=SEQ_LEN), 259)
    assert str(missing) in str(error.value)


def test_config_with_a_vocab_smaller_than_the_tokenizer_is_refused(tmp_path):
    path = write_gpt2_config(tmp_path / "config.json", vocab_size=200)
    with pytest.raises(ModelError, match="vocab_size 200, fewer than the tokenizer's 259"):
        model_config(ModelSection(config_path=str(path), seq_len=SEQ_LEN), 259)


def test_config_shorter_than_seq_len_is_refused(tmp_path):
    path = write_gpt2_config(tmp_path / "config.json", n_positions=16)
    with pytest.raises(ModelError, match="max_position_embeddings 16 < \\[model\\] seq_len 32"):
        model_config(ModelSection(config_path=str(path), seq_len=SEQ_LEN), 259)


def test_config_that_is_not_a_causal_lm_is_refused(tmp_path):
    T5Config(vocab_size=300).to_json_file(tmp_path / "config.json")
    with pytest.raises(ModelError, match="model_type 't5', which is not a causal language model"):
        model_config(ModelSection(config_path=str(tmp_path), seq_len=SEQ_LEN), 259)


def test_config_that_is_not_json_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read model config"):
        model_config(ModelSection(config_path=str(tmp_path / "config.json"), seq_len=SEQ_LEN), 259)


@pytest.mark.parametrize("as_folder", [False, True])
def test_config_json_file_or_folder_loads_and_overrides_the_preset(tmp_path, as_folder):
    path = write_gpt2_config(tmp_path / "config.json")
    spec = str(tmp_path if as_folder else path)
    config = model_config(ModelSection(preset="tiny", config_path=spec, seq_len=SEQ_LEN), 259)
    assert (config.model_type, config.vocab_size, config.n_embd) == ("gpt2", 300, 32)
    logits = init_model(config, seed=0)(fixed_batch()).logits
    assert logits.shape == (2, SEQ_LEN, 300)


# --- tokenizers -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TRICKY_TEXTS)
def test_byte_tokenizer_round_trips_utf8(text):
    tok = ByteTokenizer()
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text


def test_byte_tokenizer_decode_drops_special_ids():
    tok = ByteTokenizer()
    assert tok.decode([tok.bos_token_id, *b"hi", tok.eos_token_id, tok.pad_token_id]) == "hi"


def test_load_tokenizer_bytes_is_the_byte_tokenizer():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_token_id) == (259, 257)


def test_load_tokenizer_reads_a_tokenizer_json(tmp_path):
    tok = load_tokenizer(str(write_word_tokenizer(tmp_path / "tokenizer.json")))
    assert (tok.vocab_size, tok.eos_token_id) == (4, 3)
    assert tok.encode("hello world moon") == [1, 2, 0]
    assert tok.decode([1, 3, 2]) == "hello world"


def test_tokenizer_json_without_an_eos_token_is_refused(tmp_path):
    path = write_word_tokenizer(tmp_path / "tokenizer.json", specials=("<mask>",))
    with pytest.raises(ModelError, match="has no end-of-sequence token"):
        load_tokenizer(str(path))


def test_load_tokenizer_reads_a_transformers_folder_falling_back_to_sep(tmp_path):
    raw = tokenizers.Tokenizer.from_file(str(write_word_tokenizer(tmp_path / "tokenizer.json", ("[SEP]",))))
    PreTrainedTokenizerFast(tokenizer_object=raw, sep_token="[SEP]").save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert (tok.vocab_size, tok.eos_token_id) == (4, 3)
    assert tok.encode("world hello") == [2, 1]


def test_missing_tokenizer_path_is_refused_naming_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "no-such-tokenizer.json"
    with pytest.raises(ModelError, match="does not exist; set \\[model\\] tokenizer to 'bytes'") as error:
        load_tokenizer(str(missing))
    assert str(missing) in str(error.value)


def test_unreadable_tokenizer_json_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text("garbage")
    with pytest.raises(ModelError, match="cannot read tokenizer"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))


# --- export_model -----------------------------------------------------------------------------


def test_exported_model_gives_exactly_the_same_logits(tiny_model_config, tmp_path):
    model = init_model(tiny_model_config, seed=3).eval()
    out = export_model(model.state_dict(), tiny_model_config, "bytes", tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(fixed_batch()).logits, model(fixed_batch()).logits)
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id, loaded.config.pad_token_id) == (256, 257, 258)
    assert tiny_model_config.eos_token_id is None  # the caller's config is not changed


def test_exported_byte_tokenizer_encodes_exactly_like_byte_tokenizer(tiny_model_config, tmp_path):
    state = init_model(tiny_model_config, seed=0).state_dict()
    out = export_model(state, tiny_model_config, "bytes", tmp_path / "export")
    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (len(hf), hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (259, 256, 257, 258)
    for text in TRICKY_TEXTS:
        assert hf.encode(text) == ByteTokenizer().encode(text), text
        assert hf(text)["input_ids"] == ByteTokenizer().encode(text), text
        assert hf.decode(hf.encode(text)) == text


def test_exported_model_with_tied_embeddings_from_a_config_path_gives_the_same_logits(tmp_path):
    path = write_gpt2_config(tmp_path / "config.json")  # GPT-2 ties its input and output embeddings
    config = model_config(ModelSection(config_path=str(path), seq_len=SEQ_LEN), 259)
    model = init_model(config, seed=3).eval()
    out = export_model(model.state_dict(), config, "bytes", tmp_path / "export")
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(fixed_batch()).logits, model(fixed_batch()).logits)


@pytest.mark.parametrize("as_folder", [False, True])
def test_export_saves_a_path_tokenizer_that_auto_tokenizer_loads(tmp_path, as_folder):
    spec = str(write_word_tokenizer(tmp_path / "tokenizer.json"))
    if as_folder:
        PreTrainedTokenizerFast(tokenizer_file=spec, eos_token="</s>").save_pretrained(tmp_path / "tok")
        spec = str(tmp_path / "tok")
    config = model_config(ModelSection(preset="tiny", tokenizer=spec, seq_len=SEQ_LEN), 4)
    out = export_model(init_model(config, seed=0).state_dict(), config, spec, tmp_path / "export")
    hf = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert hf.encode("hello world", add_special_tokens=False) == load_tokenizer(spec).encode("hello world")
    assert hf.eos_token_id == 3


def test_export_into_an_empty_existing_folder_is_allowed(tiny_model_config, tmp_path):
    (tmp_path / "export").mkdir()
    state = init_model(tiny_model_config, seed=0).state_dict()
    out = export_model(state, tiny_model_config, "bytes", tmp_path / "export")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }


def test_export_into_a_non_empty_folder_raises_and_changes_nothing(tiny_model_config, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ModelError, match="exists and is not an empty folder"):
        export_model(init_model(tiny_model_config, seed=0).state_dict(), tiny_model_config, "bytes", out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert (out / "notes.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_failed_export_leaves_nothing_behind(tiny_model_config, tmp_path):
    state = init_model(tiny_model_config, seed=0).state_dict()
    del state["lm_head.weight"]
    with pytest.raises(ModelError, match="do not fit the model config"):
        export_model(state, tiny_model_config, "bytes", tmp_path / "export")
    assert list(tmp_path.iterdir()) == []


# --- presets ----------------------------------------------------------------------------------


def test_tiny_preset_has_the_parameter_count_computed_by_hand(tiny_model_config):
    hidden, layers, mlp, vocab = 128, 2, 352, 264
    attention = 4 * hidden * hidden  # q, k, v, o; 4 heads x 32 = hidden
    swiglu = 3 * hidden * mlp  # gate, up, down
    per_layer = attention + swiglu + 2 * hidden  # two RMSNorm weights
    expected = layers * per_layer + 2 * vocab * hidden + hidden  # untied embeddings, final norm
    assert expected == 469_632
    assert count_parameters(init_model(tiny_model_config, seed=0)) == expected


def test_larger_presets_have_the_documented_parameter_counts():
    assert meta_parameter_count("small") == 25_969_152
    assert meta_parameter_count("150m") == 122_982_272
    assert meta_parameter_count("1b") == 970_057_728


def test_larger_presets_match_the_papers_sizes_with_a_32000_token_vocabulary():
    # DiLoCo's 150M ties a 32,000 x 896 embedding; OpenDiLoCo's 1.1B is TinyLlama, untied.
    non_embedding_150m = meta_parameter_count("150m") - 2 * 264 * 896
    assert 145e6 < non_embedding_150m + 32_000 * 896 < 155e6
    assert meta_parameter_count("1b", vocab_size=32_000) == 1_100_048_384
