"""Every proposer and every draft tree is lossless on tiny Qwen3 and Gemma 3 targets (per-head q/k
norms, Gemma's norms around each block, scaled embeddings, sliding layers with their own RoPE):
greedy tokens identical with and without speculation, in batches with capped requests, and drafts
accepted, so speculation really ran.

Each family's target is mostly bigram (tests/helpers/family_drafters.py) and its drafters are
built from its own weights, so they are often right: long accepted blocks, partial ones and
rejections all run. Every prompt is longer than Gemma 3's window of 6, so its sliding layers
slide during prefill, verification and drafting alike."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from bigram_drafters import (
    write_bigram_eagle3_head,
    write_bigram_eagle_head,
    write_bigram_mlp_speculator,
)
from family_drafters import add_bigram_mtp_layers, build_mostly_bigram_target, write_layer_subset
from medusa_heads import write_bigram_medusa
from pinned_cost import PinnedCost
from spec_outputs import token_ids

from engine import LLM, SamplingParams

pytestmark = pytest.mark.promise("greedy-lossless-families")

FAMILIES = ("qwen3", "gemma3")
# repeats (n-gram and suffix drafts), none, and every token twice with different followers
# (ascending, then descending: whatever the model says, a model-free tree branches after it); all
# longer than Gemma 3's window of 6
PROMPTS = [
    [1, 5, 9, 13, 2, 7, 5, 9, 13, 2, 7],
    [1] + list(range(30, 50)) + list(range(30, 42)),
    [1, 60, 61, 62, 63, 64, 65, 66],
    [1] + list(range(2, 96)) + list(range(95, 1, -1)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
# NOTE: one thread: these models are too small to share out, and threads waiting on a busy core
# spin (tests/helpers/parallel_workers.py) and cost this file several times its run time
ENGINE = {"dtype": "float64", "max_model_len": 256, "num_kv_blocks": 160, "num_threads": 1}
# engine settings beside the defaults: KV blocks smaller than the window, and a token budget that
# cuts drafts and splits prefills into chunks the window crosses
SETUPS = {"roomy": {}, "tiny_blocks": {"block_size": 4},
          "tight_budget": {"max_num_batched_tokens": 6}}
# per-request caps in one batch: None = the engine's k, 0 = no speculation, others cap k
CAP_MIXES = {"all_speculate": (None, None, None, None), "on_off": (None, 0, None, 0),
             "mixed_k": (1, 4, 0, 2)}


@dataclass(frozen=True)
class Family:
    kind: str
    target: str
    # the plain target's greedy tokens on PROMPTS
    expected: list[list[int]]
    # method -> its "model" folder (mtp: the target's copy carrying MTP layers)
    drafters: dict[str, str]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Family:
    """The family's target, its plain greedy tokens, and every drafter built from it once."""
    root = tmp_path_factory.mktemp(request.param)
    target = build_mostly_bigram_target(root / "target", request.param)
    plain = LLM(target, **ENGINE)
    drafters = {
        # its first and last layers (Gemma 3: one sliding, one full), the same weights
        "draft_model": write_layer_subset(target, str(root / "draft"), keep=(0, 2)),
        "eagle": write_bigram_eagle_head(target, str(root / "eagle")),
        "eagle3": write_bigram_eagle3_head(target, str(root / "eagle3"), (0, 1, 2)),
        "mlp_speculator": write_bigram_mlp_speculator(target, str(root / "mlp")),
        "medusa": write_bigram_medusa(target, str(root / "medusa")),
        "mtp": add_bigram_mtp_layers(target, str(root / "mtp")),
    }
    return Family(request.param, target, token_ids(plain.generate(requests(), GREEDY)), drafters)


def requests() -> list[dict]:
    return [{"prompt_token_ids": p} for p in PROMPTS]


def spec_llm(family: Family, method: str, k: int, tree: bool = False, **engine) -> LLM:
    """The family's target speculating with `method` (its drafter from `family`)."""
    spec = {"method": method, "num_speculative_tokens": k, "draft_tree": tree}
    folder = family.target
    if method == "mtp":
        folder = family.drafters["mtp"]
    elif method in family.drafters:
        spec["model"] = family.drafters[method]
    return LLM(folder, **{**ENGINE, **engine}, speculative_config=spec)


