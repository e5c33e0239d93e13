"""EAGLE-3 heads as they are published (the EAGLE authors' layout and vLLM's speculators layout),
built small and random with the real key names, config fields and shapes: the published math is read
right (against an independent reading of the saved tensors), the target's features come from the
named layers, greedy output is lossless (with a random head, and with one built from the target's
weights whose drafts are mostly accepted), and a head made for another model is refused at start-up.
Sampling with EAGLE-3 drafts: tests/engine/test_sampling_distribution.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from bigram_drafters import (
    check_lossless_when_mostly_right,
    write_bigram_eagle3_head,
)
from reference_attention import reference_self_attention
from safetensors.torch import save_file
from spec_outputs import pooled_acceptance_rate, token_ids
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.models.arch import DecoderArch
from engine.models.attention import build_attention_metadata
from engine.models.loader import load_checkpoint
from engine.proposers.eagle3_head import Eagle3Head

FEATURE_LAYERS = [0, 2, 3]
PROMPTS = [[1, 5, 9, 13, 2, 7], [1] + list(range(30, 62)), [1, 60], [1, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LAYOUTS = ("eagle3", "speculators")


def layer_config(arch: DecoderArch, **overrides) -> dict:
    """The head's decoder layer as published: a Llama layer of the target's sizes, head_dim
    included (Qwen3's differs from hidden / heads)."""
    return {"model_type": "llama", "hidden_size": arch.hidden_size, "head_dim": arch.head_dim,
            "intermediate_size": 2 * arch.hidden_size, "num_attention_heads": arch.num_heads,
            "num_key_value_heads": arch.num_kv_heads, "num_hidden_layers": 1,
            "rms_norm_eps": arch.rms_norm_eps, "vocab_size": arch.vocab_size,
            "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False,
            **overrides}


def write_head(folder: str, arch: DecoderArch, layout: str, draft_vocab_size: int,
               feature_layers: list[int] | None = FEATURE_LAYERS, seed: int = 0) -> str:
    """A random head in `layout`: the authors' ship pytorch_model.bin and share the target's
    embedding; speculators ship model.safetensors with embeddings of their own."""
    torch.manual_seed(seed)
    hidden, heads, kv_heads = arch.hidden_size, arch.num_heads, arch.num_kv_heads
    head_dim, inner = arch.head_dim, 2 * hidden

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape) * 0.15

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(hidden)

    prefix = "midlayer." if layout == "eagle3" else "layers.0."
    draft_ids = torch.randperm(arch.vocab_size)[:draft_vocab_size].sort().values
    tensors = {
        "fc.weight": weight(hidden, 3 * hidden), "norm.weight": norm(),
        "lm_head.weight": weight(draft_vocab_size, hidden),
        "d2t": draft_ids - torch.arange(draft_vocab_size),
        "t2d": torch.zeros(arch.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True),
        prefix + "input_layernorm.weight": norm(), prefix + "hidden_norm.weight": norm(),
        prefix + "post_attention_layernorm.weight": norm(),
        prefix + "self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        prefix + "self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": weight(inner, hidden),
        prefix + "mlp.up_proj.weight": weight(inner, hidden),
        prefix + "mlp.down_proj.weight": weight(hidden, inner),
    }
    os.makedirs(folder, exist_ok=True)
    if layout == "eagle3":
        config = {**layer_config(arch), "architectures": ["LlamaForCausalLMEagle3"],
                  "draft_vocab_size": draft_vocab_size}
        if feature_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": feature_layers,
                                      "use_aux_hidden_state": True}
        torch.save(tensors, os.path.join(folder, "pytorch_model.bin"))
    else:
        tensors["embed_tokens.weight"] = weight(arch.vocab_size, hidden)
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": "0.1.0", "draft_vocab_size": draft_vocab_size,
            "norm_before_residual": True, "target_hidden_size": hidden,
            "transformer_layer_config": {**layer_config(arch), "architectures":
                                         ["LlamaForCausalLM"]},
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}},
        }
        if feature_layers is not None:
            config["eagle_aux_hidden_state_layer_ids"] = feature_layers
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


