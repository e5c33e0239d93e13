"""The sampling-law check of tests/engine/test_sampling_distribution*.py: a tiny Llama wired as a
bigram model (its next-token distribution depends only on the previous token), completions sampled
through the whole engine, and a chi-square test over every transition sized to catch a given
total-variation error with 95% power at a 1e-3 false-alarm rate."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers
from bigram_model import build_bigram_checkpoint
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2
from tiers import is_quick

from engine import LLM, SamplingParams

VOCAB = 4
# row a = logits of the next token after token a; each row has its own favourite and shape
TARGET_LOGITS = [[2.0, 0.5, -0.5, 1.0],
                 [0.0, 1.8, 1.2, -1.0],
                 [1.5, -0.8, 0.3, 1.1],
                 [-0.6, 0.9, 2.2, 0.4]]
# the draft model's: TV(p, q) is 0.18-0.26 per row at T=1, so min(1, p/q) rejects a real share of
# drafts and the residual max(0, p - q) is sampled often
DRAFT_LOGITS = [[1.2, 1.2, -0.5, 1.0],
                [0.6, 1.2, 1.4, -0.6],
                [1.0, -0.2, 0.9, 1.1],
                [0.0, 1.2, 1.6, 0.4]]
PROMPT = [0, 1, 2, 3, 0, 1, 2, 3, 2, 0]  # repeats itself: prompt lookup drafts from the first step
MAX_TOKENS = 32
K = 3

# ---- the requirement: what the check must catch, and how rarely it may fail a correct engine ----
# NOTE: the full suite catches a 1% TV error (2% for the other proposers); the quick tier
# (`--quick`, tests/helpers/tiers.py) twice that, at the same power and false-alarm rate, on a
# quarter of the tokens. The broken samplers (canaries) are always sized by the full suite's.
FULL_EPSILON = 0.01
# the other proposers' cases (tests/engine/test_sampling_distribution_proposers.py)
FULL_OTHER_EPSILON = 0.02
QUICK_EPSILON_SCALE = 2.0
EPSILON = FULL_EPSILON * (QUICK_EPSILON_SCALE if is_quick() else 1.0)
OTHER_EPSILON = FULL_OTHER_EPSILON * (QUICK_EPSILON_SCALE if is_quick() else 1.0)
ALPHA = 1e-3
POWER = 0.95


def required_num_tokens(df: int, epsilon: float = EPSILON, alpha: float = ALPHA,
                        power: float = POWER) -> int:
    """Emitted tokens needed to catch a TV error of `epsilon` with probability `power`.

    The check (chain_verdict) computes Pearson's X = sum_a sum_b (C[a,b] - N_a P[a,b])^2 /
    (N_a P[a,b]), where C[a,b] counts b emitted right after a and N_a = sum_b C[a,b]. When the
    tokens follow P, X is chi-square with df = sum_a (|support of P[a]| - 1) (the Anderson-Goodman
    test for a Markov chain). The check fails when X > chi2.isf(alpha, df).

    Suppose the engine instead emits b after a with probability P'[a,b]. Then X is approximately
    noncentral chi-square with lambda = sum_a N_a chi2div(P'[a] || P[a]). Two bounds give the
    sample size:
      - Cauchy-Schwarz: chi2div(P' || P) >= (sum_b |P'_b - P_b|)^2 = 4 TV(P', P)^2.
      - Jensen over rows: lambda >= 4 N eps^2, where N = sum_a N_a is the number of emitted tokens
        and eps = sum_a (N_a / N) TV(P'[a], P[a]) is the TV error of one emitted token, averaged
        over positions.
    So N = lambda* / (4 eps^2) tokens suffice, where lambda* solves
    P(ncx2(df, lambda*) > chi2.isf(alpha, df)) = power.

    With eps = 0.01, alpha = 1e-3 and power = 0.95:
      - df = 12 (4 tokens, no truncation): lambda* = 41.9, N = 104,840
      - df = 8: lambda* = 37.6, N = 93,880
      - df = 4: lambda* = 31.8, N = 79,410
    test_the_check_has_the_power_it_claims confirms this by simulation.
    """
    critical = chi2.isf(alpha, df)
    lam = brentq(lambda x: ncx2.sf(critical, df, x) - power, 1e-3, 1e4)
    return math.ceil(lam / (4 * epsilon ** 2))


@dataclass(frozen=True)
class Case:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __str__(self) -> str:
        parts = [f"T={self.temperature}"]
        parts += [f"top_k={self.top_k}"] if self.top_k else []
        parts += [f"top_p={self.top_p}"] if self.top_p < 1.0 else []
        return ",".join(parts)


def reference_probs(logits: torch.Tensor, case: Case) -> torch.Tensor:
    """P after temperature, then top-k, then top-p (keep the most likely tokens until their mass
    reaches top_p, renormalised after top-k), in float64. logits: [rows, vocab]."""
    probs = torch.softmax(logits.double() / case.temperature, dim=-1)  # [rows, vocab]
    out = torch.zeros_like(probs)
    for row, p in enumerate(probs):
        keep = torch.argsort(p, descending=True).tolist()[:case.top_k or None]
        if case.top_p < 1.0:
            cumulative = torch.cumsum(p[keep] / p[keep].sum(), 0)
            # NOTE: a cut within 1e-3 of top_p could flip on the engine's float32 rounding
            assert (cumulative - case.top_p).abs().min() > 1e-3, (case, row)
            keep = keep[:int((cumulative < case.top_p).sum()) + 1]
        out[row, keep] = p[keep] / p[keep].sum()
    return out


def degrees_of_freedom(probs: torch.Tensor) -> int:
    return int(((probs > 0).sum(dim=1) - 1).sum())


# ---- the check --------------------------------------------------------------------------------
@dataclass
class Verdict:
    statistic: float
    df: int
    pvalue: float
    num_tokens: int
    # tokens emitted where the target gives probability 0 (cut by top-k / top-p)
    num_forbidden: int
    # the smallest expected count: the chi-square approximation wants it >= 5
    min_expected: float
    # sum_a (N_a / N) TV(empirical row a, P[a]): the observed error, for messages
    empirical_tv: float

    @property
    def rejects(self) -> bool:
        return self.num_forbidden > 0 or self.pvalue < ALPHA

    def __str__(self) -> str:
        return (f"X={self.statistic:.1f}, df={self.df}, p-value={self.pvalue:.2e} over "
                f"{self.num_tokens} tokens ({self.num_forbidden} outside the target's support; "
                f"empirical TV {self.empirical_tv:.4f})")


def chain_verdict(counts: np.ndarray, target: torch.Tensor) -> Verdict:
    """Pearson's chi-square of emitted tokens against target[previous token]; counts, target:
    [vocab (previous), vocab (emitted)]. Distribution and power: required_num_tokens."""
    probs = target.numpy()
    row_totals = counts.sum(axis=1, keepdims=True)  # [vocab, 1] N_a
    expected = row_totals * probs
    cells = (row_totals > 0) & (probs > 0)
    statistic = float(((counts - expected)[cells] ** 2 / expected[cells]).sum())
    df = int(sum((probs[a] > 0).sum() - 1 for a in range(VOCAB) if row_totals[a, 0] > 0))
    tv = 0.5 * float(np.abs(counts - expected).sum()) / counts.sum()
    return Verdict(statistic, df, float(chi2.sf(statistic, df)), int(counts.sum()),
                   int(counts[probs == 0].sum()), float(expected[cells].min()), tv)


def transition_counts(token_rows: np.ndarray, last_prompt_token: int) -> np.ndarray:
    """[vocab, vocab] counts of (previous token, emitted token).

    token_rows: [completions, tokens]."""
    previous = np.concatenate(
        [np.full((len(token_rows), 1), last_prompt_token), token_rows[:, :-1]], axis=1)
    pairs = (previous * VOCAB + token_rows).ravel()
    return np.bincount(pairs, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)


# ---- the model (tests/helpers/bigram_model.py) ---------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    """The LLMs here run on one thread (tiny tensors: OpenMP hand-offs cost more than they save on
    a busy machine); the process-wide setting is put back for the modules that run after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_bigram_checkpoint(tmp_path_factory.mktemp("bigram_target"), TARGET_LOGITS)


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    return build_bigram_checkpoint(tmp_path_factory.mktemp("bigram_draft"), DRAFT_LOGITS)


@pytest.fixture(scope="module")
def target_logits(target) -> torch.Tensor:
    """[vocab, vocab] float64 logits after each token, from transformers; the context before the
    last token changes nothing, as a bigram model's must not."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).eval()
    with torch.no_grad():
        alone = model(torch.arange(VOCAB)[:, None]).logits[:, -1]  # [vocab, vocab]
        in_context = model(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1]
    torch.testing.assert_close(in_context, alone, rtol=0, atol=1e-12)
    torch.testing.assert_close(alone, torch.tensor(TARGET_LOGITS, dtype=torch.float64),
                               rtol=0, atol=1e-4)
    return alone


@dataclass
class Sample:
    counts: np.ndarray  # [vocab, vocab] transition counts
    num_draft_tokens: int
    num_accepted_tokens: int


def sample(target: str, case: Case, target_probs: torch.Tensor, seed: int | None,
           speculative_config: dict | None = None, fraction: float = 1.0,
           epsilon: float = EPSILON) -> Sample:
    """Seeded (or, with seed None, unseeded: the engine's own random stream, started from
    torch.manual_seed(0) here) completions of PROMPT, all in one batched generate call:
    MAX_TOKENS tokens each, and enough completions for required_num_tokens (times `fraction`).

    NOTE: every token is a sample, not only the first: the bigram's p is known at each position.
    Single-token requests would cost ~MAX_TOKENS times more, since the engine's cost is per request
    per step (about 100 us on the CPU), and a case needs 80-105k tokens."""
    num_completions = math.ceil(
        fraction * required_num_tokens(degrees_of_freedom(target_probs), epsilon) / MAX_TOKENS)
    llm = LLM(target, dtype="float64", num_threads=1, max_model_len=64, block_size=64,
              num_kv_blocks=num_completions + 8, max_num_seqs=num_completions,
              max_num_batched_tokens=num_completions * len(PROMPT),
              speculative_config=speculative_config)
    params = SamplingParams(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
                            max_tokens=MAX_TOKENS, ignore_eos=True, n=num_completions, seed=seed)
    if seed is None:
        torch.manual_seed(0)
    [out] = llm.generate({"prompt_token_ids": PROMPT}, params)
    token_rows = np.array([c.token_ids for c in out.outputs], dtype=np.int64)
    assert token_rows.shape == (num_completions, MAX_TOKENS)
    stats = [c.spec_stats for c in out.outputs]
    return Sample(transition_counts(token_rows, PROMPT[-1]),
                  sum(s.num_draft_tokens for s in stats if s is not None),
                  sum(s.num_accepted_draft_tokens for s in stats if s is not None))


def assert_follows_target(result: Sample, target_probs: torch.Tensor,
                          epsilon: float = EPSILON) -> None:
    verdict = chain_verdict(result.counts, target_probs)
    assert verdict.min_expected >= 5, verdict
    assert verdict.num_tokens >= required_num_tokens(verdict.df, epsilon), verdict
    assert not verdict.rejects, f"emitted tokens do not follow the target: {verdict}"


# ---- a broken sampler the check must reject ----------------------------------------------
def recover_from_p(target_probs, draft_probs, draft_token_ids):
    """Draws the recovered token from p instead of the residual norm(max(0, p - q))."""
    return target_probs
