"""The compiled Triton rejection sampler on a GPU: bit-exact agreement with the torch reference given
the same random numbers, at serving sizes, and the statistical losslessness suite run through it."""

from __future__ import annotations

import pytest
import torch
from rejection_stats import CASES, NUM_ROWS, DistCase, assert_follows_target, draw_chains

import kernels
from kernels.bench_rejection import random_inputs
from kernels.rejection_reference import rejection_sample as reference

SERVING_SIZES = [([5] * 8, 49152), ([3, 0, 5, 1, 2, 4, 0, 5], 32000), ([4] * 64, 128256),
                 ([8, 1, 0, 8] * 8, 152064), ([1] * 256, 1000)]


@pytest.mark.parametrize("greedy_fraction", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
@pytest.mark.parametrize("sizes", SERVING_SIZES, ids=lambda s: f"b{len(s[0])}-v{s[1]}")
def test_matches_reference_on_cuda(compiled_triton, sizes, has_draft_probs, greedy_fraction):
    num_drafts, vocab_size = sizes
    args = random_inputs(num_drafts, vocab_size, has_draft_probs=has_draft_probs,
                         greedy_fraction=greedy_fraction, seed=len(num_drafts), device="cuda")
    got = compiled_triton.rejection_sample(**args)
    assert got.is_cuda
    assert torch.equal(got, reference(**args))  # the reference, on the same CUDA tensors
    on_cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    assert torch.equal(got.cpu(), reference(**on_cpu))


def test_dispatch_picks_triton_for_cuda_tensors(compiled_triton, monkeypatch):
    calls = []
    original = compiled_triton.rejection_sample
    monkeypatch.setattr(compiled_triton, "rejection_sample",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    args = random_inputs([2, 3], 100, has_draft_probs=True, greedy_fraction=0.5, seed=0, device="cuda")
    assert torch.equal(kernels.rejection_sample(**args), reference(**args))
    assert calls == [1]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_output_distribution_equals_target_on_cuda(compiled_triton, case: DistCase, k: int):
    args, target_table = draw_chains(case, k, NUM_ROWS * 5, seed=k)  # the seeds the CPU suite uses
    args = {key: v.cuda() if isinstance(v, torch.Tensor) else v for key, v in args.items()}
    output = compiled_triton.rejection_sample(**args).cpu()
    assert 0.02 < (output[:, 1] >= 0).float().mean() < 0.98
    assert_follows_target(output, target_table)
