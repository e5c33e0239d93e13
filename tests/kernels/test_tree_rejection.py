"""The batched tree rejection sampler (kernels/tree_rejection.py): every request's tokens and
accepted path are the specification's (`verify_tree`) on random trees and batch mixes; a chain is
the chain sampler bit for bit, at the edges where the specification rounds otherwise too; the
emitted first token follows p (chi-square), and a sampler that forgets the residual between siblings
is caught."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import kernels
import kernels.tree_rejection as tree_rejection
from kernels.rejection_reference import rejection_sample as chain_sample
from kernels.tree_rejection import random_tree_inputs
from kernels.tree_rejection import tree_rejection_sample_reference as tree_sample
from kernels.tree_rejection_reference import DraftTree, verify_tree

MIXED = [0, 5, 1, 9, 3, 12, 0, 7, 2, 6, 4, 1, 8, 0, 3, 10]


def spec_outputs(args: dict) -> tuple[Tensor, Tensor]:
    """verify_tree request by request, padded as the batched sampler pads its two outputs."""
    cu = args["cu_num_draft_tokens"].tolist()
    width = args["max_spec_len"] + 1
    output_token_ids, accepted_drafts = [], []
    for i, end in enumerate(cu):
        start = cu[i - 1] if i else 0
        rows = slice(start + i, end + i + 1)  # the root's row, then one per draft
        # the spec's nodes: 0 the root (its token unused), 1 + j draft j
        parents = [-1] + [parent + 1 for parent in args["draft_parents"][start:end].tolist()]
        q = args["draft_probs"]
        if q is not None:
            q = torch.cat([q.new_zeros(1, q.shape[1]), q[start:end]])
        is_greedy = bool(args["is_greedy"][i])
        if is_greedy:  # the spec's argmax of p is target_argmax
            num_columns = int(args["target_argmax"].max()) + 1
            target_probs = torch.nn.functional.one_hot(args["target_argmax"][rows], num_columns)
            acceptance = samples = None
        else:
            target_probs = args["target_probs"][rows]
            acceptance = args["acceptance_uniforms"]
            acceptance = torch.cat([acceptance.new_zeros(1), acceptance[start:end]])
            samples = args["sample_uniforms"][rows]
        tree = DraftTree([0] + args["draft_token_ids"][start:end].tolist(), parents, q)
        verdict = verify_tree(tree, target_probs.double(), is_greedy, acceptance, samples)
        output_token_ids.append(verdict.token_ids + [-1] * (width - len(verdict.token_ids)))
        path = [node - 1 for node in verdict.accepted_nodes]
        accepted_drafts.append(path + [-1] * (width - 1 - len(path)))
    return (torch.tensor(output_token_ids, dtype=torch.int64).reshape(len(cu), width),
            torch.tensor(accepted_drafts, dtype=torch.int64).reshape(len(cu), width - 1))


def carried_residuals(args: dict, accepted_drafts: Tensor) -> tuple[int, int]:
    """How many requests accepted a draft after rejecting an earlier sibling, and how many drew
    their last token after rejecting two or more children: the residual carried between siblings."""
    cu = args["cu_num_draft_tokens"].tolist()
    num_accepted_after_sibling = num_drawn_after_siblings = 0
    for i, end in enumerate(cu):
        parents = args["draft_parents"][(cu[i - 1] if i else 0):end].tolist()
        path = [j for j in accepted_drafts[i].tolist() if j >= 0]
        num_accepted_after_sibling += any(parents.index(parents[j]) < j for j in path)
        last = path[-1] if path else -1
        num_drawn_after_siblings += parents.count(last) >= 2
    return num_accepted_after_sibling, num_drawn_after_siblings


# ---- the specification, on random trees ----------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [16, 300])
@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
@pytest.mark.parametrize("greedy_fraction", [0.0, 0.5], ids=["random", "mixed"])
def test_matches_the_specification(greedy_fraction: float, has_draft_probs: bool,
                                   vocab_size: int) -> None:
    num_emitted, num_carried = [], []
    for seed in range(4):
        args = random_tree_inputs(MIXED, vocab_size, has_draft_probs=has_draft_probs,
                                  greedy_fraction=greedy_fraction, seed=seed)
        output_token_ids, accepted_drafts = tree_sample(**args)
        expected_tokens, expected_drafts = spec_outputs(args)
        assert torch.equal(output_token_ids, expected_tokens)
        assert torch.equal(accepted_drafts, expected_drafts)
        num_emitted += (output_token_ids >= 0).sum(1).tolist()
        num_carried.append(carried_residuals(args, accepted_drafts))
    # the inputs exercise rejection at the root, acceptance, and residuals carried between siblings
    assert 1 in num_emitted and max(num_emitted) > 2
    assert all(sum(counts) > 0 for counts in zip(*num_carried))


def test_all_greedy_needs_no_probabilities() -> None:
    num_accepted_after_sibling = 0
    for seed in range(4):
        args = random_tree_inputs(MIXED, 50, has_draft_probs=False, greedy_fraction=1.0, seed=seed)
        args = dict(args, target_probs=None, acceptance_uniforms=None, sample_uniforms=None)
        output_token_ids, accepted_drafts = tree_sample(**args)
        expected_tokens, expected_drafts = spec_outputs(args)
        assert torch.equal(output_token_ids, expected_tokens)
        assert torch.equal(accepted_drafts, expected_drafts)
        num_accepted_after_sibling += carried_residuals(args, accepted_drafts)[0]
    assert num_accepted_after_sibling > 0  # a later sibling was the target's token


def test_greedy_takes_the_longest_agreeing_path_in_each_request() -> None:
    """Two requests as a table: the target's argmax after every row, and where each walk stops."""
    #                  request 0: drafts a b c d e      request 1: none
    #   root ── 0(7) ── 2(5) ── 4(1)                    root
    #      └─── 1(3) ── 3(2)
    draft_token_ids = torch.tensor([7, 3, 5, 2, 1])
    draft_parents = torch.tensor([-1, -1, 0, 1, 2])
    # rows: request 0 root, after drafts 0..4; request 1 root
    target_argmax = torch.tensor([7, 5, 9, 1, 9, 4, 6])
    output_token_ids, accepted_drafts = tree_sample(
        draft_token_ids, draft_parents, torch.tensor([5, 5]), None, None, target_argmax,
        torch.tensor([True, True]), None, None, 5)
    assert output_token_ids.tolist() == [[7, 5, 1, 4, -1, -1], [6, -1, -1, -1, -1, -1]]
    assert accepted_drafts.tolist() == [[0, 2, 4, -1, -1], [-1] * 5]


