"""The engine on packed weights (the CPU default for GGUF and bf16/f16 checkpoints) gives the float32
engine's tokens and logprobs bit for bit, alone and batched, with and without speculation.

The tiny GGUF mixes every format gguf-py writes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16, F32 and
MXFP4, which is expanded), q/k/v of different formats in one layer, and a packed LM head: what packing changes is
where a weight's bits live, never the float each one stands for.
"""

from __future__ import annotations

import gguf
import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.cpu_linear import QuantizedEmbedding, QuantizedLinear, packed_weights_available
from kernels.packed_weight import PACKED_FORMATS
from tests.helpers.tiny_gguf import write_tiny_gguf

pytestmark = [
    pytest.mark.skipif(not packed_weights_available(),
                       reason="no C++ compiler with AVX2 and F16C for the packed kernel"),
    pytest.mark.promise("packed-kernel-exact"),
]

PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8, 40, 41, 42, 43, 44, 3, 3, 8], list(range(10, 40)),
           [90, 91, 92, 90, 91, 92, 90, 91]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("packed") / "tiny.gguf"
    write_tiny_gguf(path)
    return str(path)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(o.outputs[0].token_ids,
             [(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def expanded(tiny_gguf):
    return generate(LLM(tiny_gguf, dtype="float32", num_threads=2, max_model_len=128), PROMPTS)


def test_packed_model_holds_its_file_formats(tiny_gguf):
    llm = LLM(tiny_gguf, num_threads=2, max_model_len=128)
    model = llm.engine.worker.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    assert [p.format for p in qkv.parts] == ["F16", "Q8_0", "Q4_0"]  # stacked, not converted
    assert isinstance(model.layers[1].self_attn.qkv_proj, QuantizedLinear)
    assert not isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)  # MXFP4: expanded
    assert not isinstance(model.layers[1].mlp.gate_up_proj, QuantizedLinear)  # F32 gate: expanded
    # the packed bytes are the file's own (every row count here fills whole groups of 16), but for
    # the F16 up projection stacked with that F32 gate
    packed_in_file = sum(int(t.n_bytes) for t in gguf.GGUFReader(tiny_gguf).tensors
                         if t.tensor_type.name in PACKED_FORMATS and t.name != "blk.1.ffn_up.weight")
    assert llm.engine.worker.memory.packed_weight_bytes == packed_in_file


def test_packed_tokens_and_logprobs_equal_float32_alone_and_batched(tiny_gguf, expanded):
    packed = LLM(tiny_gguf, num_threads=2, max_model_len=128)
    assert generate(packed, PROMPTS) == expanded
    assert [generate(packed, [p])[0] for p in PROMPTS] == expanded


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculation_on_packed_weights_keeps_tokens(tiny_gguf, expanded, method):
    spec = LLM(tiny_gguf, num_threads=2, max_model_len=128,
               speculative_config={"method": method, "num_speculative_tokens": 4})
    outs = spec.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [tokens for tokens, _ in expanded]
    assert sum(o.spec_stats.num_draft_tokens for o in outs) > 0


def test_quantization_none_expands(tiny_gguf):
    llm = LLM(tiny_gguf, quantization="none", num_threads=2, max_model_len=128)
    model = llm.engine.worker.model
    assert not any(isinstance(m, QuantizedEmbedding) for m in model.modules())
    # float32 layers may sit in the kernel's float32 layout (the native pass runs them): not packed
    assert all(part.format == "F32" for m in model.modules() if isinstance(m, QuantizedLinear)
               for part in m.parts)
    assert llm.engine.worker.memory.packed_weight_bytes == 0


def test_bfloat16_safetensors_stay_bfloat16(tmp_path, tiny_llama):
    """A bf16 Hugging Face folder runs on its bf16 bytes, with the float32 engine's tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    packed = LLM(str(tmp_path), num_threads=2, max_model_len=128)
    qkv = packed.engine.worker.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.parts[0].format == "BF16"
    expanded = LLM(str(tmp_path), dtype="float32", num_threads=2, max_model_len=128)
    assert generate(packed, PROMPTS[:2]) == generate(expanded, PROMPTS[:2])
