"""The GPU step's Triton kernels on a GPU (`--gpu-kernels triton`): the paged attention and the fused
per-layer ops agree with the torch reference compiled, not interpreted; the engine keeps greedy tokens
with them (float32) with and without speculation; a padded static step gives the eager rows."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.models.attention import build_attention_metadata, torch_paged_attention
from engine.models.llama import apply_rotary


@pytest.fixture(scope="module")
def kernels_on_gpu(gpu_kernels):
    return gpu_kernels.paged_attention_triton, gpu_kernels.fused_ops_triton


def step(query_lens, seq_lens, dtype, heads=32, kv_heads=8, head_dim=128, block_size=16):
    rng = random.Random(0)
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    gen = torch.Generator("cuda").manual_seed(0)
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen,
                        device="cuda").to(dtype)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen, device="cuda").to(dtype)
    return query, cache, tables


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("sliding_window", [None, 100])
@pytest.mark.parametrize("query_lens, seq_lens", [([1] * 16, [100 + 37 * i for i in range(16)]),
                                                  ([5, 9, 1, 1], [300, 9, 2000, 17]),
                                                  ([512, 1, 5], [700, 40, 1000])],
                         ids=["decode", "verify", "mixed"])
def test_attention_matches_torch_on_cuda(kernels_on_gpu, query_lens, seq_lens, sliding_window,
                                         dtype, atol):
    attention, _ = kernels_on_gpu
    query, cache, tables = step(query_lens, seq_lens, dtype)
    meta = build_attention_metadata(query_lens, seq_lens, tables, 16, sliding_window,
                                    torch.device("cuda"), "triton")
    kernel = meta.kernel
    out = attention.paged_attention_triton(query, cache, kernel.block_tables, kernel.seq_lens,
                                           kernel.cu_num_query_tokens, meta.max_query_len,
                                           128**-0.5, sliding_window)
    reference_meta = build_attention_metadata(query_lens, seq_lens, tables, 16, sliding_window,
                                              torch.device("cuda"))
    expected = torch_paged_attention(query.double(), cache.double(), reference_meta, 128**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_match_the_torch_ops_on_cuda(kernels_on_gpu, dtype):
    _, fused = kernels_on_gpu
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(37, 4096, generator=gen, device="cuda").to(dtype)
    delta = torch.randn(37, 4096, generator=gen, device="cuda").to(dtype)
    weight = torch.rand(4096, generator=gen, device="cuda").to(dtype) + 0.5

    def rms_norm(v):
        vf = v.float()
        return weight * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), rms_norm(x), **tolerance)
    total, normed = fused.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, rms_norm(x + delta), **tolerance)
    gate_up = torch.randn(37, 2 * 14336, generator=gen, device="cuda").to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up,
                               **tolerance)
    qkv = torch.randn(37, (32 + 16) * 128, generator=gen, device="cuda").to(dtype)
    angles = torch.rand(37, 64, generator=gen, device="cuda") * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = qkv.clone().view(37, 48, 128)
    expected[:, :40] = apply_rotary(expected[:, :40], cos[:, None], sin[:, None])
    fused.rotary_(qkv, cos, sin, 40, 128)
    torch.testing.assert_close(qkv.view(37, 48, 128), expected, **tolerance)


PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [1] + list(range(30, 50)) + list(range(30, 42)),
           [1, 11, 12, 13, 11, 12, 13, 11, 12]]


@pytest.mark.parametrize("speculative_config", [None, {"method": "ngram", "num_speculative_tokens": 4,
                                                       "prompt_lookup_min": 1,
                                                       "prompt_lookup_max": 3}],
                         ids=["plain", "ngram"])
def test_engine_with_triton_kernels_keeps_the_greedy_tokens(kernels_on_gpu, tmp_path,
                                                            speculative_config):
    torch.backends.cuda.matmul.allow_tf32 = False
    checkpoint = build_tiny_checkpoint(tmp_path, "llama", seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = {}
    for kernels in ("torch", "triton"):
        llm = LLM(checkpoint, dtype="float32", device="cuda", max_model_len=128, num_kv_blocks=64,
                  gpu_kernels=kernels, speculative_config=speculative_config)
        outputs[kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
