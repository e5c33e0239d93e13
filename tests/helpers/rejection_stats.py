"""Statistical losslessness machinery shared by the reference, interpreter and CUDA kernel tests:
chains of drafts over a small vocabulary whose target depends on the previous token, and a goodness-of-fit
check of the emitted tokens against the target."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tests.helpers.one_request_law import apply_top_k_top_p

try:
    from scipy.stats import chisquare
except ImportError:  # pragma: no cover - scipy is optional
    chisquare = None

VOCAB = 6
NUM_ROWS = 20_000


@dataclass(frozen=True)
class DistCase:
    draft: str  # "near" (q close to p), "far" (q = softmax(-logits of p)) or "one_hot" (no q)
    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


CASES = [DistCase("near"), DistCase("far"), DistCase("one_hot"), DistCase("near", top_k=3),
         DistCase("near", top_p=0.7, temperature=0.7), DistCase("far", top_k=4, temperature=0.7),
         DistCase("one_hot", top_k=4, top_p=0.8)]


def _probs(logits: Tensor, case: DistCase) -> Tensor:
    """What the caller does to both p and q before rejection sampling."""
    return apply_top_k_top_p(logits / case.temperature, case.top_k, case.top_p).softmax(-1)


def draw_chains(case: DistCase, k: int, num_rows: int, seed: int) -> tuple[dict, Tensor]:
    """Rejection-sampler arguments for num_rows requests with k drafts each, plus the target table.

    The target at position j depends on the token before it: p_j = table[j][previous token] (the
    prompt ends in token 0), so the check on the second token is a real conditional. Drafts are drawn
    from q the same way, so acceptance is random.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, VOCAB, VOCAB, generator=gen) * 1.5  # [position, previous, vocab]
    target_table = _probs(logits, case)
    if case.draft == "near":
        draft_logits = logits[:k] + 0.7 * torch.randn(k, VOCAB, VOCAB, generator=gen)
    elif case.draft == "far":
        draft_logits = -logits[:k]
    else:  # the one-hot proposer's own (unreported) way of choosing its drafts
        draft_logits = torch.randn(k, VOCAB, VOCAB, generator=gen) * 1.5
    draft_table = _probs(draft_logits, case)
    previous = torch.zeros(num_rows, dtype=torch.int64)
    target_rows, draft_rows, drafts = [], [], []
    for j in range(k):
        draft_rows.append(draft_table[j][previous])  # [num_rows, vocab]
        target_rows.append(target_table[j][previous])
        previous = torch.multinomial(draft_rows[-1], 1, generator=gen).squeeze(1)
        drafts.append(previous)
    target_rows.append(target_table[k][previous])  # the bonus row
    target_probs = torch.stack(target_rows, 1).reshape(-1, VOCAB)  # [num_rows * (k + 1), vocab]
    args = {
        "draft_token_ids": torch.stack(drafts, 1).reshape(-1),
        "cu_num_draft_tokens": torch.arange(1, num_rows + 1) * k,
        "draft_probs": None if case.draft == "one_hot" else torch.stack(draft_rows, 1).reshape(-1, VOCAB),
        "target_probs": target_probs,
        "target_argmax": target_probs.argmax(-1),
        "is_greedy": torch.zeros(num_rows, dtype=torch.bool),
        "acceptance_uniforms": torch.rand(num_rows * k, generator=gen),
        "sample_uniforms": torch.rand(num_rows * (k + 1), generator=gen, dtype=torch.float64),
        "max_spec_len": k,
    }
    return args, target_table


def pvalue(token_ids: Tensor, probs: Tensor) -> float:
    """Goodness of fit of token_ids [n] to probs [vocab]: chi-square p-value (or a TV-distance verdict)."""
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()  # [vocab]
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0  # a token the target can never produce
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    if int(support.sum()) == 1:
        return 1.0
    if chisquare is None:
        tv = 0.5 * (counts[support] - expected).abs().sum() / counts.sum()
        return 1.0 if tv < 0.02 else 0.0
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def assert_follows_target(output: Tensor, target_table: Tensor) -> None:
    """First emitted token ~ p_1; second emitted token, given first = a (a accepted draft), ~ p_2[a]."""
    assert pvalue(output[:, 0], target_table[0][0]) > 1e-4
    continued = output[:, 1] >= 0  # rows whose first draft was accepted
    for first in range(VOCAB):
        rows = continued & (output[:, 0] == first)
        if rows.sum() >= 300:
            assert pvalue(output[rows, 1], target_table[1][first]) > 1e-4, f"after token {first}"
