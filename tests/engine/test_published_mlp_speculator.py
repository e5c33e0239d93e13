"""IBM's MLP speculators as published (config.json with MLPSpeculatorPreTrainedModel / mlp_speculator,
emb.{i} / proj.{i} / head.{i} / ln.{i} tensors of their own), built small and random with the real key
names, config fields and shapes: the published math is read right (every draft logit the proposer
computes, against an independent reading of the saved tensors), output is lossless (greedy
identical, sampled distribution unchanged), and a speculator for another model is refused."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spec_outputs import third_token_law, token_ids, two_sample_chi2_pvalue
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.proposers import mlp_speculator

PROMPTS = [[1, 5, 9, 13, 2, 7], [1] + list(range(30, 62)), [1, 60], [1, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# like ibm-ai-platform/llama3-8b-accelerator (own weights per stage, model.safetensors) and
# ibm-granite's tied, input-scaling accelerators (pytorch_model.bin under `speculator.`, holding only
# the tensors the stages share)
LAYOUTS = {"untied": {"scale_input": False, "tie_weights": False},
           "tied_scaled": {"scale_input": True, "tie_weights": True}}
INNER_DIM = 48


def write_ibm_speculator(folder: str, hidden_size: int, vocab_size: int, layout: str = "untied",
                         n_predict: int = 3, inner_dim: int = INNER_DIM, seed: int = 0) -> str:
    torch.manual_seed(seed)
    options = LAYOUTS[layout]
    tied = options["tie_weights"]
    tensors = {}
    for i in range(n_predict):
        if not tied or i <= 1:  # tied: stages after the first share proj.1
            tensors[f"proj.{i}.weight"] = torch.randn(
                inner_dim, hidden_size if i == 0 else inner_dim) / math.sqrt(inner_dim)
        if not tied or i == 0:  # tied: every stage shares emb.0, head.0 and ln.0
            tensors[f"emb.{i}.weight"] = torch.randn(vocab_size, inner_dim) / math.sqrt(inner_dim)
            tensors[f"head.{i}.weight"] = torch.randn(vocab_size, inner_dim) / math.sqrt(inner_dim)
            tensors[f"ln.{i}.weight"] = 1 + 0.1 * torch.randn(inner_dim)
            tensors[f"ln.{i}.bias"] = 0.1 * torch.randn(inner_dim)
    config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
              "emb_dim": hidden_size, "inner_dim": inner_dim, "n_predict": n_predict,
              "vocab_size": vocab_size, "top_k_tokens_per_head": [4, 3, 2, 2][:n_predict],
              "n_candidates": 5, "torch_dtype": "float16", "transformers_version": "4.38.2",
              **options}
    os.makedirs(folder, exist_ok=True)
    if options["tie_weights"]:
        torch.save({f"speculator.{k}": v.half() for k, v in tensors.items()},
                   os.path.join(folder, "pytorch_model.bin"))
    else:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def saved_tensors(folder: str) -> dict[str, torch.Tensor]:
    if os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        tensors = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)
    else:
        tensors = load_file(os.path.join(folder, "model.safetensors"))
    return {k.removeprefix("speculator."): v.double() for k, v in tensors.items()}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=53)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def speculator(request, tmp_path_factory) -> str:
    return write_ibm_speculator(str(tmp_path_factory.mktemp(request.param)), 64, 96,
                                request.param)


def spec_llm(target: str, folder: str, k: int = 3) -> LLM:
    return LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64,
               speculative_config={"method": "mlp_speculator", "model": folder,
                                   "num_speculative_tokens": k})


# ---- the published math, read independently -------------------------------------------------
def reference_logits(folder: str, state: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """fms-extras' MLPSpeculator written out from the saved tensors for one chain: the target's
    state [hidden] and the tokens fed to stages 0, 1, ...; each stage's logits [vocab]."""
    w = saved_tensors(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    n, inner = config["n_predict"], config["inner_dim"]

    def tensor(kind: str, i: int, name: str = "weight") -> torch.Tensor:
        if config["tie_weights"] and f"{kind}.{i}.{name}" not in w:
            i = 1 if kind == "proj" else 0
        return w[f"{kind}.{i}.{name}"]

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean() + 1e-6)

    state_weight = 0.5 ** (0.5 / n)
    emb_weight = math.sqrt(1 - state_weight ** 2)
    if config["scale_input"]:
        state = rms(state) / 2 ** 0.5
    out = []
    for i, token in enumerate(tokens):
        z = tensor("emb", i)[token] * emb_weight * math.sqrt(inner / 2)
        mixed = tensor("proj", i) @ state * state_weight + z
        state = F.gelu(rms(mixed) * tensor("ln", i) + tensor("ln", i, "bias"))
        out.append(tensor("head", i) @ state)
    return out


