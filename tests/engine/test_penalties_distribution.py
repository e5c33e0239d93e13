"""With penalties (and logit_bias, min_p) the speculative engine samples from the distribution of
decoding one token at a time: the joint distribution of the first three tokens matches a
token-by-token reference, and a sampler whose verification rows ignore the drafts before them
(counts updated once per step instead of per position) fails the same check by far.

The target is the bigram model of test_sampling_distribution.py (tests/helpers/bigram_model.py):
without penalties, the logits after token a are row a of a table. With them they also depend on
the output so far, which the reference below follows token by token, in float64. Completions have
4 tokens, so the step after the first verifies 2 drafts and token 3 comes from a row that follows
a draft whenever the first draft is accepted.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from bigram_model import build_bigram_checkpoint
from scipy.stats import chisquare

import engine.sample.penalties as penalties_module
from engine import LLM, SamplingParams

# the penalties' law, token by token, at full power: the full suite's
pytestmark = pytest.mark.slow

VOCAB = 4
# diagonal-heavy: without penalties a token likes to follow itself, so drafts repeat tokens
TARGET_LOGITS = [[0.6, 0.2, 0.0, 0.3],
                 [0.1, 0.6, 0.3, -0.1],
                 [0.0, 0.3, 0.6, 0.4],
                 [0.3, -0.1, 0.2, 0.7]]
DRAFT_LOGITS = [[1.2, 0.1, 0.0, 0.3],
                [0.0, 1.3, 0.6, -0.2],
                [0.1, 0.2, 1.1, 0.4],
                [0.3, -0.2, 0.5, 1.4]]
# runs of repeated tokens, so prompt lookup drafts repeats; no 2, so the repetition penalty of 2
# depends on the output
PROMPT = [0, 0, 0, 1, 1, 1, 3, 3, 3]
NUM_TOKENS = 3  # the joint distribution of the first NUM_TOKENS tokens: VOCAB ** 3 cells
MAX_TOKENS = NUM_TOKENS + 1
# enough for an expected count >= 5 in every cell (asserted)
NUM_COMPLETIONS = 4000
ALPHA = 1e-3
# the wrong sampler's p-value must be below this, far below ALPHA (it is ~1e-10 with n-gram drafts,
# of which a sixth are accepted, and underflows to 0 with the draft model's)
WRONG_PVALUE = 1e-7

CASES = {
    "plain": (SamplingParams(frequency_penalty=0.8, presence_penalty=0.3), None),
    # one-hot drafts: accepted with probability p(x), recovered from p without x
    "ngram": (SamplingParams(frequency_penalty=0.8, presence_penalty=0.3),
              {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
               "prompt_lookup_max": 3}),
    # drafts drawn from a penalised q; every parameter at once
    "draft_model": (SamplingParams(frequency_penalty=0.5, presence_penalty=0.3,
                                   repetition_penalty=1.3, logit_bias={2: 0.5, 1: -0.2},
                                   min_p=0.2),
                    {"method": "draft_model", "num_speculative_tokens": 3}),
}


@pytest.fixture(scope="module", autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_bigram_checkpoint(tmp_path_factory.mktemp("bigram_target"), TARGET_LOGITS)


@pytest.fixture(scope="module")
def draft(tmp_path_factory) -> str:
    return build_bigram_checkpoint(tmp_path_factory.mktemp("bigram_draft"), DRAFT_LOGITS)


def next_token_probs(previous: int, history: list[int], params: SamplingParams) -> np.ndarray:
    """p of the next token after `previous`, the output so far being `history`, one token at a
    time: logit_bias, repetition (prompt or output), frequency and presence (output), temperature,
    min_p."""
    logits = list(TARGET_LOGITS[previous])
    bias = dict(params.logit_bias)
    for token in range(VOCAB):
        value = logits[token] + bias.get(token, 0.0)
        count = history.count(token)
        if token in PROMPT or count:
            r = params.repetition_penalty
            value = value / r if value > 0 else value * r
        logits[token] = value - params.frequency_penalty * count - params.presence_penalty * (
            count > 0)
    probs = torch.tensor(logits, dtype=torch.float64).div(params.temperature).softmax(-1).numpy()
    if params.min_p > 0:
        threshold = params.min_p * probs.max()
        # NOTE: a cut this close to a probability could flip on the engine's float32 rounding
        assert np.abs(probs - threshold).min() > 1e-4
        probs = np.where(probs >= threshold, probs, 0.0)
    return probs / probs.sum()


def reference_joint(params: SamplingParams) -> np.ndarray:
    """[VOCAB ** NUM_TOKENS] probability of each sequence of the first NUM_TOKENS tokens."""
    joint = []
    for sequence in itertools.product(range(VOCAB), repeat=NUM_TOKENS):
        probability, previous = 1.0, PROMPT[-1]
        for position, token in enumerate(sequence):
            probability *= next_token_probs(previous, list(sequence[:position]), params)[token]
            previous = token
        joint.append(probability)
    return np.array(joint)


@dataclasses.dataclass
class Sample:
    counts: np.ndarray  # [VOCAB ** NUM_TOKENS]
    num_draft_tokens: int
    num_accepted_tokens: int


def sample(target: str, params: SamplingParams, speculative_config: dict | None,
           seed: int) -> Sample:
    """NUM_COMPLETIONS seeded completions of PROMPT in one batch."""
    llm = LLM(target, dtype="float64", num_threads=1, max_model_len=32, block_size=32,
              num_kv_blocks=NUM_COMPLETIONS + 8, max_num_seqs=NUM_COMPLETIONS,
              max_num_batched_tokens=NUM_COMPLETIONS * len(PROMPT),
              speculative_config=speculative_config)
    params = dataclasses.replace(params, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 n=NUM_COMPLETIONS, seed=seed)
    [out] = llm.generate({"prompt_token_ids": PROMPT}, params)
    rows = np.array([c.token_ids[:NUM_TOKENS] for c in out.outputs])  # [completions, tokens]
    cells = rows @ VOCAB ** np.arange(NUM_TOKENS - 1, -1, -1)
    stats = [c.spec_stats for c in out.outputs]
    return Sample(np.bincount(cells, minlength=VOCAB ** NUM_TOKENS),
                  sum(s.num_draft_tokens for s in stats),
                  sum(s.num_accepted_draft_tokens for s in stats))


def pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's chi-square p-value of counts against probs over the support; 0 when a sequence
    of probability 0 was sampled."""
    support = probs > 0
    if counts[~support].any():
        return 0.0
    expected = probs[support] * counts.sum()
    assert expected.min() >= 5, expected.min()
    return float(chisquare(counts[support], expected).pvalue)


