"""Host lists to device tensors, as a step's metadata needs them, in one copy."""

from __future__ import annotations

import torch


def to_device(lists: list[list], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Host lists -> 1-D tensors on `device`, in one tensor and one copy (each step builds several):
    contiguous views of it, one per list."""
    packed = torch.tensor([value for values in lists for value in values], dtype=dtype)
    return list(packed.to(device).split_with_sizes([len(values) for values in lists]))
