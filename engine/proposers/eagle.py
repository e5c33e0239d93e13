"""EAGLE drafting: the head (eagle_head.py) catches up on the target's new features, then rolls out k
tokens on its own, with a paged KV cache of one layer.

Per request the head's cache holds positions 0 .. num_cached-1, each computed from the committed
token and the target's true feature before it. The rollout past them (drafts 2..k) is written to the
next slots but never counted: the next catch-up overwrites those slots with true features, so
rollback is bookkeeping and nothing is ever copied back.

The target's features arrive through `record_target_hidden` after every step, prefill chunks
included; those not yet consumed wait in a small per-request buffer. They are also kept per target KV
slot (target_features.py): a request that starts after a cached prefix reads the prefix's features
from there, and the head computes its own K/V for the prefix in its first catch-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import build_attention_metadata
from engine.block_manager import BlockManager
from engine.models.arch import LlamaArch
from engine.models.build import allocate_kv_cache
from engine.proposers.base import DraftProposal, Proposer, model_draft_proposal, sample_draft_token
from engine.proposers.eagle_head import EagleHead
from engine.proposers.target_features import TargetFeatureStore
from engine.request import Request


@torch.inference_mode()
def linear_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's [out, in] weight, whatever layout it keeps (the CPU path pre-packs weights
    for oneDNN and drops the plain tensor): the layer applied to the identity, exact in any float."""
    probe = next(linear.buffers(), None)
    if probe is None:
        probe = next(linear.parameters())
    eye = torch.eye(linear.in_features, dtype=probe.dtype, device=probe.device)
    zero = torch.zeros(1, linear.in_features, dtype=probe.dtype, device=probe.device)
    return (linear(eye) - linear(zero)).T.contiguous()


@dataclass
class _EagleState:
    # target features not yet consumed, for positions feature_start .. feature_start + len - 1;
    # position -1 (before the first token) has a zero feature
    features: torch.Tensor
    feature_start: int = -1
    # positions whose K/V, from true tokens and features, sits in the head's cache
    num_cached: int = 0

    @property
    def feature_end(self) -> int:
        return self.feature_start + len(self.features)


