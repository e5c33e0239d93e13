"""MTP (`"method": "mtp"`): a target's own multi-token prediction layers, in DeepSeek-V3's and
MiMo's published layouts (tests/helpers/mtp_checkpoints.py), read right against a reading of
the saved tensors; drafting through every layer in turn equals recomputing the chain from scratch;
lossless (greedy identical in mixed batches, chunked prefill, preemption, cached prefixes, trees;
sampling follows the target, beside a broken sampler the same check catches); a checkpoint without
MTP layers, or with ones that do not fit, is refused at start-up naming what is missing."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from bigram_drafters import MOSTLY_RIGHT_PROMPTS, assert_often_right
from mtp_checkpoints import add_mtp_layers, copy_target, layer_prefix, read_config
from reference_attention import reference_self_attention
from safetensors.torch import load_file
from spec_outputs import token_ids
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.models.arch import DecoderArch
from engine.models.attention import build_attention_metadata
from engine.models.loader import load_checkpoint
from engine.proposers.mtp import MtpProposer
from engine.proposers.mtp_head import read_mtp_head

PROMPTS = [[1, 5, 9, 13, 2, 7], [1] + list(range(30, 62)), [1, 60], [1, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# the bodies each layout ships on (DeepSeek's layout is also what train-speculator writes)
BODIES = {"deepseek": "llama", "mimo": "qwen2"}


def mtp_llm(folder: str, k: int = 3, spec: dict | None = None, **engine) -> LLM:
    engine = {"max_model_len": 256, "num_kv_blocks": 64, **engine}
    return LLM(folder, dtype="float64", **engine, speculative_config={
        "method": "mtp", "num_speculative_tokens": k, **(spec or {})})


def requests(prompts=PROMPTS) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=41)


@pytest.fixture(scope="module")
def expected(target) -> list[list[int]]:
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    return token_ids(plain.generate(requests(), GREEDY))


@pytest.fixture(scope="module")
def random_mtp(target, tmp_path_factory) -> str:
    """The target with two random MTP layers (DeepSeek layout): k = 3 runs both, then the second
    again (one layer alone is EAGLE's path, checked draft by draft below)."""
    folder = copy_target(target, tmp_path_factory.mktemp("random_mtp") / "m")
    return add_mtp_layers(folder, "deepseek", num_layers=2, seed=3)


# ---- the published math, read independently ----------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_layer(weights: dict[str, torch.Tensor], p: str, layout: str, embeds: torch.Tensor,
                    states: torch.Tensor, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP layer written out from the saved tensors, causal over T positions from 0: (the state
    fed on, what the LM head reads)."""
    eps, heads = config["rms_norm_eps"], config["num_attention_heads"]
    kv_heads = config["num_key_value_heads"]
    names = {"deepseek": ("enorm", "hnorm", "eh_proj"),
             "mimo": ("token_layernorm", "hidden_layernorm", "input_proj")}[layout]
    token = rms_norm(embeds, weights[f"{p}{names[0]}.weight"], eps)
    state = rms_norm(states, weights[f"{p}{names[1]}.weight"], eps)
    pair = [state, token] if layout == "mimo" else [token, state]
    x = torch.cat(pair, -1) @ weights[f"{p}{names[2]}.weight"].T
    normed = rms_norm(x, weights[f"{p}input_layernorm.weight"], eps)
    # q/k/v biases (Qwen2) folded in as one more input column
    folded = dict(weights)
    for name in ("q", "k", "v"):
        w = weights[f"{p}self_attn.{name}_proj.weight"]
        bias = weights.get(f"{p}self_attn.{name}_proj.bias", torch.zeros(len(w), dtype=w.dtype))
        folded[f"{p}self_attn.{name}_proj.weight"] = torch.cat([w, bias[:, None]], 1)
    ones = torch.ones(len(normed), 1, dtype=normed.dtype)
    x = x + reference_self_attention(torch.cat([normed, ones], 1), folded, p, heads, kv_heads)
    post = rms_norm(x, weights[f"{p}post_attention_layernorm.weight"], eps)
    mlp = F.silu(post @ weights[f"{p}mlp.gate_proj.weight"].T) \
        * (post @ weights[f"{p}mlp.up_proj.weight"].T)
    x = x + mlp @ weights[f"{p}mlp.down_proj.weight"].T
    if layout == "mimo":
        x = rms_norm(x, weights[f"{p}final_layernorm.weight"], eps)
        return x, x
    return x, rms_norm(x, weights[f"{p}shared_head.norm.weight"], eps)


@pytest.mark.parametrize("layout", BODIES)
def test_the_published_math_is_read_right(layout, tmp_path):
    folder = build_tiny_checkpoint(tmp_path / "t", BODIES[layout], seed=2)
    add_mtp_layers(folder, layout, num_layers=2, seed=4)
    config = read_config(folder)
    arch = DecoderArch.from_hf_config(load_checkpoint(folder, torch.float32).hf_config)
    head = read_mtp_head(folder, arch).placed(torch.float64, torch.device("cpu"))
    weights = {k: v.double() for k, v in load_file(os.path.join(folder, "mtp.safetensors")).items()}
    torch.manual_seed(1)
    T = 7
    embeds = torch.randn(T, arch.hidden_size, dtype=torch.float64)
    states = torch.randn(T, arch.hidden_size, dtype=torch.float64)
    for depth, layer in enumerate(head.layers):
        kv = [torch.zeros(2, arch.num_kv_heads, 1, 8, arch.head_dim, dtype=torch.float64)]
        meta = build_attention_metadata([T], [T], [[0]], 8, None, torch.device("cpu"))
        with torch.no_grad():
            fed_on = layer(embeds, states, torch.arange(T), meta, kv)
        want_fed_on, want_head_input = reference_layer(
            weights, layer_prefix(config, layout, depth), layout, embeds, states, config)
        # NOTE: rotary angles are float32 in the engine, as in the target: ~1e-6 from float64
        torch.testing.assert_close(fed_on, want_fed_on, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.head_input(fed_on), want_head_input, rtol=1e-5,
                                   atol=1e-5)
        assert layer.lm_head is None and layer.embed_tokens is None  # the target's are shared


# ---- drafting: every layer in turn, equal to the chain recomputed from scratch -----------------
def chain_from_scratch(proposer: MtpProposer, tokens: list[int], features: torch.Tensor,
                       k: int) -> list[int]:
    """The drafts after committed `tokens` (target features [n, hidden]), each pass over the whole
    sequence in a fresh cache: layer j at position p reads (x_p, layer j-1's output at p - 1),
    layer 0 the target's; step s runs layer min(s, N - 1); the last layer then reads its own."""
    num_layers = len(proposer.head.layers)
    cache_shape = proposer.runner.kv_caches[0].shape  # [2, kv heads, blocks, block size, dim]
    states = torch.cat([torch.zeros_like(features[:1]), features[:-1]])  # what position p reads
    drafts: list[int] = []
    for step in range(k):
        depth = min(step, num_layers - 1)
        sequence = tokens + drafts
        T = len(sequence)
        kv = [torch.zeros(2, cache_shape[1], 16, 8, cache_shape[-1], dtype=torch.float64)]
        meta = build_attention_metadata([T], [T], [list(range(16))], 8, None, torch.device("cpu"))
        with torch.no_grad():
            out = proposer.head.layers[depth](proposer._embeddings[depth](torch.tensor(sequence)),
                                              states[:T], torch.arange(T), meta, kv)
            drafts.append(int(proposer._logits(out[-1:], depth).argmax(-1)))
        if step + 1 < num_layers:  # the next layer reads this one's outputs, one position back
            states = torch.cat([torch.zeros_like(out[:1]), out])
        else:  # the same layer again, reading its own newest output next
            states = torch.cat([states[:T], out[-1:]])
    return drafts


@pytest.mark.parametrize("num_layers", [1, 3])
def test_drafts_equal_the_chain_recomputed_from_scratch(target, num_layers, tmp_path,
                                                        monkeypatch):
    """Through chunked prefill and verification steps, with k past the number of layers."""
    from engine.training.train_speculator import load_reference

    folder = add_mtp_layers(copy_target(target, tmp_path / "m"), "deepseek", num_layers, seed=9)
    proposed: list[tuple[list[int], list[int]]] = []
    propose = MtpProposer.propose

    def spy(self, batch, caps, hidden):
        proposals = propose(self, batch, caps, hidden)
        for request, proposal in zip(batch, proposals):
            if proposal.token_ids:
                committed = request.token_ids_between(0, request.num_tokens)
                proposed.append((committed, list(proposal.token_ids)))
        return proposals

    monkeypatch.setattr(MtpProposer, "propose", spy)
    llm = mtp_llm(folder, k=4, max_num_batched_tokens=5)
    llm.generate(requests(PROMPTS[1:2]), GREEDY)
    proposer = llm.engine.proposer
    reference = load_reference(target).double()
    assert len(proposed) > 5 and all(len(d) == 4 for _, d in proposed[:-3])
    for committed, drafts in proposed:
        with torch.no_grad():
            features = reference.model(torch.tensor([committed])).last_hidden_state[0]
        assert chain_from_scratch(proposer, committed, features, len(drafts)) == drafts, committed


# ---- lossless -----------------------------------------------------------------------------------
def test_greedy_is_token_identical_in_mixed_batches(random_mtp, expected):
    params = [replace(GREEDY, num_speculative_tokens=cap) for cap in (None, 0, 1, 2)]
    outs = mtp_llm(random_mtp).generate(requests(), params)
    assert token_ids(outs) == expected
    assert outs[1].spec_stats.num_draft_tokens == 0 and outs[0].spec_stats.num_draft_tokens > 0
    assert len(outs[2].spec_stats.accepted_per_position) <= 1


def test_chunked_prefill_feeds_every_layer(random_mtp, expected):
    outs = mtp_llm(random_mtp, k=4, max_num_batched_tokens=7).generate(requests(), GREEDY)
    assert token_ids(outs) == expected
    assert all(o.spec_stats.num_draft_tokens > 0 for o in outs)


@pytest.fixture(scope="module", params=list(BODIES))
def mostly_right(request, tmp_path_factory) -> tuple[str, str]:
    """(the plain target, the same with two bigram MTP layers) in each published layout."""
    root = tmp_path_factory.mktemp(f"bigram_{request.param}")
    plain = build_tiny_checkpoint(root / "t", BODIES[request.param], seed=41,
                                  num_hidden_layers=4, layer_scale=0.01)
    with_mtp = add_mtp_layers(copy_target(plain, root / "m"), request.param, num_layers=2,
                              bigram=True)
    return plain, with_mtp


@pytest.mark.promise("greedy-lossless:mtp")
def test_greedy_is_lossless_when_the_drafts_are_mostly_right(mostly_right):
    """Drafts accepted, partly accepted and rejected, in a batch with capped requests; the tokens
    are the plain target's (MiMo's folder read as the Qwen2 it is)."""
    plain, with_mtp = mostly_right
    want = token_ids(LLM(plain, dtype="float64", max_model_len=256, num_kv_blocks=64).generate(
        requests(MOSTLY_RIGHT_PROMPTS), GREEDY))
    outs = mtp_llm(with_mtp).generate(requests(MOSTLY_RIGHT_PROMPTS), [
        replace(GREEDY, num_speculative_tokens=cap) for cap in (None, 2, None, None)])
    assert token_ids(outs) == want
    assert_often_right(outs)


@pytest.mark.promise("greedy-lossless-tree:mtp")
def test_draft_trees_are_lossless(mostly_right, monkeypatch):
    """EAGLE's trees, grown by the first MTP layer: branches proposed, paths accepted."""
    plain, with_mtp = mostly_right
    want = token_ids(LLM(plain, dtype="float64", max_model_len=256, num_kv_blocks=64).generate(
        requests(MOSTLY_RIGHT_PROMPTS), GREEDY))
    trees = []
    propose = MtpProposer.propose

    def spy(self, batch, caps, hidden):
        proposals = propose(self, batch, caps, hidden)
        trees.extend(p for p in proposals if p.is_tree)
        return proposals

    monkeypatch.setattr(MtpProposer, "propose", spy)
    outs = mtp_llm(with_mtp, k=6, spec={"draft_tree": True}).generate(
        requests(MOSTLY_RIGHT_PROMPTS), GREEDY)
    assert token_ids(outs) == want
    assert trees, "no proposal branched"
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 20


def test_float32_layers_run_as_one_native_call_each(mostly_right):
    """In float32 on the CPU each MTP layer's decoder layer is one native call (as EAGLE's), and
    the tokens stay the float32 target's."""
    from kernels.native_decoder import native_decoder_available

    plain, with_mtp = mostly_right
    want = token_ids(LLM(plain, dtype="float32", max_model_len=256, num_kv_blocks=64).generate(
        requests(MOSTLY_RIGHT_PROMPTS), GREEDY))
    llm = LLM(with_mtp, dtype="float32", max_model_len=256, num_kv_blocks=64,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    if native_decoder_available():
        assert all(layer.native_pass is not None for layer in llm.engine.proposer.head.layers)
    outs = llm.generate(requests(MOSTLY_RIGHT_PROMPTS), GREEDY)
    assert token_ids(outs) == want
    assert_often_right(outs)


def test_greedy_survives_preemption(random_mtp, expected):
    llm = mtp_llm(random_mtp, max_model_len=72, num_kv_blocks=18, block_size=4)
    assert token_ids(llm.generate(requests(), GREEDY)) == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(o.spec_stats.num_draft_tokens > 0 for o in llm.generate(requests(), GREEDY))


def test_a_cached_prefix_gives_the_same_drafts(random_mtp, expected, monkeypatch):
    """A cached prefix's features come from beside its blocks and every layer computes its own K/V
    for it: the drafts (which random layers derive from every state they read) equal those of an
    engine that computed the whole prompt."""
    runs = []
    propose = MtpProposer.propose
    for caching in (True, False):
        seen: list[list[int]] = []

        def spy(self, batch, caps, hidden, seen=seen):
            proposals = propose(self, batch, caps, hidden)
            seen.extend(list(p.token_ids) for p in proposals)
            return proposals

        monkeypatch.setattr(MtpProposer, "propose", spy)
        llm = mtp_llm(random_mtp, enable_prefix_caching=caching)
        llm.generate(requests(PROMPTS[1:2]), GREEDY)
        seen.clear()
        again = llm.generate(requests(PROMPTS[1:2]), GREEDY)[0]
        assert again.num_cached_tokens == (32 if caching else 0)
        assert again.outputs[0].token_ids == expected[1]
        runs.append(seen)
    assert runs[0] == runs[1] and sum(len(d) for d in runs[0]) > 20, runs


def test_seeded_sampling_does_not_depend_on_the_batch(random_mtp):
    params = [SamplingParams(temperature=0.9, max_tokens=16, seed=s, ignore_eos=True,
                             num_speculative_tokens=cap) for s, cap in zip(range(4), (3, 1, 2, 3))]
    together = token_ids(mtp_llm(random_mtp).generate(requests(), params))
    alone = token_ids(mtp_llm(random_mtp).generate(requests(PROMPTS[3:]), params[3]))
    assert together[3] == alone[0]


# ---- the target's own tables, and copies of them -------------------------------------------------
def test_copies_of_the_targets_tables_are_shared_and_a_head_of_its_own_is_used(target, tmp_path):
    """DeepSeek-V3's files carry shared_head.head and embed_tokens per layer: equal to the target's,
    the target's serve (no second copy in memory); a head of its own scores that layer's drafts."""
    weights = load_file(os.path.join(target, "model.safetensors"))
    config = read_config(target)
    p = layer_prefix(config, "deepseek", 0)
    copies = {f"{p}shared_head.head.weight": weights["lm_head.weight"],
              f"{p}embed_tokens.weight": weights["model.embed_tokens.weight"]}
    folder = add_mtp_layers(copy_target(target, tmp_path / "copies"), extra=copies)
    llm = mtp_llm(folder)
    layer = llm.engine.proposer.head.layers[0]
    assert layer.lm_head is None and layer.embed_tokens is None
    assert llm.engine.proposer._lm_heads[0] is llm.engine.worker.model.lm_head
    own = {f"{p}shared_head.head.weight": torch.randn_like(weights["lm_head.weight"])}
    folder = add_mtp_layers(copy_target(target, tmp_path / "own"), extra=own)
    proposer = mtp_llm(folder).engine.proposer
    h = torch.randn(3, config["hidden_size"], dtype=torch.float64)
    norm = proposer.head.layers[0].head_norm
    torch.testing.assert_close(proposer._logits(h, 0),
                               norm(h) @ own[f"{p}shared_head.head.weight"].double().T)


# ---- refused at start-up, naming what is missing ------------------------------------------------
def test_a_checkpoint_without_mtp_layers_is_refused(target, tmp_path):
    with pytest.raises(ValueError, match='no "num_nextn_predict_layers".*model.layers.'
                                         r'\{num_hidden_layers \+ i\}.*model.mtp_layers'):
        mtp_llm(target)
    folder = copy_target(target, tmp_path / "says")
    config = read_config(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 1}, f)
    with pytest.raises(ValueError, match="no tensor under model.layers.2. .DeepSeek-V3. nor "
                                         "model.mtp_layers.0. .MiMo."):
        mtp_llm(folder)
    arch = DecoderArch.from_hf_config(load_checkpoint(target, torch.float32).hf_config)
    with pytest.raises(ValueError, match="the embedded GGUF which holds none"):
        read_mtp_head(None, arch)
    with pytest.raises(ValueError, match="model.gguf, not a folder, which holds none"):
        read_mtp_head(str(tmp_path / "model.gguf"), arch)


def test_layers_that_do_not_fit_are_refused(target, tmp_path):
    config = read_config(target)
    p = layer_prefix(config, "deepseek", 1)
    # the config names 2 layers, the file holds 1
    folder = add_mtp_layers(copy_target(target, tmp_path / "short"), num_layers=1)
    says_two = {**read_config(folder), "num_nextn_predict_layers": 2}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(says_two, f)
    with pytest.raises(ValueError, match=f"lacks MTP layer 1 .*no tensor under {p}"):
        mtp_llm(folder)
    # an MLA attention has no place in a Llama-shaped layer
    p0 = layer_prefix(config, "deepseek", 0)
    folder = add_mtp_layers(copy_target(target, tmp_path / "mla"),
                            extra={f"{p0}self_attn.q_a_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(ValueError, match="q_a_proj.weight'] have no place"):
        mtp_llm(folder)
    # a projection for another hidden size
    folder = add_mtp_layers(copy_target(target, tmp_path / "wide"),
                            extra={f"{p0}eh_proj.weight": torch.zeros(64, 256)})
    with pytest.raises(ValueError, match=r"eh_proj.weight is \[64, 256\], the target's shape "
                                         r"needs \[64, 128\]"):
        mtp_llm(folder)
    # a "model" beside mtp is refused, not ignored
    with pytest.raises(ValueError, match='drop "model"'):
        LLM(target, dtype="float64", speculative_config={
            "method": "mtp", "model": target, "num_speculative_tokens": 2})


# ---- the sampling law ---------------------------------------------------------------------------
@pytest.mark.promise("sampling-law", "sampling-law-canaries")
def test_sampling_follows_the_target_and_a_broken_sampler_is_caught(tmp_path, monkeypatch):
    """Unseeded sampling through two random MTP layers (drafts drawn from each layer's own q)
    follows the target, with tokens enough to catch a 2% TV error with 95% power, both verdicts
    common; in the same run the same check rejects a sampler that draws a rejected draft's
    replacement from p instead of the residual (tests/engine/test_sampling_distribution_proposers.py
    checks every other proposer so)."""
    import sampling_law
    import transformers
    from bigram_model import build_bigram_checkpoint
    from sampling_law import FULL_OTHER_EPSILON, OTHER_EPSILON, TARGET_LOGITS, VOCAB, Case, K

    import kernels.rejection_reference as reference_module

    folder = add_mtp_layers(build_bigram_checkpoint(tmp_path / "bigram", TARGET_LOGITS),
                            num_layers=2, seed=5)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        logits = model(torch.arange(VOCAB)[:, None]).logits[:, -1]  # [vocab, vocab]
    case = Case(temperature=0.8)
    config = {"method": "mtp", "num_speculative_tokens": K}
    probs = sampling_law.reference_probs(logits, case)
    threads = torch.get_num_threads()
    try:
        result = sampling_law.sample(folder, case, probs, seed=None, speculative_config=config,
                                     epsilon=OTHER_EPSILON)
        sampling_law.assert_follows_target(result, probs, OTHER_EPSILON)
        num_tokens = int(result.counts.sum())
        assert result.num_accepted_tokens > 0.1 * num_tokens, result
        assert result.num_draft_tokens - result.num_accepted_tokens > 0.1 * num_tokens, result
        monkeypatch.setattr(reference_module, "recovery_weights", sampling_law.recover_from_p)
        broken = sampling_law.sample(folder, case, probs, seed=None, speculative_config=config,
                                     fraction=0.2, epsilon=FULL_OTHER_EPSILON)
        verdict = sampling_law.chain_verdict(broken.counts, probs)
        assert verdict.rejects, f"recovering from p went unnoticed: {verdict}"
    finally:
        torch.set_num_threads(threads)


# ---- served: the per-request payload and the Prometheus series name the method ------------------
@pytest.mark.slow
def test_serve_reports_mtp_like_every_method(tmp_path):
    import httpx
    from live_server import LiveServer
    from prometheus_client.parser import text_string_to_metric_families

    plain = build_tiny_checkpoint(tmp_path / "t", "llama", seed=41, num_hidden_layers=4,
                                  layer_scale=0.01)
    folder = add_mtp_layers(copy_target(plain, tmp_path / "m"), num_layers=2, bigram=True)
    config = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
    with LiveServer(["--model", folder, "--dtype", "float32", "--max-model-len", "256",
                     "--speculative-config", config]) as server:
        body = {"model": "m", "prompt": MOSTLY_RIGHT_PROMPTS[1], "max_tokens": 24,
                "temperature": 0}
        response = httpx.post(f"{server.api}/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        stats = response.json()["metrics"]["speculative_decoding"]
        assert stats["num_draft_tokens"] > 0 and stats["num_accepted_draft_tokens"] > 0
        text = httpx.get(f"{server.url}/metrics", timeout=5).text
        drafts = [s for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name == "specserve:spec_decode_num_draft_tokens_total"]
        assert drafts and all(s.labels["spec_method"] == "mtp" for s in drafts)
        assert sum(s.value for s in drafts) == stats["num_draft_tokens"]
