"""Pseudo-gradient codecs: how a flat fp32 vector travels on the wire. Pure functions on tensors.

A home peer's uplink is the bottleneck of a round, so Δ is encoded before it leaves the peer:

| codec         | bytes/value | how                                                              |
|---------------|-------------|------------------------------------------------------------------|
| `fp32`        | 4           | exact                                                            |
| `bf16`        | 2           | bfloat16, round to nearest: 8 bits of mantissa, fp32's range      |
| `scaled-fp16` | 2 (+8/part) | (x - mean) / std in float16, mean and std in fp32 (the default)   |
| `int8`        | 1.03        | blockwise absmax: 128 values share one fp32 scale, q in [-127, 127] |
| `int4`        | 0.5625      | blockwise absmax: 64 values share one fp32 scale, q in [-7, 7]     |
| `int2`        | 0.28125     | blockwise RMS: 128 values share one fp32 scale, 4 levels (below)   |

int2 gives each value one of four levels, ±0.4528 and ±1.510 times its block's RMS, split at 0 and
±0.9816 RMS: the Lloyd-Max quantizer of a normal distribution (mean squared error 0.1175 of the
variance, against 0.19 for four uniform levels at the block's absmax). What it clips from an
outlier, error feedback sends in later rounds.

Blockwise scales keep heavy-tailed data honest: one outlier only coarsens its own block, not the
whole vector (a single global scale, as in hivemind's Uniform8Bit, loses over 50 % on such data).
The reducer averages in fp32 (what `decode` returns) and encodes the average once (swarm/averaging/allreduce.py),
so every peer receives the same bytes whatever the codec (I1).

Error feedback (EF): a peer that sends q = Q(s) of s = Δ + e keeps e' = s - decode(q) and adds it
to its next pseudo-gradient, so nothing it failed to send is lost, only delayed. The swarm applies
it (swarm/__init__.py); `residual` here is the arithmetic.

`decode` is called on bytes from other peers (I4): it checks the length against the shape it was
told and raises ValueError on anything malformed; the caller checks the values are finite.
"""

from __future__ import annotations

import math
import typing
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

CodecName = Literal["fp32", "bf16", "scaled-fp16", "int8", "int4", "int2"]
CODECS: tuple[CodecName, ...] = typing.get_args(CodecName)
DEFAULT = "scaled-fp16"
LOSSY = frozenset(CODECS) - {"fp32"}


@dataclass(frozen=True)
class Codec:
    name: str

    def encode(self, x: torch.Tensor) -> bytes:
        """The bytes of a flat fp32 tensor on the wire."""
        x = x.detach().reshape(-1).to(torch.float32)
        return _ENCODERS[self.name](x)

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """The fp32 tensor of `numel` values that `data` encodes; ValueError if `data` cannot be that."""
        expected = self.encoded_size(numel)
        if len(data) != expected:
            raise ValueError(f"{self.name}: {len(data)} bytes cannot encode {numel} values (expected {expected})")
        return _DECODERS[self.name](data, numel)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What a receiver decodes from this tensor: x with the codec's loss."""
        return self.decode(self.encode(x), x.numel()).view_as(x)

    def encoded_size(self, numel: int) -> int:
        if self.name == "fp32":
            return 4 * numel
        if self.name == "bf16":
            return 2 * numel
        if self.name == "scaled-fp16":
            return 2 * numel + 8
        block = _BLOCK[self.name]
        blocks = math.ceil(numel / block)
        return blocks * block * _BITS[self.name] // 8 + 4 * blocks

    def bytes_per_value(self, numel: int = 1 << 20) -> float:
        return self.encoded_size(numel) / numel

    def piece(self, data: bytes, numel: int, start: int, end: int) -> bytes:
        """The encoding of values [start, end) of the `numel` that `data` encodes, on its own:
        `decode(piece, end - start)` is `decode(data, numel)[start:end]`, bit for bit. `start` is a
        multiple of CHUNK_VALUES (of every codec's block), so a piece is whole blocks; a blockwise
        piece takes its blocks' codes and scales, a scaled-fp16 piece the part's mean and std. What
        the audit checks of a part (trust/audit.py). ValueError if `data` cannot encode `numel`."""
        if len(data) != self.encoded_size(numel) or not (0 <= start <= end <= numel) or start % CHUNK_VALUES:
            raise ValueError(f"{self.name}: no piece [{start}, {end}) of {len(data)} bytes for {numel} values")
        if self.name in ("fp32", "bf16"):
            width = 4 if self.name == "fp32" else 2
            return bytes(data[width * start : width * end])
        if self.name == "scaled-fp16":
            return bytes(data[:8]) + bytes(data[8 + 2 * start : 8 + 2 * end])
        block, n_blocks = _BLOCK[self.name], math.ceil(numel / _BLOCK[self.name])
        first, last = start // block, math.ceil(end / block)
        code_bytes = block * _BITS[self.name] // 8  # of one block
        scales = len(data) - 4 * n_blocks
        return bytes(data[first * code_bytes : last * code_bytes]) + bytes(data[scales + 4 * first : scales + 4 * last])


CHUNK_VALUES = 16384  # the audit's unit: 64 KiB of fp32, whole blocks of every codec


def chunk_index(value: int) -> int:
    """The chunk of a part that holds its value number `value`."""
    return value // CHUNK_VALUES


