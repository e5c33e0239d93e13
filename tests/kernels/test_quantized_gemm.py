"""The packed-weight CPU kernel, bit for bit against the float32 kernel on gguf-py's dequantized weights.

Blocks are random bytes (every bit pattern is a valid quant) with finite float16 scales, so every
nibble, high bit, 6-bit scale and sign the formats can hold is exercised, not only what a quantizer
happens to emit. Shapes: row counts that leave a partial group of 16, every row-count regime of the
kernel (1-12 rows dequantized in registers, over 1, 2 or 4 groups at a time, more rows through a
dequantized buffer), and biases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from real_gemma import real_gemma_path

from kernels.packed_weight import PACKED_FORMATS, PackedWeight, block_geometry
from kernels.quantized_gemm import (
    pack_for_kernel,
    quantized_gemm_available,
    quantized_linear,
    quantized_rows,
)
from kernels.skinny_gemm import pack_linear_weight, packed_linear, skinny_gemm_available

pytestmark = [
    pytest.mark.skipif(not (quantized_gemm_available() and skinny_gemm_available()),
                       reason="no C++ compiler with AVX2 and F16C to build it"),
    pytest.mark.promise("packed-kernel-exact"),
]

# byte offsets of each format's float16 scales within a block (the rest is random quants)
_HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                 "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_packed(fmt: str, rows: int, cols: int, seed: int = 0) -> PackedWeight:
    rng = np.random.default_rng(seed)
    if fmt in ("F16", "BF16"):
        dtype = torch.float16 if fmt == "F16" else torch.bfloat16
        return PackedWeight.from_float16(torch.randn(rows, cols, generator=torch.Generator()
                                                     .manual_seed(seed)).to(dtype))
    block_size, block_bytes = block_geometry(fmt)
    data = rng.integers(0, 256, size=(rows, cols // block_size, block_bytes), dtype=np.uint8)
    for offset in _HALF_OFFSETS[fmt]:
        scales = (rng.standard_normal((rows, cols // block_size, 1)) * 0.05).astype(np.float16)
        data[..., offset:offset + 2] = scales.view(np.uint8)
    return PackedWeight(fmt, torch.from_numpy(data.reshape(rows, -1)), (rows, cols))


def float_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(x, pack_linear_weight(weight), bias, weight.shape[0])


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_rows_dequantize_exactly_as_gguf_py(fmt):
    weight = random_packed(fmt, 37, 512)
    rows = quantized_rows(pack_for_kernel(weight), torch.arange(37))
    expected = weight.dequantize()
    assert torch.equal(rows.view(torch.int32), expected.view(torch.int32))
    picked = torch.tensor([[36, 0], [17, 17]])
    assert torch.equal(quantized_rows(pack_for_kernel(weight), picked), expected[picked])


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 7, 9, 12, 13, 40])
def test_linear_bit_identical_to_float_kernel(fmt, num_rows):
    out_features = 16 * 7 + 5  # a partial last group, and group counts the fused tiles do not divide
    weight = random_packed(fmt, out_features, 512, seed=num_rows)
    x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(1))
    got = quantized_linear(x, pack_for_kernel(weight), None)
    assert torch.equal(got, float_kernel(x, weight.dequantize(), None))


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_every_verification_row_count_is_each_row_alone(fmt):
    """1 to 13 rows (each register tiling of the kernel, and the first beyond them), with a bias:
    every row is the float kernel's, and its 1-row result."""
    out_features = 16 * 9 + 5  # 10 groups: tiles of 4 and 2 groups leave some, a partial last one
    weight = random_packed(fmt, out_features, 512, seed=11)
    packed, dequantized = pack_for_kernel(weight), weight.dequantize()
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2))
    x = torch.randn(13, 512, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([quantized_linear(x[i:i + 1], packed, bias) for i in range(13)])
    for num_rows in range(1, 14):
        got = quantized_linear(x[:num_rows], packed, bias)
        assert torch.equal(got, alone[:num_rows]), num_rows
        assert torch.equal(got, float_kernel(x[:num_rows], dequantized, bias)), num_rows


@pytest.mark.parametrize("num_rows", [1, 2, 4, 6, 7, 12])
def test_thread_split_does_not_change_bits_at_any_tiling(num_rows):
    weight = pack_for_kernel(random_packed("Q4_1", 16 * 11 + 3, 256))
    one, two = on_one_and_two_threads(torch.randn(num_rows, 256), weight)
    assert torch.equal(one, two)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K", "BF16"])
def test_bias_and_leading_dims(fmt):
    weight = random_packed(fmt, 48, 256)
    bias = torch.randn(48)
    x = torch.randn(2, 3, 256)
    got = quantized_linear(x, pack_for_kernel(weight), bias)
    assert got.shape == (2, 3, 48)
    assert torch.equal(got.view(6, 48), float_kernel(x.view(6, 256), weight.dequantize(), bias))


def test_a_row_is_the_same_alone_and_in_any_batch():
    weight = pack_for_kernel(random_packed("Q4_K", 64, 512))
    x = torch.randn(20, 512)
    batched = quantized_linear(x, weight, None)
    for count in (1, 2, 3, 5, 20):
        assert torch.equal(quantized_linear(x[:count], weight, None), batched[:count])


def test_threads_do_not_change_bits():
    weight = pack_for_kernel(random_packed("Q5_K", 200, 512))
    one, two = on_one_and_two_threads(torch.randn(5, 512), weight)
    assert torch.equal(one, two)


def on_one_and_two_threads(x: torch.Tensor, weight) -> tuple[torch.Tensor, torch.Tensor]:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quantized_linear(x, weight, None)
        torch.set_num_threads(2)
        two = quantized_linear(x, weight, None)
    finally:
        torch.set_num_threads(threads)
    return one, two


def test_real_quantizer_output():
    """Blocks as gguf-py's own quantizer writes them, from a float matrix."""
    import gguf

    values = np.random.default_rng(3).standard_normal((40, 256), dtype=np.float32)
    for fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType[fmt])
        weight = PackedWeight(fmt, torch.from_numpy(blocks), (40, 256))
        x = torch.randn(3, 256)
        got = quantized_linear(x, pack_for_kernel(weight), None)
        assert torch.equal(got, float_kernel(x, weight.dequantize(), None))


