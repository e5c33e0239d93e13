"""Reading LLM.generate outputs in speculation tests: the tokens, and acceptance pooled over requests."""

from __future__ import annotations


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def pooled_acceptance_rate(outs) -> float:
    """Accepted / proposed draft tokens over every request (a per-request mean would weigh short
    requests as much as long ones)."""
    proposed = sum(o.spec_stats.num_draft_tokens for o in outs)
    return sum(o.spec_stats.num_accepted_draft_tokens for o in outs) / proposed
