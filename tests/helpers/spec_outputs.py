"""Reading LLM.generate outputs in speculation tests: the tokens, acceptance pooled over requests, and
the law of a sampled token with and without speculation."""

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


def third_token_law(model: str, speculative_config: dict | None, prompt: list[int],
                    num_samples: int, vocab_size: int = 12):
    """(counts [vocab_size] of the third output token over `num_samples` seeded completions at
    temperature 1, the outputs). With speculation, that token is mostly verified from drafts."""
    import numpy as np

    from engine import LLM, SamplingParams

    llm = LLM(model, dtype="float64", max_model_len=32, num_kv_blocks=4096, max_num_seqs=256,
              speculative_config=speculative_config)
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s)
              for s in range(num_samples)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * num_samples, params)
    return np.bincount([o.outputs[0].token_ids[2] for o in outs], minlength=vocab_size), outs
