"""Trees of drafts verified in one target pass are lossless: greedy tokens identical to plain decoding
(whichever branch is accepted, in any batch mix, with penalties, min_tokens, logprobs and
preemption); sampled tokens following the target's distribution through trees is
tests/engine/test_sampling_distribution.py's (suffix trees, with a broken-sampler canary).

An oracle proposer hides the target's true continuation in a tree's SECOND branches, behind decoys
that have children of their own: every accepted path then leaves the first rows, so the accepted
K/V must be moved into place and the tree mask must keep siblings apart, or the tokens change."""

from __future__ import annotations

import numpy as np
import pytest
from pinned_cost import PinnedCost
from spec_outputs import token_ids
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.proposers.base import Proposer
from engine.step.layout import DraftProposal

PROMPTS = [
    [1, 5, 9, 13, 2, 7, 5, 9, 13, 2],
    [1] + list(range(30, 50)) + list(range(30, 42)),
    [1, 60],
    [1, 11, 12, 13, 11, 12, 13, 11, 12],
]
MAX_TOKENS = 24
VOCAB = 96


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


class OracleTreeProposer(Proposer):
    """Knows each prompt's greedy continuation; drafts it as the second child at every level, with a
    decoy (and a decoy grandchild) first: [decoy, decoy's child, true, decoy, decoy's child, true..]."""

    drafts_for_free = True

    def __init__(self, continuations: dict[tuple[int, ...], list[int]],
                 truth_first: bool = False) -> None:
        self.continuations = continuations
        # the truth as the main chain, each level's decoy a later sibling: depth-first, the decoys
        # come after the chain, so a prefix of the drafts is a chain, then trees as it grows
        self.truth_first = truth_first
        self.num_trees = 0

    def propose(self, requests, max_num_tokens, target_hidden):
        proposals = []
        for request, cap in zip(requests, max_num_tokens):
            truth = self.continuations[tuple(request.prompt_token_ids)][
                request.num_output_tokens:]
            if self.truth_first:
                chain = truth[:(cap + 1) // 2]
                decoys = [(chain[j] + 1) % VOCAB for j in reversed(range(len(chain)))]
                tokens = (chain + decoys)[:cap]
                parents = (list(range(-1, len(chain) - 1))
                           + [j - 1 for j in reversed(range(len(chain)))])[:cap]
                self.num_trees += len(tokens) > len(chain)
                proposals.append(DraftProposal(tokens, parents=parents or None))
                continue
            tokens, parents, parent = [], [], -1
            for true_token in truth:
                if len(tokens) + 3 > cap:
                    break
                decoy = (true_token + 1) % VOCAB
                tokens += [decoy, (true_token + 2) % VOCAB, true_token]
                parents += [parent, len(parents), parent]
                parent = len(parents) - 1
            self.num_trees += bool(tokens)
            proposals.append(DraftProposal(tokens, parents=parents or None))
        return proposals


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5)


@pytest.fixture(scope="module")
def plain(checkpoint) -> LLM:
    return LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64)


def oracle_llm(checkpoint: str, expected: list[list[int]], max_model_len: int = 128,
               **engine) -> LLM:
    llm = LLM(checkpoint, dtype="float64", max_model_len=max_model_len,
              speculative_config={"method": "ngram", "num_speculative_tokens": 9}, **engine)
    llm.engine.proposer = OracleTreeProposer(
        {tuple(p): out for p, out in zip(PROMPTS, expected)})
    return llm


def count_moves(llm: LLM) -> list[int]:
    """Wraps the runner's keep_rows: how many times an accepted path's K/V was moved."""
    runner, moves = llm.engine.worker.runner, []
    keep_rows = runner.keep_rows

    def counted(seq_id, start, rows, block_table=None):
        moves.append(len(rows))
        keep_rows(seq_id, start, rows, block_table)

    runner.keep_rows = counted
    return moves


PARAMS = {
    "greedy": {},
    "penalties": {"presence_penalty": 0.8, "frequency_penalty": 0.3, "repetition_penalty": 1.3},
    "min_tokens": {"min_tokens": 20, "logit_bias": {7: 3.0}},
    "logprobs": {"logprobs": 2},
}


@pytest.mark.parametrize("setup", [{"num_kv_blocks": 64}, {"num_kv_blocks": 64, "block_size": 4},
                                   {"num_kv_blocks": 64, "max_num_batched_tokens": 8}])