# Llama 3.1 8B and Qwen3 are the targets EAGLE-3 heads are published for (Qwen3's with its
# head_dim, unlike hidden / heads, and its q/k norms in the target)
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def target(request, tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), request.param, seed=43,
                                 num_hidden_layers=4)


@pytest.fixture(scope="module")
def arch(target) -> DecoderArch:
    return DecoderArch.from_hf_config(load_checkpoint(target, torch.float32).hf_config)


# the training tests' target: the head learns the same way whatever the target's family
@pytest.fixture(scope="module")
def llama_target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama_target"), "llama", seed=43,
                                 num_hidden_layers=4)


@pytest.fixture(scope="module")
def llama_arch(llama_target) -> DecoderArch:
    return DecoderArch.from_hf_config(load_checkpoint(llama_target, torch.float32).hf_config)


@pytest.fixture(scope="module", params=LAYOUTS)
def head(request, arch, tmp_path_factory) -> tuple[str, str]:
    layout = request.param
    return layout, write_head(str(tmp_path_factory.mktemp(layout)), arch, layout, 64)


def spec_llm(target: str, folder: str, k: int = 3, **engine) -> LLM:
    return LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64, **engine,
               speculative_config={"method": "eagle3", "model": folder,
                                   "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def expected(target) -> list[list[int]]:
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    return token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))


# ---- the published math, read independently -------------------------------------------------
def reference_head(folder: str, layout: str, embeds: torch.Tensor, fused: torch.Tensor,
                   arch: DecoderArch) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-3's decoder layer written out from the saved tensors, causal over T positions:
    (state [T, hidden], draft logits [T, draft_vocab])."""
    path = os.path.join(folder, "pytorch_model.bin" if layout == "eagle3" else "model.safetensors")
    if layout == "eagle3":
        w = {k: v.double() for k, v in torch.load(path, weights_only=True).items()}
    else:
        from safetensors.torch import load_file
        w = {k: v.double() for k, v in load_file(path).items()}
    p = "midlayer." if layout == "eagle3" else "layers.0."
    eps, heads, kv_heads = arch.rms_norm_eps, arch.num_heads, arch.num_kv_heads

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    g = fused @ w["fc.weight"].T if fused.shape[-1] != arch.hidden_size else fused
    normed = rms(g, w[p + "hidden_norm.weight"])
    residual = normed if layout == "speculators" else g  # speculators: norm_before_residual
    x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"]), normed], dim=-1)
    x = residual + reference_self_attention(x, w, p, heads, kv_heads)
    post = rms(x, w[p + "post_attention_layernorm.weight"])
    mlp = (F.silu(post @ w[p + "mlp.gate_proj.weight"].T) * (post @ w[p + "mlp.up_proj.weight"].T))
    state = x + mlp @ w[p + "mlp.down_proj.weight"].T
    return state, rms(state, w["norm.weight"]) @ w["lm_head.weight"].T


def test_the_published_math_is_read_right(head, arch):
    layout, folder = head
    loaded, layers = Eagle3Head.load(folder, arch, torch.float64, torch.device("cpu"))
    assert layers == tuple(FEATURE_LAYERS)
    torch.manual_seed(1)
    T = 7
    embeds = torch.randn(T, arch.hidden_size, dtype=torch.float64)
    fused = torch.randn(T, 3 * arch.hidden_size, dtype=torch.float64)
    kv = [torch.zeros(2, arch.num_kv_heads, 1, 8, arch.head_dim, dtype=torch.float64)]
    meta = build_attention_metadata([T], [T], [[0]], 8, None, torch.device("cpu"))
    with torch.no_grad():
        state = loaded(embeds, loaded.fc(fused), torch.arange(T), meta, kv)
        logits = loaded.draft_logits(state)
    want_state, want_logits = reference_head(folder, layout, embeds, fused, arch)
    # NOTE: rotary angles are float32 in the engine, as in the target: ~1e-6 apart from float64
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    d2t = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)["d2t"] \
        if layout == "eagle3" else None
    if d2t is not None:
        assert loaded.draft_token_ids.tolist() == (torch.arange(64) + d2t).tolist()


def test_features_come_from_the_named_target_layers(target, head, monkeypatch):
    """What the head is handed at each committed position: the residual stream entering target
    layers 0, 2 and 3 (Hugging Face's hidden_states[0], [2], [3]), side by side."""
    from engine.proposers.eagle import EagleProposer

    _, folder = head
    seen: dict[int, torch.Tensor] = {}
    record = EagleProposer.record_target_hidden

    def spy(self, request, start_position, hidden, block_table):
        for offset, row in enumerate(hidden):
            seen[start_position + offset] = row.clone()
        return record(self, request, start_position, hidden, block_table)

    monkeypatch.setattr(EagleProposer, "record_target_hidden", spy)
    out = spec_llm(target, folder, max_num_batched_tokens=5).generate(
        {"prompt_token_ids": PROMPTS[1]}, GREEDY)[0]
    sequence = PROMPTS[1] + out.outputs[0].token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    with torch.no_grad():
        states = model(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    want = torch.cat([states[i][0] for i in FEATURE_LAYERS], dim=-1)
    assert len(seen) >= len(sequence) - 4
    for position, row in seen.items():
        torch.testing.assert_close(row, want[position], rtol=1e-6, atol=1e-6)


def test_greedy_is_lossless_and_drafts_are_proposed(target, head, expected):
    _, folder = head
    outs = spec_llm(target, folder).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert token_ids(outs) == expected
    assert all(o.spec_stats.num_draft_tokens > 0 for o in outs)


def drafts_proposed(llm: LLM) -> dict[str, list[list[int]]]:
    """Every draft the engine's proposer returns from now on, per request id."""
    proposer, seen = llm.engine.proposer, {}
    propose = proposer.propose

    def recording(requests, caps, target_hidden):
        proposals = propose(requests, caps, target_hidden)
        for request, proposal in zip(requests, proposals):
            seen.setdefault(request.request_id, []).append(list(proposal.token_ids))
        return proposals

    proposer.propose = recording
    return seen


@pytest.mark.slow
def test_a_cached_prefix_gives_the_same_drafts(target, head, expected):
    """The fused features of a cached prefix come from beside its blocks: the drafts themselves
    (which a random head derives from every feature it has read) equal those of an engine that
    computed the whole prompt; a zero or stale feature changes them."""
    _, folder = head
    runs = []
    for caching in (True, False):
        llm = spec_llm(target, folder, enable_prefix_caching=caching)
        llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY)
        seen = drafts_proposed(llm)
        again = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY)[0]
        assert again.num_cached_tokens == (32 if caching else 0)
        assert again.outputs[0].token_ids == expected[1]
        runs.append(list(seen.values()))
    assert runs[0] == runs[1] and sum(len(d) for d in runs[0][0]) > 20, runs


