"""Pseudo-gradient codecs: sizes, exactness where it is promised, error bounds, error feedback, bad bytes."""

import pytest
import torch

from p2p_diloco.protocol import codecs


def heavy_tailed(n: int, seed: int = 0) -> torch.Tensor:
    """Student-t with 2 degrees of freedom: infinite variance, the shape of real pseudo-gradients' tails."""
    torch.manual_seed(seed)
    return torch.distributions.StudentT(2.0).sample((n,))


@pytest.mark.parametrize(
    "name, numel, size",
    [
        ("fp32", 1000, 4000),
        ("bf16", 1000, 2000),
        ("scaled-fp16", 1000, 2008),  # + mean and std in fp32
        ("int8", 1000, 8 * 128 + 8 * 4),  # 8 blocks of 128 (the last padded), one fp32 scale each
        ("int4", 1000, 16 * 32 + 16 * 4),  # 16 blocks of 64 values, 2 per byte, one fp32 scale each
        ("int2", 1000, 8 * 32 + 8 * 4),  # 8 blocks of 128 values, 4 per byte, one fp32 scale each
    ],
)
def test_encoded_size_by_hand(name, numel, size):
    codec = codecs.get(name)
    assert codec.encoded_size(numel) == size
    assert len(codec.encode(torch.randn(numel))) == size


def test_fp32_is_exact_and_bf16_keeps_representable_values():
    x = torch.randn(777)
    assert torch.equal(codecs.get("fp32").roundtrip(x), x)
    y = x.to(torch.bfloat16).float()  # already bf16-representable: nothing lost
    assert torch.equal(codecs.get("bf16").roundtrip(y), y)


