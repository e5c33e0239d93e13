"""Bad engine settings and bad requests fail at once with a message that says what was expected."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(tiny_llama, dtype="float64", max_model_len=64, num_kv_blocks=16)


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "int8"}, "dtype must be"),
    ({"device": "tpu"}, "device must be"),
    ({"max_model_len": 100_000}, "max_position_embeddings"),
    ({"max_model_len": 512, "num_kv_blocks": 4}, "KV cache holds"),
    ({"block_size": 12}, "power of two"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"gpu_kernels": "cuda"}, "gpu_kernels must be one of auto, torch, triton"),
])
def test_bad_engine_settings(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, **kwargs)


def test_a_max_model_len_above_the_trained_length_is_served_when_asked_for(tiny_llama, caplog):
    """The tiny model was trained to 512 positions: 1024 is refused above, and served here."""
    llm = LLM(tiny_llama, dtype="float64", max_model_len=1024, allow_long_max_model_len=True,
              num_kv_blocks=64)
    assert "above the model's trained length 512" in caplog.text
    [output] = llm.generate({"prompt_token_ids": [1, 2, 3] * 250},
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 8


def test_a_cache_smaller_than_the_trained_length_serves_what_it_holds(tiny_llama, caplog):
    """No max_model_len asked for: the context is what the cache holds (8 blocks of 16 of the
    model's 512), said in the log; asked for, a longer one is refused naming both ways out."""
    llm = LLM(tiny_llama, dtype="float64", num_kv_blocks=8, block_size=16)
    assert llm.engine.scheduler.max_model_len == 128
    assert "max_model_len 128: what the KV cache (8 blocks) holds" in caplog.text
    [output] = llm.generate({"prompt_token_ids": [1, 2, 3] * 40},
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(output.outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="holds 128 tokens, fewer than max_model_len 256"):
        LLM(tiny_llama, dtype="float64", num_kv_blocks=8, block_size=16, max_model_len=256)


def test_triton_kernels_need_a_gpu_or_the_interpreter(tiny_llama, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="runs on CUDA devices"):
        LLM(tiny_llama, device="cpu", gpu_kernels="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="takes float32, float16 or bfloat16"):
        LLM(tiny_llama, dtype="float64", gpu_kernels="triton")


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    save_file({"wte.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [1] * 64}, "max_model_len"),
    ({"prompt_token_ids": []}, "at least one token"),
    ({"prompt_token_ids": [1, 10_000]}, "token ids must be in"),
    ("text needs a tokenizer", "no tokenizer"),
    ({"text": "misnamed key"}, "needs \"prompt\""),
])
def test_bad_prompts_are_rejected_and_leave_nothing_behind(llm, prompt, message):
    good = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished
    assert llm.engine.scheduler.block_manager.num_free_blocks == 16


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([{"prompt_token_ids": [1]}], [SamplingParams(), SamplingParams()])


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate({"prompt_token_ids": [1] * 60},
                       SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    completion = out[0].outputs[0]
    assert len(completion.token_ids) == 4 and completion.finish_reason == "length"
