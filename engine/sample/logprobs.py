"""Logprobs of emitted tokens: the raw target distribution (before temperature) at each token's own
position, as OpenAI reports them, computed for all wanted rows at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import TokenLogprobs


@dataclass
class RowLogprobs:
    """Per row, on the host: the chosen token's logprob and rank, and the top-N alternatives."""

    logprob: list[float]
    # 1 = the most likely token
    rank: list[int]
    # [rows][max_top], most likely first
    top_logprobs: list[list[float]]
    top_token_ids: list[list[int]]

    def token_logprobs(self, first_row: int, token_ids: list[int],
                       num_top: int) -> list[TokenLogprobs]:
        """TokenLogprobs of rows first_row .. first_row + len(token_ids) - 1, num_top alternatives."""
        return [TokenLogprobs(token_id, self.logprob[row], self.rank[row],
                              list(zip(self.top_token_ids[row][:num_top],
                                       self.top_logprobs[row][:num_top])))
                for row, token_id in enumerate(token_ids, start=first_row)]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, max_top: int) -> RowLogprobs:
    """logits: [rows, vocab] raw target logits; token_ids: [rows] int64, the token chosen at each row.
    One transfer to the host at the end."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]  # [rows]
    rank = (logprobs > chosen[:, None]).sum(dim=-1) + 1  # [rows]
    top_logprobs, top_token_ids = torch.topk(logprobs, max_top, dim=-1)  # [rows, max_top]
    return RowLogprobs(chosen.tolist(), rank.tolist(), top_logprobs.tolist(), top_token_ids.tolist())
