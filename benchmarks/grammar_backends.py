"""The grammar libraries the grammar benchmark compares, behind one interface, and the embedded
model's tokenizer they all compile for (benchmarks/bench_grammar_libraries.py runs them)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# token bytes that close a JSON string, object or array: what a walk steers to when it should end
CLOSER_BYTES = frozenset(b'"}]')
K = 8  # draft tokens per speculative block


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """The token ids a full-vocabulary bitmask row allows."""
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])



@dataclass
class Vocab:
    tokenizer: Any  # transformers tokenizer of the embedded model
    vocab_size: int
    eos_ids: list[int]
    special_ids: frozenset[int]  # added/control tokens: never part of JSON text
    token_bytes: list[bytes]  # the bytes each token adds to the text
    # [vocab_size] bool each, for steering walks: only '"', '}', ']' / only whitespace / has '}' or
    # ']' / one byte long
    is_closer: np.ndarray = field(init=False)
    is_blank: np.ndarray = field(init=False)
    has_bracket_close: np.ndarray = field(init=False)
    is_one_byte: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.is_closer = np.array([bool(b) and set(b) <= CLOSER_BYTES for b in self.token_bytes])
        self.is_blank = np.array([bool(b) and not b.strip() for b in self.token_bytes])
        self.has_bracket_close = np.array([b"}" in b or b"]" in b for b in self.token_bytes])
        self.is_one_byte = np.array([len(b) == 1 for b in self.token_bytes])


def load_vocab() -> Vocab:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from engine.models import loader

    tokenizer = loader.load_tokenizer(None)
    unicode_to_byte = {u: b for b, u in bytes_to_unicode().items()}
    special = frozenset(tokenizer.all_special_ids) | frozenset(
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    vocab_size = len(tokenizer)
    token_bytes = [b""] * vocab_size
    for piece, token_id in tokenizer.get_vocab().items():
        token_bytes[token_id] = (piece.encode() if token_id in special
                                 else bytes(unicode_to_byte[c] for c in piece))
    return Vocab(tokenizer, vocab_size, [tokenizer.eos_token_id], special, token_bytes)


# ---------------------------------------------------------------- one adapter per library


class Backend:
    """The handful of operations a speculative engine needs, over one library."""

    name = ""
    package = ""

    def build_tokenizer(self, vocab: Vocab) -> None: ...
    def compile(self, schema: dict[str, Any] | None) -> Any: ...  # raises on a refused schema
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def accept(self, matcher: Any, token_id: int) -> bool: ...
    def rollback(self, matcher: Any, num_tokens: int) -> None: ...

    def fill_draft_native(self, matcher: Any, draft: list[int], bitmask: torch.Tensor) -> bool:
        """Masks at the 1 + k verification positions in one library call; False if none exists."""
        return False

    can_rollback = True

    def pick_draft(self, matcher: Any, vocab: Vocab, rng: random.Random,
                   bitmask: torch.Tensor) -> list[int]:
        """k random allowed non-EOS tokens from the current state, which is left as it was."""
        draft: list[int] = []
        for _ in range(K):
            self.fill(matcher, bitmask, 0)
            allowed = allowed_ids(bitmask[0], vocab.vocab_size)
            allowed = allowed[~np.isin(allowed, vocab.eos_ids)]
            if len(allowed) == 0:
                break
            token_id = int(allowed[rng.randrange(len(allowed))])
            if not self.accept(matcher, token_id):
                break
            draft.append(token_id)
        self.rollback(matcher, len(draft))
        return draft

    notes: tuple[str, ...] = ()


class XGrammarBackend(Backend):
    name, package = "xgrammar", "xgrammar"
    notes = (
        "rollback: GrammarMatcher.rollback(n), unlimited since 0.2; accept_token on a rejected "
        "token returns False and leaves the state unchanged",
        "speculation: traverse_draft_tree fills masks for a draft tree in one call",
        "threads: GrammarCompiler is shared and caches; one matcher per request (fork() copies); "
        "BatchGrammarMatcher fills a batch in threads",
        "from_huggingface misses this tokenizer's added tokens (<|im_start|>, <repo_name>, ...): "
        "it lets them appear inside JSON strings",
    )

    def build_tokenizer(self, vocab: Vocab) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            vocab.tokenizer, vocab_size=vocab.vocab_size, stop_token_ids=vocab.eos_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, schema):
        if schema is None:
            return self.compiler.compile_json_schema({"type": "object"}, strict_mode=False)
        return self.compiler.compile_json_schema(schema)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask, row):
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token_id):
        return matcher.accept_token(token_id)

    def rollback(self, matcher, num_tokens):
        matcher.rollback(num_tokens)

    def fill_draft_native(self, matcher, draft, bitmask):
        n = len(draft) + 1
        # a chain: node i's only child is node i + 1; node 0 is the committed position
        next_token = torch.tensor(list(range(1, n)) + [-1], dtype=torch.int64)
        next_sibling = torch.full((n,), -1, dtype=torch.int64)
        tokens = torch.tensor([0] + draft, dtype=torch.int64)
        matcher.traverse_draft_tree(next_token, next_sibling, tokens, bitmask[:n])
        return True


class LLGuidanceBackend(Backend):
    name, package = "llguidance", "llguidance"
    notes = (
        "rollback: LLMatcher.rollback(n); a rejected consume_token puts the matcher in an error "
        "state that rollback does NOT leave, so check drafts with validate_tokens (no state change) "
        "first",
        "speculation: validate_tokens(draft) -> accepted prefix length; LLExecutor fills the masks "
        "at every draft position of a batch in one call, in threads, without the GIL",
        "threads: a compiled grammar is shared by deep_copy() of a template matcher (~10 us); "
        "mask computation drops the GIL",
    )

    def build_tokenizer(self, vocab: Vocab) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.llg_torch = llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(vocab.tokenizer, n_vocab=vocab.vocab_size,
                                                      eos_token=vocab.eos_ids)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema)
        template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask, row):
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token_id):
        return matcher.validate_tokens([token_id]) == 1 and matcher.consume_token(token_id)

    def rollback(self, matcher, num_tokens):
        matcher.rollback(num_tokens)

    def fill_draft_native(self, matcher, draft, bitmask):
        self.llg_torch.fill_next_token_bitmask_par_with_draft_tokens(
            self.executor, [(matcher, 0, draft)], bitmask)
        return True


class OutlinesCoreBackend(Backend):
    name, package = "outlines-core", "outlines-core"
    notes = (
        "rollback: Guide(index, max_rollback=N).rollback_state(n), bounded by N",
        "speculation: accepts_tokens(draft) -> bool only (no prefix length), no multi-position call",
        "grammar = a regex compiled to a token-level DFA (Index): no recursion, so free JSON and "
        "recursive $ref are unrolled to a fixed depth; the Index is built per schema and shared",
    )

    def build_tokenizer(self, vocab: Vocab) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self.oc = outlines_core
        self.build_regex = build_regex_from_schema
        pieces: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(vocab.token_bytes):
            if token_id not in vocab.special_ids:
                pieces.setdefault(piece, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos_ids[0], pieces)

    def compile(self, schema):
        regex = self.build_regex(json.dumps({"type": "object"} if schema is None else schema))
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled):
        return self.oc.Guide(compiled, max_rollback=64)

    def fill(self, matcher, bitmask, row):
        target = bitmask[row]
        matcher.write_mask_into(target.data_ptr(), target.numel(), 4)

    def accept(self, matcher, token_id):
        if not matcher.accepts_tokens([token_id]):
            return False
        matcher.advance(token_id, return_tokens=False)
        return True

    def rollback(self, matcher, num_tokens):
        matcher.rollback_state(num_tokens)


class SpecserveBackend(Backend):
    """engine.structured itself (llguidance, bounded whitespace, EOS handled by the wrapper)."""

    name, package = "specserve", "llguidance"
    can_rollback = False  # the state holds committed tokens only; drafts go through fill_masks
    notes = (
        "engine.structured over llguidance: 'mask' = GrammarState.fill_masks([]), 'native' = "
        "fill_masks(draft): cut, 1 + k masks in one executor call, EOS rows, state unchanged",
    )

    def build_tokenizer(self, vocab: Vocab) -> None:
        from engine.structured import GrammarCompiler, parse_response_format

        self.parse = parse_response_format
        self.compiler = GrammarCompiler(vocab.tokenizer, vocab.eos_ids)

    def compile(self, schema):
        fmt = ({"type": "json_object"} if schema is None else
               {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}})
        return self.compiler.compile(self.parse(fmt))

    def matcher(self, compiled):
        return compiled.new_state()

    def fill(self, matcher, bitmask, row):
        matcher.fill_masks([], bitmask, row)

    def accept(self, matcher, token_id):
        if matcher.valid_draft_prefix([token_id]) != 1:
            return False
        matcher.commit([token_id])
        return True

    def pick_draft(self, matcher, vocab, rng, bitmask):
        fork = matcher.fork()
        draft: list[int] = []
        for _ in range(K):
            self.fill(fork, bitmask, 0)
            allowed = allowed_ids(bitmask[0], vocab.vocab_size)
            allowed = allowed[~np.isin(allowed, vocab.eos_ids)]
            if len(allowed) == 0:
                break
            draft.append(int(allowed[rng.randrange(len(allowed))]))
            fork.commit(draft[-1:])
        return draft

    def fill_draft_native(self, matcher, draft, bitmask):
        matcher.fill_masks(draft, bitmask, 0)
        return True


BACKENDS: dict[str, Callable[[], Backend]] = {
    "xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend,
    "outlines-core": OutlinesCoreBackend, "specserve": SpecserveBackend,
}

# ---------------------------------------------------------------- random masked walks
