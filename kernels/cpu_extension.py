"""Build-once loader for specserve's hand-written CPU kernels (C++ in `kernels/csrc/`).

torch's own CPU ops leave a batch-1 decode step at ~2x the weight-streaming floor (docs/perf.md), so
the kernels that decide the step are ours. Each source file registers ops in the `specserve` torch
namespace (`TORCH_LIBRARY_FRAGMENT`), and is compiled for the machine it runs on (`-march=native`, as
llama.cpp's GGML_NATIVE) the first time a process asks for it (~10 s); the library is cached on disk,
keyed by the source, the flags, torch's version and the CPU's feature flags (a cache carried to another
machine is never loaded there), so later processes only load it (~0.1 s).

OpenMP: the library links `libgomp.so.1`, the soname torch's own runtime already loaded, so its parallel
loops share torch's thread pool instead of starting a second one that would fight it for the cores.

Without a C++ compiler (or with SPECSERVE_CPU_KERNELS=0) nothing is built and callers keep their torch
reference path. With SPECSERVE_REQUIRE_CPU_KERNELS=1 (CI sets it) a kernel that cannot be built is an
error instead, so the tests of the kernels fail rather than skip on a machine without a compiler.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)


def cpu_kernels_enabled() -> bool:
    return os.environ.get("SPECSERVE_CPU_KERNELS", "1") != "0"


def cpu_kernels_required() -> bool:
    """SPECSERVE_REQUIRE_CPU_KERNELS=1: a kernel that cannot be built raises (CI), never falls back."""
    return os.environ.get("SPECSERVE_REQUIRE_CPU_KERNELS", "0") not in ("", "0")


class CpuKernelUnavailable(RuntimeError):
    """A CPU kernel could not be built although SPECSERVE_REQUIRE_CPU_KERNELS asks for it."""


def _cache_root() -> Path:
    """SPECSERVE_CACHE_DIR, else ~/.cache/specserve: where the engine caches converted models too."""
    root = os.environ.get("SPECSERVE_CACHE_DIR") or "~/.cache/specserve"
    return Path(root).expanduser().resolve() / "cpu_kernels"


def _cpu_features() -> bytes:
    """The CPU's feature flags as the kernel reads them (Linux); empty where unknown."""
    try:
        with open("/proc/cpuinfo", "rb") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(b"flags")), b"")
    except OSError:
        return b""


@functools.cache
def load_cpu_library(source_name: str) -> bool:
    """Compile (once per machine) and load `kernels/csrc/<source_name>.cpp`; True if its ops are usable."""
    if not cpu_kernels_enabled():
        return False
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        if cpu_kernels_required():
            raise CpuKernelUnavailable(f"no C++ compiler ({os.environ.get('CXX', 'c++')!r}) to "
                                       f"build CPU kernel {source_name}, and "
                                       f"SPECSERVE_REQUIRE_CPU_KERNELS is set")
        logger.warning("no C++ compiler: CPU kernel %s not built, torch ops used instead", source_name)
        return False
    from torch.utils import cpp_extension

    source = SOURCE_DIR / f"{source_name}.cpp"
    key = hashlib.sha256(b"\0".join([source.read_bytes(), torch.__version__.encode(),
                                     " ".join(CFLAGS + LDFLAGS).encode(), _cpu_features()])).hexdigest()[:16]
    build_dir = _cache_root() / f"{source_name}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        cpp_extension.load(name=f"specserve_{source_name}", sources=[str(source)],
                           extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                           build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as error:  # a broken toolchain must not take the engine down
        if cpu_kernels_required():
            raise CpuKernelUnavailable(f"CPU kernel {source_name} failed to build, and "
                                       f"SPECSERVE_REQUIRE_CPU_KERNELS is set") from error
        logger.warning("CPU kernel %s failed to build (%s); torch ops used instead", source_name,
                       str(error).strip().splitlines()[-1] if str(error).strip() else error)
        return False
    return True
