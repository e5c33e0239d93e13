"""EAGLE and EAGLE-3 draft trees ("draft_tree": true): the tree rule itself (top-BRANCH children,
cumulative scores, the cap best nodes, depth-first), greedy output token-identical to plain decoding
in a batch with different caps, sampled output following the target's distribution and not
depending on the batch when seeded, the tree passes leaving the head's cache as the chain leaves it,
and a trained head accepting at least as much from its tree as from its chain."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from pinned_cost import PinnedCost
from spec_outputs import token_ids, two_sample_chi2_pvalue
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.adaptive.acceptance import MAX_POSITIONS, AcceptanceTracker
from engine.draft_tree import check_parents, depth_first, paths
from engine.models.arch import DecoderArch
from engine.models.loader import load_checkpoint
from engine.proposers.eagle import EagleProposer
from engine.proposers.eagle_tree import BRANCH, TreeGrowth
from engine.request import Request
from engine.step.layout import DraftProposal


def sibling(name: str) -> ModuleType:
    """A sibling test module, for its head builders (test files are not importable by name under
    --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location(f"_{name}_helpers",
                                                  Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


test_eagle, test_eagle3 = sibling("test_eagle"), sibling("test_eagle3")
PROMPTS = test_eagle.PROMPTS
K = 8
# per-request caps in one batch: the engine's k, off, a small tree, a middling one
CAPS = (None, 0, 3, 5)


def greedy(cap: int | None = None, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          num_speculative_tokens=cap)


def arch_of(target: str) -> DecoderArch:
    return DecoderArch.from_hf_config(load_checkpoint(target, torch.float32).hf_config)


def spec_llm(target: str, head: str, method: str, tree: bool = True, k: int = K) -> LLM:
    return LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64,
               speculative_config={"method": method, "model": head, "num_speculative_tokens": k,
                                   "draft_tree": tree})


def record_proposals(llm: LLM) -> list[tuple[int, DraftProposal]]:
    """Wraps the proposer: every (cap, proposal) it returns."""
    proposer, seen = llm.engine.proposer, []
    propose = proposer.propose

    def recording(requests, caps, target_hidden):
        proposals = propose(requests, caps, target_hidden)
        seen.extend(zip(caps, proposals))
        return proposals

    proposer.propose = recording
    return seen


# ---- the tree rule, on made-up logits ----------------------------------------------------------
def grow(rows: dict[tuple[int, ...], list[float]], cap: int) -> TreeGrowth:
    """A tree over a 6-token vocabulary whose log-probabilities after each path are `rows[path]`
    (uniform where not given), grown as the proposer grows it."""
    request = Request("r", [1, 2], greedy(), frozenset())
    growth = TreeGrowth(request, cap, torch.zeros(1))

    def logits(path: list[int]) -> torch.Tensor:
        return torch.tensor(rows.get(tuple(path), [0.0] * 6), dtype=torch.float64)

    growth.expand([-1], logits([])[None])
    while growth.frontier:
        assert len(growth.pass_rows()) <= cap
        growth.expand(growth.frontier,
                      torch.stack([logits(growth.nodes[n].path) for n in growth.frontier]))
    return growth


def log_probs(*probs: float) -> list[float]:
    return [float(np.log(p)) if p > 0 else float("-inf") for p in probs]


def test_the_tree_keeps_the_cap_best_paths_depth_first():
    rows = {
        (): log_probs(0.55, 0.35, 0.1, 0, 0, 0),       # a=0 .55, b=1 .35, c=2 .10
        (0,): log_probs(0.5, 0.35, 0.15, 0, 0, 0),     # a a .275, a b .1925, a c .0825
        (1,): log_probs(0.9, 0.1, 0, 0, 0, 0),         # b a .315, b b .035
        (0, 0): log_probs(0, 0, 0, 0.1, 0.9, 0),       # a a e=4 .2475, a a d=3 .0275
    }
    proposal = grow(rows, cap=5).proposal()
    # the 5 best: a, b, b a, a a, a a e; depth-first, likeliest child first
    assert proposal.token_ids == [0, 0, 4, 1, 0]
    assert proposal.parents == [-1, 0, 1, -1, 3]
    assert proposal.probs is None


def test_a_cap_of_one_is_the_greedy_chain_and_ties_go_to_the_node_made_first():
    rows = {(): log_probs(0.1, 0.9, 0, 0, 0, 0), (1,): log_probs(0, 0, 1.0, 0, 0, 0),
            (1, 2): log_probs(0, 0, 0, 1.0, 0, 0), (1, 2, 3): log_probs(0, 0, 0, 0, 1.0, 0)}
    assert grow(rows, cap=1).proposal().token_ids == [1]
    # certain children tie with their parents: ties go to the parent, so the tree stays a tree
    proposal = grow(rows, cap=3).proposal()
    assert proposal.token_ids == [1, 2, 3] and not proposal.is_tree
    # two even guesses with certain children: four equal scores, the cap takes the first made
    rows = {(): log_probs(0.5, 0.5, 0, 0, 0, 0), (0,): log_probs(0, 0, 1.0, 0, 0, 0),
            (1,): log_probs(0, 0, 0, 1.0, 0, 0)}
    proposal = grow(rows, cap=2).proposal()
    assert (proposal.token_ids, proposal.parents) == ([0, 1], [-1, -1])


def test_random_trees_are_valid_within_budget():
    generator = torch.Generator().manual_seed(0)
    for cap in (1, 2, 5, 13, 32):
        request = Request("r", [1, 2], greedy(), frozenset())
        growth = TreeGrowth(request, cap, torch.zeros(1))
        growth.expand([-1], torch.randn(1, 50, generator=generator))
        while growth.frontier:
            assert len(growth.frontier) <= BRANCH and len(growth.pass_rows()) <= cap
            growth.expand(growth.frontier,
                          torch.randn(len(growth.frontier), 50, generator=generator))
        assert_valid(growth.proposal(), cap)


def assert_valid(proposal, cap: int) -> None:
    """Within the budget, engine/draft_tree.py's order, siblings distinct."""
    assert len(proposal.token_ids) <= cap
    if not proposal.is_tree:
        return
    check_parents(proposal.parents)
    assert depth_first(proposal.token_ids, proposal.parents) == (proposal.token_ids,
                                                                proposal.parents)
    routes = [tuple(proposal.token_ids[j] for j in path) for path in paths(proposal.parents)]
    assert len(set(routes)) == len(routes)


# ---- in the engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eagle(tmp_path_factory) -> tuple[str, str, list[list[int]]]:
    """A tiny target, a random EAGLE head for it, and the plain greedy outputs."""
    folder = tmp_path_factory.mktemp("eagle")
    target = build_tiny_checkpoint(folder / "target", "llama", seed=41)
    head = test_eagle.save_head(arch_of(target), str(folder / "head"))
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    return target, head, token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                  greedy()))


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory) -> tuple[str, str, list[list[int]]]:
    folder = tmp_path_factory.mktemp("eagle3")
    target = build_tiny_checkpoint(folder / "target", "llama", seed=43, num_hidden_layers=4)
    head = test_eagle3.write_head(str(folder / "head"), arch_of(target), "speculators", 64)
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    return target, head, token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                  greedy()))


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.promise(
    f"greedy-lossless-tree:{m}")) for m in ("eagle", "eagle3")])
