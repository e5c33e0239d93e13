"""The kernel's layout of packed weights, cached beside the GGUF's metadata: a second load lays
nothing out and gives the first load's tokens bit for bit; two files that share a header (so a
cache folder) but not their weights never share a layout; a damaged cache file is laid out anew."""

from __future__ import annotations

import glob
import os

import pytest

import engine.models.kernel_layout_cache as kernel_layout_cache
from engine import LLM, SamplingParams
from engine.models.cpu_linear import packed_weights_available
from engine.models.gguf_cache import metadata_cache_dir
from tests.helpers.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not packed_weights_available(),
                                reason="no C++ compiler with AVX2 and F16C for the packed kernel")

PROMPTS = [{"prompt_token_ids": p} for p in ([1, 5, 9, 2, 7], list(range(10, 30)))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


def run(path: str) -> list:
    llm = LLM(path, num_threads=2, max_model_len=64)
    outs = llm.generate(PROMPTS, GREEDY)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Layouts done afresh, counted; the cache in a folder of this test's own."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    original = kernel_layout_cache.pack_for_kernel
    monkeypatch.setattr(kernel_layout_cache, "pack_for_kernel",
                        lambda weight: calls.append(1) or original(weight))
    return calls


def layout_files(tmp_path) -> list[str]:
    return glob.glob(str(tmp_path / "cache" / "**" / "kernel-layout-*.safetensors"),
                     recursive=True)


def test_a_second_load_reads_the_layout(tmp_path, counted):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, seed=0)
    first = run(path)
    laid_out = len(counted)
    assert laid_out > 0 and len(layout_files(tmp_path)) == 1
    assert run(path) == first
    assert len(counted) == laid_out  # nothing laid out the second time


def test_files_that_share_a_header_do_not_share_a_layout(tmp_path, counted):
    a, b = str(tmp_path / "a" / "tiny.gguf"), str(tmp_path / "b" / "tiny.gguf")
    os.makedirs(os.path.dirname(a))
    os.makedirs(os.path.dirname(b))
    write_tiny_gguf(a, seed=0)
    write_tiny_gguf(b, seed=1)  # same names, types and shapes: the same metadata folder
    assert metadata_cache_dir(a) == metadata_cache_dir(b)
    from_a = run(a)
    from_b = run(b)
    assert from_a != from_b
    os.environ.pop("SPECSERVE_CACHE_DIR")  # the same answers without any cache
    assert run(b) == from_b


def test_a_damaged_layout_file_is_laid_out_anew(tmp_path, counted):
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, seed=0)
    first = run(path)
    [layout] = layout_files(tmp_path)
    with open(layout, "r+b") as file:
        file.write(b"\xff" * 64)
    before = len(counted)
    assert run(path) == first
    assert len(counted) > before
