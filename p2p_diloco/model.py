"""Model presets, model construction and tokenizers."""

from __future__ import annotations


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
