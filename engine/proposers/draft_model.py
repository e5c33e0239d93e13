"""A smaller model with the same tokenizer drafts k tokens autoregressively, with its own paged KV cache.

Rollback is bookkeeping, never copying: after proposing, the draft cache holds the request's tokens up to
the step's base length plus drafts 1..k-1. Next time, the cache is valid up to the base length plus the
drafts the target kept (compared token by token with what was committed); the slots past that are simply
rewritten by the catch-up forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.models.arch import DecoderArch
from engine.models.build import build_model
from engine.models.loader import load_checkpoint
from engine.proposers.base import DraftProposal, Proposer
from engine.proposers.chain import draft_chains
from engine.request import Request
from engine.runner.paged_runner import PagedRunner
from engine.runner.target_handle import TargetHandle
from engine.step.types import SequenceRows


@dataclass
class _DraftState:
    # tokens of the request whose K/V sits in the draft cache (a prefix of prompt + output + drafts)
    num_cached: int = 0
    # the request's length when the drafts below were proposed
    base_len: int = 0
    draft_token_ids: list[int] = field(default_factory=list)


class DraftModelProposer(Proposer):
    def __init__(self, model_path: str, target: TargetHandle) -> None:
        checkpoint = load_checkpoint(model_path, target.dtype, packed=target.weights_packed)
        arch = DecoderArch.from_hf_config(checkpoint.hf_config)
        if arch.vocab_size != target.arch.vocab_size:
            raise ValueError(f"draft model vocab {arch.vocab_size} differs from the target's "
                             f"{target.arch.vocab_size}: a draft must share the target's tokenizer")
        model, _ = build_model(checkpoint, target.dtype, target.device)
        self.runner = PagedRunner.with_own_pool(model, arch, target.num_blocks, target.block_size,
                                                target.dtype, target.device)
        self.states: dict[str, _DraftState] = {}

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_num_tokens: list[int],
                target_hidden: torch.Tensor | None) -> list[DraftProposal]:
        for request, cap in zip(requests, max_num_tokens):
            if cap > 0:
                self._roll_back(request)

        def advance(step: int, rows: list[int],
                    drafts: dict[int, list[int]]) -> tuple[list[int], torch.Tensor | None]:
            ran = [i for i in rows if self._reserve(requests[i], drafts[i])]
            if not ran:
                return ran, None
            inputs = self.runner.prepare([self._next_rows(requests[i], drafts[i]) for i in ran])
            return ran, self.runner.run_with_logits(inputs, inputs.last_rows)[1]

        proposals = draft_chains(requests, max_num_tokens, advance)
        for index, (request, proposal) in enumerate(zip(requests, proposals)):
            state = self.states.get(request.request_id)
            if state is None:  # its pool ran out mid-chain: the cache no longer says what it holds
                proposals[index] = DraftProposal([], None)
            elif proposal.token_ids:
                state.base_len, state.draft_token_ids = request.num_tokens, list(proposal.token_ids)
        return proposals

    def free(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.runner.free(request_id)

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
        if self.runner.reserve(request.request_id,
                               state.num_cached + len(self._pending(request, drafts))):
            return True
        self.free(request.request_id)  # the draft pool is full: no draft for this request
        return False

    def _next_rows(self, request: Request, drafts: list[int]) -> SequenceRows:
        """This pass's rows for the request; its cache then holds them."""
        state = self.states[request.request_id]
        pending = self._pending(request, drafts)
        rows = SequenceRows(request.request_id, state.num_cached, pending)
        state.num_cached += len(pending)
        return rows
