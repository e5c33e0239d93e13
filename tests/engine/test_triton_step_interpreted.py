"""The engine with `gpu_kernels="triton"` run on the CPU under TRITON_INTERPRET=1: the Triton paged
attention and fused per-layer ops in the real step, with prefill chunks, decode and verification
rows, keep the greedy tokens of the default path, with and without speculation."""

from __future__ import annotations

import importlib
import os

import pytest

from engine import LLM, SamplingParams

os.environ["TRITON_INTERPRET"] = "1"
interpreter = pytest.importorskip("triton.runtime.interpreter")
from kernels import fused_ops_triton, paged_attention_triton  # noqa: E402

# the GPU step's Triton kernels through the whole engine under the interpreter: the full suite's
pytestmark = pytest.mark.slow

if not isinstance(paged_attention_triton._paged_attention_kernel, interpreter.InterpretedFunction):
    importlib.reload(paged_attention_triton)
    importlib.reload(fused_ops_triton)

PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [1] + list(range(30, 50)) + list(range(30, 42)),
           [1, 11, 12, 13, 11, 12, 13, 11, 12]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.mark.parametrize("speculative_config", [None, NGRAM], ids=["plain", "ngram"])
def test_triton_kernels_keep_the_greedy_tokens(tiny_llama, speculative_config):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs, engines = {}, {}
    for kernels in ("torch", "triton"):
        # NOTE: chunks of 16 tokens: the 33-token prompt is prefilled in three chunks
        engines[kernels] = LLM(tiny_llama, dtype="float32", max_model_len=128, num_kv_blocks=64,
                               max_num_batched_tokens=16, gpu_kernels=kernels,
                               speculative_config=speculative_config)
        outs = engines[kernels].generate(prompts, params)
        outputs[kernels] = [o.outputs[0].token_ids for o in outs]
        if speculative_config is not None:
            assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0
    assert outputs["triton"] == outputs["torch"]
    assert "triton" in engines["triton"].engine.worker.linear_backend
    layer = engines["triton"].engine.worker.model.layers[0]
    assert layer.fused_ops is fused_ops_triton
