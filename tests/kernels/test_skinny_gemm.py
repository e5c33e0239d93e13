"""specserve's CPU linear kernel: exact against its torch reference, rows independent of the batch."""

from __future__ import annotations

import pytest
import torch

from kernels.skinny_gemm import (
    linear_reference,
    pack_linear_weight,
    packed_linear,
    skinny_gemm_available,
)

pytestmark = pytest.mark.skipif(not skinny_gemm_available(), reason="no C++ compiler to build it")


def make(out_features: int, in_features: int, rows: int, bias: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.1
    x = torch.randn(rows, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    return weight, x, b


@pytest.mark.parametrize("out_features, in_features", [(24, 8), (50, 37), (7, 64), (97, 130)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_its_reference_bit_for_bit(out_features, in_features, rows, bias):
    weight, x, b = make(out_features, in_features, rows, bias)
    packed = pack_linear_weight(weight)
    got = packed_linear(x, packed, b, out_features)
    assert torch.equal(got, linear_reference(x, packed, b, out_features))
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_batch_or_the_threads():
    """What keeps greedy speculation token-identical: a verification row equals the decode row."""
    weight, x, _ = make(1000, 576, 17, bias=False)
    packed = pack_linear_weight(weight)
    full = packed_linear(x, packed, None, 1000)
    for start, stop in ((0, 1), (5, 6), (3, 12), (16, 17), (0, 9)):
        assert torch.equal(packed_linear(x[start:stop], packed, None, 1000), full[start:stop])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(packed_linear(x, packed, None, 1000), full)
    finally:
        torch.set_num_threads(threads)


def test_leading_dimensions_are_kept():
    weight, x, _ = make(30, 16, 6, bias=False)
    packed = pack_linear_weight(weight)
    out = packed_linear(x.view(2, 3, 16), packed, None, 30)
    assert out.shape == (2, 3, 30)
    assert torch.equal(out.view(6, 30), packed_linear(x, packed, None, 30))


def test_bad_shapes_are_refused():
    weight, x, _ = make(30, 16, 2, bias=False)
    packed = pack_linear_weight(weight)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.specserve.packed_linear(torch.randn(2, 17), packed, None, 30)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.specserve.packed_linear(x.double(), packed, None, 30)
