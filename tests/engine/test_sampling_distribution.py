"""Sampled tokens follow the target's distribution through the whole engine, with enough tokens per
case that a 1% total-variation error is caught with probability >= 0.95 at a false-alarm rate of
1e-3. Deliberately broken samplers fail the same check.

The target is a real (tiny) Llama checkpoint wired as a bigram model: its attention and MLP outputs
are zero, so the next-token distribution depends only on the previous token, P[a] = softmax(L[a]).
Every emitted token, at every position and on every path (plain sampling, an accepted draft, a
recovered or a bonus token), must be a draw from P[previous token] after the request's temperature,
top-k and top-p. Because the previous token changes from position to position, a row of p or q taken
from the wrong position shows up too. P comes from transformers in float64, and the transforms are
written out here rather than borrowed from engine/.

Every other proposer (suffix chains and trees, EAGLE, EAGLE-3, the MLP speculator) is checked the
same way, unseeded, with tokens enough for a 2% TV error, each beside a broken sampler that the
same check must reject in the same run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers
from bigram_model import build_bigram_checkpoint
from scipy.optimize import brentq
from scipy.stats import chi2, ncx2

import engine.sample.rejection as rejection_module
import engine.sample.sampler as sampler_module
import kernels.rejection_reference as reference_module
from engine import LLM, SamplingParams
from kernels import rejection_sample_reference

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
EPSILON = 0.01
# the other proposers' cases (below): 26-21k tokens each
OTHER_EPSILON = 0.02
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


# ---- the check itself ------------------------------------------------------------------------
def test_the_check_has_the_power_it_claims():
    """Simulated counts, no engine: with required_num_tokens tokens, an error of exactly EPSILON
    (each row moved in its hardest direction, mass shifted in proportion to p between two halves)
    is caught in >= 95% of trials, and a correct sampler passes."""
    probs = reference_probs(torch.tensor(TARGET_LOGITS), Case())  # [vocab, vocab]
    df = degrees_of_freedom(probs)
    num_tokens = required_num_tokens(df)
    moved = probs.clone()
    for a, p in enumerate(probs):
        # the split of row a's tokens into two sides with masses closest to 1/2 minimises chi2div
        side = min((torch.tensor([b in s for b in range(VOCAB)])
                    for r in range(1, VOCAB) for s in itertools.combinations(range(VOCAB), r)),
                   key=lambda s: abs(float(p[s].sum()) - 0.5))
        moved[a] = torch.where(side, p * (1 + EPSILON / p[side].sum()),
                               p * (1 - EPSILON / p[~side].sum()))
    stationary = torch.linalg.matrix_power(probs, 200)[0]  # visits per previous token
    row_totals = np.round(num_tokens * stationary.numpy()).astype(np.int64)
    rng = np.random.default_rng(0)
    rejections = {"correct": 0, "moved": 0}
    num_trials = 400
    for name, table in (("correct", probs), ("moved", moved)):
        for _ in range(num_trials):
            counts = np.stack([rng.multinomial(n, table[a].numpy())
                               for a, n in enumerate(row_totals)])
            rejections[name] += chain_verdict(counts, probs).rejects
    assert 0.5 * float((moved - probs).abs().sum(dim=1).max()) == pytest.approx(EPSILON)
    assert rejections["moved"] >= 0.92 * num_trials, rejections  # 0.95 expected, 0.011 s.d.
    assert rejections["correct"] <= 3, rejections  # 0.4 expected


# ---- the engine ------------------------------------------------------------------------------
PLAIN_CASES = [Case(temperature=0.7), Case(temperature=1.3, top_k=3),
               Case(temperature=1.0, top_p=0.8)]


@pytest.mark.parametrize("case", PLAIN_CASES, ids=str)
def test_plain_sampling_follows_the_target(target, target_logits, case):
    probs = reference_probs(target_logits, case)
    result = sample(target, case, probs, seed=1_000_000 * PLAIN_CASES.index(case))
    assert_follows_target(result, probs)


SPEC_CASES = {
    # one-hot drafts: x is accepted with probability p(x), else recovered from p with x removed
    "ngram": (Case(temperature=1.3), {"method": "ngram", "num_speculative_tokens": K,
                                      "prompt_lookup_min": 1, "prompt_lookup_max": 3}),
    # drafts drawn from q != p, itself tempered and truncated like p
    "draft_model": (Case(temperature=0.7, top_k=3, top_p=0.9),
                    {"method": "draft_model", "num_speculative_tokens": K}),
}


@pytest.mark.parametrize("method", SPEC_CASES)
def test_speculative_sampling_follows_the_target(target, draft, target_logits, method):
    case, config = SPEC_CASES[method]
    if method == "draft_model":
        config = {**config, "model": draft}
    probs = reference_probs(target_logits, case)
    result = sample(target, case, probs, seed=7_000_000, speculative_config=config)
    assert_follows_target(result, probs)
    # most tokens came through verification, and both outcomes of the test happened often
    num_rejected = result.num_draft_tokens - result.num_accepted_tokens
    num_tokens = int(result.counts.sum())
    assert result.num_accepted_tokens > 0.1 * num_tokens, result
    assert num_rejected > 0.1 * num_tokens, result


# ---- broken samplers: the same check must reject them ----------------------------------------
def accept_with_probability_p(**args):
    """Accepts draft x with probability p(x) instead of min(1, p(x)/q(x)): the reference accepts
    when u * q(x) < p(x), so it is handed u / q(x)."""
    if args["draft_probs"] is None:  # a step without drafts to accept
        return rejection_sample_reference(**args)
    q_of_draft = args["draft_probs"].gather(1, args["draft_token_ids"][:, None])[:, 0]
    args["acceptance_uniforms"] = args["acceptance_uniforms"].double() / q_of_draft.double()
    return rejection_sample_reference(**args)


def recover_from_p(target_probs, draft_probs, draft_token_ids):
    """Draws the recovered token from p instead of the residual norm(max(0, p - q))."""
    return target_probs


def bonus_from_the_last_draft_row(**args):
    """Off by one in the layout: draws the bonus token from the last draft's row of p, not from
    the row after it."""
    cu = args["cu_num_draft_tokens"]
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))
    bonus_row = cu + torch.arange(len(cu))  # request i's rows are cu[i-1] + i .. cu[i] + i
    shifted = bonus_row[num_drafts > 0]
    probs = args["target_probs"].clone()
    probs[shifted] = probs[shifted - 1]
    return rejection_sample_reference(**dict(args, target_probs=probs))


def temperature_after_top_p(logits, metadata):
    """Truncates (top-k, top-p) the untempered distribution, then applies the temperature."""
    rows = metadata.request_of_row
    kept = sampler_module.apply_top_k(logits.float(), metadata.top_k[rows], metadata.max_top_k)
    kept = sampler_module.apply_top_p(kept, metadata.top_p[rows])
    return (kept / metadata.temperature[rows, None]).softmax(dim=-1)


DRAFT_T1 = (Case(temperature=1.0), {"method": "draft_model", "num_speculative_tokens": K})
BROKEN = {
    "accepts_with_p_not_min_1_p_over_q": (rejection_module, "rejection_sample",
                                          accept_with_probability_p, DRAFT_T1),
    "recovers_from_p_not_the_residual": (reference_module, "recovery_weights",
                                         recover_from_p, DRAFT_T1),
    "bonus_from_the_last_draft_row": (rejection_module, "rejection_sample",
                                      bonus_from_the_last_draft_row, DRAFT_T1),
    "temperature_after_top_p": (rejection_module, "target_probs", temperature_after_top_p,
                                (Case(temperature=0.7, top_k=3, top_p=0.9), None)),
}


@pytest.mark.parametrize("bug", BROKEN)
def test_a_broken_sampler_is_caught(target, draft, target_logits, monkeypatch, bug):
    """Each bug is a TV error of several percent, far above EPSILON, so a tenth of the tokens
    already rejects it; the check is chain_verdict, as above."""
    module, name, replacement, (case, config) = BROKEN[bug]
    monkeypatch.setattr(module, name, replacement)
    if config is not None:
        config = {**config, "model": draft}
    probs = reference_probs(target_logits, case)
    result = sample(target, case, probs, seed=9_000_000, speculative_config=config, fraction=0.1)
    verdict = chain_verdict(result.counts, probs)
    assert verdict.rejects, f"{bug} went unnoticed: {verdict}"


# ---- every other proposer, unseeded, each beside a broken sampler that must fail -------------
# NOTE: these catch a 2% TV error with 95% power (a quarter of the tokens a 1% error needs, since
# N grows as 1 / eps^2): the drafters' Python per request and step makes each token dearer here.
# Unseeded: seeded requests with one-hot drafts are decided by their keyed inverse CDF, not
# by rejection sampling; the rejection sampler is what these cases check, draft by draft
@pytest.fixture(scope="module")
def deep_target(tmp_path_factory) -> str:
    """The same bigram model with 3 (inert) layers: EAGLE-3 reads three layers' streams."""
    return build_bigram_checkpoint(tmp_path_factory.mktemp("bigram_deep"), TARGET_LOGITS,
                                   num_layers=3)