def run_case(target: str, draft: str, name: str, seed: int) -> tuple[Sample, float]:
    params, config = CASES[name]
    if config is not None and config["method"] == "draft_model":
        config = {**config, "model": draft}
    result = sample(target, params, config, seed)
    return result, pvalue(result.counts, reference_joint(params))


@pytest.mark.parametrize("name", CASES)
def test_follows_the_token_by_token_reference(target, draft, name):
    result, p = run_case(target, draft, name, seed=1_000)
    print(f"{name}: p-value {p:.3g}, {result.num_accepted_tokens}/{result.num_draft_tokens} "
          "drafts accepted")
    assert p > ALPHA, (name, p, result)
    if name != "plain":
        # verification rows after an accepted draft produced many of the sampled tokens
        assert result.num_accepted_tokens > 0.2 * NUM_COMPLETIONS, result
        assert result.num_draft_tokens - result.num_accepted_tokens > 0.2 * NUM_COMPLETIONS


@pytest.mark.parametrize("name", ["ngram", "draft_model"])
def test_counts_updated_once_per_step_fail(target, draft, name, monkeypatch):
    """The deliberately wrong sampler: each row of a verification block counts only the committed
    output, as if the penalties were computed once per step."""
    original = penalties_module.row_token_counts

    def once_per_step(penalties, draft_token_ids, vocab_size, dtype):
        return original(dataclasses.replace(penalties, draft_pairs=None), draft_token_ids,
                        vocab_size, dtype)

    monkeypatch.setattr(penalties_module, "row_token_counts", once_per_step)
    result, p = run_case(target, draft, name, seed=1_000)
    print(f"{name}, counts once per step: p-value {p:.3g}")
    assert p < WRONG_PVALUE, (name, p, result)


def test_the_reference_is_a_distribution_the_penalties_change():
    """The check can tell: penalties move the reference far from the unpenalised bigram chain."""
    for params, _ in CASES.values():
        joint = reference_joint(params)
        assert joint.sum() == pytest.approx(1.0)
        plain = reference_joint(SamplingParams(temperature=params.temperature))
        assert 0.5 * np.abs(joint - plain).sum() > 0.1
