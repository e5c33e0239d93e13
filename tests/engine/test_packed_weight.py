"""kernels/packed_weight.py: picking and stacking rows moves whole rows of blocks, so the
result dequantizes to the same rows as the weights it came from, for every packed format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.packed_weight import PACKED_FORMATS, PackedWeight, block_geometry

# byte offsets of each format's float16 scales within a block
SCALE_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
                 "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_weight(fmt: str, rows: int, cols: int, seed: int = 0) -> PackedWeight:
    rng = np.random.default_rng(seed)
    if fmt in ("F16", "BF16"):
        dtype = torch.float16 if fmt == "F16" else torch.bfloat16
        return PackedWeight.from_float16(torch.from_numpy(rng.standard_normal((rows, cols),
                                                                              np.float32)).to(dtype))
    block_size, block_bytes = block_geometry(fmt)
    blocks = rng.integers(0, 256, (rows, cols // block_size * block_bytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[fmt]:  # finite float16 scales; the rest random quants
        blocks.reshape(rows, -1, block_bytes)[..., offset:offset + 2] = 0x3C
    return PackedWeight(fmt, torch.from_numpy(blocks), (rows, cols))


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_selected_rows_dequantize_to_the_same_rows(fmt):
    rows, cols = 12, 256
    weight = random_weight(fmt, rows, cols)

    for index in (torch.randperm(rows), [11, 0, 0, 5]):
        picked = weight.select_rows(index)
        assert picked.shape == (len(index), cols) and picked.data.is_contiguous()
        expected = weight.dequantize()[torch.as_tensor(index, dtype=torch.long)]
        assert torch.equal(picked.dequantize().view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("fmt", PACKED_FORMATS)
def test_stacked_weights_dequantize_to_the_stacked_rows(fmt):
    parts = [random_weight(fmt, rows, 256, seed) for seed, rows in enumerate((8, 4, 4))]

    stacked = PackedWeight.concat(parts)

    assert stacked.shape == (16, 256) and stacked.data.is_contiguous()
    expected = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(stacked.dequantize().view(torch.int32), expected.view(torch.int32))
    with pytest.raises(ValueError, match="cannot stack"):
        PackedWeight.concat([parts[0], random_weight(fmt, 4, 512)])
