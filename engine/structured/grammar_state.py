"""One request's position in its grammar, and the masks of a speculative step.

The state only ever holds COMMITTED tokens. Drafts are explored and undone inside one call, so a
rejected draft never needs a rollback by the caller:

    propose:  draft = draft[:state.valid_draft_prefix(draft)]    # cut at the first rejected token
    verify:   fill_batch_masks(states, drafts, bitmask, rows)    # mask j = after committed + draft[:j]
              apply_token_bitmask_(logits, bitmask, vocab, rows) # to p (and to q, like any transform)
    commit:   state.commit(accepted drafts + recovered/bonus token)

End of sequence: the grammar marks where the output may end by allowing the EOS ids; an EOS taken
there terminates the state, after which only EOS is allowed. EOS is never fed to the library (it
does not count an EOS taken after a complete grammar as a token, which would break rollback
counting), the state tracks it itself.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import llguidance
import torch

from engine.structured.bitmask import any_token_bit, num_bitmask_words, set_token_bits
from engine.structured.errors import GrammarStateError


@dataclass(frozen=True)
class _DraftPlan:
    num_valid: int  # leading draft tokens the grammar accepts (EOS included)
    num_grammar: int  # of those, the non-EOS tokens the library steps through
    ends: bool  # the valid prefix contains an EOS: the positions after it allow only EOS


class GrammarState:
    """The grammar state of one sequence. Not thread-safe; one per request (per choice for n > 1).

    Built by CompiledGrammar.new_state(). Every method leaves the committed state unchanged except
    commit(); a method that finds the library in error raises GrammarStateError."""

    def __init__(self, template: llguidance.LLMatcher, vocab_size: int,
                 grammar_eos_ids: Sequence[int], eos_token_ids: Iterable[int]) -> None:
        self._matcher = template.deep_copy()
        self.vocab_size = vocab_size
        # the ids where the library marks "may end here", and the request's own EOS ids
        self._grammar_eos_ids = list(grammar_eos_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        if not self.eos_token_ids:
            raise ValueError("a grammar-constrained request needs at least one EOS token id")
        self._sorted_eos = sorted(self.eos_token_ids)
        self._is_remapped = self.eos_token_ids != frozenset(self._grammar_eos_ids)
        self._is_terminated = False
        # tokens committed so far, EOS included
        self.num_committed = 0

    # ------------------------------------------------------------ queries (no state change)

    def is_terminated(self) -> bool:
        """An EOS was committed: the output is complete and only EOS is allowed from now on."""
        return self._is_terminated

    def accepts_eos(self) -> bool:
        """The text so far is a complete match: EOS is allowed next."""
        return self._is_terminated or self._grammar_accepts([], end=True)

    def valid_draft_prefix(self, draft_token_ids: Sequence[int]) -> int:
        """How many leading draft tokens the grammar accepts after the committed tokens: the draft
        must be cut there (all of it when it returns len(draft))."""
        return self._plan(draft_token_ids).num_valid

    def fill_masks(self, draft_token_ids: Sequence[int], bitmask: torch.Tensor,
                   start_row: int) -> int:
        """fill_batch_masks for this state alone; returns valid_draft_prefix(draft)."""
        return fill_batch_masks([self], [draft_token_ids], bitmask, [start_row])[0]

    def fork(self) -> GrammarState:
        """An independent copy (a draft-model proposer can advance it through its own draft)."""
        twin = object.__new__(GrammarState)
        twin.__dict__.update(self.__dict__)
        twin._matcher = self._matcher.deep_copy()
        return twin

    # ------------------------------------------------------------ the one mutation

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advance by tokens that are now part of the output (accepted drafts, then the recovered or
        bonus token). All or nothing: a token the grammar does not allow raises GrammarStateError
        and commits none of them. Tokens after an EOS must be EOS (a request ends at its EOS; the
        caller passes nothing past it)."""
        plan = self._plan(token_ids)
        if plan.num_valid < len(token_ids):
            raise GrammarStateError(
                f"token {token_ids[plan.num_valid]} at position {plan.num_valid} of {list(token_ids)}"
                f" is not allowed by the grammar after {self.num_committed} committed tokens")
        if plan.num_grammar and not self._matcher.consume_tokens(list(token_ids[:plan.num_grammar])):
            raise GrammarStateError(f"grammar library failed: {self._matcher.get_error()}")
        self._is_terminated = self._is_terminated or plan.ends
        self.num_committed += len(token_ids)

    # ------------------------------------------------------------ internals

    def _grammar_accepts(self, token_ids: list[int], end: bool = False) -> bool:
        """Whether the library takes all of `token_ids` (then an EOS, when `end`) from here."""
        if end and not token_ids and self._matcher.is_stopped():
            return True  # NOTE: a stopped matcher allows only EOS, yet validates none
        probe = token_ids + [self._grammar_eos_ids[0]] if end else token_ids
        return self._matcher.validate_tokens(probe) == len(probe)

    def _plan(self, draft: Sequence[int]) -> _DraftPlan:
        eos = self.eos_token_ids
        if self._is_terminated:
            num_eos = next((i for i, t in enumerate(draft) if t not in eos), len(draft))
            return _DraftPlan(num_eos, 0, True)
        # the tokens before the first EOS (or an id outside the grammar's vocabulary) go to the
        # library, which says how many of them it takes
        stop = next((i for i, t in enumerate(draft) if t in eos or not 0 <= t < self.vocab_size),
                    len(draft))
        body = list(draft[:stop])
        num_body = self._matcher.validate_tokens(body) if body else 0
        if num_body < stop or stop == len(draft) or draft[stop] not in eos:
            return _DraftPlan(num_body, num_body, False)
        if not self._grammar_accepts(body, end=True):
            return _DraftPlan(num_body, num_body, False)
        num_valid = stop + 1
        while num_valid < len(draft) and draft[num_valid] in eos:
            num_valid += 1
        return _DraftPlan(num_valid, num_body, True)

    def _fix_rows(self, plan: _DraftPlan, num_draft: int, bitmask: torch.Tensor,
                  start_row: int) -> None:
        """After the library wrote rows start .. start + num_grammar: the request's EOS ids in them,
        and the rows past the valid prefix (EOS only after an accepted EOS; otherwise unreachable,
        given a copy of the last valid row so that no row is all -inf)."""
        if self._is_terminated:
            bitmask[start_row:start_row + num_draft + 1] = 0
            for row in range(start_row, start_row + num_draft + 1):
                set_token_bits(bitmask, row, self._sorted_eos, True)
            return
        last = start_row + plan.num_grammar
        if self._is_remapped:
            for row in range(start_row, last + 1):
                may_end = any_token_bit(bitmask, row, self._grammar_eos_ids)
                set_token_bits(bitmask, row, self._grammar_eos_ids, False)
                set_token_bits(bitmask, row, self._sorted_eos, may_end)
        end = start_row + num_draft + 1
        if last + 1 < end:
            if plan.ends:
                bitmask[last + 1:end] = 0
                for row in range(last + 1, end):
                    set_token_bits(bitmask, row, self._sorted_eos, True)
            else:
                bitmask[last + 1:end] = bitmask[last]


