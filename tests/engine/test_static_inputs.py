"""The static-buffer step layout (what a CUDA graph replays), run on the CPU with the Triton attention
under TRITON_INTERPRET=1: padded steps give the real rows the eager step's hidden states, padding
writes K/V only to the scratch slot, and a greedy decode loop over reused buffers keeps the tokens of
the torch reference path."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from engine.models.attention import build_attention_metadata
from engine.models.build import allocate_kv_cache, build_model
from engine.models.loader import load_checkpoint
from engine.runner.static_inputs import StaticStepInputs, StepBucket, seq_buckets
from tests.helpers.tiny_models import build_tiny_checkpoint

os.environ["TRITON_INTERPRET"] = "1"
interpreter = pytest.importorskip("triton.runtime.interpreter")
from kernels import paged_attention_triton  # noqa: E402

if not isinstance(paged_attention_triton._paged_attention_kernel, interpreter.InterpretedFunction):
    importlib.reload(paged_attention_triton)

CPU = torch.device("cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 40
PADDING_BLOCK = NUM_BLOCKS  # the spare block past the pool


def test_seq_buckets():
    assert seq_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert seq_buckets(1) == [1]
    assert seq_buckets(12) == [1, 2, 4, 8, 12]


def test_bucket_for():
    inputs = StaticStepInputs(12, [1, 9], 8, 0, None, CPU)
    assert inputs.bucket_for([1, 1, 1]) == StepBucket(4, 1)
    assert inputs.bucket_for([1, 3, 9]) == StepBucket(4, 9)
    assert inputs.bucket_for([1] * 9) == StepBucket(12, 1)
    assert inputs.bucket_for([10]) is None  # a prefill chunk runs eagerly
    assert inputs.bucket_for([1] * 13) is None  # more sequences than the largest bucket
    assert StepBucket(4, 9).num_tokens == 36


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_attention_heads=6,
                                 num_key_value_heads=2, hidden_size=96)
    built, _ = build_model(load_checkpoint(path, torch.float32), torch.float32, CPU)
    return built


def prefill(model, prompts, tables):
    """Prompts into a fresh cache through the torch reference path; their next greedy tokens."""
    caches = allocate_kv_cache(model.arch, NUM_BLOCKS + 1, BLOCK_SIZE, torch.float32, CPU)
    lens = [len(p) for p in prompts]
    meta = build_attention_metadata(lens, lens, tables, BLOCK_SIZE, None, CPU)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    hidden = model(ids, positions, meta, caches)
    last = torch.tensor(lens).cumsum(0) - 1
    return caches, model.compute_logits(hidden[last]).argmax(-1).tolist()


PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 9, 22, 30]]
TABLES = [[7, 2, 9, 30, 31], [1, 12, 5, 6, 32], [20, 3, 14, 15, 33]]


@torch.inference_mode()
def test_a_padded_verification_step_gives_the_eager_rows(model):
    caches, next_tokens = prefill(model, PROMPTS, TABLES)
    for cache in caches:  # NOTE: a sentinel: padding rows' K/V may be 0 (token 0's embedding)
        cache[:, :, PADDING_BLOCK] = 7.0
    # each sequence verifies a different number of drafts: 1 + k rows of 3, 1 and 2
    rows = [[next_tokens[0], 40, 41], [next_tokens[1]], [next_tokens[2], 50]]
    query_lens = [len(r) for r in rows]
    seq_lens = [len(p) + len(r) for p, r in zip(PROMPTS, rows)]
    ids = [t for r in rows for t in r]
    positions = [p for prompt, r in zip(PROMPTS, rows) for p in range(len(prompt), len(prompt) + len(r))]
    eager_caches = [c.clone() for c in caches]
    meta = build_attention_metadata(query_lens, seq_lens, TABLES, BLOCK_SIZE, None, CPU, "triton")
    eager = model(torch.tensor(ids), torch.tensor(positions), meta, eager_caches)

    inputs = StaticStepInputs(8, [1, 4], 6, PADDING_BLOCK * BLOCK_SIZE, None, CPU)
    bucket = inputs.bucket_for(query_lens)
    assert bucket == StepBucket(4, 4)
    step = inputs.load(bucket, ids, positions, query_lens, seq_lens, TABLES, BLOCK_SIZE)
    assert step.input_ids.shape == (16,) and step.num_real_tokens == 6
    padded = model(step.input_ids, step.positions, step.attn_metadata, caches)

    torch.testing.assert_close(padded[:6], eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.compute_logits(padded[:6]).argmax(-1),
                       model.compute_logits(eager).argmax(-1))
    for static_cache, eager_cache in zip(caches, eager_caches):
        # every real block holds the same K/V; the padding rows wrote into the spare block alone
        torch.testing.assert_close(static_cache[:, :, :NUM_BLOCKS], eager_cache[:, :, :NUM_BLOCKS],
                                   rtol=1e-5, atol=1e-5)
        assert (eager_cache[:, :, PADDING_BLOCK] == 7.0).all()
        assert (static_cache[:, :, PADDING_BLOCK, 0] != 7.0).all()  # the padding slot
        assert (static_cache[:, :, PADDING_BLOCK, 1:] == 7.0).all()


@torch.inference_mode()
def test_a_greedy_decode_loop_over_reused_buffers_keeps_the_reference_tokens(model):
    """Ten decode steps of three sequences (bucket 4 x 1) through one StaticStepInputs, against the
    same steps through the torch reference path."""
    inputs = StaticStepInputs(4, [1], 6, PADDING_BLOCK * BLOCK_SIZE, None, CPU)
    results = {}
    for path in ("reference", "static"):
        caches, tokens = prefill(model, PROMPTS, TABLES)
        lens = [len(p) for p in PROMPTS]
        generated = [[t] for t in tokens]
        for _ in range(10):
            ids = [g[-1] for g in generated]
            positions = lens[:]
            lens = [n + 1 for n in lens]
            if path == "reference":
                meta = build_attention_metadata([1, 1, 1], lens, TABLES, BLOCK_SIZE, None, CPU)
                hidden = model(torch.tensor(ids), torch.tensor(positions), meta, caches)
            else:
                step = inputs.load(inputs.bucket_for([1, 1, 1]), ids, positions, [1, 1, 1], lens,
                                   TABLES, BLOCK_SIZE)
                hidden = model(step.input_ids, step.positions, step.attn_metadata, caches)[:3]
            for g, token in zip(generated, model.compute_logits(hidden).argmax(-1).tolist()):
                g.append(token)
        results[path] = generated
    assert results["static"] == results["reference"]
    assert len({tuple(g) for g in results["reference"]}) == 3


def test_a_step_that_does_not_fit_its_bucket_is_refused():
    inputs = StaticStepInputs(4, [1, 3], 2, 0, None, CPU)
    with pytest.raises(ValueError, match="does not fit"):
        inputs.load(StepBucket(1, 1), [1, 2], [0, 0], [1, 1], [1, 1], [[0], [1]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="does not fit"):
        inputs.load(StepBucket(1, 3), [1], [8], [1], [9], [[0, 1, 2]], BLOCK_SIZE)