def generate(llm: LLM, caps) -> list:
    return llm.generate(requests(), [replace(GREEDY, num_speculative_tokens=c) for c in caps])


def assert_lossless(family: Family, outs, caps) -> None:
    """The plain target's tokens; requests capped to 0 drafted nothing; some drafts accepted."""
    assert token_ids(outs) == family.expected
    for cap, out in zip(caps, outs):
        assert (out.spec_stats.num_draft_tokens == 0) == (cap == 0), (cap, out.spec_stats)
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0


def record_proposals(llm: LLM) -> list:
    """Wraps the proposer: every proposal it returns."""
    proposer, seen = llm.engine.proposer, []
    propose = proposer.propose

    def recording(batch, caps, target_hidden):
        proposals = propose(batch, caps, target_hidden)
        seen.extend(proposals)
        return proposals

    proposer.propose = recording
    return seen


# ---- chains --------------------------------------------------------------------------------
@pytest.mark.parametrize("mix, setup", [("all_speculate", "roomy"), ("on_off", "tiny_blocks"),
                                        ("mixed_k", "tight_budget")])
def test_ngram_chains_in_mixed_batches(family, mix, setup):
    llm = spec_llm(family, "ngram", k=4, **SETUPS[setup])
    outs = generate(llm, CAP_MIXES[mix])
    assert_lossless(family, outs, CAP_MIXES[mix])


# method -> the engine setup it runs under (one each, so every setting meets a model drafter)
CHAIN_SETUPS = {"suffix": "roomy", "draft_model": "tiny_blocks", "eagle": "tight_budget",
                "eagle3": "tiny_blocks", "mlp_speculator": "roomy", "medusa": "tight_budget",
                "mtp": "tiny_blocks"}
CHAIN_CAPS = (None, 2, 0, None)


@pytest.mark.parametrize("method", CHAIN_SETUPS)
def test_chains_in_a_capped_batch(family, method):
    llm = spec_llm(family, method, k=3, **SETUPS[CHAIN_SETUPS[method]])
    outs = generate(llm, CHAIN_CAPS)
    assert_lossless(family, outs, CHAIN_CAPS)
    assert len(outs[1].spec_stats.accepted_per_position) <= 2  # its cap held


def test_the_target_as_its_own_draft_model_accepts_every_draft(family):
    """A draft model's own runner lays out the family's layers as the target's does (windows
    across small KV blocks, local RoPE, q/k norms): the target drafting for itself is always
    right, so a drafter that mishandled them could not hide behind rejections."""
    llm = LLM(family.target, **{**ENGINE, "block_size": 4}, speculative_config={
        "method": "draft_model", "model": family.target, "num_speculative_tokens": 3})
    outs = llm.generate(requests(), GREEDY)
    assert token_ids(outs) == family.expected
    assert all(o.spec_stats.draft_acceptance_rate == 1.0 for o in outs)


# ---- trees ---------------------------------------------------------------------------------
TREE_METHODS = ("ngram", "suffix", "eagle", "eagle3", "medusa", "mtp")
TREE_CAPS = (None, 0, 4, None)


@pytest.mark.parametrize("method", TREE_METHODS)
def test_trees_in_a_capped_batch(family, method):
    """Draft trees of up to 8 nodes beside a smaller tree and a request that does not draft;
    some proposal branched, so a tree (not only a chain) was verified."""
    llm = spec_llm(family, method, k=8, tree=True)
    proposals = record_proposals(llm)
    outs = generate(llm, TREE_CAPS)
    assert_lossless(family, outs, TREE_CAPS)
    assert any(p.is_tree for p in proposals), "no proposal branched"


# ---- adaptive ------------------------------------------------------------------------------
def test_adaptive_eagle_trees(family):
    """The policy sizes each request's tree (step costs pinned so extra rows are cheap: the
    choice rests on acceptance, not this machine's timings); tokens stay the target's."""
    llm = LLM(family.target, **ENGINE, speculative_config={
        "method": "eagle", "model": family.drafters["eagle"], "num_speculative_tokens": 8,
        "draft_tree": True, "adaptive": True})
    llm.engine.adaptive.cost = PinnedCost(per_token=0.001)
    outs = generate(llm, CHAIN_CAPS)
    assert_lossless(family, outs, CHAIN_CAPS)