@functools.cache
def _executor() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # threads: 80% of the CPUs, at most 32


def fill_batch_masks(states: Sequence[GrammarState], drafts: Sequence[Sequence[int]],
                     bitmask: torch.Tensor, start_rows: Sequence[int]) -> list[int]:
    """The allowed tokens at every verification position of a batch, in one library call.

    For state i with draft d (k = len(d)), row start_rows[i] + j (j = 0..k) gets the mask after the
    committed tokens + d[:j]. Rows past the draft's valid prefix cannot be reached (the draft token
    before them is rejected for sure under the mask): they get a copy of the last valid row, or EOS
    only after an accepted EOS. No committed state changes.
    bitmask: int32 [num_rows, ceil(vocab_size / 32)], CPU, contiguous; rows of other requests are
    left alone. Returns each state's valid_draft_prefix.
    """
    if len(states) != len(drafts) or len(states) != len(start_rows):
        raise ValueError("one draft and one start row per state")
    if not states:
        return []
    vocab_size = states[0].vocab_size
    if any(state.vocab_size != vocab_size for state in states):
        raise ValueError("all states of a batch must share one tokenizer")
    _check_bitmask(bitmask, vocab_size)
    plans = [state._plan(draft) for state, draft in zip(states, drafts)]
    with_draft, without_draft = [], []
    for state, draft, plan, row in zip(states, drafts, plans, start_rows):
        if row < 0 or row + len(draft) >= bitmask.shape[0]:
            raise ValueError(f"rows {row}..{row + len(draft)} do not fit a {bitmask.shape[0]}-row "
                             "bitmask")
        if state._is_terminated:
            continue
        if plan.num_grammar:
            with_draft.append((state._matcher, row, list(draft[:plan.num_grammar])))
        else:
            without_draft.append((state._matcher, row))
    # NOTE: threads, without the GIL. Called directly: llguidance.torch imports torch._dynamo.
    pointer, row_bytes = bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size()
    if with_draft:  # steps each matcher through its valid draft, a mask at each position, and back
        _executor().unsafe_compute_mask_ptr_with_draft_token(with_draft, pointer, row_bytes,
                                                             bitmask.shape[0])
    if without_draft:
        _executor().unsafe_compute_mask_ptr(without_draft, pointer, row_bytes, bitmask.shape[0])
    for state, draft, plan, row in zip(states, drafts, plans, start_rows):
        if state._matcher.is_error():
            raise GrammarStateError(f"grammar library failed: {state._matcher.get_error()}")
        state._fix_rows(plan, len(draft), bitmask, row)
    return [plan.num_valid for plan in plans]


def _check_bitmask(bitmask: torch.Tensor, vocab_size: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.ndim != 2 or bitmask.device.type != "cpu":
        raise ValueError("the bitmask must be an int32 [rows, words] tensor on the CPU")
    if not bitmask.is_contiguous() or bitmask.shape[1] != num_bitmask_words(vocab_size):
        raise ValueError(f"the bitmask must be contiguous with {num_bitmask_words(vocab_size)} "
                         f"words a row (vocabulary {vocab_size}), got {tuple(bitmask.shape)}")
