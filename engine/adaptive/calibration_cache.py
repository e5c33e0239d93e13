"""Start-up calibration's measurements, kept on disk so a warm start does not time ~60 target passes
again (seconds on a CPU, most of a warm start).

The file is keyed by everything the timings depend on: the machine (CPU model and feature flags,
usable cores, torch threads, a GPU's name and capability), the versions of torch, specserve and the C++
kernels' sources, the model file (path, size, modification time), the engine's configuration (dtype,
weight format, the matmul path chosen, KV cache, tensor parallelism, the ranks' feature capture) and
the calibration's own sizes and repeats. Another machine, another model, another build or another
setting misses the cache and measures again. A CPU calibration taken while other processes had the
cores is used but not saved (MIN_CPU_SHARE). SPECSERVE_RECALIBRATE=1 measures (and saves) again
regardless, for a change the key cannot see. A stale table only costs the first steps their best
choice: the policy follows the steps it runs (engine/adaptive/step_cost.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

import torch

from engine.config import CacheConfig, ModelConfig, ParallelConfig
from engine.cpu_threads import usable_cpu_count
from engine.disk_cache import cache_root, write_atomically
from kernels.cpu_extension import SOURCE_DIR as KERNEL_SOURCES

logger = logging.getLogger(__name__)

RECALIBRATE_ENV = "SPECSERVE_RECALIBRATE"
# bump when the file's meaning changes (what is timed, how it is stored)
FORMAT_VERSION = 1
# a CPU calibration is only cached when this process's threads ran for at least this share of its
# wall time (idle, OpenMP's spinning threads run ~all of it): timings taken while another process
# had the cores would slow every later start's first choices
MIN_CPU_SHARE = 0.75
# calibrations kept: each model file, configuration and machine has its own, so one for every
# model ever served (or temporary test model) would pile up; the least recently used go first
MAX_CACHED_CALIBRATIONS = 64


def machine_fields(device: torch.device) -> dict[str, Any]:
    """What a timing depends on in the machine: the CPU (model, flags), cores and threads, the GPU."""
    fields: dict[str, Any] = {"machine": platform.machine(), "cpu": _cpu_description(),
                              "usable_cpus": usable_cpu_count(), "torch_threads": torch.get_num_threads(),
                              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}
    if device.type == "cuda":
        fields["gpu"] = [torch.cuda.get_device_name(device),
                         list(torch.cuda.get_device_capability(device))]
    return fields


def software_fields() -> dict[str, Any]:
    """What a timing depends on in the software: torch, specserve, the kernels' sources."""
    try:
        specserve_version = metadata.version("specserve")
    except metadata.PackageNotFoundError:
        specserve_version = "unknown"
    sources = hashlib.sha256()
    for source in sorted(KERNEL_SOURCES.glob("*")):
        sources.update(source.name.encode() + b"\0" + source.read_bytes())
    return {"torch": torch.__version__, "specserve": specserve_version,
            "kernel_sources": sources.hexdigest()[:16],
            "cpu_kernels": os.environ.get("SPECSERVE_CPU_KERNELS", "1"),
            "native_pass": os.environ.get("SPECSERVE_NATIVE_PASS", "1")}


def model_file_fields(path: str) -> dict[str, Any]:
    """The model's identity on disk: its path, and the size and modification time of each file."""
    path = os.path.realpath(path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path)
        if name.endswith((".safetensors", ".json", ".gguf")))
    return {"model_path": path, "model_files": [
        [os.path.basename(name), os.path.getsize(name), os.stat(name).st_mtime_ns] for name in files]}


def engine_fields(model_config: ModelConfig, cache_config: CacheConfig,
                  parallel_config: ParallelConfig | None, model_path: str, linear_backend: str,
                  feature_layers: tuple[int, ...], device: torch.device) -> dict[str, Any]:
    """Every field a calibration of this engine depends on (the module docstring's list)."""
    parallel = parallel_config or ParallelConfig()
    return {"format": FORMAT_VERSION, **machine_fields(device), **software_fields(),
            **model_file_fields(model_path),
            "model_config": dataclasses.asdict(model_config),
            "cache_config": dataclasses.asdict(cache_config),
            "tensor_parallel": [parallel.tensor_parallel_size, parallel.nnodes],
            "linear_backend": linear_backend, "feature_layers": list(feature_layers)}


