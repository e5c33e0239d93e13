"""SPECSERVE_REQUIRE_CPU_KERNELS (set by .ci/run): a CPU kernel that cannot be built is an error, so
the kernel tests fail instead of skipping on a machine without a compiler; unset, the engine falls back
to torch's ops as before."""

from __future__ import annotations

import os

import pytest

from kernels.cpu_extension import CpuKernelUnavailable, load_cpu_library
from kernels.paged_attention_cpu import paged_attention_cpu_available


def test_no_compiler_is_an_error_when_the_kernels_are_required(monkeypatch):
    # NOTE: a source name of its own: load_cpu_library caches its answer per name
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.delenv("SPECSERVE_REQUIRE_CPU_KERNELS", raising=False)
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "1")
    assert load_cpu_library("required_test_fallback") is False
    monkeypatch.setenv("SPECSERVE_REQUIRE_CPU_KERNELS", "1")
    with pytest.raises(CpuKernelUnavailable, match="no C.. compiler"):
        load_cpu_library("required_test_missing")


def test_a_failed_build_is_an_error_when_the_kernels_are_required(monkeypatch, tmp_path):
    import kernels.cpu_extension as cpu_extension

    if cpu_extension.shutil.which(os.environ.get("CXX", "c++")) is None \
            and not cpu_extension.cpu_kernels_required():
        pytest.skip("no C++ compiler here (CI installs one and sets SPECSERVE_REQUIRE_CPU_KERNELS)")
    (tmp_path / "broken_kernel.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(cpu_extension, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECSERVE_REQUIRE_CPU_KERNELS", "1")
    with pytest.raises(CpuKernelUnavailable, match="failed to build"):
        load_cpu_library("broken_kernel")


@pytest.mark.skipif(not os.environ.get("SPECSERVE_REQUIRE_CPU_KERNELS"),
                    reason="only where the kernels are required (CI)")
def test_the_kernels_are_built_where_required():
    assert paged_attention_cpu_available()