def test_every_draft_logit_is_the_published_math(target, speculator, monkeypatch):
    """Each propose call's chain of stages, through the engine: fed the target's hidden state and
    the newest token, then each draft, scored by the speculator's own embeddings and heads."""
    chains: list[dict] = []
    propose, draft_chains = (mlp_speculator.MLPSpeculatorProposer.propose,
                             mlp_speculator.draft_chains)

    def spy_propose(self, requests, caps, target_hidden):
        if target_hidden is not None and caps[0] > 0:
            chains.append({"state": target_hidden[0].clone(), "tokens": [], "logits": []})
        return propose(self, requests, caps, target_hidden)

    def spy_chains(requests, caps, advance):
        def recording(step, rows, drafts):
            (row,) = rows
            request = requests[row]
            chains[-1]["tokens"].append(drafts[row][-1] if drafts[row] else
                                        (request.output_token_ids or request.prompt_token_ids)[-1])
            ran, logits = advance(step, rows, drafts)
            chains[-1]["logits"].append(logits[0].clone())
            return ran, logits
        return draft_chains(requests, caps, recording)

    monkeypatch.setattr(mlp_speculator.MLPSpeculatorProposer, "propose", spy_propose)
    monkeypatch.setattr(mlp_speculator, "draft_chains", spy_chains)
    spec_llm(target, speculator).generate({"prompt_token_ids": PROMPTS[0]}, GREEDY)
    # near max_tokens the engine asks for fewer drafts
    assert sum(len(chain["tokens"]) == 3 for chain in chains) > 3
    assert all(1 <= len(chain["tokens"]) <= 3 for chain in chains)
    for chain in chains:
        want = reference_logits(speculator, chain["state"], chain["tokens"])
        for got, expected in zip(chain["logits"], want):
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


def test_greedy_is_lossless_and_drafts_are_proposed(target, speculator):
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    expected = token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             num_speculative_tokens=cap) for cap in (None, 4, 1, 2)]
    outs = spec_llm(target, speculator, k=4).generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                      params)
    assert token_ids(outs) == expected
    assert all(o.spec_stats.num_draft_tokens > 0 for o in outs)
    # 3 stages: never more than 3 drafts a step, whatever k asks
    assert all(len(o.spec_stats.accepted_per_position) <= 3 for o in outs)


@pytest.mark.slow
def test_sampled_distribution_is_unchanged(tmp_path):
    """Token 3 of the output, mostly verified from the speculator's drafts: the same distribution
    with and without speculation (two-sample chi-square over 2000 seeded completions each)."""
    path = build_tiny_checkpoint(tmp_path / "t", "llama", seed=17, vocab_size=12,
                                 initializer_range=0.05)
    folder = write_ibm_speculator(str(tmp_path / "s"), 64, 12, "tied_scaled", seed=7)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain, _ = third_token_law(path, None, prompt, 2000)
    spec = {"method": "mlp_speculator", "model": folder, "num_speculative_tokens": 3}
    speculative, outs = third_token_law(path, spec, prompt, 2000)
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 100
    assert two_sample_chi2_pvalue(plain, speculative) > 1e-4, (plain, speculative)


# ---- refused at start-up -----------------------------------------------------------------------
def test_a_speculator_for_another_model_is_refused(target, tmp_path):
    folder = write_ibm_speculator(str(tmp_path / "narrow"), 32, 96)
    with pytest.raises(ValueError, match=f"speculator in {folder} was made for hidden size 32 and "
                                         f"vocabulary 96; the target has 64 and 96"):
        spec_llm(target, folder)
    folder = write_ibm_speculator(str(tmp_path / "vocab"), 64, 104)
    with pytest.raises(ValueError, match="vocabulary 104; the target has 64 and 96"):
        spec_llm(target, folder)


def test_a_folder_for_another_method_or_not_fitting_its_config_is_refused(target, tmp_path):
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 96}))
    with pytest.raises(ValueError, match='"method": "eagle"'):
        spec_llm(target, str(eagle))
    folder = write_ibm_speculator(str(tmp_path / "inner"), 64, 96)
    config = json.loads((tmp_path / "inner" / "config.json").read_text())
    (tmp_path / "inner" / "config.json").write_text(json.dumps({**config, "inner_dim": 32}))
    with pytest.raises(ValueError, match=r"emb.0.weight is \[96, 48\], .* needs \[96, 32\]"):
        spec_llm(target, folder)
    folder = write_ibm_speculator(str(tmp_path / "short"), 64, 96)
    config = json.loads((tmp_path / "short" / "config.json").read_text())
    (tmp_path / "short" / "config.json").write_text(json.dumps({**config, "n_predict": 4}))
    with pytest.raises(ValueError, match="lacks emb.3.weight"):
        spec_llm(target, folder)