class EagleProposer(Proposer):
    needs_committed_hidden = True

    def __init__(self, folder: str, target: LlamaArch, embed_tokens: nn.Embedding,
                 lm_head: nn.Module, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int) -> None:
        self.head = EagleHead.load(folder, target, dtype, device)
        arch = self.head.config.layer_arch(target)
        # the target's embedding, read-only; the LM-head rows of the draft vocabulary, a copy
        self.embed_tokens = embed_tokens
        self.draft_head = self.head.draft_head_weight(linear_weight(lm_head))  # [draft, hidden]
        self.vocab_size = target.vocab_size
        self.dtype, self.device = dtype, device
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv_cache = allocate_kv_cache(arch, num_blocks, block_size, dtype, device)[0]
        # NOTE: sized like the target's pool (num_blocks, block_size are the target's)
        self.target_features = TargetFeatureStore(num_blocks, block_size, target.hidden_size, dtype,
                                                  device)
        self.states: dict[str, _EagleState] = {}
        # requests whose features went missing (never expected): they draft nothing from then on
        self.disabled: set[str] = set()

    def record_target_hidden(self, request: Request, start_position: int, hidden: torch.Tensor,
                             block_table: list[int]) -> None:
        # NOTE: first, and for every request: a block this request fills may be cached and read
        # by a later request, whether or not this one drafts
        self.target_features.write(block_table, start_position, hidden)
        request_id = request.request_id
        if request_id in self.disabled:
            return
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = _EagleState(
                torch.zeros(1, self.draft_head.shape[1], dtype=self.dtype, device=self.device))
        end = start_position + len(hidden)
        if start_position > state.feature_end:
            # a cached prefix: its features were kept by whoever computed its blocks
            hidden = torch.cat([self.target_features.read(block_table, state.feature_end,
                                                          start_position), hidden])
            start_position = state.feature_end
        if end > state.feature_end:
            # NOTE: a preempted request recomputes features already seen; only new ones are kept
            fresh = hidden[state.feature_end - start_position:]
            state.features = torch.cat([state.features, fresh.to(self.dtype)])

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        active = [i for i, cap in enumerate(max_num_tokens)
                  if cap > 0 and self._reserve(requests[i], cap)]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        if active:
            last = self._catch_up([requests[i] for i in active])
            for step in range(max(max_num_tokens[i] for i in active)):
                if step:
                    keep = [row for row, i in enumerate(active) if max_num_tokens[i] > step]
                    active, last = [active[row] for row in keep], last[keep]
                    last = self._roll_out([requests[i] for i in active],
                                          [drafts[i][-1] for i in active], last, step)
                logits = self._logits(last)
                for row, i in enumerate(active):
                    token, q = sample_draft_token(logits[row], requests[i], drafts[i])
                    drafts[i].append(token)
                    probs[i].append(q)
        return [model_draft_proposal(request, drafts.get(i, []), probs.get(i, []))
                for i, request in enumerate(requests)]

    def free(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.disabled.discard(request_id)
        self.blocks.free(request_id)

    # ------------------------------------------------------------------ internals
    def _reserve(self, request: Request, cap: int) -> bool:
        """Whether the request can draft now: the features its catch-up reads are here, and the head's
        cache holds blocks for the catch-up and the rollout (allocated here when they are)."""
        state = self.states.get(request.request_id)
        if state is None or request.request_id in self.disabled:
            return False
        num_tokens = request.num_tokens
        # catching up on positions num_cached .. num_tokens-1 reads features num_cached-1 .. num_tokens-2
        if not (state.num_cached < num_tokens and state.feature_start <= state.num_cached - 1
                and state.feature_end >= num_tokens - 1):
            return False
        total = num_tokens + cap - 1
        if not self.blocks.can_allocate(request.request_id, total):
            self._disable(request.request_id)  # the head's pool is full: no drafts for this one
            return False
        self.blocks.allocate(request.request_id, total)
        return True

    def _catch_up(self, requests: list[Request]) -> torch.Tensor:
        """Feed every committed token the head has not seen, with the target's feature before it;
        returns h at each request's newest token: [len(requests), hidden]."""
        token_ids, features, positions, query_lens, seq_lens, tables = [], [], [], [], [], []
        for request in requests:
            state = self.states[request.request_id]
            start, end = state.num_cached, request.num_tokens
            token_ids += request.token_ids_between(start, end)
            offset = start - 1 - state.feature_start
            features.append(state.features[offset:offset + end - start])
            positions += range(start, end)
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(self.blocks.block_table(request.request_id))
            state.num_cached = end
            # keep f_{end-1}: the next catch-up starts at position `end`
            state.features = state.features[end - 1 - state.feature_start:]
            state.feature_start = end - 1
        hidden = self._forward(token_ids, torch.cat(features), positions, query_lens, seq_lens,
                               tables)
        last_rows = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return hidden[last_rows]

    def _roll_out(self, requests: list[Request], tokens: list[int], features: torch.Tensor,
                  step: int) -> torch.Tensor:
        """One more draft position per request, from its last draft token and the head's own h."""
        positions = [r.num_tokens - 1 + step for r in requests]
        return self._forward(tokens, features, positions, [1] * len(requests),
                             [p + 1 for p in positions],
                             [self.blocks.block_table(r.request_id) for r in requests])

    def _forward(self, token_ids: list[int], features: torch.Tensor, positions: list[int],
                 query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> torch.Tensor:
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.blocks.block_size, None,
                                        self.device)
        embeds = self.embed_tokens(torch.tensor(token_ids, device=self.device))
        return self.head(embeds, features, torch.tensor(positions, device=self.device), meta,
                         self.kv_cache)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits, -inf outside the draft vocabulary: [rows, vocab]."""
        logits = hidden.new_full((len(hidden), self.vocab_size), float("-inf"))
        index = self.head.draft_token_ids.expand(len(hidden), -1)
        return logits.scatter_(1, index, hidden @ self.draft_head.T)

    def _disable(self, request_id: str) -> None:
        self.disabled.add(request_id)
        self.states.pop(request_id, None)
        self.blocks.free(request_id)
