"""The packed weights as the CPU kernel reads them, kept beside the model file's cached metadata.

Re-laying a GGUF's blocks out for `kernels/quantized_gemm.py` (groups of 16 rows, scales and quants
side by side per k) takes 0.6-0.75 s for the embedded 135M model, at every start, on cores the HTTP
process needs at the same moment. The result depends only on the file's bytes and on that module's
code, so it is written once to `kernel-layout-<code hash>-<file hash>.safetensors` in the file's
cache folder and read back in ~50 ms. NOTE: the folder is keyed by the file's header only
(engine/models/gguf_cache.py), which two files with the same tensors' names, types and shapes
share, so the layout is keyed by the whole file's SHA-256 too (~80 ms for 98 MB). A layout whose
name, format or shape does not match is re-laid out: the cache can only save work.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import mmap
import os

import torch

import kernels.quantized_gemm as quantized_gemm
from engine.disk_cache import write_atomically
from engine.models.packed_weight import PackedWeight
from kernels.quantized_gemm import KernelWeight, pack_for_kernel

logger = logging.getLogger(__name__)

LAYOUT_PREFIX = "kernel-layout-"


def _layout_version() -> str:
    """A change to the packing code is a new layout: its file is keyed by that code's bytes."""
    with open(quantized_gemm.__file__, "rb") as source:
        return hashlib.sha256(source.read()).hexdigest()[:16]


def _file_digest(path: str) -> str:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return hashlib.sha256(data).hexdigest()[:16]


class KernelLayoutCache:
    def __init__(self, folder: str, source_file: str) -> None:
        """`folder`: where to keep it; `source_file`: the checkpoint file the weights came from."""
        self.folder = folder
        name = f"{LAYOUT_PREFIX}{_layout_version()}-{_file_digest(source_file)}.safetensors"
        self.path = os.path.join(folder, name)
        self.cached: dict[str, KernelWeight] = {}
        self.num_packed = 0
        try:
            self.cached = _read(self.path)
        except FileNotFoundError:
            pass
        except Exception as error:  # noqa: BLE001 -- a damaged file costs one re-layout, no more
            logger.warning("ignoring the kernel layout cache %s: %s", self.path, error)
        self.used: dict[str, KernelWeight] = {}

    def pack(self, name: str, weight: PackedWeight) -> KernelWeight:
        """`weight` laid out for the kernel, from the cache when it holds `name` as this weight."""
        hit = self.cached.get(name)
        if hit is None or hit.format != weight.format or hit.shape != tuple(weight.shape):
            hit = pack_for_kernel(weight)
            self.num_packed += 1
        self.used[name] = hit
        return hit

    def save(self) -> None:
        """Write what this load used, if anything had to be laid out; a read-only folder only
        costs the next start the same work."""
        if not self.num_packed:
            return
        tensors = {name: weight.groups for name, weight in self.used.items()}
        meta = {name: json.dumps([weight.format, list(weight.shape)])
                for name, weight in self.used.items()}
        from safetensors.torch import save

        try:
            write_atomically(self.path, save(tensors, metadata=meta))
            # NOTE: one layout per folder: an older code's, or a replaced file's, is dead weight
            for old in glob.glob(os.path.join(self.folder, f"{LAYOUT_PREFIX}*.safetensors")):
                if old != self.path:
                    os.unlink(old)
        except OSError as error:
            logger.warning("cannot cache the kernel layout in %s (%s)", self.path, error)


def _read(path: str) -> dict[str, KernelWeight]:
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="pt") as file:
        meta = file.metadata() or {}
        for name in file.keys():
            format, shape = json.loads(meta[name])
            groups = file.get_tensor(name)
            if groups.dtype != torch.uint8 or groups.dim() != 2:
                raise ValueError(f"{name} is not a uint8 [groups, bytes] layout")
            out[name] = KernelWeight(format, groups, (int(shape[0]), int(shape[1])))
    return out