@pytest.mark.parametrize("extra", PARAMS)
def test_greedy_is_identical_whichever_branch_is_accepted(checkpoint, plain, extra, setup):
    params = [greedy(**PARAMS[extra])] * len(PROMPTS)
    expected_outs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    expected = token_ids(expected_outs)
    llm = oracle_llm(checkpoint, expected, **setup)
    moves = count_moves(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert token_ids(outs) == expected
    assert llm.engine.proposer.num_trees > 0 and moves, "no tree's path was moved into place"
    accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
    assert accepted >= len(PROMPTS) * 4, accepted
    if extra == "logprobs":
        for out, want in zip(outs, expected_outs):
            got, ref = out.outputs[0].logprobs, want.outputs[0].logprobs
            assert [lp.token_id for lp in got] == out.outputs[0].token_ids
            np.testing.assert_allclose([lp.logprob for lp in got], [lp.logprob for lp in ref],
                                       rtol=0, atol=1e-9)
            assert [[t for t, _ in lp.top] for lp in got] == [[t for t, _ in lp.top] for lp in ref]
    assert llm.engine.scheduler.block_manager.num_free_blocks == setup["num_kv_blocks"]


def test_greedy_survives_preemption(checkpoint, plain):
    expected = token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                        greedy()))
    llm = oracle_llm(checkpoint, expected, max_model_len=72, num_kv_blocks=22, block_size=4,
                     enable_prefix_caching=False)
    assert token_ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                  greedy())) == expected
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.promise(
    f"greedy-lossless-tree:{m}")) for m in ("ngram", "suffix")])
def test_model_free_trees_are_lossless_in_a_batch(checkpoint, plain, method):
    """The real tree proposers, in a batch with chains (k capped to 0 and 2) beside trees."""
    expected = token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy()))
    spec = {"method": method, "num_speculative_tokens": 10, "draft_tree": True}
    llm = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64,
              speculative_config=spec)
    caps = [None, 0, None, 2]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [greedy(num_speculative_tokens=cap) for cap in caps])
    assert token_ids(outs) == expected
    assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0


@pytest.mark.parametrize("truth_first", [False, True])
def test_adaptive_speculation_values_trees_node_by_node_and_stays_lossless(checkpoint, plain,
                                                                           truth_first):
    """With "adaptive", the policy picks each tree's node count from the step costs (pinned here,
    so the test does not depend on this machine's timings) and each node's chance of being kept,
    and cuts the tree to its likeliest nodes. Tokens stay identical either way.

    The truth a later sibling, behind a decoy and its child: the policy learns that second
    guesses pay and first ones do not, keeps the true nodes, and most drafts are accepted (a
    depth-first prefix would have to take each decoy first). The truth the main chain, the decoys
    its later siblings: it learns the side branches never pay and cuts them, sending chains."""
    params = [greedy()] * len(PROMPTS)
    expected = token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS], params))
    llm = LLM(checkpoint, dtype="float64", max_model_len=128, num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 9,
                                  "draft_tree": True, "adaptive": True})
    # rows cheap enough that a guess kept 3 times in 10 pays: the first trees test both branches
    llm.engine.adaptive.cost = PinnedCost(per_token=0.0002)
    oracle = OracleTreeProposer({tuple(p): out for p, out in zip(PROMPTS, expected)},
                                truth_first=truth_first)
    llm.engine.proposer = oracle
    sent = []
    update = llm.engine.scheduler.update_draft_token_ids

    def recording(drafts):
        sent.extend(p for p in drafts.proposals.values() if p.token_ids)
        update(drafts)

    llm.engine.scheduler.update_draft_token_ids = recording
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert token_ids(outs) == expected
    assert oracle.num_trees > 0 and all(len(p.token_ids) <= 9 for p in sent)
    accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
    total = sum(len(o.outputs[0].token_ids) for o in outs)
    assert len({len(p.token_ids) for p in sent}) > 1
    if truth_first:
        # trees only until the first verification is observed (two proposals per request), then
        # the main chain alone
        assert sum(p.is_tree for p in sent) <= 2 * len(PROMPTS)
        assert accepted > 0.5 * total, accepted
    else:
        # the true nodes, each the proposer's second guess: kept and sent (as a chain, once the
        # decoys are cut), where a depth-first prefix would have to send each decoy first
        assert accepted > 0.4 * total, accepted
