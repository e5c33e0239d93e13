"""Faster CPU matmuls for decode-sized batches, with bit-identical rows whatever the batch size.

First choice: specserve's own kernel (`kernels/skinny_gemm.py`), which streams the weights at close to
the machine's read bandwidth for the 1 to 9 rows of a decode or verification step (docs/perf.md has
the numbers). Where it cannot be built (no C++ compiler), oneDNN's packed layout, measured before it
on a 2-core AVX2 EPYC, all 135M SmolLM2 weights in float32 (ms per forward's matmuls):

    rows      1    2    4    6    8   16   512
    F.linear  46   89   87   74   70   83  1316    (MKL, row-major weight)
    oneDNN    26   23   27   30   35   47   875    (weight pre-packed for 16 rows)

so verifying 1 + k draft rows costs barely more than decoding one. oneDNN also computes each output row
the same way whatever the number of rows, which keeps greedy speculation token-identical to plain
decoding. Its internal ops are what torch's own CPU compiler (inductor) emits for frozen linears; where
they are missing we fall back to a transposed weight layout, which MKL also multiplies faster.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.skinny_gemm import pack_linear_weight, packed_linear, skinny_gemm_available

# rows the oneDNN weight layout is tuned for; measured flat for 1..16 rows, still best at 512
PACKING_BATCH_HINT = 16


def onednn_linear_available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and ops is not None
            and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class OneDNNLinear(nn.Module):
    """A float32 Linear whose weight oneDNN has re-laid out once, at load time."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKING_BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class SkinnyGemmLinear(nn.Module):
    """A float32 Linear on specserve's CPU kernel, its weight packed once at load time."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", pack_linear_weight(linear.weight.detach()),
                             persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)


def optimize_linears_for_cpu(model: nn.Module) -> str:
    """Give every Linear of a float32 CPU model the fastest layout available; returns its name.

    Other dtypes keep torch's row-major layout: for bf16 and fp16 the transposed one is ~20x slower.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not all(m.weight.dtype == torch.float32 for _, m in linears):
        return "torch"
    for backend, available, replacement in (
            ("skinny-gemm", skinny_gemm_available, SkinnyGemmLinear),
            ("onednn-packed", onednn_linear_available, OneDNNLinear)):
        if available():
            for name, module in linears:
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name), child, replacement(module))
            return backend
    for _, module in linears:
        # same [out, in] shape over [in, out] storage: MKL streams it about twice as fast at 1 row
        module.weight.data = module.weight.data.t().contiguous().t()
    return "transposed"
