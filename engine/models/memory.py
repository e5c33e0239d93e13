"""What the loaded model costs in memory, as start-up reports it: a packed model should hold about its
file's bytes, not a float32 expansion of them."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource
from dataclasses import dataclass

MB = 1e6


@dataclass(frozen=True)
class MemoryReport:
    packed_weight_bytes: int  # weights kept in their file's format (GGUF blocks, bf16/f16)
    dense_weight_bytes: int  # float parameters and buffers (norms, float linears)
    kv_cache_bytes: int
    resident_bytes: int  # the engine process's resident set after loading, 0 where unknown

    def describe(self) -> str:
        weights = f"weights {self.dense_weight_bytes / MB:.0f} MB"
        if self.packed_weight_bytes:
            weights = (f"weights {self.packed_weight_bytes / MB:.0f} MB packed + "
                       f"{self.dense_weight_bytes / MB:.0f} MB float")
        resident = f", process resident {self.resident_bytes / MB:.0f} MB" if self.resident_bytes else ""
        return f"{weights}, KV cache {self.kv_cache_bytes / MB:.0f} MB{resident}"


def resident_bytes() -> int:
    """This process's resident set size now (Linux /proc), else its peak (getrusage), else 0."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        try:
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        except (OSError, ValueError):
            return 0


def release_freed_memory() -> None:
    """Hand the loader's freed scratch (file reads, repacking) back to the OS: glibc keeps freed heap
    for reuse, so without this the process's resident set carries it for good (~70 MB measured
    after loading the embedded model)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        trim = getattr(libc, "malloc_trim", None)  # glibc only
        if trim is not None:
            trim(0)
    except OSError:
        pass
