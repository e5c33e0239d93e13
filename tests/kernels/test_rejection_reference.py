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
from kernels.rejection_reference import rejection_sample

# ---- hand-computed tables ------------------------------------------------------------------------

P = [0.1, 0.6, 0.2, 0.1]  # a target row, argmax 1
Q = [0.5, 0.1, 0.3, 0.1]  # a draft row: p/q = 0.2 at token 0, 6 at token 1


def onehot(token_id: int) -> list[float]:
    return [1.0 if i == token_id else 0.0 for i in range(4)]


@dataclass
class Req:
    """One request: its drafts, k + 1 target rows, and the random numbers it consumes."""

    drafts: list[int]
    p: list[list[float]]  # k + 1 rows over a 4-token vocab
    bonus: int = 3
    is_greedy: bool = False
    q: list[list[float]] | None = None  # k rows; None = one-hot drafts (all requests in a call agree)
    u: list[float] | None = None  # k uniforms; default 0.5
    noise: list[list[float]] | None = None  # k rows of Exp(1) draws; default all ones


def run(reqs: list[Req], max_spec_len: int | None = None) -> list[list[int]]:
    num_drafts = [len(r.drafts) for r in reqs]
    has_q = reqs[0].q is not None

    def rows(get: Callable[[Req], list[list[float]]]) -> Tensor:
        return torch.tensor([row for r in reqs for row in get(r)], dtype=torch.float32)

    out = rejection_sample(
        draft_token_ids=torch.tensor([t for r in reqs for t in r.drafts], dtype=torch.int64),
        cu_num_draft_tokens=torch.tensor(num_drafts, dtype=torch.int64).cumsum(0),
        draft_probs=rows(lambda r: r.q).reshape(-1, 4) if has_q else None,
        target_probs=rows(lambda r: r.p).reshape(-1, 4),
        bonus_token_ids=torch.tensor([r.bonus for r in reqs], dtype=torch.int64),
        is_greedy=torch.tensor([r.is_greedy for r in reqs]),
        uniform_samples=torch.tensor([u for r in reqs for u in (r.u or [0.5] * len(r.drafts))]),
        recovery_noise=rows(lambda r: r.noise or [[1.0] * 4] * len(r.drafts)).reshape(-1, 4),
        max_spec_len=max(num_drafts) if max_spec_len is None else max_spec_len,
    )
    return out.tolist()


TABLE = {
    "greedy all accepted, then bonus": ([Req([1, 1], [P, P, P], bonus=2, is_greedy=True)], [[1, 1, 2]]),
    "greedy rejects 2nd, recovers argmax p": (
        [Req([1, 0], [P, P, P], is_greedy=True)], [[1, 1, -1]]),
    "greedy ignores u and q": (
        [Req([1], [P, P], is_greedy=True, q=[onehot(0)], u=[0.99])], [[1, 3]]),
    "greedy tie: argmax is the lowest id": (
        [Req([2], [[0.4, 0.1, 0.4, 0.1], P], is_greedy=True)], [[0, -1]]),
    "k=0 emits the bonus token": ([Req([], [P], bonus=2)], [[2]]),
    "k=0 padded to max_spec_len": ([Req([], [P], bonus=2)], [[2, -1, -1]]),
    "one-hot accepted when u < p(x)": ([Req([2], [P, P], u=[0.19])], [[2, 3]]),
    "one-hot rejected when u >= p(x), recovers from p without x": (
        [Req([1], [P, P], u=[0.6])], [[2, -1]]),
    "p(x) = 0 is never accepted, even at u = 0": (
        [Req([0], [[0.0, 0.5, 0.5, 0.0], P], u=[0.0])], [[1, -1]]),
    "q: accepted when u < p/q": ([Req([0], [P, P], q=[Q], u=[0.19])], [[0, 3]]),
    "q: rejected when u >= p/q, recovers from max(0, p - q)": (
        [Req([0], [P, P], q=[Q], u=[0.2])], [[1, -1]]),
    "q: p >= q is always accepted": ([Req([1], [P, P], q=[Q], u=[0.999])], [[1, 3]]),
    "recovery noise picks within the residual": (
        [Req([0], [P, P], q=[[0.5, 0.1, 0.1, 0.3]], u=[0.9], noise=[[1.0, 10.0, 1.0, 1.0]])],
        [[2, -1]]),
    "mixed batch: k = 2, 0, 3, greedy and random, -1 padding": (
        [Req([1, 3], [P, P, P], bonus=0, q=[onehot(1), onehot(3)], u=[0.5, 0.05]),
         Req([], [P], bonus=2, q=[]),
         Req([1, 1, 2], [P, P, P, P], is_greedy=True, q=[Q, Q, Q])],
        [[1, 3, 0, -1, -1], [2, -1, -1, -1, -1], [1, 1, 1, -1, -1]]),
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
    "draft_probs": lambda a: dict(a, draft_probs=a["draft_probs"].double()),
    "recovery_noise must be contiguous": lambda a: dict(
        a, recovery_noise=a["recovery_noise"].t().contiguous().t()),
    "is_greedy": lambda a: dict(a, is_greedy=a["is_greedy"].long()),
    "uniform_samples": lambda a: dict(a, uniform_samples=a["uniform_samples"][:-1]),
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
    u = args["uniform_samples"][:, None]  # [rows, 1]
    if bug == "accept with min(1, q/p)":
        is_accepted = u * p.gather(1, x) < q.gather(1, x)
        residual = (p - q).clamp_min(0.0)
    else:  # "recover from p instead of max(0, p - q)"
        is_accepted = u * q.gather(1, x) < p.gather(1, x)
        residual = p
    recovered = (residual / args["recovery_noise"]).argmax(1, keepdim=True)
    return torch.where(is_accepted, x, recovered).squeeze(1)


@pytest.mark.parametrize("bug", ["accept with min(1, q/p)", "recover from p instead of max(0, p - q)"])
def test_the_check_has_power(bug: str) -> None:
    args, target_table = draw_chains(DistCase("far"), 1, NUM_ROWS, seed=1)
    assert pvalue(rejection_sample(**args)[:, 0], target_table[0][0]) > 1e-4
    assert pvalue(_first_tokens_with_bug(args, bug), target_table[0][0]) < 1e-4
