"""The CPU kernels' build cache: a library is compiled once, then later processes load it directly
(no compiler needed); a named baseline (SPECSERVE_CPU_ARCH, what the Docker image builds) is keyed
without the CPU's flags and loads from a read-only prebuilt folder; a CPU that lacks the baseline's
features builds for itself; a first build says what it does and that it happens once."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

import kernels.cpu_extension as cpu_extension

# the smallest library that registers an op, so one real compile stays short
TINY_SOURCE = """#include <torch/library.h>

int64_t cache_test_answer() { return 42; }

TORCH_LIBRARY_FRAGMENT(specserve, m) { m.def("cache_test_answer() -> int", &cache_test_answer); }
"""
NAME = "cache_test_answer"
BASELINE = "x86-64-v3"
ZEN3_FLAGS = (b"flags\t\t: fpu sse2 ssse3 cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c fma "
              b"bmi1 avx2 bmi2 abm lahf_lm\n")


def has_compiler() -> bool:
    return cpu_extension.shutil.which(os.environ.get("CXX", "c++")) is not None


def load_in_a_new_process(source_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """load_cpu_library(NAME) in a fresh interpreter (nothing loaded or cached in memory yet)."""
    code = (f"import pathlib, torch, kernels.cpu_extension as c\n"
            f"c.SOURCE_DIR = pathlib.Path({str(source_dir)!r})\n"
            f"assert c.load_cpu_library({NAME!r})\n"
            f"print(torch.ops.specserve.{NAME}())\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


@pytest.fixture(scope="module")
def built_baseline(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny library compiled once for BASELINE: (its source folder, the cache it went to)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the named baseline is an x86-64 level")
    if not has_compiler():
        pytest.skip("no C++ compiler here (CI installs one)")
    root = tmp_path_factory.mktemp("kernel_cache")
    (root / "src").mkdir()
    (root / "src" / f"{NAME}.cpp").write_text(TINY_SOURCE)
    result = load_in_a_new_process(root / "src", {"SPECSERVE_CACHE_DIR": str(root / "cache"),
                                                  cpu_extension.CPU_ARCH_ENV: BASELINE})
    if cpu_extension.missing_cpu_features(BASELINE):
        pytest.skip(f"this CPU cannot run {BASELINE} code")
    assert result.returncode == 0 and result.stdout.strip() == "42", result.stderr
    assert "happens once" not in result.stderr  # NOTE: only build_cpu_libraries announces it
    return root / "src", root / "cache"


def test_a_built_library_loads_without_a_compiler(built_baseline):
    source_dir, cache = built_baseline
    result = load_in_a_new_process(source_dir, {
        "SPECSERVE_CACHE_DIR": str(cache), cpu_extension.CPU_ARCH_ENV: BASELINE,
        "CXX": "/nonexistent/c++", "SPECSERVE_REQUIRE_CPU_KERNELS": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "42", result.stderr
    assert "compiled" not in result.stderr


def test_a_prebuilt_folder_is_read_before_an_empty_cache(built_baseline, tmp_path):
    source_dir, cache = built_baseline
    result = load_in_a_new_process(source_dir, {
        "SPECSERVE_CACHE_DIR": str(tmp_path / "empty"), cpu_extension.CPU_ARCH_ENV: BASELINE,
        cpu_extension.PREBUILT_ENV: str(cache / "cpu_kernels"),
        "CXX": "/nonexistent/c++", "SPECSERVE_REQUIRE_CPU_KERNELS": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "42", result.stderr
    assert not (tmp_path / "empty").exists()  # nothing built, nothing written


def test_a_library_without_its_ready_marker_is_not_trusted(built_baseline, tmp_path):
    """A build cut short (no marker) goes back to the builder, which needs the compiler."""
    source_dir, cache = built_baseline
    [folder] = (cache / "cpu_kernels").glob(f"{NAME}-*")
    copy = tmp_path / "cpu_kernels" / folder.name
    copy.mkdir(parents=True)
    (copy / f"specserve_{NAME}.so").write_bytes((folder / f"specserve_{NAME}.so").read_bytes())
    result = load_in_a_new_process(source_dir, {
        cpu_extension.CPU_ARCH_ENV: BASELINE, cpu_extension.PREBUILT_ENV: str(tmp_path / "cpu_kernels"),
        "SPECSERVE_CACHE_DIR": str(tmp_path / "cache"), "CXX": "/nonexistent/c++",
        "SPECSERVE_REQUIRE_CPU_KERNELS": "1"})
    assert result.returncode != 0 and "no C++ compiler" in result.stderr


def test_a_baseline_is_keyed_without_the_cpu_flags_and_native_with_them(monkeypatch):
    monkeypatch.setattr(cpu_extension, "_cpu_features", lambda: ZEN3_FLAGS)
    baseline, native = (cpu_extension.build_folder_name("decoder_ops", arch)
                        for arch in (BASELINE, "native"))
    monkeypatch.setattr(cpu_extension, "_cpu_features", lambda: ZEN3_FLAGS.strip() + b" avx512f\n")
    assert cpu_extension.build_folder_name("decoder_ops", BASELINE) == baseline
    assert cpu_extension.build_folder_name("decoder_ops", "native") != native
    assert baseline != native


def test_a_shared_header_keys_every_library(monkeypatch, tmp_path):
    """entry_points.h and decoder_math.h are compiled into several libraries: editing one must
    rebuild them all, not load a library built from the old header."""
    for source in cpu_extension.SOURCE_DIR.iterdir():
        (tmp_path / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(cpu_extension, "SOURCE_DIR", tmp_path)
    before = {name: cpu_extension.build_folder_name(name, BASELINE)
              for name in ("decoder_ops", "native_decoder")}
    header = tmp_path / "decoder_math.h"
    header.write_text(header.read_text() + "\n// edited\n")
    assert all(cpu_extension.build_folder_name(name, BASELINE) != key
               for name, key in before.items())


def test_a_cpu_without_the_baselines_features_builds_for_itself(monkeypatch):
    monkeypatch.setenv(cpu_extension.CPU_ARCH_ENV, BASELINE)
    monkeypatch.setattr(cpu_extension, "_cpu_features", lambda: ZEN3_FLAGS)
    assert cpu_extension.missing_cpu_features(BASELINE) == []
    assert cpu_extension._build_plan("decoder_ops")[0] == BASELINE
    monkeypatch.setattr(cpu_extension, "_cpu_features", lambda: b"flags\t\t: fpu sse2 avx\n")
    assert "avx2" in cpu_extension.missing_cpu_features(BASELINE)
    assert cpu_extension._build_plan("decoder_ops")[0] == "native"
    monkeypatch.delenv(cpu_extension.CPU_ARCH_ENV)
    assert cpu_extension.cpu_arch() == "native"


def test_a_first_build_says_it_happens_once(monkeypatch, tmp_path, caplog):
    if not has_compiler():
        pytest.skip("no C++ compiler here (CI installs one)")
    # NOTE: a source the compiler rejects at its first line: the build fails at once, announced
    (tmp_path / "announced_kernel.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(cpu_extension, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECSERVE_REQUIRE_CPU_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_extension"):
        assert cpu_extension.build_cpu_libraries(["announced_kernel"]) == {"announced_kernel": False}
    messages = [record.getMessage() for record in caplog.records]
    assert any("compiling specserve's CPU kernels" in m and "happens once" in m for m in messages)
    assert "CPU kernels: 0 of 1 built" in messages[-1]


def test_without_a_compiler_nothing_is_announced(monkeypatch, tmp_path, caplog):
    (tmp_path / "unbuildable_kernel.cpp").write_text("// any source\n")
    monkeypatch.setattr(cpu_extension, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECSERVE_REQUIRE_CPU_KERNELS", raising=False)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with caplog.at_level(logging.WARNING, logger="kernels.cpu_extension"):
        assert cpu_extension.build_cpu_libraries(["unbuildable_kernel"]) == {
            "unbuildable_kernel": False}
    [message] = [record.getMessage() for record in caplog.records]
    assert "no C++ compiler" in message  # the fallback's own warning, no promise of a build


def test_a_first_build_starts_the_longest_compile_first(monkeypatch):
    """Two at a time, the longest first: the last to start is short, and both cores stay busy."""
    started = []
    monkeypatch.setattr(cpu_extension, "cpu_kernels_enabled", lambda: True)
    monkeypatch.setattr(cpu_extension, "_is_ready", lambda name: False)
    monkeypatch.setattr(cpu_extension, "_build_plan", lambda name: ("native", []))
    monkeypatch.setattr(cpu_extension.shutil, "which", lambda name: "/usr/bin/c++")
    monkeypatch.setattr(cpu_extension.os, "cpu_count", lambda: 1)  # one at a time: a fixed order
    monkeypatch.setattr(cpu_extension, "load_cpu_library",
                        lambda name: started.append(name) or True)
    names = ["decoder_ops", "skinny_gemm", "paged_attention", "quantized_gemm", "new_kernel"]
    assert all(cpu_extension.build_cpu_libraries(names).values())
    assert started[:5] == ["quantized_gemm", "paged_attention", "decoder_ops", "skinny_gemm",
                           "new_kernel"]


@pytest.mark.parametrize("engine_args, expected", [
    ({}, list(cpu_extension.PACKED_MODEL_KERNELS)),  # the default: a GGUF kept packed
    ({"dtype": "float32"}, None),  # expanded: float32 linears, every kernel
])
def test_a_packed_model_builds_no_float32_matmul_upfront(monkeypatch, engine_args, expected):
    import engine.runner.worker as worker
    from engine.config import CacheConfig, ModelConfig

    asked = []
    monkeypatch.setattr(worker, "build_cpu_libraries", lambda names=None: asked.append(names))
    worker.Worker(ModelConfig(max_model_len=64, **engine_args), CacheConfig(num_blocks=8))
    assert asked == [expected]
