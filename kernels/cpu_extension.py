"""Build-once loader for specserve's hand-written CPU kernels (C++ in `kernels/csrc/`).

torch's own CPU ops leave a batch-1 decode step at ~2x the weight-streaming floor (docs/perf.md), so
the kernels that decide the step are ours. Each source file registers ops in the `specserve` torch
namespace (`TORCH_LIBRARY_FRAGMENT`), and is compiled for the machine it runs on (`-march=native`, as
llama.cpp's GGML_NATIVE) the first time a process asks for it (~10-20 s each; `build_cpu_libraries`
builds them side by side and says so); the library is cached on disk, keyed by the source, the flags,
torch's version and the CPU's feature flags (a cache carried to another machine is never loaded
there). A later process loads the cached library directly (milliseconds): no compiler, no ninja.

SPECSERVE_CPU_ARCH names a baseline instead of `native` (e.g. `x86-64-v3`, what the Docker image
builds at image build time): such a library is keyed without the CPU's flags, so it can be built on
one machine and run on any machine whose CPU has the baseline's features (checked before loading; one
that lacks them builds for itself). The kernels give the same bits on every baseline (csrc: register
blocking only changes with the vector width). SPECSERVE_PREBUILT_KERNELS names a read-only folder of
libraries built ahead (the image's), looked in before the cache.

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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
CPU_ARCH_ENV = "SPECSERVE_CPU_ARCH"
PREBUILT_ENV = "SPECSERVE_PREBUILT_KERNELS"
LDFLAGS = ("-fopenmp",)
# written into a build folder once its library loaded: a folder without it (a build cut short) is
# handed back to torch's builder, which finishes or redoes it
READY_MARKER = "specserve-ready"
# /proc/cpuinfo flags a CPU needs to run code built with -march=<level> (gcc's x86-64 levels)
_X86_64_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_X86_64_V3 = (*_X86_64_V2, "avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")
ARCH_FLAGS = {"x86-64": (), "x86-64-v2": _X86_64_V2, "x86-64-v3": _X86_64_V3,
              "x86-64-v4": (*_X86_64_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")}


def cpu_kernels_enabled() -> bool:
    return os.environ.get("SPECSERVE_CPU_KERNELS", "1") != "0"


def cpu_kernels_required() -> bool:
    """SPECSERVE_REQUIRE_CPU_KERNELS=1: a kernel that cannot be built raises (CI), never falls back."""
    return os.environ.get("SPECSERVE_REQUIRE_CPU_KERNELS", "0") not in ("", "0")


class CpuKernelUnavailable(RuntimeError):
    """A CPU kernel could not be built although SPECSERVE_REQUIRE_CPU_KERNELS asks for it."""


def cpu_arch() -> str:
    """The -march the kernels are built for: SPECSERVE_CPU_ARCH, else `native` (this machine)."""
    return os.environ.get(CPU_ARCH_ENV, "").strip() or "native"


def cflags(arch: str) -> tuple[str, ...]:
    return ("-O3", f"-march={arch}", "-fopenmp", "-ffp-contract=off")


def source_names() -> list[str]:
    """Every kernel library there is (one per `csrc/*.cpp`)."""
    return sorted(path.stem for path in SOURCE_DIR.glob("*.cpp"))


# compile seconds measured alone on a 2-vCPU Xeon (docs/perf.md): a build starts the longest first,
# so the last one to start is short and both cores stay busy to the end (57 s -> ~51 s for four)
COMPILE_SECONDS = {"quantized_gemm": 35.0, "paged_attention": 27.8, "decoder_ops": 22.4,
                   "native_decoder": 12.5, "skinny_gemm": 15.8}
# what the CPU default (a GGUF kept packed) runs on; skinny_gemm only serves float32 linears and is
# built when first asked for (kernels/skinny_gemm.py)
PACKED_MODEL_KERNELS = ("quantized_gemm", "paged_attention", "decoder_ops", "native_decoder")


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


def missing_cpu_features(arch: str) -> list[str]:
    """The features a library built for `arch` needs that this CPU lacks ([] for native, and for a
    level this module does not know: gcc's name is then trusted)."""
    flags = set(_cpu_features().decode(errors="replace").partition(":")[2].split())
    return [] if not flags else [flag for flag in ARCH_FLAGS.get(arch, ()) if flag not in flags]


def build_folder_name(source_name: str, arch: str) -> str:
    """<source>-<key>: the key digests the source and the shared headers, torch's version, the
    flags, and for `native` the CPU's feature flags (a named baseline runs on every CPU that has
    its features)."""
    source = SOURCE_DIR / f"{source_name}.cpp"
    features = _cpu_features() if arch == "native" else b""
    # the headers every library may include (entry_points.h, decoder_math.h) key them all
    headers = b"".join(path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.h")))
    key = hashlib.sha256(b"\0".join([source.read_bytes(), headers, torch.__version__.encode(),
                                     " ".join(cflags(arch) + LDFLAGS).encode(), features]))
    return f"{source_name}-{key.hexdigest()[:16]}"


def _ready_library(folder: Path, source_name: str) -> Path | None:
    library = folder / f"specserve_{source_name}.so"
    return library if (folder / READY_MARKER).is_file() and library.is_file() else None


def _build_plan(source_name: str) -> tuple[str, list[Path]]:
    """The -march to build for here, and the folders a finished library may be in: the prebuilt
    folder's (if any), then the cache's, where a build goes."""
    arch = cpu_arch()
    if missing_cpu_features(arch):
        arch = "native"
    if not (SOURCE_DIR / f"{source_name}.cpp").is_file():  # NOTE: the builder then says so
        return arch, [_cache_root() / f"{source_name}-missing"]
    folder_name = build_folder_name(source_name, arch)
    prebuilt = os.environ.get(PREBUILT_ENV)
    return arch, ([Path(prebuilt) / folder_name] if prebuilt else []) + [_cache_root() / folder_name]


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def load_cpu_library(source_name: str) -> bool:
    """Compile (once per machine) and load `kernels/csrc/<source_name>.cpp`; True if its ops are
    usable. Thread-safe: `build_cpu_libraries` calls it from several threads."""
    with _locks_guard:
        lock = _locks.setdefault(source_name, threading.Lock())
    with lock:
        return _load_cpu_library(source_name)


@functools.cache
def _load_cpu_library(source_name: str) -> bool:
    if not cpu_kernels_enabled():
        return False
    _warn_if_baseline_unusable(cpu_arch())
    arch, folders = _build_plan(source_name)
    for folder in folders:
        library = _ready_library(folder, source_name)
        if library is not None:
            torch.ops.load_library(str(library))
            return True
    return _build(source_name, arch, folders[-1])


@functools.cache
def _warn_if_baseline_unusable(arch: str) -> None:
    missing = missing_cpu_features(arch)
    if missing:
        logger.warning("this CPU lacks %s, which %s=%s needs: the CPU kernels are built for this "
                       "machine (-march=native) instead", ", ".join(missing), CPU_ARCH_ENV, arch)


def _build(source_name: str, arch: str, build_dir: Path) -> bool:
    """Compile into `build_dir` (torch's builder: ninja, a lock against other processes) and load."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        if cpu_kernels_required():
            raise CpuKernelUnavailable(f"no C++ compiler ({compiler!r}) to build CPU kernel "
                                       f"{source_name}, and SPECSERVE_REQUIRE_CPU_KERNELS is set")
        logger.warning("no C++ compiler: CPU kernel %s not built, torch ops used instead", source_name)
        return False
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        cpp_extension.load(name=f"specserve_{source_name}",
                           sources=[str(SOURCE_DIR / f"{source_name}.cpp")],
                           extra_cflags=list(cflags(arch)), extra_ldflags=list(LDFLAGS),
                           build_directory=str(build_dir), is_python_module=False, verbose=False)
    except Exception as error:  # a broken toolchain must not take the engine down
        if cpu_kernels_required():
            raise CpuKernelUnavailable(f"CPU kernel {source_name} failed to build, and "
                                       f"SPECSERVE_REQUIRE_CPU_KERNELS is set") from error
        logger.warning("CPU kernel %s failed to build (%s); torch ops used instead", source_name,
                       str(error).strip().splitlines()[-1] if str(error).strip() else error)
        return False
    (build_dir / READY_MARKER).write_text(f"-march={arch}\n")
    seconds = time.perf_counter() - start
    if seconds > 1:  # NOTE: only a real compile takes this long; a finished folder loads at once
        logger.warning("compiled CPU kernel %s for -march=%s in %.1f s (once; cached in %s)",
                       source_name, arch, seconds, build_dir)
    return True


def build_cpu_libraries(names: list[str] | None = None) -> dict[str, bool]:
    """Load every kernel library (or `names`), compiling the missing ones side by side, one per core
    (a first start on a new machine: ~10-20 s each, alone). Says so first, since it happens once."""
    names = source_names() if names is None else names
    if not cpu_kernels_enabled():
        return dict.fromkeys(names, False)
    to_build = sorted((name for name in names if not _is_ready(name)),
                      key=lambda name: -COMPILE_SECONDS.get(name, 0.0))
    if not to_build or shutil.which(os.environ.get("CXX", "c++")) is None:
        return {name: load_cpu_library(name) for name in names}  # NOTE: each says why not
    workers = max(1, min(len(to_build), os.cpu_count() or 1))
    logger.warning("compiling specserve's CPU kernels (-march=%s): %s, %d at a time; this "
                   "happens once, later starts load them from %s", _build_plan(to_build[0])[0],
                   ", ".join(to_build), workers, _cache_root())
    start = time.perf_counter()
    with ThreadPoolExecutor(workers, thread_name_prefix="cpu-kernel-build") as pool:
        built = dict(zip(to_build, pool.map(load_cpu_library, to_build)))
    logger.warning("CPU kernels: %d of %d built in %.1f s", sum(built.values()), len(built),
                   time.perf_counter() - start)
    return {name: built[name] if name in built else load_cpu_library(name) for name in names}


def _is_ready(source_name: str) -> bool:
    """Built already: waiting in the prebuilt folder or the cache (or loaded, which implies it)."""
    _, folders = _build_plan(source_name)
    return any(_ready_library(folder, source_name) is not None for folder in folders)
