"""Model presets, model construction, tokenizers, and export to a transformers model folder.

Every peer builds the same architecture from `[model]` (a preset or a transformers config.json) and
the same θ(0) from the run's seed, so `init_model` must be bit-reproducible. Configs come from
local paths only (`local_files_only=True`), and the default byte tokenizer needs no file at all.
The one thing here that may reach the network is a tokenizer named by its Hugging Face Hub id
(`org/name`): transformers downloads its files once into the Hub cache and reads them from there.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import tokenizers
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from p2p_diloco.config import ModelSection, hub_spec
from p2p_diloco.errors import ModelError


class Tokenizer(Protocol):
    """What training needs from a tokenizer: ids for text, and the id that separates documents."""

    vocab_size: int
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-255 are the UTF-8 bytes of the text; needs no download."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# Llama-style (pre-norm RMSNorm, SwiGLU MLP, RoPE) LlamaConfig kwargs; model_config adds the vocab and
# the context length. Parameter counts with the byte tokenizer (259 ids -> 264 embedding rows, input
# and output embeddings untied), from instantiating each preset on the meta device; the unit tests
# check them:
#   tiny        469,632  CPU unit tests: a forward/backward pass takes milliseconds.
#   small    25,969,152  a CPU or home-GPU swarm that learns visibly within minutes.
#   150m    122,982,272  DiLoCo's 150M (Douillard et al. 2023, Table 1: 12 layers, hidden 896, 16 heads
#                        of K/V size 64). Its "150M" counts a 32,000-token vocabulary, tied: 122.5M +
#                        28.7M. Chinchilla's MLP is 4 x hidden and ungated; SwiGLU has three matrices,
#                        so 8/3 x 896 = 2,389 rounded up to a multiple of 64 (2,432) keeps its size.
#   1b      970,057,728  OpenDiLoCo's 1.1B (TinyLlama layout: 4 key-value heads, grouped-query
#                        attention); with TinyLlama's 32,000-token vocabulary: 1,100,048,384.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=352),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, intermediate_size=1408),
    "150m": dict(hidden_size=896, num_hidden_layers=12, num_attention_heads=16, head_dim=64, intermediate_size=2432),
    "1b": dict(
        hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, intermediate_size=5632
    ),
}

# From this size on a model is GPU-sized: `run.device = auto` refuses to fall back to the CPU for it.
# The line falls between small (26M) and 150m (123M): on a 2-core CPU a forward and backward pass
# of 512 tokens ran at 630 tokens/s for small and 160 for 150m, so one round of peers/home-gpu.toml
# (500 steps x 64 x 1024 tokens) would take 2-3 days there, against 10-30 minutes on a home GPU.
GPU_SIZED_PARAMETERS = 100_000_000

# Spellings of the end-of-sequence token (and of BERT's [SEP], its stand-in) in bare tokenizer.json
# files, which, unlike a transformers folder, do not say which token ends a sequence.
_EOS_SPELLINGS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")

# Names of the byte tokenizer's special tokens (ids 256-258) in an exported tokenizer.json.
_BYTE_SPECIALS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}


# A Hub repository id with its owner (org/name). A bare name (gpt2) is read as a missing local
# path instead: the Hub only redirects such legacy names, and a typo in a folder name should say so.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def load_tokenizer(spec: str) -> Tokenizer:
    """`bytes`, a tokenizer.json file, a transformers tokenizer folder, or a Hub tokenizer id `org/name`,
    optionally pinned as `org/name@revision` (a commit hash, tag or branch).

    A local path wins over a Hub id of the same spelling. The spec itself is the tokenizer's identity
    in the config fingerprint (`model.tokenizer` is a shared field), so peers must spell it alike.
    """
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.exists():
        return _FolderTokenizer(spec) if path.is_dir() else _JsonTokenizer(path)
    name, revision = hub_spec(spec)
    if _HUB_ID.fullmatch(name) and not name.endswith(".json"):
        return _FolderTokenizer(name, from_hub=True, revision=revision)
    raise ModelError(
        f"tokenizer {spec!r} does not exist; set [model] tokenizer to 'bytes', a tokenizer.json file, "
        "a local tokenizer folder or a Hugging Face Hub id such as org/name"
    )


class _JsonTokenizer:
    """A bare `tokenizers` tokenizer.json; its end-of-sequence token is found by its usual spelling."""

    def __init__(self, path: Path) -> None:
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception for unreadable or invalid files
            raise ModelError(f"cannot read tokenizer {path}: {e}; give a valid tokenizer.json") from e
        self.path = path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token, self.eos_token_id = _find_eos(self._tok, path)

    def encode(self, text: str) -> list[int]:
        # No BOS/CLS from a post-processor: the data pipeline joins documents with eos itself, and a
        # per-call special token would land in the middle of its token stream.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _find_eos(tok: tokenizers.Tokenizer, path: Path) -> tuple[str, int]:
    """The end-of-sequence token's spelling and id."""
    for spelling in _EOS_SPELLINGS:
        token_id = tok.token_to_id(spelling)
        if token_id is not None:
            return spelling, token_id
    raise ModelError(
        f"tokenizer {path} has no end-of-sequence token (looked for {', '.join(_EOS_SPELLINGS)}); "
        "give its transformers folder instead, whose tokenizer_config.json names eos_token"
    )


