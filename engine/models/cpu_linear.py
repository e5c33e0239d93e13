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

from kernels.packed_weight import PackedWeight
from kernels.quantized_gemm import (
    KernelWeight,
    pack_for_kernel,
    quantized_gemm_available,
    quantized_linear,
    quantized_rows,
)
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
    """Give every Linear of a float32 CPU model the fastest layout available; returns its name
    ("none" for a model with no Linear left, e.g. all packed).

    Other dtypes keep torch's row-major layout: for bf16 and fp16 the transposed one is ~20x slower.
    """
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:  # NOTE: asking whether a kernel is available would build it (a first start)
        return "none"
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


class QuantizedLinear(nn.Module):
    """A Linear whose weight stays as the file holds it (GGUF blocks, bf16/f16), float32 in and out.

    Its outputs are bit for bit SkinnyGemmLinear's on the dequantized weight (kernels/quantized_gemm.py).
    It may hold several parts stacked along the outputs (q/k/v of a file that quantizes them
    differently), each run by the kernel, their outputs side by side.
    """

    def __init__(self, parts: list[KernelWeight], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = parts
        self.in_features = parts[0].shape[1]
        self.out_features = sum(part.shape[0] for part in parts)
        # NOTE: a plain attribute, not a buffer: the module joins a model still on the meta device,
        # whose to_empty() would replace buffers with uninitialized memory
        self.bias = None if bias is None else bias.float().contiguous()
        # each part's slice of the bias (None: no bias)
        self.bias_parts = ([None] * len(parts) if bias is None
                            else list(self.bias.split([part.shape[0] for part in parts])))

    @classmethod
    def from_packed(cls, parts: list[PackedWeight], bias: torch.Tensor | None = None
                    ) -> QuantizedLinear:
        """Parts of one format are stacked into one weight, so the kernel streams them in one call."""
        if len({part.format for part in parts}) == 1 and len(parts) > 1:
            parts = [PackedWeight.concat(parts)]
        return cls([pack_for_kernel(part) for part in parts], bias)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] float32
        if len(self.parts) == 1:
            return quantized_linear(x, self.parts[0], self.bias_parts[0])
        return torch.cat([quantized_linear(x, part, bias)
                          for part, bias in zip(self.parts, self.bias_parts)], dim=-1)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] float32, what `PackedWeight.dequantize()` gives: for code that needs the matrix."""
        return torch.cat([quantized_rows(part, torch.arange(part.shape[0])) for part in self.parts])


class QuantizedEmbedding(nn.Module):
    """An embedding table kept packed; a lookup dequantizes only the rows it reads (float32)."""

    def __init__(self, table: PackedWeight) -> None:
        super().__init__()
        self.table = pack_for_kernel(table)
        self.num_embeddings, self.embedding_dim = table.shape

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quantized_rows(self.table, ids)

    def as_linear(self) -> QuantizedLinear:
        """The same table as an LM head (tied embeddings), sharing its bytes."""
        return QuantizedLinear([self.table])


def packed_weights_available() -> bool:
    """Whether this machine runs QuantizedLinear (a C++ compiler, AVX2 and F16C)."""
    return quantized_gemm_available()
