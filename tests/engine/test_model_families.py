"""Qwen3 and Gemma 3 (text) against transformers' own implementation: the architecture read from
their configs, logits within float32 rounding of the reference, greedy tokens identical, tied and
untied heads, and what is refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_gguf import write_tiny_gguf
from tiny_models import build_tiny_checkpoint, hf_greedy

from engine import LLM, SamplingParams
from engine.models.arch import DecoderArch
from engine.models.build import build_model
from engine.models.loader import load_checkpoint
from engine.runner.paged_runner import PagedRunner
from engine.step.types import SequenceRows

# longer than the tiny Gemma 3's window (6), so its sliding layers drop context
PROMPT = [1, 5, 9, 13, 2, 7, 40, 41, 42, 5, 9, 13, 60, 61, 3, 8, 30, 31]


def engine_logits(path: str, dtype: torch.dtype, prompt: list[int]) -> torch.Tensor:
    """The engine's model, prefilled with `prompt` in chunks of 5 rows (so later chunks read
    the paged cache, windowed or not): logits at every position, [len(prompt), vocab]."""
    model, _ = build_model(load_checkpoint(path, dtype), dtype, torch.device("cpu"))
    runner = PagedRunner.with_own_pool(model, model.arch, 16, 4, dtype, torch.device("cpu"))
    runner.reserve("a", len(prompt))
    rows = []
    with torch.no_grad():
        for start in range(0, len(prompt), 5):
            inputs = runner.prepare([SequenceRows("a", start, prompt[start:start + 5])])
            rows.append(runner.logits(runner.run(inputs)))
    return torch.cat(rows)


def reference_logits(path: str, dtype: torch.dtype, prompt: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_logits_match_transformers(tmp_path, kind, tied):
    path = build_tiny_checkpoint(tmp_path, kind, tie_word_embeddings=tied)
    for dtype, tolerance in ((torch.float64, 1e-9), (torch.float32, 2e-4)):
        got, want = engine_logits(path, dtype, PROMPT), reference_logits(path, dtype, PROMPT)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=tolerance, atol=tolerance), (
            kind, dtype, (got - want).abs().max().item())
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_float32_engine_greedy_matches_transformers(tmp_path, kind):
    """float32 through the whole engine (the CPU's fused ops; chunked prefill, two requests in
    a batch) gives transformers' float32 greedy tokens."""
    path = build_tiny_checkpoint(tmp_path, kind)
    prompts = [PROMPT, PROMPT[3:] + PROMPT[:3]]
    want = [hf_greedy(path, prompt, 24, dtype=torch.float32) for prompt in prompts]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64,
              max_num_batched_tokens=12, block_size=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want


def test_gemma3_architecture_is_read_as_its_model_class_applies_it(tmp_path):
    path = build_tiny_checkpoint(tmp_path, "gemma3")
    config = transformers.AutoConfig.from_pretrained(path)
    arch = DecoderArch.from_hf_config(config)
    assert arch.sliding_layers == (True, True, False)
    assert (arch.sliding_window, arch.local_window) == (None, 6)
    assert arch.embedding_scale == pytest.approx(8.0)
    assert arch.attention_scale == 32 ** -0.5
    assert arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.qk_norm and arch.gemma_norms and arch.sandwich_norms
    reference = transformers.AutoModelForCausalLM.from_pretrained(path).model.rotary_emb
    assert torch.equal(torch.tensor(arch.rope_inv_freq), reference.full_attention_inv_freq)
    assert torch.equal(torch.tensor(arch.local_rope_inv_freq),
                       reference.sliding_attention_inv_freq)


def test_qwen3_slides_only_from_max_window_layers_on(tmp_path):
    config = transformers.Qwen3Config(num_hidden_layers=4, use_sliding_window=True,
                                      sliding_window=32, max_window_layers=2)
    arch = DecoderArch.from_hf_config(config)
    assert arch.sliding_layers == (False, False, True, True)
    assert (arch.sliding_window, arch.local_window, arch.local_rope_inv_freq) == (None, 32, None)
    plain = DecoderArch.from_hf_config(transformers.Qwen3Config(num_hidden_layers=4))
    assert (plain.sliding_window, plain.local_window, plain.qkv_bias) == (None, None, False)
    assert plain.qk_norm and plain.head_dim == 128


def test_qwen3_with_sliding_layers_matches_transformers(tmp_path):
    path = build_tiny_checkpoint(tmp_path, "qwen3", use_sliding_window=True, sliding_window=5,
                                 max_window_layers=1)
    got = engine_logits(path, torch.float64, PROMPT)
    want = reference_logits(path, torch.float64, PROMPT)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-9)


def test_logit_soft_capping_is_refused_by_name():
    config = transformers.Gemma3TextConfig(num_hidden_layers=2, final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        DecoderArch.from_hf_config(config)


def test_draft_head_layers_stay_plain_llama_layers(tmp_path):
    """EAGLE's and MTP's own layers take the target's sizes, never its family's extras."""
    arch = DecoderArch.from_hf_config(transformers.AutoConfig.from_pretrained(
        build_tiny_checkpoint(tmp_path, "gemma3")))
    head = arch.plain_layers(1)
    assert head.num_layers == 1 and head.hidden_size == arch.hidden_size
    assert not (head.qk_norm or head.gemma_norms or head.sandwich_norms or head.sliding_layers)
    assert (head.embedding_scale, head.hidden_act, head.local_window) == (None, "silu", None)


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_gguf_served_packed_gives_transformers_tokens(tmp_path, architecture):
    """A tiny qwen3 / gemma3 GGUF of packed blocks, served packed (the CPU default) and expanded
    to float32, gives transformers' greedy tokens on its own load of the same file."""
    path = tmp_path / f"{architecture}.gguf"
    write_tiny_gguf(path, architecture, num_layers=3)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference.generate(torch.tensor([PROMPT]), max_new_tokens=16, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
    want = out[0, len(PROMPT):].tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for dtype in ("auto", "float32"):
        llm = LLM(str(path), dtype=dtype, max_model_len=128, num_kv_blocks=64)
        assert llm.engine.worker.weights_packed == (dtype == "auto")
        got = llm.generate({"prompt_token_ids": PROMPT}, greedy)[0].outputs[0].token_ids
        assert got == want, (dtype, got, want)