@pytest.mark.promise("greedy-lossless:eagle3")
def test_greedy_is_lossless_when_the_drafts_are_mostly_right(tmp_path):
    check_lossless_when_mostly_right(tmp_path, "eagle3", write_bigram_eagle3_head)


# ---- refused at start-up -----------------------------------------------------------------------
def test_a_head_for_another_model_is_refused(target, arch, tmp_path):
    other = DecoderArch.from_hf_config(load_checkpoint(build_tiny_checkpoint(
        tmp_path / "wide", "llama", hidden_size=32, num_hidden_layers=4), torch.float32).hf_config)
    for layout in LAYOUTS:
        with pytest.raises(ValueError, match="hidden size 32 .*the target has 64"):
            spec_llm(target, write_head(str(tmp_path / f"wide-{layout}"), other, layout, 16))
    from dataclasses import replace
    bigger_vocab = replace(arch, vocab_size=arch.vocab_size + 8)
    with pytest.raises(ValueError, match=f"vocabulary {arch.vocab_size + 8}"):
        spec_llm(target, write_head(str(tmp_path / "vocab"), bigger_vocab, "eagle3", 16))
    with pytest.raises(ValueError, match=r"reads target layers \[0, 2, 9\]"):
        spec_llm(target, write_head(str(tmp_path / "deep"), arch, "eagle3", 16, [0, 2, 9]))