def chunk_bounds(numel: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a part of `numel` values: CHUNK_VALUES each, the last shorter."""
    return [(start, min(numel, start + CHUNK_VALUES)) for start in range(0, numel, CHUNK_VALUES)]


def get(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; one of {', '.join(CODECS)}")
    return Codec(name)


def residual(sent: torch.Tensor, codec: Codec) -> torch.Tensor:
    """What a receiver of `sent` through `codec` does not get: error feedback carries it to the next round."""
    return sent - codec.roundtrip(sent)


# --- the encodings ---------------------------------------------------------------------------

_BLOCK = {"int8": 128, "int4": 64, "int2": 128}
_BITS = {"int8": 8, "int4": 4, "int2": 2}
_LEVELS = {"int8": 127, "int4": 7}
INT2_LEVELS = (-1.510, -0.4528, 0.4528, 1.510)  # in units of the block's RMS (Lloyd-Max, normal)
INT2_SPLIT = 0.9816  # the boundary between the inner and the outer levels


def _raw(x: torch.Tensor) -> bytes:
    return x.contiguous().numpy().tobytes()


def _from_raw(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of its own (writable) holding `data`."""
    return torch.frombuffer(bytearray(data), dtype=dtype)


def _view(data: bytes | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A read-only view of `data`, for input that is only read on the way to a new tensor: no copy."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given buffer is not writable"
        return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _encode_fp32(x: torch.Tensor) -> bytes:
    return _raw(x)


def _decode_fp32(data: bytes, numel: int) -> torch.Tensor:
    return _from_raw(data, torch.float32)


def _encode_bf16(x: torch.Tensor) -> bytes:
    return _raw(x.to(torch.bfloat16).view(torch.int16))


def _decode_bf16(data: bytes, numel: int) -> torch.Tensor:
    return _view(data, torch.int16).view(torch.bfloat16).to(torch.float32)


def _encode_scaled_fp16(x: torch.Tensor) -> bytes:
    mean = x.mean() if x.numel() else torch.tensor(0.0)
    std = x.std(unbiased=False) if x.numel() else torch.tensor(1.0)
    std = std if std > 0 else torch.tensor(1.0)
    stats = torch.stack([mean, std]).to(torch.float32)
    return _raw(stats) + _raw(((x - mean) / std).to(torch.float16).view(torch.int16))


def _decode_scaled_fp16(data: bytes, numel: int) -> torch.Tensor:
    mean, std = _view(data[:8], torch.float32).tolist()
    return _view(memoryview(data)[8:], torch.int16).view(torch.float16).to(torch.float32) * std + mean


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x padded with zeros to whole blocks, shape (blocks, block)."""
    pad = (-x.numel()) % block
    return torch.nn.functional.pad(x, (0, pad)).view(-1, block)


def _encode_blockwise(name: str, x: torch.Tensor) -> bytes:
    levels = _LEVELS[name]
    blocks = _blocks(x, _BLOCK[name])
    scale = blocks.abs().amax(dim=1) / levels  # (blocks,); 0 for an all-zero block
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-levels, levels).to(torch.int8)
    if name == "int4":  # two values per byte: q + 8 in 1..15, low nibble first
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)
        payload = nibbles[:, 0] | (nibbles[:, 1] << 4)
    else:
        payload = q.view(torch.uint8)
    return _raw(payload.reshape(-1)) + _raw(scale)


def _decode_blockwise(name: str, data: bytes, numel: int) -> torch.Tensor:
    block = _BLOCK[name]
    n_blocks = math.ceil(numel / block)
    payload = _view(memoryview(data)[: len(data) - 4 * n_blocks], torch.uint8)
    scale = _view(memoryview(data)[len(data) - 4 * n_blocks :], torch.float32)
    if name == "int4":
        q = torch.stack([payload & 0x0F, payload >> 4], dim=1).reshape(-1).to(torch.float32) - 8
        if bool((q < -7).any()):
            raise ValueError("int4: a nibble outside [-7, 7]")
    else:
        q = payload.view(torch.int8).to(torch.float32)
        if bool((q < -127).any()):
            raise ValueError("int8: the value -128 is never sent")
    return (q.view(n_blocks, block) * scale[:, None]).reshape(-1)[:numel]


def _encode_int2(x: torch.Tensor) -> bytes:
    blocks = _blocks(x, _BLOCK["int2"])
    scale = blocks.square().mean(dim=1).sqrt()  # (blocks,); 0 for an all-zero block
    z = blocks / torch.where(scale > 0, scale, torch.ones_like(scale))[:, None]
    codes = ((z > -INT2_SPLIT).to(torch.uint8) + (z > 0).to(torch.uint8) + (z > INT2_SPLIT).to(torch.uint8)).view(-1, 4)
    packed = codes[:, 0] | (codes[:, 1] << 2) | (codes[:, 2] << 4) | (codes[:, 3] << 6)  # first value lowest
    return _raw(packed) + _raw(scale)


def _decode_int2(data: bytes, numel: int) -> torch.Tensor:
    n_blocks = math.ceil(numel / _BLOCK["int2"])
    packed = _view(memoryview(data)[: len(data) - 4 * n_blocks], torch.uint8)
    scale = _view(memoryview(data)[len(data) - 4 * n_blocks :], torch.float32)
    codes = torch.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], dim=1).reshape(-1).long()
    values = torch.tensor(INT2_LEVELS, dtype=torch.float32)[codes]  # every code is a level: nothing to reject
    return (values.view(n_blocks, -1) * scale[:, None]).reshape(-1)[:numel]


_ENCODERS = {
    "fp32": _encode_fp32,
    "bf16": _encode_bf16,
    "scaled-fp16": _encode_scaled_fp16,
    "int8": lambda x: _encode_blockwise("int8", x),
    "int4": lambda x: _encode_blockwise("int4", x),
    "int2": _encode_int2,
}
_DECODERS = {
    "fp32": _decode_fp32,
    "bf16": _decode_bf16,
    "scaled-fp16": _decode_scaled_fp16,
    "int8": lambda d, n: _decode_blockwise("int8", d, n),
    "int4": lambda d, n: _decode_blockwise("int4", d, n),
    "int2": _decode_int2,
}