def test_greedy_trees_are_token_identical_in_a_batch(method, request):
    target, head, expected = request.getfixturevalue(method)
    llm = spec_llm(target, head, method)
    seen = record_proposals(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [greedy(c) for c in CAPS])
    assert token_ids(outs) == expected
    assert outs[1].spec_stats.num_draft_tokens == 0
    assert any(p.is_tree for _, p in seen), "no proposal branched"
    for cap, proposal in seen:
        assert_valid(proposal, cap)
    assert max(len(p.token_ids) for _, p in seen) == K
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0


class PinnedAcceptance(AcceptanceTracker):
    """Each request's acceptance pinned, by order of arrival, to the next of RATES: the policy's
    budgets then differ by request whatever a random head's drafts achieve."""

    RATES = (0.95, 0.3, 0.8, 0.6)

    def __init__(self) -> None:
        super().__init__()
        self.rates: dict[str, float] = {}

    def conditional_acceptance(self, request_id: str) -> np.ndarray:
        rate = self.rates.setdefault(request_id, self.RATES[len(self.rates) % len(self.RATES)])
        return np.full(MAX_POSITIONS, rate)


def test_adaptive_trees_are_sized_by_the_policy_and_stay_lossless(eagle):
    """With "adaptive", the policy picks each request's node budget (costs and acceptance pinned,
    so the choice does not rest on this machine's timings); the head grows its tree within that
    budget. Tokens stay identical, and trees of several sizes run."""
    target, head, expected = eagle
    llm = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64,
              speculative_config={"method": "eagle", "model": head, "num_speculative_tokens": K,
                                  "draft_tree": True, "adaptive": True})
    llm.engine.adaptive.cost = PinnedCost(per_token=0.001)
    llm.engine.adaptive.acceptance = PinnedAcceptance()
    seen = record_proposals(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy())
    assert token_ids(outs) == expected
    for cap, proposal in seen:
        assert_valid(proposal, cap)
    caps = {cap for cap, _ in seen}
    assert len(caps) > 1 and max(caps) <= K, caps
    assert any(p.is_tree for _, p in seen), "no proposal branched"


def test_seeded_sampling_does_not_depend_on_the_batch(eagle):
    """Trees take no random draws: a seeded request's tokens are the same alone or in a batch."""
    target, head, _ = eagle
    params = [SamplingParams(temperature=0.9, max_tokens=16, seed=s, ignore_eos=True, top_k=20,
                             num_speculative_tokens=cap) for s, cap in zip(range(4), (8, 1, 3, 6))]
    together = spec_llm(target, head, "eagle").generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)
    alone = spec_llm(target, head, "eagle").generate({"prompt_token_ids": PROMPTS[3]}, params[3])
    assert token_ids(together)[3] == token_ids(alone)[0]
    assert together[3].spec_stats.num_draft_tokens > 0