def drafter_folder(method: str, target: str, folder: str) -> str | None:
    """A random head of `method` for the bigram target (q far from p: both outcomes are common)."""
    from engine.models.arch import LlamaArch
    from engine.models.loader import load_checkpoint
    from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head
    from engine.proposers.eagle_head import EagleConfig, EagleHead
    from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig

    arch = LlamaArch.from_hf_config(load_checkpoint(target, torch.float32).hf_config)
    torch.manual_seed(5)
    if method == "eagle":
        head = EagleHead(EagleConfig.for_target(arch, VOCAB), arch)
        head.draft_token_ids.copy_(torch.arange(VOCAB))
        head.save(folder)
    elif method == "eagle3":
        config = Eagle3Config.for_target(arch, VOCAB, (0, 1, 2))
        head3 = Eagle3Head(config, config.layer_arch(arch), has_embeddings=False)
        head3.draft_token_ids.copy_(torch.arange(VOCAB))
        head3.save(folder, "test")
    elif method == "mlp_speculator":
        MLPSpeculator(MLPSpeculatorConfig(arch.hidden_size, VOCAB, K)).save(folder)
    else:
        return None
    return folder


OTHER_SPEC_CASES = {
    # one-hot drafts from the suffix trees of the prompt and the output so far
    "suffix": (Case(temperature=1.0), {"method": "suffix", "num_speculative_tokens": K}),
    # one-hot trees: several continuations verified at once, multi-draft rejection sampling
    "suffix_tree": (Case(temperature=1.3, top_k=3),
                    {"method": "suffix", "num_speculative_tokens": 6, "draft_tree": True}),
    # drafts sampled from the heads' own q
    "eagle": (Case(temperature=0.7), {"method": "eagle", "num_speculative_tokens": K}),
    "eagle3": (Case(temperature=1.0, top_k=3), {"method": "eagle3", "num_speculative_tokens": K}),
    "mlp_speculator": (Case(temperature=1.0),
                       {"method": "mlp_speculator", "num_speculative_tokens": K}),
}


