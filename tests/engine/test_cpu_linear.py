"""CPU matmul layouts: the same numbers as nn.Linear, rows independent of batch size, right per dtype."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.cpu_linear import OneDNNLinear, onednn_linear_available, optimize_linears_for_cpu
from kernels.skinny_gemm import skinny_gemm_available

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")


def make_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 32, bias=False)).to(dtype)


@needs_onednn
def test_onednn_rows_do_not_depend_on_batch_size():
    linear = make_model(torch.float32)[0]
    packed = OneDNNLinear(linear)
    x = torch.randn(17, 64)
    full = packed(x)
    for rows in (1, 2, 6, 16):
        assert torch.equal(packed(x[:rows]), full[:rows])  # bit for bit: speculation relies on it
    torch.testing.assert_close(full, linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, "torch"), (torch.float16, "torch")])
def test_half_precision_keeps_torch_layout(dtype, expected):
    model = make_model(dtype)
    reference = [m.weight.clone() for m in model]
    assert optimize_linears_for_cpu(model) == expected
    assert all(m.weight.is_contiguous() and torch.equal(m.weight, w)
               for m, w in zip(model, reference))


def test_float32_gets_a_faster_layout_with_the_same_outputs():
    model = make_model(torch.float32)
    x = torch.randn(5, 64)
    want = model(x)
    backend = optimize_linears_for_cpu(model)
    assert backend == ("skinny-gemm" if skinny_gemm_available()
                       else "onednn-packed" if onednn_linear_available() else "transposed")
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_without_the_cpu_kernel_onednn_takes_over(monkeypatch):
    """SPECSERVE_CPU_KERNELS=0 (or no compiler) keeps the engine on torch's own ops."""
    monkeypatch.setattr("engine.models.cpu_linear.skinny_gemm_available", lambda: False)
    model = make_model(torch.float32)
    x = torch.randn(5, 64)
    want = model(x)
    assert optimize_linears_for_cpu(model) == (
        "onednn-packed" if onednn_linear_available() else "transposed")
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