def test_requests_without_drafts() -> None:
    for num_drafts in ([0, 0, 0], []):
        args = random_tree_inputs(num_drafts, 10, has_draft_probs=True, greedy_fraction=0.5, seed=0)
        output_token_ids, accepted_drafts = tree_sample(**args)
        assert output_token_ids.shape == (len(num_drafts), 1)
        assert accepted_drafts.shape == (len(num_drafts), 0)
        assert torch.equal(output_token_ids, chain_sample(**_without_parents(args)))


def test_an_empty_residual_keeps_the_one_before() -> None:
    """A second sibling whose rejection leaves no mass (p <= q) leaves the residual of the first
    rejection, as in the specification: the draw comes from p, which the first left as it was."""
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 3)
    args = {
        "draft_token_ids": torch.tensor([2, 1]),
        "draft_parents": torch.tensor([-1, -1]),
        "cu_num_draft_tokens": torch.tensor([2]),
        "draft_probs": torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.6, 0.0, 0.0]]),
        "target_probs": p,
        "target_argmax": torch.tensor([3, 3, 3]),  # unread: p has mass
        "is_greedy": torch.tensor([False]),
        "acceptance_uniforms": torch.tensor([0.5, 0.99]),  # p(2) = 0; 0.99 * 0.6 >= 0.5
        "sample_uniforms": torch.tensor([0.25, 0.0, 0.0], dtype=torch.float64),
        "max_spec_len": 2,
    }
    output_token_ids, _ = tree_sample(**args)
    assert output_token_ids.tolist() == [[0, -1, -1]]
    assert torch.equal(output_token_ids, spec_outputs(args)[0])


