"""Linear layers on weights kept packed (GGUF blocks, 16-bit floats): the `specserve::quantized_linear`
C++ kernel (`kernels/csrc/quantized_gemm.cpp` says why and how).

`pack_for_kernel` re-lays a `PackedWeight` out once, at load time, in groups of 16 rows whose scales
and quants sit side by side per k; no value changes, so a group costs the bytes its rows cost in the
file (K-quants: +3% for unpacked 6-bit scales). `quantized_linear` multiplies; `quantized_rows` reads
rows back as float32 (an embedding lookup). Both dequantize exactly as gguf-py does, so the result is
bit for bit `packed_linear` (the float32 kernel) on `PackedWeight.dequantize()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu_extension import load_cpu_library
from kernels.packed_weight import PackedWeight, block_geometry

GROUP_WIDTH = 16  # rows per group: 2 AVX2 registers of outputs
# the kernel's format ids (quantized_gemm.cpp's enum Format)
FORMAT_IDS = {"F32": 0, "Q4_0": 1, "Q4_1": 2, "Q8_0": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "F16": 7,
              "BF16": 8, "Q5_0": 9, "Q5_1": 10}


def quantized_gemm_available() -> bool:
    return load_cpu_library("quantized_gemm") and torch.ops.specserve.quantized_gemm_supported()


@dataclass(frozen=True, eq=False)
class KernelWeight:
    """A weight as the kernel reads it: uint8 [groups, bytes per group]."""

    format: str
    groups: torch.Tensor
    shape: tuple[int, int]  # (out_features, in_features)

    @property
    def format_id(self) -> int:
        return FORMAT_IDS[self.format]

    @property
    def nbytes(self) -> int:
        return self.groups.numel()


def quantized_linear(x: torch.Tensor, weight: KernelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., in_features] float32 -> [..., out_features]."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.specserve.quantized_linear(rows, weight.groups, weight.format_id, bias,
                                               weight.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


def quantized_rows(weight: KernelWeight, ids: torch.Tensor) -> torch.Tensor:
    """ids: [...] int64 -> [..., in_features] float32: those rows, dequantized."""
    out = torch.ops.specserve.quantized_rows(weight.groups, weight.format_id, ids.long(),
                                             *weight.shape)
    return out.view(*ids.shape, weight.shape[1])


def pack_float32_for_kernel(weight: torch.Tensor) -> KernelWeight:
    """A float32 [out, in] weight in the kernel's group layout (per k, 16 rows' floats side by side):
    what lets a float32 layer run in the native decoder pass. Its outputs are bit for bit
    `packed_linear`'s (kernels/skinny_gemm.py), at about the same speed (docs/perf.md)."""
    rows, cols = weight.shape
    groups = -(-rows // GROUP_WIDTH)
    padded = torch.zeros(groups * GROUP_WIDTH, cols, dtype=torch.float32)
    padded[:rows] = weight.detach().float()
    packed = padded.view(groups, GROUP_WIDTH, cols).transpose(1, 2).contiguous()  # [G, K, 16]
    return KernelWeight("F32", packed.view(torch.uint8).view(groups, -1), (rows, cols))


def pack_for_kernel(weight: PackedWeight) -> KernelWeight:
    rows, cols = weight.shape
    block_size, block_bytes = block_geometry(weight.format)
    groups = -(-rows // GROUP_WIDTH)
    data = weight.data.numpy()
    if groups * GROUP_WIDTH != rows:  # zero rows pad the last group: zero scales, zero weights
        data = np.concatenate([data, np.zeros((groups * GROUP_WIDTH - rows, data.shape[1]),
                                              np.uint8)])
    if weight.format in ("F16", "BF16"):
        halves = data.view(np.uint16).reshape(groups, GROUP_WIDTH, cols)
        packed = np.ascontiguousarray(halves.transpose(0, 2, 1)).view(np.uint8)
        return KernelWeight(weight.format, torch.from_numpy(packed.reshape(groups, -1)), weight.shape)
    blocks = data.reshape(groups, GROUP_WIDTH, cols // block_size, block_bytes)
    header, quants, record_block = _UNPACKERS[weight.format](blocks)
    # quants: [G, 16, K] small ints -> per k the 16 rows' bits, then per block [header | quants]
    per_k = _interleave_quants(weight.format, quants.transpose(0, 2, 1))  # [G, K, bytes per k]
    per_block = per_k.reshape(groups, cols // record_block, -1)
    packed = np.concatenate([header, per_block], axis=2)
    return KernelWeight(weight.format, torch.from_numpy(np.ascontiguousarray(packed).reshape(groups, -1)),
                        weight.shape)


# ------------------------------------------------------------------ GGUF blocks -> fields
# Each unpacker takes blocks [G, 16, blocks per row, bytes per block] and returns (header bytes
# [G, blocks, header], quants [G, 16, K] as the small unsigned or signed ints the file holds, the
# weights per record). Headers are lane-fastest: each field's 16 rows side by side.


def _lanes(field: np.ndarray) -> np.ndarray:
    """[G, 16, blocks, ...] -> uint8 [G, blocks, bytes]: per block, the field's rows lane-fastest."""
    moved = np.moveaxis(field, 1, -1)  # [G, blocks, ..., 16]
    return np.ascontiguousarray(moved).view(np.uint8).reshape(*moved.shape[:2], -1)


def _half(blocks: np.ndarray, offset: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.uint16)[..., 0]


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """gguf-py's order: each `chunk` bytes give `chunk` low nibbles, then their high nibbles."""
    shaped = qs.reshape(*qs.shape[:-1], -1, 1, chunk) >> np.array([0, 4], np.uint8).reshape(2, 1)
    return (shaped & 0x0F).reshape(*qs.shape[:-1], -1)


def _flat(q: np.ndarray) -> np.ndarray:
    """[G, 16, blocks, per block] -> [G, 16, K]."""
    return q.reshape(*q.shape[:2], -1)


def _unpack_q4_0(blocks):
    return _lanes(_half(blocks, 0)), _flat(_nibbles(blocks[..., 2:18], 16)), 32


def _unpack_q4_1(blocks):
    header = np.concatenate([_lanes(_half(blocks, 0)), _lanes(_half(blocks, 2))], axis=2)
    return header, _flat(_nibbles(blocks[..., 4:20], 16)), 32


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: a block's 4 bytes of high bits -> [..., 32] bits, weight i's from bit i of
    the little-endian word (gguf-py's order)."""
    word = np.ascontiguousarray(qh).view("<u4")  # [..., 1]
    return ((word >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _unpack_q5_0(blocks):
    low = _nibbles(blocks[..., 6:22], 16)
    return _lanes(_half(blocks, 0)), _flat(low | (_fifth_bits(blocks[..., 2:6]) << 4)), 32


def _unpack_q5_1(blocks):
    header = np.concatenate([_lanes(_half(blocks, 0)), _lanes(_half(blocks, 2))], axis=2)
    low = _nibbles(blocks[..., 8:24], 16)
    return header, _flat(low | (_fifth_bits(blocks[..., 4:8]) << 4)), 32


def _unpack_q8_0(blocks):
    return _lanes(_half(blocks, 0)), _flat(blocks[..., 2:34].view(np.int8)), 32


def _k_scales(blocks):
    """Q4_K / Q5_K header: d, dmin, then the 8 sub-blocks' 6-bit scales and mins as bytes."""
    import gguf

    scales = np.ascontiguousarray(blocks[..., 4:16])
    sc, mins = gguf.quants.Q4_K.get_scale_min(scales.reshape(-1, 12))
    sc, mins = (a.astype(np.uint8).reshape(*blocks.shape[:3], 8) for a in (sc, mins))
    return np.concatenate([_lanes(_half(blocks, 0)), _lanes(_half(blocks, 2)), _lanes(sc),
                           _lanes(mins)], axis=2)


def _unpack_q4_k(blocks):
    return _k_scales(blocks), _flat(_nibbles(blocks[..., 16:144], 32)), 256


def _unpack_q5_k(blocks):
    low = _nibbles(blocks[..., 48:176], 32)
    qh = blocks[..., 16:48]
    high = (qh.reshape(*qh.shape[:-1], 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    return _k_scales(blocks), _flat(low | (high.reshape(low.shape) << 4)), 256


def _unpack_q6_k(blocks):
    low = _nibbles(blocks[..., 0:128], 64)
    qh = blocks[..., 128:192]
    high = (qh.reshape(*qh.shape[:-1], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3
    header = np.concatenate([_lanes(_half(blocks, 208)), _lanes(blocks[..., 192:208])], axis=2)
    return header, _flat(low | (high.reshape(low.shape) << 4)), 256


_UNPACKERS = {"Q4_0": _unpack_q4_0, "Q4_1": _unpack_q4_1, "Q5_0": _unpack_q5_0,
              "Q5_1": _unpack_q5_1, "Q8_0": _unpack_q8_0, "Q4_K": _unpack_q4_k,
              "Q5_K": _unpack_q5_k, "Q6_K": _unpack_q6_k}


def _interleave_quants(format: str, q: np.ndarray) -> np.ndarray:
    """q: [G, K, 16] -> uint8 [G, K, bytes]: byte j holds row j's low nibble and row j + 8's as its
    high nibble; 5- and 6-bit formats append a word of high bits, row j's at bit j (or 2j)."""
    if format == "Q8_0":
        return np.ascontiguousarray(q.astype(np.int8)).view(np.uint8)
    q = q.astype(np.uint32)
    low = q & 0x0F
    nibbles = (low[..., :8] | (low[..., 8:] << 4)).astype(np.uint8)
    if format in ("Q4_0", "Q4_1", "Q4_K"):
        return nibbles
    bits, dtype = (1, np.uint16) if format in ("Q5_0", "Q5_1", "Q5_K") else (2, np.uint32)
    shifts = (np.arange(GROUP_WIDTH, dtype=np.uint32) * bits)
    word = ((q >> 4) << shifts).sum(axis=-1, dtype=np.uint64).astype(dtype)
    return np.concatenate([nibbles, word[..., None].view(np.uint8)], axis=-1)
