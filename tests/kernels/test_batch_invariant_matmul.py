"""The batch-invariant matmul under TRITON_INTERPRET=1: F.linear's values (float32, IEEE products),
a row's bits the same alone, in a short batch and in a long one, bias and ragged shapes, and the
engine built with batch_invariant: every linear swapped, the attention told, the config implying the
Triton kernels. On a GPU, in bfloat16: tests/cuda/test_batch_invariant_cuda.py."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from torch import nn

os.environ["TRITON_INTERPRET"] = "1"
interpreter = pytest.importorskip("triton.runtime.interpreter")
from kernels import batch_invariant_matmul  # noqa: E402

if not isinstance(batch_invariant_matmul._invariant_matmul_kernel, interpreter.InterpretedFunction):
    batch_invariant_matmul = importlib.reload(batch_invariant_matmul)


@pytest.mark.parametrize("m, k, n, bias", [(1, 64, 64, False), (5, 100, 70, True),
                                           (70, 130, 9, True), (0, 64, 64, False)])
def test_matches_f_linear(m, k, n, bias):
    gen = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    got = batch_invariant_matmul.invariant_linear(x, weight, b)
    assert got.shape == (m, n) and got.dtype == x.dtype
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5,
                               atol=1e-5)


def test_a_rows_bits_do_not_depend_on_its_batch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 200, generator=gen)  # two M tiles, a ragged K tile
    weight = torch.randn(90, 200, generator=gen)
    batch = batch_invariant_matmul.invariant_linear(x, weight)
    for row in (0, 5, 63, 64, 69):
        alone = batch_invariant_matmul.invariant_linear(x[row:row + 1], weight)
        assert torch.equal(alone[0], batch[row])
    short = batch_invariant_matmul.invariant_linear(x[:6], weight)
    assert torch.equal(short, batch[:6])


def test_leading_dimensions_and_a_mismatched_dtype():
    x = torch.randn(2, 3, 64)
    weight = torch.randn(8, 64)
    out = batch_invariant_matmul.invariant_linear(x, weight)
    assert out.shape == (2, 3, 8)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="dtype|float64"):
        batch_invariant_matmul.invariant_linear(x.double(), weight)


def test_the_engine_swaps_every_linear_and_keeps_the_greedy_tokens(tiny_llama):
    """batch_invariant implies the Triton kernels; every nn.Linear of the target becomes
    invariant and every attention runs at one tile shape; greedy tokens equal the default path's
    (float32), plain and with speculation, batched and alone."""
    from engine import LLM, SamplingParams
    from engine.config import ModelConfig
    from engine.models.batch_invariant import BatchInvariantLinear
    from engine.models.llama import Attention

    cpu = torch.device("cpu")
    assert ModelConfig(batch_invariant=True).resolved_gpu_kernels(cpu, torch.float32) == "triton"
    assert ModelConfig().resolved_gpu_kernels(cpu, torch.float32) == "torch"
    cuda = torch.device("cuda")
    assert ModelConfig().resolved_gpu_kernels(cuda, torch.float64) == "torch"
    assert ModelConfig().resolved_batch_invariant("triton", cuda, torch.bfloat16)
    assert not ModelConfig().resolved_batch_invariant("triton", cuda, torch.float32)
    assert not ModelConfig(batch_invariant=False).resolved_batch_invariant(
        "triton", cuda, torch.bfloat16)
    assert not ModelConfig().resolved_batch_invariant("torch", cpu, torch.float32)
    with pytest.raises(ValueError, match="needs the Triton kernels"):
        ModelConfig(batch_invariant=True, gpu_kernels="torch")
    prompts = [{"prompt_token_ids": p} for p in (
        [1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [1] + list(range(30, 50)) + list(range(30, 42)),
        [1, 11, 12, 13, 11, 12, 13, 11, 12])]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 3}
    default = LLM(tiny_llama, dtype="float32", max_model_len=128, num_kv_blocks=64)
    want = [o.outputs[0].token_ids for o in default.generate(prompts, params)]
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128, num_kv_blocks=64,
              batch_invariant=True, speculative_config=ngram)
    model = llm.engine.worker.model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is BatchInvariantLinear for m in linears)
    assert all(m.batch_invariant for m in model.modules() if isinstance(m, Attention))
    assert "batch-invariant" in llm.engine.worker.linear_backend
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0
    assert llm.generate(prompts[1], params)[0].outputs[0].token_ids == want[1]



def test_batch_invariant_without_a_gpu_is_a_clear_error(monkeypatch):
    """device auto on a machine with no GPU: refused when the config is built, naming the flag."""
    from engine.config import ModelConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("auto", "cpu"):
        with pytest.raises(ValueError, match="--batch-invariant.*CUDA"):
            ModelConfig(batch_invariant=True, device=device)
