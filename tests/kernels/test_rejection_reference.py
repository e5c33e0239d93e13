"""The torch rejection sampler: hand-computed tables, input validation, and statistical losslessness."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from rejection_stats import CASES, NUM_ROWS, DistCase, assert_follows_target, draw_chains, pvalue
from torch import Tensor

import kernels
from kernels.bench_rejection import random_inputs
from kernels.rejection_reference import inverse_cdf, rejection_sample, to_fixed_point

# ---- hand-computed tables ------------------------------------------------------------------------

P = [0.1, 0.6, 0.2, 0.1]  # a target row, argmax 1; its CDF is 0.1, 0.7, 0.9, 1.0
P2 = [0.1, 0.2, 0.6, 0.1]  # another, argmax 2
Q = [0.5, 0.1, 0.3, 0.1]  # a draft row: p/q = 0.2 at token 0, 6 at token 1


def onehot(token_id: int) -> list[float]:
    return [1.0 if i == token_id else 0.0 for i in range(4)]


@dataclass
class Req:
    """One request: its drafts, k + 1 target rows, and the random numbers it consumes."""

    drafts: list[int]
    p: list[list[float]]  # k + 1 rows over a 4-token vocab
    is_greedy: bool = False
    q: list[list[float]] | None = None  # k rows; None = one-hot drafts (all requests in a call agree)
    u: list[float] | None = None  # k acceptance uniforms; default 0.5
    s: list[float] | None = None  # k + 1 sample uniforms, one per row of p; default 0.5


def run(reqs: list[Req], max_spec_len: int | None = None) -> list[list[int]]:
    num_drafts = [len(r.drafts) for r in reqs]
    has_q = reqs[0].q is not None

    def rows(get: Callable[[Req], list[list[float]]]) -> Tensor:
        return torch.tensor([row for r in reqs for row in get(r)], dtype=torch.float32)

    target_probs = rows(lambda r: r.p).reshape(-1, 4)
    out = rejection_sample(
        draft_token_ids=torch.tensor([t for r in reqs for t in r.drafts], dtype=torch.int64),
        cu_num_draft_tokens=torch.tensor(num_drafts, dtype=torch.int64).cumsum(0),
        draft_probs=rows(lambda r: r.q).reshape(-1, 4) if has_q else None,
        target_probs=target_probs,
        target_argmax=target_probs.argmax(-1),
        is_greedy=torch.tensor([r.is_greedy for r in reqs]),
        acceptance_uniforms=torch.tensor([u for r in reqs for u in (r.u or [0.5] * len(r.drafts))]),
        sample_uniforms=torch.tensor([u for r in reqs for u in (r.s or [0.5] * len(r.p))],
                                     dtype=torch.float64),
        max_spec_len=max(num_drafts) if max_spec_len is None else max_spec_len,
    )
    return out.tolist()


TABLE = {
    "greedy all accepted, then argmax of the bonus row": (
        [Req([1, 1], [P, P, P2], is_greedy=True)], [[1, 1, 2]]),
    "greedy rejects 2nd, recovers argmax p": (
        [Req([1, 0], [P, P, P], is_greedy=True)], [[1, 1, -1]]),
    "greedy ignores u, q and the sample uniforms": (
        [Req([1], [P, P2], is_greedy=True, q=[onehot(0)], u=[0.99], s=[0.0, 0.99])], [[1, 2]]),
    "greedy tie: argmax is the lowest id": (
        [Req([2], [[0.4, 0.1, 0.4, 0.1], P], is_greedy=True)], [[0, -1]]),
    "k=0 draws the bonus token by inverse CDF": ([Req([], [P], s=[0.75])], [[2]]),
    "k=0 low uniform draws the first token": ([Req([], [P], s=[0.05])], [[0]]),
    "k=0 padded to max_spec_len": ([Req([], [P], s=[0.95])], [[3, -1, -1]]),
    "one-hot accepted when u < p(x), then the bonus": (
        [Req([2], [P, P2], u=[0.19], s=[0.0, 0.5])], [[2, 2]]),
    "one-hot rejected when u >= p(x), recovers from p without x": (
        # residual [0.1, 0, 0.2, 0.1]: CDF 0.1, 0.1, 0.3, 0.4; 0.9 * 0.4 = 0.36 -> token 3
        [Req([1], [P, P], u=[0.6], s=[0.9, 0.0])], [[3, -1]]),
    "one-hot recovery skips the rejected draft at its own CDF step": (
        # 0.3 * 0.4 = 0.12 passes 0.1 first at token 1, which has no residual: token 2
        [Req([1], [P, P], u=[0.6], s=[0.3, 0.0])], [[2, -1]]),
    "p(x) = 0 is never accepted, even at u = 0": (
        [Req([0], [[0.0, 0.5, 0.5, 0.0], P], u=[0.0], s=[0.25, 0.5])], [[1, -1]]),
    "q: accepted when u < p/q": ([Req([0], [P, P2], q=[Q], u=[0.19])], [[0, 2]]),
    "q: rejected when u >= p/q, recovers from max(0, p - q)": (
        [Req([0], [P, P], q=[Q], u=[0.2], s=[0.99, 0.5])], [[1, -1]]),
    "q: p >= q is always accepted": ([Req([1], [P, P], q=[Q], u=[0.999], s=[0.0, 0.95])], [[1, 3]]),
    "recovery draws within the residual": (
        # residual [0, 0.5, 0.1, 0]: 0.9 * 0.6 = 0.54 lies past token 1's 0.5
        [Req([0], [P, P], q=[[0.5, 0.1, 0.1, 0.3]], u=[0.9], s=[0.9, 0.0])], [[2, -1]]),
    "no residual mass left (p <= q): the draw falls back to p": (
        [Req([1], [[0.5, 0.5, 0.0, 0.0], P], q=[[0.5, 0.6, 0.0, 0.0]], u=[0.9], s=[0.75, 0.0])],
        [[1, -1]]),
    "mixed batch: k = 2, 0, 3, greedy and random, -1 padding": (
        [Req([1, 3], [P, P, P], q=[onehot(1), onehot(3)], u=[0.5, 0.05]),
         Req([], [P], q=[], s=[0.95]),
         Req([1, 1, 2], [P, P, P, P], is_greedy=True, q=[Q, Q, Q])],
        [[1, 3, 1, -1, -1], [3, -1, -1, -1, -1], [1, 1, 1, -1, -1]]),
}


@pytest.mark.parametrize("name", TABLE)
def test_table(name: str) -> None:
    reqs, expected = TABLE[name]
    width = len(expected[0])
    assert run(reqs, max_spec_len=width - 1) == expected


@pytest.mark.parametrize("seed", range(3))
def test_one_hot_none_equals_explicit_one_hot_q(seed: int) -> None:
    args = random_inputs([3, 0, 5, 1, 2, 4], 50, has_draft_probs=False, greedy_fraction=0.3, seed=seed)
    explicit = dict(args, draft_probs=torch.nn.functional.one_hot(args["draft_token_ids"], 50).float())
    assert torch.equal(rejection_sample(**args), rejection_sample(**explicit))


def test_dispatch_uses_the_reference_on_cpu() -> None:
    args = random_inputs([2, 3], 20, has_draft_probs=True, greedy_fraction=0.5, seed=0)
    assert torch.equal(kernels.rejection_sample(**args), rejection_sample(**args))


def test_empty_batch() -> None:
    args = random_inputs([], 8, has_draft_probs=True, greedy_fraction=0.0, seed=0)
    assert rejection_sample(**dict(args, max_spec_len=2)).shape == (0, 3)


BAD_INPUTS = {
    "draft_token_ids": lambda a: dict(a, draft_token_ids=a["draft_token_ids"].int()),
    "cu_num_draft_tokens must end": lambda a: dict(a, cu_num_draft_tokens=a["cu_num_draft_tokens"] - 1),
    "non-decreasing": lambda a: dict(a, cu_num_draft_tokens=torch.tensor([3, 1, 4])),
    "more than max_spec_len": lambda a: dict(a, max_spec_len=1),
    "target_probs must have shape": lambda a: dict(a, target_probs=a["target_probs"][:-1]),
    "target_probs must be \\[": lambda a: dict(a, target_probs=a["target_probs"][0]),
    "target_argmax": lambda a: dict(a, target_argmax=a["target_argmax"][:-1]),
    "draft_probs": lambda a: dict(a, draft_probs=a["draft_probs"].double()),
    "target_probs must be contiguous": lambda a: dict(
        a, target_probs=a["target_probs"].t().contiguous().t()),
    "is_greedy": lambda a: dict(a, is_greedy=a["is_greedy"].long()),
    "acceptance_uniforms": lambda a: dict(a, acceptance_uniforms=a["acceptance_uniforms"][:-1]),
    "sample_uniforms": lambda a: dict(a, sample_uniforms=a["sample_uniforms"].half()),
    "needed with target_probs": lambda a: dict(a, sample_uniforms=None),
    "only when every request is greedy": lambda a: dict(a, target_probs=None),
}


@pytest.mark.parametrize("match", BAD_INPUTS)
def test_invalid_inputs_raise_value_error(match: str) -> None:
    args = random_inputs([2, 1, 3], 5, has_draft_probs=True, greedy_fraction=0.5, seed=0)
    with pytest.raises(ValueError, match=match):
        rejection_sample(**BAD_INPUTS[match](args))


# ---- statistical losslessness (tests/helpers/rejection_stats.py) -------------------------------------


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_output_distribution_equals_target(case: DistCase, k: int) -> None:
    args, target_table = draw_chains(case, k, NUM_ROWS, seed=k)
    output = rejection_sample(**args)  # [rows, k + 1]
    accepted_first = (output[:, 1] >= 0).float().mean()
    assert 0.02 < accepted_first < 0.98  # acceptance is genuinely random in every case
    assert_follows_target(output, target_table)


def _first_tokens_with_bug(args: dict, bug: str) -> Tensor:
    """A k = 1 rejection sampler with a deliberate bug: the check above must notice it."""
    p = args["target_probs"][0::2]  # [rows, vocab]
    q = args["draft_probs"]  # [rows, vocab]
    x = args["draft_token_ids"][:, None]  # [rows, 1]
    u = args["acceptance_uniforms"][:, None]  # [rows, 1]
    if bug == "accept with min(1, q/p)":
        is_accepted = u * p.gather(1, x) < q.gather(1, x)
        residual = (p - q).clamp_min(0.0)
    else:  # "recover from p instead of max(0, p - q)"
        is_accepted = u * q.gather(1, x) < p.gather(1, x)
        residual = p
    recovered = inverse_cdf(to_fixed_point(residual), args["sample_uniforms"][0::2],
                            p.argmax(1))[:, None]
    return torch.where(is_accepted, x, recovered).squeeze(1)


@pytest.mark.parametrize("bug", ["accept with min(1, q/p)", "recover from p instead of max(0, p - q)"])
def test_the_check_has_power(bug: str) -> None:
    args, target_table = draw_chains(DistCase("far"), 1, NUM_ROWS, seed=1)
    assert pvalue(rejection_sample(**args)[:, 0], target_table[0][0]) > 1e-4
    assert pvalue(_first_tokens_with_bug(args, bug), target_table[0][0]) < 1e-4


# ---- the inverse-CDF draws themselves ------------------------------------------------------------


@pytest.mark.parametrize("draft", ["q", "one_hot"])
def test_recovered_and_bonus_tokens_follow_their_own_distributions(draft: str) -> None:
    """Conditioned on the outcome: a recovered token follows norm(max(0, p - q)) and the bonus token
    p_2. 20,000 rows, so drawing the recovered token from p instead (TV 0.3 here) cannot pass."""
    gen = torch.Generator().manual_seed(5)
    num_rows, vocab = NUM_ROWS, 6
    p1, p2, q = ((torch.randn(vocab, generator=gen) * 1.5).softmax(-1) for _ in range(3))
    q = q if draft == "q" else (torch.randn(vocab, generator=gen) * 1.5).softmax(-1)
    draft_token_ids = torch.multinomial(q, num_rows, replacement=True, generator=gen)
    target_probs = torch.stack([p1, p2]).repeat(num_rows, 1)  # [2 * rows, vocab]
    out = rejection_sample(
        draft_token_ids=draft_token_ids,
        cu_num_draft_tokens=torch.arange(1, num_rows + 1),
        draft_probs=q.expand(num_rows, -1).contiguous() if draft == "q" else None,
        target_probs=target_probs,
        target_argmax=target_probs.argmax(-1),
        is_greedy=torch.zeros(num_rows, dtype=torch.bool),
        acceptance_uniforms=torch.rand(num_rows, generator=gen),
        sample_uniforms=torch.rand(2 * num_rows, generator=gen, dtype=torch.float64),
        max_spec_len=1,
    )
    is_rejected = out[:, 1] < 0
    # one-hot q: the residual depends on the rejected draft x, so each x is checked on its own
    groups = [(is_rejected, q)] if draft == "q" else [
        (is_rejected & (draft_token_ids == x), torch.nn.functional.one_hot(torch.tensor(x), vocab))
        for x in range(vocab)]
    for rows, q_rows in groups:
        if rows.sum() >= 500:
            residual = (p1 - q_rows).clamp_min(0.0)
            residual /= residual.sum()
            assert pvalue(out[rows, 0], residual) > 1e-4
            if 0.5 * (residual - p1).abs().sum() > 0.1:
                assert pvalue(out[rows, 0], p1) < 1e-4  # the check tells the residual from p
    assert pvalue(out[~is_rejected, 1], p2) > 1e-4


@pytest.mark.parametrize("uniform", [1 - 2**-53, 1 - 2**-24, 0.0], ids=["f64_edge", "f32_edge", "zero"])
@pytest.mark.parametrize("weights", [
    [0.25, 0.75, 0.0, 0.0],  # zeros after the last positive token
    [0.0, 0.0, 0.5, 0.5],  # zeros before the first
    [0.3, 0.0, 0.0, 0.7, 0.0],  # and between
    [1e-30, 0.0, 1e-7, 0.0],  # a weight below the fixed-point resolution counts as zero
    [2**-42, 0.0, 0.0, 0.0],  # the smallest weight that counts
])
def test_a_zero_weight_token_is_never_drawn_at_the_cdf_edges(uniform: float,
                                                             weights: list[float]) -> None:
    fixed = to_fixed_point(torch.tensor([weights], dtype=torch.float32))  # [1, vocab]
    token = int(inverse_cdf(fixed, torch.tensor([uniform], dtype=torch.float64), torch.tensor([-7])))
    fixed = fixed[0]
    if fixed.sum() == 0:
        assert token == -7  # no mass at all: the fallback
    else:
        assert fixed[token] > 0
        positive = fixed.nonzero().squeeze(1)
        # u = 0 draws the first token with weight, u near 1 the last
        assert token == int(positive[0] if uniform == 0.0 else positive[-1])


def test_a_uniform_of_one_draws_the_last_positive_token() -> None:
    """u = 1 (out of contract, but a float64 uniform rounded to float32 can get there) puts the
    threshold at the total, past every CDF entry: the cap below it draws the last token with weight."""
    w = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    u = torch.tensor([1 - 2**-60], dtype=torch.float64).float()
    assert u.item() == 1.0
    assert int(inverse_cdf(to_fixed_point(w), u, torch.tensor([0]))) == 1
