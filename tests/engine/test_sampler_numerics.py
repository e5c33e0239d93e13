"""Numerics of the sampling path (issue 28): a temperature below 1e-5 is greedy, a tiny top_p keeps
the top token, a row left without probability mass emits the argmax of its processed logits (never
token 0), NaN never reaches the fixed-point draw, and a request whose raw logits hold NaN or +inf
fails alone. Each on every path: plain (k = 0), chain, tree; seeded and unseeded; one-hot and soft
drafts; the torch reference and the Triton kernels under TRITON_INTERPRET=1."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

import engine.sample.sampler as sampler_module
import engine.step.rejection as rejection_module
import kernels.rejection_reference as reference_module
import kernels.tree_rejection as tree_module
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.step.layout import StepLayout
from engine.step.rejection import NON_FINITE_LOGITS, RejectionSampler
from engine.step.types import SampledTokens, ScheduledRequest
from tests.helpers.one_request_law import apply_top_k_top_p, request_q

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: before kernels' Triton modules load (conftest sets it too)
interpreter = pytest.importorskip("triton.runtime.interpreter")
from kernels import rejection_triton, tree_rejection_triton  # noqa: E402

if not isinstance(rejection_triton._accept_kernel, interpreter.InterpretedFunction):
    rejection_triton = importlib.reload(rejection_triton)
    tree_rejection_triton = importlib.reload(tree_rejection_triton)

VOCAB = 16
K = 3
TREE_PARENTS = [-1, 0, -1]  # two children under the newest token, one grandchild


def logits_with_argmax(num_rows: int, seed: int) -> torch.Tensor:
    """[num_rows, VOCAB] random logits in [-3, 3] whose row r peaks (6) at a token other than 0."""
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed))
    logits = logits.clamp(-3.0, 3.0)
    logits[torch.arange(num_rows), 1 + (5 * torch.arange(num_rows)) % (VOCAB - 1)] = 6.0
    return logits


def run(logits: torch.Tensor, params: list[SamplingParams], path: str, soft: bool,
        num_output_tokens: int = 0) -> tuple[list[SampledTokens], StepLayout]:
    """One step of requests with `params`, each verifying K drafts that are its rows' argmaxes
    (so a greedy walk accepts them) as a chain or a tree, or none (plain)."""
    items, start = [], 0
    for index, p in enumerate(params):
        request = Request(f"r{index}", [1, 2], p, frozenset({0}))
        request.output_token_ids = [7] * num_output_tokens
        k = 0 if path == "plain" else K
        rows = logits[start:start + k + 1].argmax(dim=-1).tolist()
        parents = TREE_PARENTS if path == "tree" else None
        drafts = [rows[0 if parents is None or parent < 0 else parent + 1]
                  for parent in (parents or range(-1, k - 1))]
        q = torch.full((k, VOCAB), 1.0 / VOCAB) if soft and k else None
        items.append(ScheduledRequest(request, 1 + k, True, drafts, q, parents))
        start += k + 1
    layout = StepLayout.build(items, torch.device("cpu"))
    return RejectionSampler()(logits[:start], layout), layout


def assert_argmax_path(sampled: list[SampledTokens], layout: StepLayout,
                       logits: torch.Tensor) -> None:
    """Every emitted token is the argmax of the row it came from (the accepted path's rows)."""
    for index, kept in enumerate(sampled):
        assert kept.error is None and kept.token_ids
        rows = layout.kept_rows(index, kept.kept_drafts)
        assert kept.token_ids == logits[rows].argmax(dim=-1).tolist(), index


@pytest.fixture(params=["reference", "triton"])
def kernel(request, monkeypatch) -> str:
    """The sampler's kernels: the torch reference, or the Triton kernels under the interpreter.
    Also checks that no NaN reaches a fixed-point conversion, wherever it happens."""
    if request.param == "triton":
        monkeypatch.setattr(rejection_module, "rejection_sample", rejection_triton.rejection_sample)
        monkeypatch.setattr(rejection_module, "tree_rejection_sample",
                            tree_rejection_triton.tree_rejection_sample)
    original = reference_module.to_fixed_point

    def checked(weights: torch.Tensor) -> torch.Tensor:
        assert not weights.isnan().any(), "NaN reached to_fixed_point"
        return original(weights)

    for module in (reference_module, tree_module, sampler_module):
        monkeypatch.setattr(module, "to_fixed_point", checked)
    return request.param


PATHS = ["plain", "chain", "tree"]
# (name, params, logits scale): each leaves at most the top token, or no mass at all
DEGENERATE = {
    # 1e-50 is 0.0 in float32: dividing by it left NaN everywhere
    "temperature_1e-50": ({"temperature": 1e-50}, 1.0),
    # 1e-50 is 0.0 in float32: every token's mass before it reached it, the top token's too
    "top_p_1e-50": ({"temperature": 1.0, "top_p": 1e-50}, 1.0),
    "min_p_1": ({"temperature": 1.0, "min_p": 1.0}, 1.0),
    # finite logits that overflow float32 once tempered: +inf, so softmax has no mass
    "overflow_after_temperature": ({"temperature": 1e-4}, 1e37),
}


@pytest.mark.parametrize("soft", [False, True], ids=["one_hot", "soft"])
@pytest.mark.parametrize("seed", [None, 11], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", DEGENERATE)
def test_degenerate_rows_emit_the_argmax(kernel, case, path, seed, soft) -> None:
    extra, scale = DEGENERATE[case]
    logits = logits_with_argmax(3 * (K + 1), seed=len(case)) * scale  # [rows, vocab]
    params = [SamplingParams(seed=seed if seed is None else seed + i, **extra) for i in range(3)]
    sampled, layout = run(logits, params, path, soft)
    assert_argmax_path(sampled, layout, logits)


def test_a_tiny_temperature_is_greedy() -> None:
    assert SamplingParams(temperature=1e-50).is_greedy
    assert SamplingParams(temperature=9.99e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_a_tiny_top_p_keeps_the_top_token() -> None:
    log_p = torch.tensor([0.1, 0.5, 0.4]).log()
    for top_p in (1e-50, 1e-45, 1e-30):
        masked = apply_top_k_top_p(log_p, None, top_p)
        assert torch.isfinite(masked).tolist() == [False, True, False]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_q_without_mass_is_one_hot_at_its_argmax(bad: float) -> None:
    """A drafter's q must stay a distribution (its draft is drawn from it, and the kernels read
    it): a row with NaN, +inf or nothing but -inf becomes one-hot at its argmax (NaN as -inf)."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [bad, 3.0, 1.0], [float("-inf")] * 3])
    probs = request_q(logits, SamplingParams(temperature=0.5))  # [3, 3]
    assert not probs.isnan().any()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3))
    assert probs[1].tolist() == ([1.0, 0.0, 0.0] if bad > 0 else [0.0, 1.0, 0.0])
    assert sorted(probs[2].tolist()) == [0.0, 0.0, 1.0]
    assert 0.0 < float(probs[0, 2]) < float(probs[0, 1]) < 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("path", PATHS)
def test_non_finite_logits_fail_that_request_alone(kernel, path, bad) -> None:
    """A request with NaN or +inf among its raw logits (in its last row) gets an error and no
    tokens; its batch mates (greedy, seeded, seeded with top-k; logprobs asked) get exactly the
    tokens and logprobs of a step without it."""
    mates = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(seed=5, logprobs=1),
             SamplingParams(seed=6, top_k=4)]
    per_request = 1 if path == "plain" else K + 1  # rows
    logits = logits_with_argmax(4 * per_request, seed=3)  # [rows, vocab]
    broken = logits.clone()
    broken[2 * per_request - 1, 3] = bad  # the second request's last row
    everything, _ = run(broken, mates[:1] + [SamplingParams(seed=9)] + mates[1:], path, False)
    assert everything[1].error == NON_FINITE_LOGITS and everything[1].token_ids == []
    alone, _ = run(torch.cat([logits[:per_request], logits[2 * per_request:]]), mates, path, False)
    mates_tokens = everything[:1] + everything[2:]
    assert [s.token_ids for s in mates_tokens] == [s.token_ids for s in alone]
    assert [[lp.logprob for lp in s.logprobs or []] for s in mates_tokens] \
        == [[lp.logprob for lp in s.logprobs or []] for s in alone]
