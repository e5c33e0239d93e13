"""A linear layer's weight kept as the file holds it (GGUF blocks, or 16-bit floats), never expanded.

The CPU kernel (`kernels/quantized_gemm.py`) reads these bytes and dequantizes in registers; every
other path (the GPU, `--dtype float32`, tests) calls `dequantize()`, which computes each float exactly
as gguf-py does, the library transformers' GGUF loader calls, so both paths see the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# GGML type names this product keeps packed; F16 and BF16 also stand for a safetensors tensor's bytes
PACKED_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16",
                  "BF16")


@dataclass(frozen=True)
class PackedWeight:
    format: str  # one of PACKED_FORMATS
    # uint8 [out_features, bytes per row]: each row's blocks in file order (GGUF's row-major layout)
    data: torch.Tensor
    shape: tuple[int, int]  # (out_features, in_features)

    def __post_init__(self) -> None:
        if self.format not in PACKED_FORMATS:
            raise ValueError(f"packed weights take {', '.join(PACKED_FORMATS)}, not {self.format!r}")
        block_size, block_bytes = block_geometry(self.format)
        rows, cols = self.shape
        if cols % block_size:
            raise ValueError(f"a {self.format} row holds whole blocks of {block_size}; "
                             f"{cols} columns do not divide")
        expected = (rows, cols // block_size * block_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.format} weight {self.shape} needs uint8 data {expected}, "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self) -> torch.Tensor:
        """float32 [out_features, in_features], bit for bit what gguf-py's dequantize gives."""
        if self.format == "F16":
            return self.data.view(torch.float16).float()
        if self.format == "BF16":
            return self.data.view(torch.bfloat16).float()
        import gguf

        qtype = gguf.GGMLQuantizationType[self.format]
        values = gguf.quants.dequantize(self.data.numpy(), qtype)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(self.shape)

    def select_rows(self, index: torch.Tensor | Sequence[int]) -> PackedWeight:
        """The rows `index` picks, in that order (a permutation undoes GGUF's q/k row order)."""
        # NOTE: numpy's copy, not torch's: the same bytes, in one thread; torch's copies wake
        # OpenMP threads, which on busy cores cost up to ~16 ms a call here (torch.cat of q/k/v or
        # gate/up: a median 19-60 ms against numpy's 0.4 ms)
        index = np.asarray(index, dtype=np.int64)
        return PackedWeight(self.format, torch.from_numpy(self.data.numpy()[index]),
                            (len(index), self.in_features))

    def select_columns(self, columns: range) -> PackedWeight:
        """Input features `columns` of every row; both ends on block boundaries (a row-parallel
        shard, engine/runner/sharding.py)."""
        block_size, block_bytes = block_geometry(self.format)
        if columns.start % block_size or columns.stop % block_size or columns.step != 1 or not (
                0 <= columns.start < columns.stop <= self.in_features):
            raise ValueError(f"{self.format} columns split on blocks of {block_size} within "
                             f"{self.in_features}, not {columns}")
        first, last = columns.start // block_size * block_bytes, columns.stop // block_size * block_bytes
        data = np.ascontiguousarray(self.data.numpy()[:, first:last])  # NOTE: numpy's, as above
        return PackedWeight(self.format, torch.from_numpy(data), (self.out_features, len(columns)))

    @staticmethod
    def concat(parts: Sequence[PackedWeight]) -> PackedWeight:
        """Rows of same-format, same-width weights stacked (q/k/v, gate/up), as one weight."""
        formats = {p.format for p in parts}
        widths = {p.in_features for p in parts}
        if len(formats) != 1 or len(widths) != 1:
            raise ValueError(f"cannot stack weights of formats {sorted(formats)} and widths "
                             f"{sorted(widths)} into one")
        data = np.concatenate([p.data.numpy() for p in parts])  # NOTE: numpy's, as in select_rows
        return PackedWeight(parts[0].format, torch.from_numpy(data),
                            (sum(p.out_features for p in parts), parts[0].in_features))

    @staticmethod
    def from_float16(tensor: torch.Tensor) -> PackedWeight:
        """A float16 or bfloat16 [out, in] tensor's bytes, kept as they are."""
        name = {torch.float16: "F16", torch.bfloat16: "BF16"}.get(tensor.dtype)
        if name is None or tensor.dim() != 2:
            raise ValueError(f"from_float16 takes a 2-D float16 or bfloat16 tensor, not "
                             f"{tensor.dtype} {tuple(tensor.shape)}")
        rows, cols = tensor.shape
        data = tensor.contiguous().view(torch.uint8).view(rows, cols * 2)
        return PackedWeight(name, data, (rows, cols))


def block_geometry(format: str) -> tuple[int, int]:
    """(weights per block, bytes per block) of a format, as GGML defines them."""
    if format in ("F16", "BF16"):
        return 1, 2
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[format]]