def test_the_dispatcher_runs_the_reference_on_the_cpu() -> None:
    args = random_tree_inputs(MIXED, 30, has_draft_probs=True, greedy_fraction=0.5, seed=2)
    got, expected = kernels.tree_rejection_sample(**args), tree_sample(**args)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_bad_parents_are_refused() -> None:
    args = random_tree_inputs([2, 3], 8, has_draft_probs=True, greedy_fraction=0.0, seed=0)
    for parents in ([-1, 0, -1, 2, 2], [-1, 0, -1, 0, -2], [-1, 0, 0, 0, 1]):
        with pytest.raises(ValueError, match="parent"):
            tree_sample(**dict(args, draft_parents=torch.tensor(parents)))
    with pytest.raises(ValueError, match="draft_parents"):
        tree_sample(**dict(args, draft_parents=torch.tensor([-1, 0, -1, 0])))


# ---- a chain is the chain sampler ----------------------------------------------------------------


def _without_parents(args: dict) -> dict:
    return {name: value for name, value in args.items() if name != "draft_parents"}


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
@pytest.mark.parametrize("uniform_dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_a_chain_is_the_chain_sampler(has_draft_probs: bool, uniform_dtype: torch.dtype) -> None:
    for seed in range(4):
        args = random_tree_inputs(MIXED, 50, has_draft_probs=has_draft_probs, greedy_fraction=0.3,
                                  seed=seed, is_chain=True)
        args = dict(args, acceptance_uniforms=args["acceptance_uniforms"].to(uniform_dtype),
                    sample_uniforms=args["sample_uniforms"].to(uniform_dtype))
        output_token_ids, accepted_drafts = tree_sample(**args)
        assert torch.equal(output_token_ids, chain_sample(**_without_parents(args)))
        num_accepted = (output_token_ids >= 0).sum(1) - 1
        columns = torch.arange(args["max_spec_len"])
        assert torch.equal(accepted_drafts,
                           torch.where(columns < num_accepted[:, None], columns, -1))


def _one_draft(token: int, p: list[list[float]], q: list[float] | None, acceptance: float,
               sample: float) -> dict:
    """A single request with one draft: p's two rows, the draft's q (None: one-hot)."""
    target_probs = torch.tensor(p)
    return {
        "draft_token_ids": torch.tensor([token]),
        "draft_parents": torch.tensor([-1]),
        "cu_num_draft_tokens": torch.tensor([1]),
        "draft_probs": None if q is None else torch.tensor([q]),
        "target_probs": target_probs,
        "target_argmax": torch.tensor([len(p[0]) - 1, len(p[0]) - 1]),  # the no-mass fallback
        "is_greedy": torch.tensor([False]),
        "acceptance_uniforms": torch.tensor([acceptance], dtype=torch.float64),
        "sample_uniforms": torch.tensor([sample, 0.9], dtype=torch.float64),
        "max_spec_len": 1,
    }


# NOTE: at these edges verify_tree (which normalises in float64 before its fixed-point draw) answers
# otherwise; the batched sampler keeps the chain sampler's conventions, as the kernel does.
CHAIN_EDGES = {
    # q(x) = 0: u * q < p accepts whenever p(x) > 0 (the specification never accepts)
    "q_of_draft_zero": (_one_draft(1, [[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], [1.0, 0.0, 0.0], 0.5,
                                   0.9), [1, 2]),
    # p - q leaves 2e-13 at token 3, below 2^-42: no mass, so the draw is from p
    "residual_below_resolution": (_one_draft(2, [[0.5, 0.5, 1e-13, 2e-13], [0.25] * 4],
                                             [0.5, 0.5, 3e-13, 0.0], 0.9, 0.1), [0, -1]),
    # residual [.., 2.2e-13, 5e-13, ..] in fixed point is [0, 2]: token 2 is never drawn
    "residual_truncated": (_one_draft(4, [[0.5, 0.5, 2.2e-13, 5e-13, 1e-13], [0.2] * 5],
                                      [0.5, 0.5, 0.0, 0.0, 8e-13], 0.9, 0.1), [3, -1]),
    # one-hot (p not normalised): what p leaves beside the draft is below 2^-42: the draw is from p
    "one_hot_leftover_below_resolution": (_one_draft(2, [[1e-13, 0.0, 0.5, 0.0], [0.25] * 4],
                                                     None, 0.99, 0.25), [2, -1]),
    # a row of p without any mass: target_argmax
    "p_without_mass": (_one_draft(0, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [1.0, 0.0, 0.0], 0.5,
                                  0.5), [2, -1]),
}


@pytest.mark.parametrize("case", CHAIN_EDGES)
def test_a_chain_is_the_chain_sampler_at_the_edges(case: str) -> None:
    args, expected = CHAIN_EDGES[case]
    output_token_ids, _ = tree_sample(**args)
    assert output_token_ids[0].tolist() == expected
    assert torch.equal(output_token_ids, chain_sample(**_without_parents(args)))


# ---- statistical losslessness --------------------------------------------------------------------

VOCAB = 6
# three children under the root, each with one child of its own
STAT_PARENTS = [-1, 0, -1, 2, -1, 4]
NUM_TREES = 20_000


def first_token_pvalue(has_draft_probs: bool, seed: int = 0) -> float:
    """Chi-square p-value of the batched sampler's first emitted token against p, over NUM_TREES
    requests whose drafts are drawn i.i.d. from q (passed as one-hot when not has_draft_probs)."""
    chisquare = pytest.importorskip("scipy.stats").chisquare
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(VOCAB, generator=gen) * 1.5).softmax(-1)
    q = (torch.randn(VOCAB, generator=gen) * 1.5).softmax(-1)
    k = len(STAT_PARENTS)
    num_draft_tokens, num_rows = NUM_TREES * k, NUM_TREES * (k + 1)
    output_token_ids, _ = tree_sample(
        draft_token_ids=torch.multinomial(q, num_draft_tokens, replacement=True, generator=gen),
        draft_parents=torch.tensor(STAT_PARENTS * NUM_TREES),
        cu_num_draft_tokens=torch.arange(1, NUM_TREES + 1) * k,
        draft_probs=q.expand(num_draft_tokens, -1).contiguous() if has_draft_probs else None,
        target_probs=p.expand(num_rows, -1).contiguous(),
        target_argmax=p.argmax().expand(num_rows).contiguous(),
        is_greedy=torch.zeros(NUM_TREES, dtype=torch.bool),
        acceptance_uniforms=torch.rand(num_draft_tokens, generator=gen),
        sample_uniforms=torch.rand(num_rows, generator=gen, dtype=torch.float64),
        max_spec_len=k,
    )
    counts = torch.bincount(output_token_ids[:, 0], minlength=VOCAB).double()
    expected = p.double() / p.double().sum() * NUM_TREES
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_first_token_follows_the_target(has_draft_probs: bool) -> None:
    assert first_token_pvalue(has_draft_probs) > 1e-3


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_forgetting_the_residual_between_siblings_is_caught(
        has_draft_probs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sibling tested against p itself, and the last token drawn from p: rejected siblings'
    tokens come back through later siblings and the draw, and the check fails."""
    monkeypatch.setattr(tree_rejection, "_reject",
                        lambda residual, scale, token_ids, draft_probs: (residual, scale))
    assert first_token_pvalue(has_draft_probs) < 1e-6