@pytest.mark.parametrize("method", OTHER_SPEC_CASES)
def test_every_proposer_samples_the_target_and_a_broken_sampler_is_caught(
        deep_target, target_logits, tmp_path, monkeypatch, method):
    """Unseeded speculative sampling follows the target (the same check as above, with tokens
    enough to catch a 2% TV error with 95% power), most tokens come through verification with
    both outcomes common, and in the same run the same check rejects a sampler that draws a
    rejected draft's replacement from p instead of the residual (a 7-10% TV error, on a fifth of
    the tokens)."""
    case, config = OTHER_SPEC_CASES[method]
    folder = drafter_folder(method, deep_target, str(tmp_path / "drafter"))
    config = {**config, "model": folder} if folder else config
    probs = reference_probs(target_logits, case)
    result = sample(deep_target, case, probs, seed=None, speculative_config=config,
                    epsilon=OTHER_EPSILON)
    assert_follows_target(result, probs, OTHER_EPSILON)
    num_rejected = result.num_draft_tokens - result.num_accepted_tokens
    num_tokens = int(result.counts.sum())
    assert result.num_accepted_tokens > 0.1 * num_tokens, result
    assert num_rejected > 0.1 * num_tokens, result

    import kernels.tree_rejection as tree_module

    is_tree = config.get("draft_tree", False)
    monkeypatch.setattr(tree_module if is_tree else reference_module, "recovery_weights",
                        recover_from_p)
    broken = sample(deep_target, case, probs, seed=None, speculative_config=config,
                    fraction=0.2, epsilon=OTHER_EPSILON)
    verdict = chain_verdict(broken.counts, probs)
    assert verdict.rejects, f"{method}: recovering from p went unnoticed: {verdict}"
