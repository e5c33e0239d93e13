"""Float32 linear layers for decode-sized batches on the CPU: the `specserve::packed_linear` C++ kernel.

`pack_linear_weight` lays a [N, K] weight out once, at load time, in groups of 16 output features
(`kernels/csrc/skinny_gemm.cpp` says why); `packed_linear` multiplies. Each output is one FMA chain
over k in order, so rows are bit-identical whatever the batch holds. The torch reference is
`linear_reference`: the same products, accumulated in the same order, in float64-free torch ops.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import load_cpu_library

GROUP_WIDTH = 16  # output features per packed group: 2 AVX2 registers


def skinny_gemm_available() -> bool:
    return load_cpu_library("skinny_gemm")


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N / 16), K, 16]: group g, column k holds W[16g : 16g + 16, k]."""
    out_features, in_features = weight.shape
    num_groups = -(-out_features // GROUP_WIDTH)
    padded = weight.new_zeros(num_groups * GROUP_WIDTH, in_features)
    padded[:out_features] = weight
    return padded.view(num_groups, GROUP_WIDTH, in_features).transpose(1, 2).contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """x: [..., K] float32 -> [..., out_features]."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.specserve.packed_linear(rows, packed, bias, out_features)
    return out.view(*x.shape[:-1], out_features)


def linear_reference(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                     out_features: int) -> torch.Tensor:
    """The kernel's arithmetic in torch: for each k in order, acc = fma(x[:, k], w[:, k], acc).

    Slow (K torch ops); tests compare the kernel to it bit for bit on small shapes.
    """
    rows = x.reshape(-1, x.shape[-1]).double()  # exact products; fma rounds once, as float64 then cast
    weight = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features]  # [N, K]
    acc = torch.zeros(rows.shape[0], out_features, dtype=torch.float32)
    for k in range(rows.shape[1]):
        acc = (acc.double() + rows[:, k:k + 1] * weight[:, k].double()).float()
    if bias is not None:
        acc = acc + bias
    return acc.view(*x.shape[:-1], out_features)