def cached_calibration(fields: Mapping[str, Any], measure: Callable[[], dict[int, float]]
                       ) -> dict[int, float]:
    """Seconds per calibrated size: from the cache file `fields` key, else `measure()` (then saved)."""
    path = calibration_path(fields)
    if os.environ.get(RECALIBRATE_ENV, "0") in ("", "0"):
        cached = _read(path, fields)
        if cached is not None:
            logger.info("step costs from the calibration cache %s (measured once on this machine "
                        "for this model and configuration; %s=1 measures again)", path,
                        RECALIBRATE_ENV)
            with contextlib.suppress(OSError):
                os.utime(path)  # NOTE: used now: the last to be evicted (_evict_least_recent)
            return cached
    logger.info("calibrating step costs (%d target passes; once for this machine, model and "
                "configuration)", 0 if not fields.get("sizes") else
                len(fields["sizes"]) * (fields.get("repeats", 0) + 1))
    start, cpu_start = time.perf_counter(), time.process_time()
    seconds = measure()
    wall = time.perf_counter() - start
    share = (time.process_time() - cpu_start) / max(wall * torch.get_num_threads(), 1e-9)
    if "gpu" not in fields and share < MIN_CPU_SHARE:
        logger.warning("calibrated step costs in %.1f s, but other processes had the cores (this "
                       "process got %.0f%% of its threads' time): not cached, the next start "
                       "measures again", wall, 100 * share)
        return seconds
    try:
        write_atomically(path, json.dumps({"fields": dict(fields), "measured_at": time.time(),
                                           "cpu_share": share,
                                           "seconds": {str(n): s for n, s in seconds.items()}},
                                          indent=1, sort_keys=True).encode())
        logger.info("calibrated step costs in %.1f s; cached in %s", wall, path)
        _evict_least_recent(os.path.dirname(path), MAX_CACHED_CALIBRATIONS)
    except OSError as error:
        logger.warning("cannot cache the calibrated step costs in %s (%s): measured again at "
                       "every start", path, error)
    return seconds


def calibration_path(fields: Mapping[str, Any]) -> str:
    key = hashlib.sha256(json.dumps(_canonical(fields), sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_root(), "calibration", f"v{FORMAT_VERSION}-{key}.json")


def _evict_least_recent(folder: str, keep: int) -> None:
    """Delete all but the `keep` most recently used calibration files of `folder`."""
    files = []
    for name in os.listdir(folder):
        if name.startswith("v") and name.endswith(".json"):
            with contextlib.suppress(OSError):  # NOTE: another process may evict it meanwhile
                files.append((os.stat(os.path.join(folder, name)).st_mtime, name))
    for _, name in sorted(files, reverse=True)[keep:]:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))


def _read(path: str, fields: Mapping[str, Any]) -> dict[int, float] | None:
    """The file's timings, if it is a whole file written for exactly `fields`; None otherwise."""
    try:
        with open(path, encoding="utf-8") as file:
            saved = json.load(file)
        if saved["fields"] != _canonical(fields):  # NOTE: a digest collision, or an edited file
            return None
        seconds = {int(n): float(s) for n, s in saved["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return seconds if seconds and all(s > 0 for s in seconds.values()) else None


def _canonical(fields: Mapping[str, Any]) -> Any:
    """`fields` as JSON reads it back (tuples become lists), so a saved key compares equal."""
    return json.loads(json.dumps(dict(fields), sort_keys=True))


def _cpu_description() -> str:
    """The CPU's model name and feature flags (Linux); the platform's processor string elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            lines = cpuinfo.read().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "cpu family", "model\t", "Features", "CPU part")
    found: dict[str, str] = {}
    for line in lines:
        for name in wanted:
            if line.startswith(name) and name not in found:
                found[name] = line.split(":", 1)[-1].strip()
    return " | ".join(f"{name.strip()}: {value}" for name, value in found.items())
