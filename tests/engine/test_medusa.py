"""Medusa heads ("method": "medusa"): the published layouts (FasterDecoding's, vLLM's) and specserve's own
are read as the same math, written here with random weights under the real names; greedy output is
token-identical to plain decoding with random heads and with heads that are often right (chains,
grown trees and medusa_choices trees; batched with capped requests, preempted, prefix cache hits);
seeded sampling does not depend on the batch; the tree rules; and bad configurations fail at start-up
naming what is wrong. The sampling law is test_medusa_sampling_law.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from bigram_drafters import MOSTLY_RIGHT_PROMPTS, assert_often_right
from medusa_heads import (
    build_medusa_target,
    random_tensors,
    write_authors_folder,
    write_bigram_medusa,
    write_vllm_folder,
)
from spec_outputs import token_ids
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.models.arch import DecoderArch
from engine.proposers.medusa_heads import MedusaConfig, MedusaHeads
from engine.proposers.medusa_tree import choice_tree, cut_choices
from engine.proposers.published_medusa import load_medusa_heads
from engine.request import Request
from engine.spec_config import SpeculativeConfig

PROMPTS = [[1, 5, 9, 13, 2, 7], [1] + list(range(30, 62)), [1, 60], [1, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
HIDDEN, VOCAB = 64, 96  # tiny_models' target
CHOICES = [[0], [0, 0], [1], [0, 1], [0, 0, 0], [2], [1, 0]]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=31)


@pytest.fixture(scope="module")
def arch(target) -> DecoderArch:
    import transformers

    return DecoderArch.from_hf_config(transformers.AutoConfig.from_pretrained(target))


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("random_heads"))
    return write_authors_folder(folder, random_tensors(HIDDEN, VOCAB, num_heads=3), 3, 1)


@pytest.fixture(scope="module")
def expected(target) -> list[list[int]]:
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    return token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))


@pytest.fixture(scope="module")
def mostly_right(tmp_path_factory) -> tuple[str, str, list[list[int]]]:
    """(target, FasterDecoding-layout heads built from it, its greedy tokens on the prompts)."""
    root = tmp_path_factory.mktemp("mostly_right")
    target = build_medusa_target(root / "target")
    heads = write_bigram_medusa(target, str(root / "heads"))
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    return target, heads, token_ids(plain.generate(
        [{"prompt_token_ids": p} for p in MOSTLY_RIGHT_PROMPTS], GREEDY))


def medusa(target: str, heads: str, k: int = 3, **options) -> LLM:
    engine = {key: options.pop(key) for key in ("num_kv_blocks", "block_size", "max_model_len")
              if key in options}
    return LLM(target, dtype="float64", **{"max_model_len": 256, "num_kv_blocks": 64, **engine},
               speculative_config={"method": "medusa", "model": heads,
                                   "num_speculative_tokens": k, **options})


# ---- the layouts, read as the same math ------------------------------------------------------
def reference_logits(tensors: dict[str, torch.Tensor], hidden: torch.Tensor, num_heads: int,
                     num_layers: int, target_head: torch.Tensor | None = None,
                     token_map: torch.Tensor | None = None) -> torch.Tensor:
    """Medusa's forward written out from the tensors, as its authors do: per head, ResBlocks
    x + silu(linear(x)), then the head's projection (or the shared one, or the target's);
    [heads, rows, vocab]."""
    out = []
    for head in range(num_heads):
        x = hidden
        for layer in range(num_layers):
            bias = tensors.get(f"blocks.{head}.layers.{layer}.bias")
            x = x + F.silu(F.linear(x, tensors[f"blocks.{head}.layers.{layer}.weight"].double(),
                                    None if bias is None else bias.double()))
        weight = tensors.get(f"lm_heads.{head}.weight", tensors.get("lm_head.weight", target_head))
        logits = x @ weight.double().T
        if token_map is not None:
            full = torch.full((len(x), VOCAB), float("-inf"), dtype=torch.float64)
            full[:, token_map] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


def check_reads(folder: str, arch: DecoderArch, want: torch.Tensor, hidden: torch.Tensor,
                target_head: torch.Tensor | None = None, atol: float = 1e-9) -> MedusaHeads:
    heads = load_medusa_heads(folder, arch, torch.float64, torch.device("cpu"))
    lm_head = None
    if target_head is not None:
        lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=torch.float64)
        lm_head.weight.data.copy_(target_head)
    got = heads.logits(hidden, len(want), lm_head)
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
    return heads


def test_the_authors_layout_reads_as_their_forward(arch, tmp_path):
    hidden = torch.randn(5, HIDDEN, dtype=torch.float64)
    tensors = random_tensors(HIDDEN, VOCAB, num_heads=4, num_layers=2, seed=1)
    want = reference_logits(tensors, hidden, 4, 2)
    heads = check_reads(write_authors_folder(str(tmp_path / "st"), tensors, 4, 2), arch, want,
                        hidden)
    assert heads.config.vocab_projection == "per_head" and heads.config.num_layers == 2
    # the .pt state dict, in half precision, under the prefix of a whole MedusaModel's dict
    halved = {name: t.half().float() for name, t in tensors.items()}
    check_reads(write_authors_folder(str(tmp_path / "pt"), tensors, 4, 2, file="pt",
                                     prefix="medusa_head."), arch,
                reference_logits(halved, hidden, 4, 2), hidden)


def test_heads_without_projections_share_the_targets_lm_head(arch, tmp_path):
    hidden = torch.randn(3, HIDDEN, dtype=torch.float64)
    tensors = random_tensors(HIDDEN, VOCAB, num_heads=2, projection="target", seed=2)
    target_head = torch.randn(VOCAB, HIDDEN, dtype=torch.float64)
    want = reference_logits(tensors, hidden, 2, 1, target_head)
    heads = check_reads(write_authors_folder(str(tmp_path / "authors"), tensors, 2, 1), arch,
                        want, hidden, target_head)
    assert heads.config.vocab_projection == "target"
    check_reads(write_vllm_folder(str(tmp_path / "vllm"), tensors, HIDDEN, VOCAB, 2, 1), arch,
                want, hidden, target_head)


@pytest.mark.parametrize("variant", ["per_head", "bin_no_bias", "original_lm_head", "truncated"])
def test_the_vllm_layout_reads_as_vllms_forward(arch, tmp_path, variant):
    hidden = torch.randn(4, HIDDEN, dtype=torch.float64)
    token_map = torch.randperm(VOCAB)[:40].sort().values if variant == "truncated" else None
    tensors = random_tensors(HIDDEN, VOCAB, num_heads=3, seed=3, bias=variant != "bin_no_bias",
                             projection="shared" if variant == "original_lm_head" else "per_head",
                             projection_rows=None if token_map is None else len(token_map))
    folder = write_vllm_folder(str(tmp_path), tensors, HIDDEN, VOCAB, 3, 1,
                               original_lm_head=variant == "original_lm_head",
                               token_map=token_map,
                               file="bin" if variant == "bin_no_bias" else "safetensors")
    check_reads(folder, arch, reference_logits(tensors, hidden, 3, 1, token_map=token_map), hidden)


def test_our_own_folder_saves_and_reads_back(arch, tmp_path):
    config = MedusaConfig(HIDDEN, VOCAB, num_heads=2, num_layers=1, trained_for="test")
    heads = MedusaHeads(config)
    heads.save(str(tmp_path))
    read = load_medusa_heads(str(tmp_path), arch, torch.float32, torch.device("cpu"))
    assert read.config == config
    for name, tensor in heads.state_dict().items():
        assert torch.equal(read.state_dict()[name], tensor)


# ---- greedy: token-identical -----------------------------------------------------------------
@pytest.mark.parametrize("shape", ["chain", "tree", "choices"])
def test_greedy_is_token_identical_in_mixed_batches(target, random_heads, expected, shape):
    options = {"chain": {}, "tree": {"draft_tree": True},
               "choices": {"draft_tree": True, "medusa_choices": CHOICES}}[shape]
    llm = medusa(target, random_heads, k=3 if shape == "chain" else 6, **options)
    params = [replace(GREEDY, num_speculative_tokens=cap) for cap in (None, 0, 1, 2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert token_ids(outs) == expected
    assert outs[1].spec_stats.num_draft_tokens == 0 and outs[0].spec_stats.num_draft_tokens > 0
    if shape == "chain":
        assert len(outs[2].spec_stats.accepted_per_position) <= 1


@pytest.mark.parametrize("shape", [
    pytest.param("chain", marks=pytest.mark.promise("greedy-lossless:medusa")),
    pytest.param("tree", marks=pytest.mark.promise("greedy-lossless-tree:medusa")),
    "choices"])
def test_greedy_is_lossless_when_the_drafts_are_mostly_right(mostly_right, shape):
    target, heads, want = mostly_right
    options = {"chain": {}, "tree": {"draft_tree": True},
               "choices": {"draft_tree": True, "medusa_choices": CHOICES}}[shape]
    llm = medusa(target, heads, k=3 if shape == "chain" else 8, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in MOSTLY_RIGHT_PROMPTS],
                        [replace(GREEDY, num_speculative_tokens=cap)
                         for cap in (None, 2, None, None)])
    assert token_ids(outs) == want
    assert_often_right(outs, at_least=0.3 if shape == "chain" else 0.1)


def test_vllm_layout_heads_accept_as_the_authors_layout_does(mostly_right, tmp_path):
    target, heads, want = mostly_right
    vllm_heads = write_bigram_medusa(target, str(tmp_path), layout="vllm")
    outs = medusa(target, vllm_heads).generate(
        [{"prompt_token_ids": p} for p in MOSTLY_RIGHT_PROMPTS], GREEDY)
    authors = medusa(target, heads).generate(
        [{"prompt_token_ids": p} for p in MOSTLY_RIGHT_PROMPTS], GREEDY)
    assert token_ids(outs) == want == token_ids(authors)
    assert [o.spec_stats.accepted_per_position for o in outs] == \
        [o.spec_stats.accepted_per_position for o in authors]


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_survives_preemption_and_prefix_cache_hits(mostly_right, tree):
    target, heads, want = mostly_right
    llm = medusa(target, heads, k=6 if tree else 3, draft_tree=tree, max_model_len=72,
                 num_kv_blocks=22, block_size=4)
    requests = [{"prompt_token_ids": p} for p in MOSTLY_RIGHT_PROMPTS]
    assert token_ids(llm.generate(requests, GREEDY)) == want
    assert llm.engine.scheduler.num_preemptions > 0
    # the same prompts again, their prefixes now cached
    outs = llm.generate(requests, GREEDY)
    assert token_ids(outs) == want
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0


def test_seeded_sampling_does_not_depend_on_the_batch(target, random_heads):
    params = [SamplingParams(temperature=0.9, max_tokens=16, seed=s, ignore_eos=True,
                             num_speculative_tokens=cap) for s, cap in zip(range(4), (3, 1, 2, 3))]
    together = token_ids(medusa(target, random_heads).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params))
    alone = token_ids(medusa(target, random_heads).generate({"prompt_token_ids": PROMPTS[3]},
                                                            params[3]))
    assert together[3] == alone[0]


def test_sampled_chains_carry_the_heads_q(target, random_heads):
    """A sampled request's chain carries q (rejection sampling against it); a greedy one's none."""
    llm = medusa(target, random_heads)
    proposer, seen = llm.engine.proposer, []
    propose = proposer.propose

    def recording(requests, caps, target_hidden):
        proposals = propose(requests, caps, target_hidden)
        seen.extend((r.params.is_greedy, p) for r, p in zip(requests, proposals))
        return proposals

    proposer.propose = recording
    llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2,
                 [GREEDY, SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True)])
    sampled = [p for is_greedy, p in seen if not is_greedy and p.token_ids]
    assert sampled and all(p.probs is not None and p.probs.shape == (len(p.token_ids), VOCAB)
                           for p in sampled)
    for p in sampled:
        torch.testing.assert_close(p.probs.sum(-1), torch.ones(len(p.token_ids),
                                                               dtype=p.probs.dtype))
    assert all(p.probs is None for is_greedy, p in seen if is_greedy)


# ---- the tree rules --------------------------------------------------------------------------
def test_a_choice_tree_takes_each_heads_ranked_guesses_depth_first():
    request = Request("r", [1, 2], GREEDY, frozenset())
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0, -2.0],   # head 0: 1, 2, 3, ...
                           [5.0, 0.0, 0.0, 4.0, 0.0, 3.0]],    # head 1: 0, 3, 5, ...
                          dtype=torch.float64)
    proposal = choice_tree(request, [(0,), (1,), (0, 0), (0, 1), (1, 2)], logits)
    # depth-first, best child first: 1 (0,), 0 (0,0), 3 (0,1), 2 (1,), 5 (1,2)
    assert proposal.token_ids == [1, 0, 3, 2, 5]
    assert proposal.parents == [-1, 0, 0, -1, 3]
    assert proposal.probs is None


def test_a_banned_guess_is_left_out_with_its_subtree():
    request = Request("r", [1, 2], GREEDY, frozenset())
    logits = torch.tensor([[0.0, 3.0, float("-inf")], [1.0, 0.0, 2.0]], dtype=torch.float64)
    # rank 2 of head 0 is a -inf token: (2,) and (2, 0) go
    proposal = choice_tree(request, [(0,), (1,), (2,), (0, 0), (2, 0)], logits)
    assert proposal.token_ids == [1, 2, 0] and proposal.parents == [-1, 0, -1]


def test_a_budget_keeps_the_first_choices_each_after_its_parent():
    choices = [(0,), (0, 0), (1, 0), (1,), (0, 1), (2,)]
    # (1, 0) is listed before its parent: it waits for (1,)
    assert cut_choices(choices, 3) == [(0,), (0, 0), (1,)]
    assert cut_choices(choices, 4) == [(0,), (0, 0), (1,), (1, 0)]
    assert cut_choices(choices, 10) == [(0,), (0, 0), (1,), (1, 0), (0, 1), (2,)]


# ---- bad configurations, refused at start-up -------------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({}, 'needs "model"'),
    ({"model": "x", "medusa_choices": [[0]]}, '"draft_tree": true'),
    ({"model": "x", "draft_tree": True, "medusa_choices": []}, "non-empty list"),
    ({"model": "x", "draft_tree": True, "medusa_choices": [[0], [0, -1]]}, "ranks in"),
    ({"model": "x", "draft_tree": True, "medusa_choices": [[0], "0"]}, "lists of ranks"),
    ({"model": "x", "draft_tree": True, "medusa_choices": [[0], [True]]}, "lists of ranks"),
    ({"model": "x", "draft_tree": True, "medusa_choices": [[0], [1, 1]]}, r"no parent \[1\]"),
    ({"model": "x", "draft_tree": True, "medusa_choices": [[0], [0]]}, "twice"),
])
def test_bad_medusa_settings_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json({"method": "medusa", "num_speculative_tokens": 3, **config})


def test_medusa_choices_belong_to_medusa():
    with pytest.raises(ValueError, match='"method": "medusa"'):
        SpeculativeConfig.from_json({"method": "eagle", "model": "x", "num_speculative_tokens": 3,
                                     "draft_tree": True, "medusa_choices": [[0]]})


def test_heads_for_another_model_are_refused(target, tmp_path):
    folder = write_authors_folder(str(tmp_path / "wide"), random_tensors(32, VOCAB), 3, 1)
    with pytest.raises(ValueError, match="hidden size 32 and vocabulary 96"):
        medusa(target, folder)
    folder = write_vllm_folder(str(tmp_path / "vocab"), random_tensors(HIDDEN, 50), HIDDEN, 50,
                               3, 1)
    with pytest.raises(ValueError, match="vocabulary 50; the target has 64 and 96"):
        medusa(target, folder)


def test_more_depth_than_heads_is_refused(target, random_heads):
    with pytest.raises(ValueError, match="asks for 4 tokens ahead; the 3 Medusa heads"):
        medusa(target, random_heads, k=4)
    with pytest.raises(ValueError, match="medusa_choices reach 4 tokens ahead"):
        medusa(target, random_heads, k=8, draft_tree=True,
               medusa_choices=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])


def test_a_folder_without_medusa_heads_is_refused(target, tmp_path):
    from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

    with pytest.raises(FileNotFoundError, match="does not exist"):
        medusa(target, str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no Medusa heads"):
        medusa(target, str(tmp_path / "empty"))
    MLPSpeculator(MLPSpeculatorConfig(HIDDEN, VOCAB, 3)).save(str(tmp_path / "mlp"))
    with pytest.raises(FileNotFoundError, match="holds no Medusa heads"):
        medusa(target, str(tmp_path / "mlp"))
    with pytest.raises(ValueError, match="holds no Medusa heads: its config.json"):
        medusa(target, target)  # the target's own folder, by mistake


def test_a_tensor_out_of_place_is_named(target, tmp_path):
    tensors = random_tensors(HIDDEN, VOCAB, num_heads=3)
    del tensors["blocks.1.layers.0.bias"]
    with pytest.raises(ValueError, match="lack blocks.1.layers.0.bias"):
        medusa(target, write_vllm_folder(str(tmp_path / "a"), tensors, HIDDEN, VOCAB, 3, 1))
    tensors = random_tensors(HIDDEN, VOCAB, num_heads=3)
    del tensors["lm_heads.2.weight"]
    with pytest.raises(ValueError, match="lack lm_heads.2.weight"):
        medusa(target, write_authors_folder(str(tmp_path / "b"), tensors, 3, 1))