class _FolderTokenizer:
    """A tokenizer that transformers.AutoTokenizer reads: a local folder (tokenizer_config.json and
    files), or a Hub id, whose files transformers downloads once into the Hugging Face cache and
    reads from there afterwards (also offline, HF_HUB_OFFLINE=1). Never with trust_remote_code:
    a tokenizer's repository does not get to run code on a volunteer's machine."""

    def __init__(self, source: str, from_hub: bool = False, revision: str | None = None) -> None:
        try:
            self._tok = AutoTokenizer.from_pretrained(source, local_files_only=not from_hub, revision=revision)
        except Exception as e:  # transformers raises OSError, ValueError, ImportError... by case
            if from_hub:
                raise _hub_error(source + (f"@{revision}" if revision else ""), e) from e
            raise ModelError(f"cannot read tokenizer folder {source}: {e}") from e
        self.source = source
        self.vocab_size = len(self._tok)  # with added tokens; `.vocab_size` leaves them out
        eos = self._tok.eos_token_id if self._tok.eos_token_id is not None else self._tok.sep_token_id
        if eos is None:
            raise ModelError(
                f"tokenizer {source} has no eos_token (nor sep_token); set eos_token in its tokenizer_config.json"
            )
        self.eos_token_id = eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)  # why no specials: see _JsonTokenizer

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def _hub_error(hub_id: str, error: Exception) -> ModelError:
    """One line naming both fixes: a Hub error's own text runs over several lines (offline, not
    found, gated), so only its first line is kept."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    return ModelError(
        f"cannot load tokenizer {hub_id!r} from the Hugging Face Hub ({type(error).__name__}: {first[:200]}); "
        "it is not a local path either: set [model] tokenizer to a local tokenizer folder or tokenizer.json, "
        "or run once with network access to download it into the Hub cache"
    )


def model_config(cfg: ModelSection, vocab_size: int) -> PretrainedConfig:
    """The architecture of the run: `cfg.config_path` if set, else the preset.

    `vocab_size` is the tokenizer's; the model must have at least that many embedding rows.
    """
    if cfg.config_path:
        return _config_from_path(cfg.config_path, vocab_size, cfg.seq_len)
    return _preset_config(cfg.preset, vocab_size, cfg.seq_len)


def _preset_config(preset: str, vocab_size: int, seq_len: int) -> LlamaConfig:
    if preset not in PRESETS:
        raise ModelError(
            f"unknown model preset {preset!r}; set [model] preset to one of {', '.join(PRESETS)}, "
            "or [model] config_path to a transformers config.json"
        )
    return LlamaConfig(
        **PRESETS[preset],
        # A multiple of 8 gives the embedding and output matmuls tensor-core-friendly shapes; the
        # extra rows are never a target, so they only learn to be unlikely.
        vocab_size=_round_up(vocab_size, 8),
        max_position_embeddings=seq_len,
        # Untied, as in Llama and OpenDiLoCo; also every parameter is then one tensor of the
        # state_dict, so pseudo-gradients never count a shared tensor twice.
        tie_word_embeddings=False,
        attention_dropout=0.0,  # Llama has no other dropout
        # The config does not know the tokenizer; export_model writes the tokenizer's ids.
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _config_from_path(config_path: str, vocab_size: int, seq_len: int) -> PretrainedConfig:
    path = Path(config_path)
    if not path.exists():
        raise ModelError(
            f"model config_path {config_path!r} does not exist; point [model] config_path at a transformers "
            "config.json or its folder, or leave it empty to use [model] preset"
        )
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # not JSON, no config.json, unknown model_type
        raise ModelError(f"cannot read model config {path}: {e}") from e
    _check_config(config, path, vocab_size, seq_len)
    return config


def _check_config(config: PretrainedConfig, path: Path, vocab_size: int, seq_len: int) -> None:
    """A config from a file must make a causal LM that fits the tokenizer and the sequence length."""
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelError(
            f"model config {path} has model_type {config.model_type!r}, which is not a causal language model "
            "that transformers.AutoModelForCausalLM knows; use a decoder config such as llama, mistral or gpt2"
        )
    vocab = getattr(config, "vocab_size", None)
    if vocab is None or vocab < vocab_size:
        raise ModelError(
            f"model config {path} has vocab_size {vocab}, fewer than the tokenizer's {vocab_size} ids; "
            f"set vocab_size >= {vocab_size} in the config or use the tokenizer it was made for"
        )
    # Models without learned or rotary positions (e.g. state-space models) have no such field: no limit.
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and positions < seq_len:
        raise ModelError(
            f"model config {path} has max_position_embeddings {positions} < [model] seq_len {seq_len}; "
            "lower seq_len or raise max_position_embeddings"
        )


def init_model(config: PretrainedConfig, seed: int) -> torch.nn.Module:
    """A freshly initialised fp32 causal LM whose parameters depend only on `config` and `seed`.

    Every peer that initialises θ(0) from the run's seed gets the same bits. The caller's RNG state
    is left as it was, so seeding the model does not shift the data order or dropout of the caller.
    """
    # fork_rng restores the CPU generator afterwards; seeding the default generator directly (not
    # torch.manual_seed) also leaves every CUDA generator alone. The model is built on the CPU.
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=_attention(config))


def _attention(config: PretrainedConfig) -> str:
    """sdpa where the architecture has it, else eager.

    On CPU, sdpa runs a fused kernel that is bit-reproducible run to run (for a given thread count)
    and several times faster than eager (docs/design.md §7); on a GPU it picks the flash or
    memory-efficient kernels.
    """
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of the model `config` describes, counted on the meta device: no memory, no init."""
    with torch.device("meta"):
        return count_parameters(AutoModelForCausalLM.from_config(config))


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameters; a tensor shared by two modules (tied embeddings) counts once."""
    return sum(p.numel() for p in model.parameters())


def export_model(
    state_dict: dict[str, torch.Tensor],
    config: PretrainedConfig,
    tokenizer_spec: str,
    out_dir: str | Path,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Write a transformers model folder that `from_pretrained(out_dir)` loads, with its tokenizer
    and `extra_files` (name: text, such as the model card).

    Nothing is overwritten: an `out_dir` that exists and is not empty is refused. The folder is
    written under a temporary name next to `out_dir` and renamed at the end, so a failed export
    leaves nothing half-written behind. Every file is 0644 and every folder 0755, whatever the umask:
    an export is made to be published.
    """
    out = Path(out_dir)
    _refuse_non_empty(out)
    tokenizer = load_tokenizer(tokenizer_spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        _save_model(state_dict, _with_token_ids(config, tokenizer), tmp)
        _save_tokenizer(tokenizer_spec, tokenizer, tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        _make_readable(tmp)
        _move_into_place(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return out


def _make_readable(folder: Path) -> None:
    # safetensors writes through a temporary file (0600), and the umask may be stricter than 022:
    # set the modes outright so that anyone can read the export (and a web server can serve it).
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _refuse_non_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelError(f"export folder {out} exists and is not an empty folder; choose a new one or remove it first")


def _move_into_place(tmp: Path, out: Path) -> None:
    # rename(2) replaces an empty folder atomically and fails on a non-empty one, so a folder that
    # filled up since _refuse_non_empty is still never overwritten.
    try:
        os.replace(tmp, out)
    except OSError as e:
        raise ModelError(f"cannot move the export into {out}: {e}; choose a new, empty folder") from e


def _with_token_ids(config: PretrainedConfig, tokenizer: Tokenizer) -> PretrainedConfig:
    """A copy of `config` naming the tokenizer's special ids, so generate() stops at its eos."""
    config = copy.deepcopy(config)
    config.eos_token_id = tokenizer.eos_token_id
    for name in ("bos_token_id", "pad_token_id"):
        if getattr(tokenizer, name, None) is not None:
            setattr(config, name, getattr(tokenizer, name))
    return config


def _save_model(state_dict: dict[str, torch.Tensor], config: PretrainedConfig, folder: Path) -> None:
    # A meta-device model allocates nothing; assign=True makes it hold the caller's tensors, which
    # it only reads. So exporting a 1B model needs no second 4 GB copy and no random init.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:
        raise ModelError(f"the parameters do not fit the model config: {e}") from e
    model.save_pretrained(folder)


def _save_tokenizer(spec: str, tokenizer: Tokenizer, folder: Path) -> None:
    """Save the tokenizer where `AutoTokenizer.from_pretrained(folder)` finds it."""
    if isinstance(tokenizer, _FolderTokenizer):
        tokenizer._tok.save_pretrained(folder)
        return
    if isinstance(tokenizer, _JsonTokenizer):
        fast = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer.path), eos_token=tokenizer.eos_token)
    else:
        fast = _byte_tokenizer_for_transformers()
    fast.save_pretrained(folder)
    _name_portable_class(folder / "tokenizer_config.json")


def _byte_tokenizer_for_transformers() -> PreTrainedTokenizerFast:
    """ByteTokenizer as a transformers tokenizer: the same ids for any text, no BOS/EOS added."""
    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_tokenizer(),
        # Text that happens to contain "<eos>" is bytes, as ByteTokenizer sees it, not token 257.
        split_special_tokens=True,
        **_BYTE_SPECIALS,
    )


def _byte_level_tokenizer() -> tokenizers.Tokenizer:
    """A BPE with no merges over the 256 ByteLevel symbols: every byte of the text is one token.

    ByteLevel writes each byte as one printable symbol; the vocabulary gives the symbol of byte b the
    id b. No regex split and no prefix space: a prefix space would add a byte, and with no merges the
    split would change nothing. The special tokens follow at 256, 257, 258 as in ByteTokenizer.
    """
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken(name, special=True) for name in _BYTE_SPECIALS.values()])
    return tok


def _byte_symbols() -> list[str]:
    """The symbol ByteLevel (GPT-2's table) writes for each byte 0-255.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, 0x7f-0xa0, 0xad) are
    moved, in order, to U+0100 onwards.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, moved = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + moved))
            moved += 1
    return symbols


def _name_portable_class(tokenizer_config: Path) -> None:
    # transformers 5 writes its own class name, TokenizersBackend, which transformers 4 (also within
    # our supported range) does not know; PreTrainedTokenizerFast names the same class in both.
    settings = json.loads(tokenizer_config.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config.write_text(json.dumps(settings, indent=2) + "\n")
