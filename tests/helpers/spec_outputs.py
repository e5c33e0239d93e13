"""Reading LLM.generate outputs in speculation tests: the tokens, and acceptance pooled over requests."""

from __future__ import annotations


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def pooled_acceptance_rate(outs) -> float:
    """Accepted / proposed draft tokens over every request (a per-request mean would weigh short
    requests as much as long ones)."""
    proposed = sum(o.spec_stats.num_draft_tokens for o in outs)
    return sum(o.spec_stats.num_accepted_draft_tokens for o in outs) / proposed


def two_sample_chi2_pvalue(a, b) -> float:
    """p-value that two count vectors over the same categories come from one distribution."""
    import numpy as np
    from scipy.stats import chi2

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    total = a + b
    expected_a, expected_b = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    statistic = ((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum()
    return float(chi2.sf(statistic, int(keep.sum()) - 1))