@pytest.mark.parametrize("name, levels, block", [("int8", 127, 128), ("int4", 7, 64)])
def test_blockwise_is_exact_on_multiples_of_the_block_scale(name, levels, block):
    # Each block holds k / levels * s for integers |k| <= levels, with its max levels * s / levels = s.
    scales = torch.tensor([0.5, 3.0, 1e-6])
    k = torch.arange(block) % (2 * levels + 1) - levels  # holds -levels in every block
    x = (k.float()[None, :] / levels * scales[:, None]).reshape(-1)
    torch.testing.assert_close(codecs.get(name).roundtrip(x), x, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name, bound", [("bf16", 4e-3), ("scaled-fp16", 5e-4), ("int8", 0.03), ("int4", 0.2)])
def test_relative_error_on_heavy_tailed_data(name, bound):
    # Measured: bf16 1.6e-3, scaled fp16 2.1e-4, int8 2.0e-2, int4 0.16 (a global scale loses > 50 %).
    x = heavy_tailed(100_003)
    error = (codecs.get(name).roundtrip(x) - x).norm() / x.norm()
    assert error < bound


def test_blockwise_error_is_at_most_half_a_step_of_each_block():
    x = heavy_tailed(64 * 50, seed=1)
    y = codecs.get("int4").roundtrip(x)
    step = x.view(-1, 64).abs().amax(dim=1, keepdim=True) / 7
    assert bool(((y - x).view(-1, 64).abs() <= step / 2 * (1 + 1e-5)).all())


@pytest.mark.parametrize("name, bound", [("int4", 0.03), ("int2", 0.06)])
def test_error_feedback_sends_everything_eventually(name, bound):
    # Over 50 rounds, what was received sums to what was meant up to the one residual still held.
    codec = codecs.get(name)
    residual = torch.zeros(1000)
    meant, received = torch.zeros(1000), torch.zeros(1000)
    for r in range(50):
        delta = torch.randn(1000, generator=torch.Generator().manual_seed(r))
        sent = delta + residual
        residual = codecs.residual(sent, codec)
        meant += delta
        received += sent - residual
    torch.testing.assert_close(received + residual, meant, rtol=1e-5, atol=1e-4)
    assert (meant - received).norm() / meant.norm() < bound  # measured 0.052 for int2; without feedback it compounds


@pytest.mark.parametrize("name", codecs.CODECS)
def test_zeros_and_odd_sizes_roundtrip(name):
    for n in (1, 63, 65, 129):
        assert torch.equal(codecs.get(name).roundtrip(torch.zeros(n)), torch.zeros(n))


@pytest.mark.parametrize("name", codecs.CODECS)
def test_bytes_of_the_wrong_length_are_refused(name):
    codec = codecs.get(name)
    data = codec.encode(torch.randn(100))
    for bad in (data[:-1], data + b"\0", b""):
        with pytest.raises(ValueError, match="cannot encode 100 values"):
            codec.decode(bad, 100)


def test_impossible_quantized_values_are_refused():
    data = bytearray(codecs.get("int8").encode(torch.randn(128)))
    data[0] = 0x80  # -128: never produced by the encoder
    with pytest.raises(ValueError, match="-128"):
        codecs.get("int8").decode(bytes(data), 128)


def test_unknown_codec_names_the_choices():
    with pytest.raises(ValueError, match="fp32, bf16, scaled-fp16, int8, int4, int2"):
        codecs.get("int1")


def test_int2_by_hand():
    # One block of 128: 2, -2, 0.5, -0.5 repeated. RMS = sqrt((4 + 4 + 0.25 + 0.25) / 4) = 1.4577;
    # 2 / 1.4577 = 1.372 > 0.9816: the outer levels, ±1.510 x 1.4577 = ±2.2012; 0.5 / 1.4577 = 0.343:
    # the inner ones, ±0.4528 x 1.4577 = ±0.6601. Codes 3, 0, 2, 1, the first value lowest:
    # 3 | 0 << 2 | 2 << 4 | 1 << 6 = 0x63 per 4 values, then the scale in fp32.
    x = torch.tensor([2.0, -2.0, 0.5, -0.5] * 32)
    data = codecs.get("int2").encode(x)
    assert data[:32] == b"\x63" * 32
    rms = float(torch.frombuffer(bytearray(data[32:]), dtype=torch.float32))
    assert rms == pytest.approx((8.5 / 4) ** 0.5, rel=1e-7)  # the RMS in fp32
    expected = torch.tensor([1.510 * rms, -1.510 * rms, 0.4528 * rms, -0.4528 * rms] * 32)
    torch.testing.assert_close(codecs.get("int2").decode(data, 128), expected)


def test_int2_is_the_lloyd_max_quantizer_of_a_normal():
    # its mean squared error is 0.1175 of the variance for normal data (four uniform levels at the
    # block's absmax: about 0.19)
    x = torch.randn(128 * 1000, generator=torch.Generator().manual_seed(0))
    error = (codecs.get("int2").roundtrip(x) - x).square().mean() / x.var()
    assert 0.11 < float(error) < 0.125


@pytest.mark.parametrize("name", codecs.CODECS)
def test_a_chunks_piece_decodes_to_the_same_values_as_the_whole_part(name):
    # The audit checks one chunk of a part (trust/audit.py): its piece must decode, on its own, to
    # exactly the values the whole encoding decodes to there. 40,000 values: chunks of 16,384,
    # 16,384 and 7,232 (not a whole number of int4's 64-value blocks: 113 blocks, the last padded).
    codec = codecs.get(name)
    x = torch.randn(40_000, generator=torch.Generator().manual_seed(0))
    data = codec.encode(x)
    whole = codec.decode(data, 40_000)
    assert codecs.chunk_bounds(40_000) == [(0, 16_384), (16_384, 32_768), (32_768, 40_000)]
    for start, end in codecs.chunk_bounds(40_000):
        piece = codec.piece(data, 40_000, start, end)
        assert len(piece) == codec.encoded_size(end - start)
        assert torch.equal(codec.decode(piece, end - start), whole[start:end])
    with pytest.raises(ValueError):
        codec.piece(data, 40_000, 100, 200)  # not on a chunk's start
    with pytest.raises(ValueError):
        codec.piece(data[:-1], 40_000, 0, 16_384)  # not an encoding of 40,000 values
