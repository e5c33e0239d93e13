"""Tree verification's specification: greedy takes the longest path the target agrees with; sampled
verification keeps the emitted tokens' law equal to the target's (chi-square on the first two tokens
over a bigram target, for drafts drawn from q and for one-hot candidates), and the same check rejects
a sampler that forgets the residual between siblings; a one-child tree is the chain sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2

import kernels.tree_rejection_reference as tree_reference
from kernels.rejection_reference import rejection_sample
from kernels.tree_rejection_reference import DraftTree, verify_tree

VOCAB = 5
# a bigram target P[a] = p(next | a), and a different draft Q[a]
P = torch.tensor([[0.40, 0.25, 0.15, 0.12, 0.08], [0.10, 0.45, 0.20, 0.15, 0.10],
                  [0.30, 0.10, 0.35, 0.15, 0.10], [0.20, 0.20, 0.20, 0.30, 0.10],
                  [0.15, 0.25, 0.10, 0.10, 0.40]], dtype=torch.float64)
Q = torch.tensor([[0.10, 0.50, 0.10, 0.20, 0.10], [0.30, 0.10, 0.30, 0.10, 0.20],
                  [0.20, 0.20, 0.20, 0.20, 0.20], [0.50, 0.05, 0.05, 0.30, 0.10],
                  [0.05, 0.05, 0.60, 0.20, 0.10]], dtype=torch.float64)
ROOT = 0
# root -> 2 children -> 2 children each
PARENTS = [-1, 0, 0, 1, 1, 2, 2]
NUM_TRIALS = 12000


def sampled_tree(generator: torch.Generator) -> DraftTree:
    """Each node's children drawn i.i.d. from Q[its token], as a sampling proposer would."""
    tokens = [ROOT]
    for node in range(1, len(PARENTS)):
        tokens.append(int(torch.multinomial(Q[tokens[PARENTS[node]]], 1, generator=generator)))
    draft_probs = torch.stack([Q[tokens[parent]] if parent >= 0 else Q[0] for parent in PARENTS])
    return DraftTree(tokens, PARENTS, draft_probs)


def one_hot_tree(_: torch.Generator) -> DraftTree:
    """Fixed candidates (n-gram matches, suffix continuations, top-k expansions)."""
    return DraftTree([ROOT, 1, 3, 1, 4, 0, 2], PARENTS)


def first_two_tokens(make_tree, seed: int) -> np.ndarray:
    """[VOCAB, VOCAB] counts of the first two tokens emitted; when a step emits one, the second
    comes from the next (plain) step, drawn from P[first]."""
    generator = torch.Generator().manual_seed(seed)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for _ in range(NUM_TRIALS):
        tree = make_tree(generator)
        target_probs = P[tree.token_ids]
        uniforms = torch.rand(2, len(PARENTS), generator=generator, dtype=torch.float64)
        verdict = verify_tree(tree, target_probs, False, uniforms[0], uniforms[1])
        tokens = verdict.token_ids
        if len(tokens) == 1:
            tokens = tokens + [int(torch.multinomial(P[tokens[0]], 1, generator=generator))]
        counts[tokens[0], tokens[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray) -> float:
    expected = (P[ROOT][:, None] * P).numpy() * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    return float(chi2.sf(statistic, VOCAB * VOCAB - 1))


@pytest.mark.parametrize("make_tree", [sampled_tree, one_hot_tree], ids=["sampled", "one_hot"])
def test_sampled_tree_verification_keeps_the_target_law(make_tree):
    counts = first_two_tokens(make_tree, seed=5)
    assert chi_square_pvalue(counts) > 1e-3, counts


def test_forgetting_the_residual_between_siblings_is_caught(monkeypatch):
    """A second sibling tested against p itself, not against what the first rejection left: the
    token after a rejected sibling is favoured twice, and the check fails."""
    monkeypatch.setattr(tree_reference, "_reject", lambda residual, token, q: residual)
    counts = first_two_tokens(sampled_tree, seed=5)
    assert chi_square_pvalue(counts) < 1e-6, counts


def test_greedy_takes_the_longest_path_the_target_agrees_with():
    logits = torch.full((7, VOCAB), -5.0, dtype=torch.float64)
    # argmax after each node: root -> 3; node 2 (token 3) -> 4; node 6 (token 4) -> 1
    for node, choice in ((0, 3), (1, 0), (2, 4), (3, 2), (4, 2), (5, 0), (6, 1)):
        logits[node, choice] = 5.0
    tree = DraftTree([ROOT, 1, 3, 0, 2, 1, 4], PARENTS)
    verdict = verify_tree(tree, logits.softmax(-1), True)
    assert verdict.accepted_nodes == [2, 6] and verdict.token_ids == [3, 4, 1]
    # no child agrees at the root: the target's own token, nothing accepted
    logits[0] = -5.0
    logits[0, 2] = 5.0
    assert verify_tree(tree, logits.softmax(-1), True).token_ids == [2]


@pytest.mark.parametrize("one_hot", [True, False])
def test_a_chain_is_the_chain_sampler(one_hot):
    """One child per node: the same tokens as rejection_reference.rejection_sample, given the same
    uniforms, over many random draws."""
    generator = torch.Generator().manual_seed(3)
    k = 4
    for _ in range(300):
        tokens = [ROOT] + torch.randint(VOCAB, (k,), generator=generator).tolist()
        p = torch.rand(k + 1, VOCAB, generator=generator, dtype=torch.float64) ** 3
        p = (p / p.sum(-1, keepdim=True)).float()
        q = None
        if not one_hot:
            q = torch.rand(k + 1, VOCAB, generator=generator, dtype=torch.float64) ** 3
            q = (q / q.sum(-1, keepdim=True)).float()
        acceptance = torch.rand(k + 1, generator=generator, dtype=torch.float64)
        samples = torch.rand(k + 1, generator=generator, dtype=torch.float64)
        tree = DraftTree(tokens, [-1] + list(range(k)), None if q is None else q.double())
        got = verify_tree(tree, p.double(), False, acceptance, samples).token_ids
        chain = rejection_sample(
            torch.tensor(tokens[1:]), torch.tensor([k]), None if q is None else q[1:], p,
            p.argmax(-1), torch.tensor([False]), acceptance[1:], samples, k)[0]
        assert got == [t for t in chain.tolist() if t >= 0]
