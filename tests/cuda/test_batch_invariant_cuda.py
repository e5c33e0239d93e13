"""Batch invariance on the GPU, in bfloat16 where it matters: the invariant matmul's rows and the
Triton attention's rows keep their bits whatever else is in the step, and the engine built with
batch_invariant gives the same greedy tokens with and without speculation, batched and alone."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.models.attention import build_attention_metadata

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def compiled(gpu_kernels):
    return gpu_kernels.batch_invariant_matmul, gpu_kernels.paged_attention_triton


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matmul_rows_keep_their_bits_in_any_batch(compiled, dtype):
    matmul, _ = compiled
    gen = torch.Generator(CUDA).manual_seed(0)
    x = torch.randn(300, 576, generator=gen, device=CUDA).to(dtype)
    weight = (torch.randn(1536, 576, generator=gen, device=CUDA) / 24).to(dtype)
    full = matmul.invariant_linear(x, weight)
    for m in (1, 3, 6, 24, 64, 65, 200):
        assert torch.equal(matmul.invariant_linear(x[:m], weight), full[:m]), m
    for row in (7, 150, 299):
        assert torch.equal(matmul.invariant_linear(x[row:row + 1], weight)[0], full[row])
    want = x.double() @ weight.double().T
    error = (full.double() - want).norm() / want.norm()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), float(error)


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_attention_rows_keep_their_bits_decoded_or_verified(compiled, sliding_window):
    """A row decoded alone (1 query row) and the same row verified among 6 (and beside a prefill
    chunk): bit for bit equal with batch_invariant, bfloat16."""
    _, attention = compiled
    gen = torch.Generator(CUDA).manual_seed(1)
    num_blocks, block_size, heads, kv_heads, head_dim = 64, 16, 9, 3, 64
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen,
                        device=CUDA).to(torch.bfloat16)
    table = list(range(40, 0, -1))  # shuffled blocks, read in place
    start, k = 300, 5  # verification rows at positions 300 .. 305
    rows = torch.randn(1 + k, heads, head_dim, generator=gen, device=CUDA).to(torch.bfloat16)
    prefill = torch.randn(37, heads, head_dim, generator=gen, device=CUDA).to(torch.bfloat16)

    def run(query_lens, seq_lens, tables, query):
        meta = build_attention_metadata(query_lens, seq_lens, tables, block_size, sliding_window,
                                        CUDA, "triton")
        kernel = meta.kernel
        return attention.paged_attention_triton(
            query, cache, kernel.block_tables, kernel.seq_lens, kernel.cu_num_query_tokens,
            meta.max_query_len, head_dim**-0.5, sliding_window, batch_invariant=True)

    verified = run([1 + k], [start + 1 + k], [table], rows)
    mixed = run([37, 1 + k], [37, start + 1 + k], [list(range(41, 44)), table],
                torch.cat([prefill, rows]))[37:]
    assert torch.equal(mixed, verified)
    for i in range(1 + k):
        decoded = run([1], [start + 1 + i], [table], rows[i:i + 1])
        assert torch.equal(decoded[0], verified[i]), i


PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [1] + list(range(30, 50)) + list(range(30, 42)),
           [1, 60], [1, 11, 12, 13, 11, 12, 13, 11, 12]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def test_bf16_greedy_speculation_equals_plain_decoding(compiled, tmp_path):
    checkpoint = build_tiny_checkpoint(tmp_path, "llama", seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = LLM(checkpoint, dtype="bfloat16", device="cuda", max_model_len=128, num_kv_blocks=64,
                batch_invariant=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    alone = [plain.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert alone == want
    for config in (NGRAM, {"method": "draft_model", "model": checkpoint,
                           "num_speculative_tokens": 3}):
        llm = LLM(checkpoint, dtype="bfloat16", device="cuda", max_model_len=128,
                  num_kv_blocks=64, batch_invariant=True, speculative_config=config)
        outs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == want, config["method"]
        assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0
        assert [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts] == want
