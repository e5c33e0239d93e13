"""CUDA graphs on a GPU (engine/runner/cuda_graphs.py, `--gpu-kernels triton`): the engine captures
its decode and verification steps at start-up, replays them, and keeps the greedy tokens of
enforce_eager (float32, TF32 off), with and without speculation, over batches that shrink as
requests end (so steps move between buckets); a replayed padded step gives the eager rows."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.step.types import SequenceRows

PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [1] + list(range(30, 50)) + list(range(30, 42)),
           [1, 11, 12, 13, 11, 12, 13, 11, 12], [1, 3, 4], list(range(2, 60)),
           [1, 7, 7, 7, 7, 7, 7]]
# different lengths: the batch shrinks from 6 sequences to 1 as they end
MAX_TOKENS = [40, 24, 33, 8, 17, 29]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def kernels_on_gpu(gpu_kernels):
    return gpu_kernels.paged_attention_triton, gpu_kernels.fused_ops_triton


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def cuda_llm(checkpoint, **kwargs) -> LLM:
    return LLM(checkpoint, dtype="float32", device="cuda", max_model_len=128, num_kv_blocks=96,
               max_num_seqs=8, gpu_kernels="triton", **kwargs)


@pytest.mark.parametrize("speculative_config", [None, NGRAM], ids=["plain", "ngram"])
def test_graphs_keep_the_eager_greedy_tokens(kernels_on_gpu, no_tf32, tmp_path,
                                             speculative_config):
    checkpoint = build_tiny_checkpoint(tmp_path, "llama", seed=5)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = {}
    for enforce_eager in (True, False):
        llm = cuda_llm(checkpoint, speculative_config=speculative_config,
                       enforce_eager=enforce_eager)
        graphs = llm.engine.worker.step_graphs
        if enforce_eager:
            assert graphs is None
        else:
            assert graphs is not None, "nothing captured: see the log's 'CUDA graph' line"
            # captured at start-up: 1, 2, 4, 8 sequences x (1 row, and 1 + k rows when speculating)
            assert len(graphs.captured) == (8 if speculative_config else 4)
            assert all(c.graph is not None for c in graphs.captured.values())
            assert graphs.capture_seconds > 0 and graphs.num_replays == 0
        outs = llm.generate(prompts, params)
        outputs[enforce_eager] = [o.outputs[0].token_ids for o in outs]
        if not enforce_eager:
            assert graphs.num_replays >= 10, graphs.num_replays
        if speculative_config is not None:
            assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0
        del llm
    assert outputs[False] == outputs[True]


@torch.inference_mode()
def test_replayed_steps_give_the_eager_rows(kernels_on_gpu, no_tf32, tmp_path):
    """Two different padded verification steps in the same bucket, back to back: each replay
    reads its own inputs (no stale metadata) and gives the eager step's rows."""
    llm = cuda_llm(build_tiny_checkpoint(tmp_path, "llama", seed=5), speculative_config=NGRAM)
    worker = llm.engine.worker
    assert worker.step_graphs is not None, "nothing captured: see the log's 'CUDA graph' line"
    blocks = worker.block_manager
    for cache in worker.kv_caches:
        cache.normal_()
    for batch in ([("a", 20, 5), ("b", 9, 1), ("c", 31, 3)],
                  [("d", 40, 2), ("e", 3, 5), ("f", 70, 1)]):
        for seq_id, start, num_rows in batch:
            blocks.allocate(seq_id, start + num_rows)
        sequences = [SequenceRows(s, start, [(5 * start + i) % 90 + 3 for i in range(n)])
                     for s, start, n in batch]
        # NOTE: both paths write the same K/V into the same slots, so the order does not matter
        replays = worker.step_graphs.num_replays
        static = worker.step_graphs.run(sequences)
        assert worker.step_graphs.num_replays == replays + 1
        eager = worker.runner.run(worker.runner.prepare(sequences))
        torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(worker.runner.logits(static).argmax(-1),
                           worker.runner.logits(eager).argmax(-1))
        for seq_id, _, _ in batch:
            blocks.free(seq_id)
