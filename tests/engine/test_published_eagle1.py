"""EAGLE-1 heads as the EAGLE authors publish them (config.json = the base model's Llama config with one
layer; pytorch_model.bin or model.safetensors with fc, layers.0.* without input_layernorm, and a copy
of the embeddings), built small and random with the real key names and config fields: the published
math is read right (against an independent reading of the saved tensors), output is lossless (greedy
identical, sampled distribution unchanged), and a head made for another model is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from reference_attention import reference_self_attention
from safetensors.torch import load_file, save_file
from spec_outputs import third_token_law, token_ids, two_sample_chi2_pvalue
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.models.arch import DecoderArch
from engine.models.attention import build_attention_metadata
from engine.models.loader import load_checkpoint
from engine.proposers.eagle_head import EagleHead
from engine.proposers.published_eagle import load_eagle_head

PROMPTS = [[1, 5, 9, 13, 2, 7], [1] + list(range(30, 62)), [1, 60], [1, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# (weight file, fc bias, whether config.json says "bias"): the authors' loader takes a config
# without "bias" to mean fc has one
LAYOUTS = {"bin": ("pytorch_model.bin", True, False),
           "safetensors": ("model.safetensors", False, True)}


def write_authors_head(folder: str, arch: DecoderArch, layout: str = "bin", seed: int = 0) -> str:
    """A random EAGLE-1 head as SafeAILab/EAGLE saves one (the .bin in float16, as published)."""
    weight_file, bias, bias_in_config = LAYOUTS[layout]
    torch.manual_seed(seed)
    hidden, heads, kv_heads = arch.hidden_size, arch.num_heads, arch.num_kv_heads
    head_dim, inner = hidden // heads, arch.intermediate_size

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape) * 0.15

    tensors = {
        "embed_tokens.weight": weight(arch.vocab_size, hidden),
        "fc.weight": weight(hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": weight(heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": weight(inner, hidden),
        "layers.0.mlp.up_proj.weight": weight(inner, hidden),
        "layers.0.mlp.down_proj.weight": weight(hidden, inner),
        "layers.0.post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
    }
    if bias:
        tensors["fc.bias"] = 0.1 * torch.randn(hidden)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": inner, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "hidden_act": "silu",
              "rms_norm_eps": arch.rms_norm_eps, "vocab_size": arch.vocab_size,
              "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None,
              "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 1,
              "eos_token_id": 0, "pad_token_id": None, "torch_dtype": "float16",
              "transformers_version": "4.38.2"}
    if bias_in_config:
        config["bias"] = bias
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, weight_file)
    if weight_file.endswith(".bin"):
        torch.save({k: v.half() for k, v in tensors.items()}, path)
    else:
        save_file(tensors, path)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def saved_tensors(folder: str) -> dict[str, torch.Tensor]:
    if os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        tensors = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)
    else:
        tensors = load_file(os.path.join(folder, "model.safetensors"))
    return {k: v.double() for k, v in tensors.items()}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=47)


@pytest.fixture(scope="module")
def arch(target) -> DecoderArch:
    return DecoderArch.from_hf_config(load_checkpoint(target, torch.float32).hf_config)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def head(request, arch, tmp_path_factory) -> str:
    return write_authors_head(str(tmp_path_factory.mktemp(request.param)), arch, request.param)


def spec_llm(target: str, folder: str, k: int = 3) -> LLM:
    return LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64,
               speculative_config={"method": "eagle", "model": folder, "num_speculative_tokens": k})


# ---- the published math, read independently -------------------------------------------------
def reference_head(folder: str, embeds: torch.Tensor, features: torch.Tensor,
                   arch: DecoderArch) -> torch.Tensor:
    """The authors' one-layer head written out from the saved tensors, causal over T positions:
    fc on [embedding; feature] (+ bias), attention straight on that (no input norm), then the
    usual post-attention norm and SwiGLU MLP with residuals. Returns h [T, hidden]."""
    w = saved_tensors(folder)
    p, eps = "layers.0.", arch.rms_norm_eps
    heads, kv_heads = arch.num_heads, arch.num_kv_heads

    x = torch.cat([embeds, features], dim=-1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    x = x + reference_self_attention(x, w, p, heads, kv_heads)
    post = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) \
        * w[p + "post_attention_layernorm.weight"]
    mlp = F.silu(post @ w[p + "mlp.gate_proj.weight"].T) * (post @ w[p + "mlp.up_proj.weight"].T)
    return x + mlp @ w[p + "mlp.down_proj.weight"].T


def run_head(head: EagleHead, embeds: torch.Tensor, features: torch.Tensor,
             arch: DecoderArch) -> torch.Tensor:
    """The loaded head over T positions of one sequence, through its paged KV cache."""
    T = len(embeds)
    kv = [torch.zeros(2, arch.num_kv_heads, 1, 8, arch.hidden_size // arch.num_heads,
                      dtype=torch.float64)]
    meta = build_attention_metadata([T], [T], [[0]], 8, None, torch.device("cpu"))
    with torch.no_grad():
        return head(embeds, features, torch.arange(T), meta, kv)


def test_the_published_math_is_read_right(head, arch, tmp_path):
    loaded = load_eagle_head(head, arch, torch.float64, torch.device("cpu"))
    assert isinstance(loaded.layer.input_layernorm, torch.nn.Identity)
    assert (loaded.fc.bias is not None) == ("fc.bias" in saved_tensors(head))
    torch.manual_seed(1)
    T = 7
    embeds = torch.randn(T, arch.hidden_size, dtype=torch.float64)
    features = torch.randn(T, arch.hidden_size, dtype=torch.float64)
    h = run_head(loaded, embeds, features, arch)
    # NOTE: rotary angles are float32 in the engine, as in the target: ~1e-6 apart from float64
    torch.testing.assert_close(h, reference_head(head, embeds, features, arch),
                               rtol=1e-5, atol=1e-5)
    # saved again in specserve's own layout, it loads as the same head
    loaded.save(str(tmp_path / "own"))
    again = load_eagle_head(str(tmp_path / "own"), arch, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(run_head(again, embeds, features, arch), h, rtol=0, atol=0)


def test_drafts_are_scored_over_the_whole_vocabulary_by_the_targets_lm_head(target, head, arch):
    proposer = spec_llm(target, head).engine.proposer
    assert proposer.head.draft_token_ids.tolist() == list(range(arch.vocab_size))
    lm_head = load_file(os.path.join(target, "model.safetensors"))["lm_head.weight"].double()
    h = torch.randn(5, arch.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(proposer._logits(h), h @ lm_head.T)


def test_greedy_is_lossless_and_drafts_are_proposed(target, head):
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    expected = token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    outs = spec_llm(target, head).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert token_ids(outs) == expected
    assert all(o.spec_stats.num_draft_tokens > 0 for o in outs)


@pytest.mark.slow
def test_sampled_distribution_is_unchanged(tmp_path):
    """Token 3 of the output, mostly verified from the head's drafts: the same distribution with
    and without speculation (two-sample chi-square over 2000 seeded completions each)."""
    path = build_tiny_checkpoint(tmp_path / "t", "llama", seed=13, vocab_size=12,
                                 initializer_range=0.05)
    arch = DecoderArch.from_hf_config(load_checkpoint(path, torch.float32).hf_config)
    folder = write_authors_head(str(tmp_path / "h"), arch, "bin", seed=5)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain, _ = third_token_law(path, None, prompt, 2000)
    spec = {"method": "eagle", "model": folder, "num_speculative_tokens": 3}
    speculative, outs = third_token_law(path, spec, prompt, 2000)
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 100
    assert two_sample_chi2_pvalue(plain, speculative) > 1e-4, (plain, speculative)


# ---- refused at start-up -----------------------------------------------------------------------
def test_a_head_for_another_model_is_refused(target, arch, tmp_path):
    from dataclasses import replace

    narrow = replace(arch, hidden_size=32, intermediate_size=64)
    folder = write_authors_head(str(tmp_path / "narrow"), narrow)
    with pytest.raises(ValueError, match=f"EAGLE head in {folder} was made for hidden size 32 "
                                         f"and vocabulary 96; the target has 64 and 96"):
        spec_llm(target, folder)
    folder = write_authors_head(str(tmp_path / "vocab"), replace(arch, vocab_size=104))
    with pytest.raises(ValueError, match="vocabulary 104; the target has 64 and 96"):
        spec_llm(target, folder)


def test_a_folder_for_another_method_or_not_fitting_its_config_is_refused(target, arch, tmp_path):
    ibm = tmp_path / "ibm"
    ibm.mkdir()
    (ibm / "config.json").write_text(json.dumps({
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
        "emb_dim": 64, "inner_dim": 32, "n_predict": 2, "vocab_size": 96}))
    save_file({"emb.0.weight": torch.zeros(96, 32)}, str(ibm / "model.safetensors"))
    with pytest.raises(ValueError, match='"method": "mlp_speculator"'):
        spec_llm(target, str(ibm))
    folder = write_authors_head(str(tmp_path / "liar"), arch, "safetensors")
    config = json.loads((tmp_path / "liar" / "config.json").read_text())
    (tmp_path / "liar" / "config.json").write_text(json.dumps({**config, "bias": True}))
    with pytest.raises(ValueError, match="bias=True, but its weights lack fc.bias"):
        spec_llm(target, folder)
    folder = write_authors_head(str(tmp_path / "heads"), arch, "safetensors")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    (tmp_path / "heads" / "config.json").write_text(json.dumps({**config,
                                                                "num_key_value_heads": 4}))
    with pytest.raises(ValueError, match="does not fit its config.json"):
        spec_llm(target, folder)
