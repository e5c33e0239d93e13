"""A smaller model with the same tokenizer drafts k tokens autoregressively, with its own paged KV cache.

Rollback is bookkeeping, never copying: after proposing, the draft cache holds the request's tokens up to
the step's base length plus drafts 1..k-1. Next time, the cache is valid up to the base length plus the
drafts the target kept (compared token by token with what was committed); the slots past that are simply
rewritten by the catch-up forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import build_attention_metadata
from engine.block_manager import BlockManager
from engine.models.arch import LlamaArch
from engine.models.build import allocate_kv_cache, build_model
from engine.models.loader import load_checkpoint
from engine.proposers.base import DraftProposal, Proposer, model_draft_proposal, sample_draft_token
from engine.request import Request


@dataclass
class _DraftState:
    # tokens of the request whose K/V sits in the draft cache (a prefix of prompt + output + drafts)
    num_cached: int = 0
    # the request's length when the drafts below were proposed
    base_len: int = 0
    draft_token_ids: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    def __init__(self, model_path: str, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int, target_vocab_size: int) -> None:
        checkpoint = load_checkpoint(model_path, dtype)
        self.arch = LlamaArch.from_hf_config(checkpoint.hf_config)
        if self.arch.vocab_size != target_vocab_size:
            raise ValueError(f"draft model vocab {self.arch.vocab_size} differs from the target's "
                             f"{target_vocab_size}: a draft must share the target's tokenizer")
        self.model, _ = build_model(checkpoint, dtype, device)
        self.device = device
        self.blocks = BlockManager(num_blocks, block_size)
        self.kv_caches = allocate_kv_cache(self.arch, num_blocks, block_size, dtype, device)
        self.states: dict[str, _DraftState] = {}

    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        active = [i for i, k in enumerate(max_num_tokens) if k > 0]
        drafts: dict[int, list[int]] = {i: [] for i in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for i in active:
            self._roll_back(requests[i])
        for position in range(max(max_num_tokens, default=0)):
            batch = [i for i in active if max_num_tokens[i] > position]
            batch = [i for i in batch if self._reserve(requests[i], drafts[i])]
            if not batch:
                break
            logits = self._forward([requests[i] for i in batch], [drafts[i] for i in batch])
            for row, i in enumerate(batch):
                token, q = sample_draft_token(logits[row], requests[i], drafts[i])
                drafts[i].append(token)
                probs[i].append(q)
            active = batch
        proposals = []
        for i, request in enumerate(requests):
            state = self.states.get(request.request_id)
            tokens = drafts.get(i, []) if state is not None else []
            if tokens:
                state.base_len, state.draft_token_ids = request.num_tokens, list(tokens)
            proposals.append(model_draft_proposal(request, tokens, probs.get(i, [])))
        return proposals

    def free(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.blocks.free(request_id)

    # ------------------------------------------------------------------ internals
    def _roll_back(self, request: Request) -> None:
        """Keep the cached prefix the committed tokens agree with; the rest is overwritten later."""
        state = self.states.setdefault(request.request_id, _DraftState())
        num_valid = state.base_len
        for offset, draft in enumerate(state.draft_token_ids[:-1]):
            position = state.base_len + offset
            if position >= request.num_tokens or request.token_ids_between(
                    position, position + 1)[0] != draft:
                break
            num_valid += 1
        # NOTE: the newest token is always fed again, since its logits draft the next token. A draft
        # that the scheduler left unverified can equal the token then committed at its position
        # (its K/V valid), and would otherwise leave nothing to feed.
        state.num_cached = min(state.num_cached, num_valid, request.num_tokens - 1)
        state.draft_token_ids = []

    def _pending(self, request: Request, drafts: list[int]) -> list[int]:
        """Tokens to feed the draft now: committed tokens it has not seen, then its newest draft."""
        state = self.states[request.request_id]
        known = request.token_ids_between(min(state.num_cached, request.num_tokens),
                                          request.num_tokens)
        return known + drafts[-1:] if drafts else known

    def _reserve(self, request: Request, drafts: list[int]) -> bool:
        state = self.states[request.request_id]
        total = state.num_cached + len(self._pending(request, drafts))
        if self.blocks.can_allocate(request.request_id, total):
            self.blocks.allocate(request.request_id, total)
            return True
        self.free(request.request_id)  # the draft pool is full: no draft for this request
        return False

    @torch.inference_mode()
    def _forward(self, requests: list[Request], drafts: list[list[int]]) -> torch.Tensor:
        """One draft pass over the pending tokens of every request; logits at each one's last row."""
        token_ids, positions, query_lens, seq_lens, tables, last_rows = [], [], [], [], [], []
        for request, own_drafts in zip(requests, drafts):
            state = self.states[request.request_id]
            pending = self._pending(request, own_drafts)
            token_ids += pending
            positions += range(state.num_cached, state.num_cached + len(pending))
            state.num_cached += len(pending)
            query_lens.append(len(pending))
            seq_lens.append(state.num_cached)
            tables.append(self.blocks.block_table(request.request_id))
            last_rows.append(len(token_ids) - 1)
        meta = build_attention_metadata(query_lens, seq_lens, tables, self.blocks.block_size,
                                        self.arch.sliding_window, self.device)
        hidden = self.model(torch.tensor(token_ids, device=self.device),
                            torch.tensor(positions, device=self.device), meta, self.kv_caches)
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=self.device)])