def test_eagle3s_default_layers(tmp_path):
    """No layers named: EAGLE-3's 2, L // 2, L - 3; a target too shallow for them reads its first,
    middle and last; one too shallow for three layers is refused."""
    deep = build_tiny_checkpoint(tmp_path / "deep", "llama", seed=2, num_hidden_layers=8)
    arch = DecoderArch.from_hf_config(load_checkpoint(deep, torch.float32).hf_config)
    folder = write_head(str(tmp_path / "head"), arch, "speculators", 32, feature_layers=None)
    llm = spec_llm(deep, folder)
    assert llm.engine.proposer.target_feature_layers == (2, 4, 5)
    assert llm.engine.worker.model.aux_hidden_layers == (2, 4, 5)
    shallow = build_tiny_checkpoint(tmp_path / "shallow", "llama", seed=2, num_hidden_layers=4)
    assert spec_llm(shallow, folder).engine.proposer.target_feature_layers == (0, 2, 3)
    too_shallow = build_tiny_checkpoint(tmp_path / "two", "llama", seed=2, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"\[0, 1, 1\] \(default\)"):
        spec_llm(too_shallow, folder)


@pytest.mark.slow
def test_training_makes_the_head_guess_what_the_target_says(llama_target, llama_arch, tmp_path):
    """`train-speculator --method eagle3`'s pieces on the tiny target: the three layers' streams,
    training-time test over 2 steps, the distribution loss alone; the saved speculators folder
    loads, stays lossless and is accepted far more often than a random head."""
    from engine.proposers.eagle3_head import Eagle3Config
    from engine.training.train_eagle import (
        chain_accuracy,
        choose_draft_vocab,
        extract_features,
        train_head,
    )
    from engine.training.train_speculator import load_reference

    plain = LLM(llama_target, dtype="float32", max_model_len=256, num_kv_blocks=64)
    prompts = [[1] + [(7 * i + j) % 90 + 2 for j in range(6)] for i in range(48)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    reference = load_reference(llama_target)
    stream = extract_features(reference, [o.prompt_token_ids + o.outputs[0].token_ids
                                          for o in outs], aux_layers=tuple(FEATURE_LAYERS))
    assert stream.aux.shape == (len(stream), 3 * llama_arch.hidden_size)
    draft_ids, _ = choose_draft_vocab(stream.labels, 64, llama_arch.eos_token_ids, llama_arch.vocab_size)
    config = Eagle3Config.for_target(llama_arch, len(draft_ids), tuple(FEATURE_LAYERS))
    torch.manual_seed(0)
    head = Eagle3Head(config, config.layer_arch(llama_arch), has_embeddings=False)
    head.draft_token_ids.copy_(draft_ids)
    embed = reference.get_input_embeddings()
    draft_head = reference.get_output_embeddings().weight.detach()[draft_ids]
    before = chain_accuracy(head, embed, draft_head, stream, window=32, num_steps=2)
    train_head(head, embed, draft_head, stream, epochs=30, batch_size=8, window=32, num_steps=2,
               learning_rate=3e-3, feature_weight=1.0, seed=0)
    after = chain_accuracy(head, embed, draft_head, stream, window=32, num_steps=2)
    assert min(after) > max(before) + 0.3, (before, after)
    trained = str(tmp_path / "trained")
    head.save(trained, "test")
    untrained = write_head(str(tmp_path / "random"), llama_arch, "speculators", 64)

    test_prompts = [{"prompt_token_ids": p} for p in prompts[:6]]
    rates = []
    for folder in (untrained, trained):
        spec_outs = spec_llm(llama_target, folder).generate(test_prompts, greedy)
        assert token_ids(spec_outs) == [o.outputs[0].token_ids for o in outs[:6]]
        rates.append(pooled_acceptance_rate(spec_outs))
    assert rates[1] > max(0.1, 5 * rates[0]), rates


@pytest.mark.slow
def test_the_agreement_counts_answers_and_the_loss_prompts_by_choice(llama_target, llama_arch):
    """The agreement never counts prompt positions: garbage labels there leave it unchanged. With
    --answer-only-loss they are context only: garbage labels and teacher features there change
    neither the trained weights nor the agreement; by default (or counted as answer) they change
    both, so each comparison can fail. Marks follow the whole sequence across max_len pieces."""
    from dataclasses import replace

    from engine.proposers.eagle3_head import Eagle3Config
    from engine.training.train_eagle import chain_accuracy, extract_features, train_head
    from engine.training.train_speculator import load_reference

    plain = LLM(llama_target, dtype="float32", max_model_len=256, num_kv_blocks=64)
    prompts = [[1] + [(7 * i + j) % 90 + 2 for j in range(12)] for i in range(16)]
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    reference = load_reference(llama_target)
    stream = extract_features(reference, [o.prompt_token_ids + o.outputs[0].token_ids
                                          for o in outs], max_len=20,
                              aux_layers=tuple(FEATURE_LAYERS), prompt_lens=[13] * len(prompts))
    # label p is token p + 1: an answer token from p = 12 on, in the second piece too
    assert stream.is_answer.tolist() == ([False] * 12 + [True] * 25) * len(prompts)
    is_prompt = ~stream.is_answer
    garbled = replace(stream,
                      labels=torch.where(is_prompt, (stream.labels + 1) % llama_arch.vocab_size,
                                         stream.labels),
                      features=torch.where(is_prompt[:, None], 10 * torch.randn(
                          stream.features.shape, generator=torch.Generator().manual_seed(1)),
                          stream.features))
    embed = reference.get_input_embeddings()
    config = Eagle3Config.for_target(llama_arch, llama_arch.vocab_size, tuple(FEATURE_LAYERS))
    draft_head = reference.get_output_embeddings().weight.detach()

    def trained(data, answer_only_loss=True) -> tuple[Eagle3Head, list[float]]:
        torch.manual_seed(0)
        head = Eagle3Head(config, config.layer_arch(llama_arch), has_embeddings=False)
        head.draft_token_ids.copy_(torch.arange(llama_arch.vocab_size))
        with torch.no_grad():
            head.lm_head.weight.copy_(draft_head)  # as run_eagle starts it
        train_head(head, embed, draft_head, data, epochs=4, batch_size=8, window=16,
                   num_steps=2, learning_rate=3e-3, feature_weight=1.0, seed=0,
                   answer_only_loss=answer_only_loss)
        return head, chain_accuracy(head, embed, draft_head, data, window=16, num_steps=2)

    def same_weights(a: Eagle3Head, b: Eagle3Head) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))

    (clean_head, clean), (garbled_head, garbage) = trained(stream), trained(garbled)
    assert same_weights(clean_head, garbled_head) and clean == garbage and min(clean) > 0.1
    everywhere = torch.ones_like(stream.is_answer)
    (clean_head, clean), (garbled_head, garbage) = (
        trained(replace(stream, is_answer=everywhere)),
        trained(replace(garbled, is_answer=everywhere)))
    assert not same_weights(clean_head, garbled_head) and clean != garbage
    (clean_head, clean), (garbled_head, garbage) = (trained(stream, answer_only_loss=False),
                                                    trained(garbled, answer_only_loss=False))
    assert not same_weights(clean_head, garbled_head)
    wrong_prompt_labels = replace(stream, labels=garbled.labels)
    assert chain_accuracy(clean_head, embed, draft_head, wrong_prompt_labels, window=16,
                          num_steps=2) == clean


@pytest.mark.slow
def test_train_speculator_eagle3_command_trains_and_saves_a_loadable_head(llama_target, llama_arch, tmp_path):
    """The command's own path after generation (`run_eagle` with the command's defaults): it writes
    a speculators folder whose LM head starts from the llama_target's rows, and that folder serves."""
    from engine.training.train_eagle import run_eagle
    from engine.training.train_speculator import add_arguments, load_reference

    out = str(tmp_path / "head")
    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", out, "--method", "eagle3", "--epochs", "1",
                              "--draft-vocab-size", "48", "--window", "16"])
    args.batch_size = 8
    plain = LLM(llama_target, dtype="float32", max_model_len=256, num_kv_blocks=64)
    prompts = [[1] + [(5 * i + j) % 90 + 2 for j in range(6)] for i in range(20)]
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    summary = run_eagle(args, load_reference(llama_target), None,
                        [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids))
                         for o in outs], "test")
    assert "EAGLE-3" in summary and "on answer tokens" in summary and out in summary
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == 48
    spec_outs = spec_llm(llama_target, out).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert token_ids(spec_outs) == token_ids(plain.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