def test_a_real_gemma_q5_0_tensor():
    """A Q5_0 tensor of Gemma 3 270M's Q4_K_M file (81 of its tensors), read as the engine reads
    it: dequantized, looked up and multiplied bit for bit as gguf-py and the float32 kernel do."""
    import gguf

    from engine.models.gguf_checkpoint import _read_tensor
    from engine.models.gguf_file import read_gguf_layout

    layout = read_gguf_layout(str(real_gemma_path()))
    tensor = next(t for t in layout.tensors if t.tensor_type.name == "Q5_0")
    weight = _read_tensor(tensor, None, torch.float32, True)
    assert isinstance(weight, PackedWeight) and weight.format == "Q5_0"
    expected = torch.from_numpy(gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type))
    assert torch.equal(weight.dequantize().view(torch.int32), expected.view(torch.int32))
    packed = pack_for_kernel(weight)
    rows = quantized_rows(packed, torch.arange(weight.out_features))
    assert torch.equal(rows.view(torch.int32), expected.view(torch.int32))
    x = torch.randn(13, weight.in_features, generator=torch.Generator().manual_seed(4))
    for num_rows in (1, 5, 13):  # decode, verification, the dequantized-buffer path
        got = quantized_linear(x[:num_rows], packed, None)
        assert torch.equal(got, float_kernel(x[:num_rows], expected, None)), num_rows


def test_bad_inputs_are_refused():
    weight = pack_for_kernel(random_packed("Q8_0", 16, 64))
    with pytest.raises(RuntimeError, match="groups|bytes|shapes|K="):
        quantized_linear(torch.randn(1, 96), weight, None)
    with pytest.raises(RuntimeError, match="out of"):
        quantized_rows(weight, torch.tensor([16]))
    with pytest.raises(ValueError, match="whole blocks"):
        PackedWeight("Q8_0", torch.zeros(2, 34, dtype=torch.uint8), (2, 48))