def test_tree_passes_leave_the_heads_cache_as_chains_do(eagle, monkeypatch):
    """The head's h at every committed position (each catch-up row) is the same whether the steps
    before drafted trees or chains: the tree rows past the committed tokens are overwritten before
    they are read, and the newest token's row is rewritten from the same inputs."""
    target, head, expected = eagle
    catch_up, run = EagleProposer._catch_up, EagleProposer._run

    def spy_catch_up(self, requests):
        self.catching_up = True
        try:
            return catch_up(self, requests)
        finally:
            self.catching_up = False

    def spy_run(self, inputs, features):
        hidden = run(self, inputs, features)
        if getattr(self, "catching_up", False):
            for position, h in zip(inputs.positions.tolist(), hidden):
                self.seen.setdefault(position, h.clone())
        return hidden

    monkeypatch.setattr(EagleProposer, "_catch_up", spy_catch_up)
    monkeypatch.setattr(EagleProposer, "_run", spy_run)
    seen = []
    for tree in (True, False):
        llm = spec_llm(target, head, "eagle", tree=tree, k=5)
        llm.engine.proposer.seen = {}
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy())[0]
        assert out.outputs[0].token_ids == expected[0]
        seen.append(llm.engine.proposer.seen)
    assert len(seen[0]) >= len(PROMPTS[0]) + 20 and seen[0].keys() == seen[1].keys()
    for position in seen[0]:
        torch.testing.assert_close(seen[0][position], seen[1][position], rtol=1e-9, atol=1e-9,
                                   msg=f"position {position}")


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_distribution(tmp_path):
    """Output tokens 2 and 3, verified from trees of one-hot drafts: the same distributions with
    and without EAGLE trees (two-sample chi-square over 2000 seeded completions each)."""
    path = build_tiny_checkpoint(tmp_path / "t", "llama", seed=11, vocab_size=12,
                                 initializer_range=0.05)
    head = test_eagle.save_head(arch_of(path), str(tmp_path / "h"), draft_vocab_size=12, seed=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    counts = []
    for spec in (None, {"method": "eagle", "model": head, "num_speculative_tokens": 6,
                        "draft_tree": True}):
        llm = LLM(path, dtype="float64", max_model_len=32, num_kv_blocks=4096, max_num_seqs=256,
                  speculative_config=spec)
        seen = record_proposals(llm) if spec else []
        params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s)
                  for s in range(2000)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * 2000, params)
        counts.append([np.bincount([o.outputs[0].token_ids[i] for o in outs], minlength=12)
                       for i in (1, 2)])
        if spec is not None:
            assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 100
            assert sum(p.is_tree for _, p in seen) >= 1000
    for plain, speculated in zip(*counts):
        assert two_sample_chi2_pvalue(plain, speculated) > 1e-4, (plain, speculated)


@pytest.mark.slow
def test_a_trained_heads_tree_accepts_at_least_what_its_chain_does(eagle, tmp_path):
    """With the same node budget, a trained head's tree (several guesses where it is unsure)
    accepts at least as many drafts per verification as its chain, token-identically."""
    from engine.proposers.eagle_head import EagleConfig, EagleHead
    from engine.training.train_eagle import choose_draft_vocab, extract_features, train_head
    from engine.training.train_speculator import load_reference

    target, _, _ = eagle
    arch = arch_of(target)
    prompts = [[1] + [(7 * i + j) % 90 + 2 for j in range(6)] for i in range(48)]
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    answers = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens=40))
    reference = load_reference(target)
    stream = extract_features(reference, [o.prompt_token_ids + o.outputs[0].token_ids
                                          for o in answers])
    draft_ids, _ = choose_draft_vocab(stream.labels, 64, arch.eos_token_ids, arch.vocab_size)
    head = EagleHead(EagleConfig.for_target(arch, len(draft_ids)), arch)
    head.draft_token_ids.copy_(draft_ids)
    draft_head = head.draft_head_weight(reference.get_output_embeddings().weight.detach())
    train_head(head, reference.get_input_embeddings(), draft_head, stream, epochs=30,
               batch_size=8, window=32, num_steps=2, learning_rate=3e-3, feature_weight=1.0,
               seed=0)
    head.save(str(tmp_path))

    accepted_per_step = []
    for tree in (False, True):
        outs = spec_llm(target, str(tmp_path), "eagle", tree=tree, k=6).generate(
            [{"prompt_token_ids": p} for p in prompts[:6]], greedy(max_tokens=40))
        assert token_ids(outs) == token_ids(answers[:6])
        accepted_per_step.append(sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
                                 / sum(o.spec_stats.num_spec_steps for o in outs))
    chain, tree = accepted_per_step
    assert tree >= chain > 0.3, accepted_per_step
