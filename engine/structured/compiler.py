"""Response formats -> llguidance grammars for one tokenizer, each distinct format compiled once (LRU).

Why llguidance (docs/grammar_choice.md): every output of its masks parsed and matched its schema in
our random-walk measurement; it refuses the schema features it cannot enforce instead of ignoring
them; it tells how many draft tokens a grammar accepts without moving; and it fills the masks of all
draft positions of a batch in one call that runs without the GIL.

Entry points:
- `parse_response_format(value)` (response_format.py): the shape, size and depth, in microseconds;
- `check_grammar_support(fmt)`: whether the schema can be enforced, no tokenizer (0.1 ms, up to ~1 s
  for a large schema; llguidance releases the GIL, so the server runs it on a thread);
- `check_response_format(value)`: both, for the server to answer 400 before the engine sees it;
- `GrammarCompiler(tokenizer, eos_token_ids)`: per engine, the tokenizer's view built once (~1 s);
  `compile(fmt)` / `new_state(fmt, eos_token_ids)` for each request.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import llguidance

from engine.structured.errors import UnsupportedSchemaError
from engine.structured.grammar_state import GrammarState
from engine.structured.response_format import ResponseFormat, parse_response_format

# Whitespace between JSON tokens: free, as a model writes it (compact or indented), but at most this
# many characters per gap, so that a small model cannot loop on newlines until max_tokens.
MAX_WHITESPACE = 32
# NOTE: passed as llguidance *overrides*, which win over a schema's own "x-guidance" options: a
# client cannot turn on `lenient` (silently ignoring what cannot be enforced), `coerce_one_of`
# (oneOf run as anyOf) or separators that are not JSON.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": True,
    "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}",
    "item_separator": ",",
    "key_separator": ":",
    "coerce_one_of": False,
    "lenient": False,
}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_WHERE = {"json_object": "response_format", "json_schema": "response_format.json_schema.schema",
          "lark": "tools"}


def check_response_format(value: Any) -> ResponseFormat | None:
    """Parse a request's `response_format` and check that its schema can be enforced, without a
    tokenizer. None = no grammar. Raises InvalidResponseFormatError / UnsupportedSchemaError (both
    ResponseFormatError, a ValueError, with param = "response_format")."""
    fmt = parse_response_format(value)
    if fmt is not None:
        check_grammar_support(fmt)
    return fmt


def check_grammar_support(fmt: ResponseFormat) -> None:
    """Raise UnsupportedSchemaError unless the grammar can enforce `fmt` exactly."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(fmt))
    if is_error:
        raise _unsupported(fmt, messages[0])


def grammar_text(fmt: ResponseFormat) -> str:
    """The llguidance grammar for `fmt`: a pure function of fmt.key, so equal keys compile alike."""
    if fmt.type == "lark":
        return llguidance.grammar_from("lark", fmt.grammar)
    schema = json.loads(fmt.key).get("schema", _ANY_OBJECT)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as error:
        raise _unsupported(fmt, str(error)) from None


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """One format compiled for one tokenizer; shared by every request that uses the format."""

    key: str  # ResponseFormat.key
    # a matcher in the grammar's initial state: each request's state is a copy (~1 us)
    template: llguidance.LLMatcher
    # the grammar's end-of-sequence ids (the compiler's): where the library marks "may end here"
    eos_token_ids: tuple[int, ...]
    # the tokenizer's vocabulary: the columns a mask covers, ceil(vocab_size / 32) int32 words
    vocab_size: int

    def new_state(self, eos_token_ids: Iterable[int] | None = None) -> GrammarState:
        """A fresh per-request (per sequence, for n > 1) state. `eos_token_ids`: the request's EOS ids
        (Request.eos_token_ids), default the grammar's; once the grammar is complete only they are
        allowed."""
        return GrammarState(self.template, self.vocab_size, self.eos_token_ids,
                            self.eos_token_ids if eos_token_ids is None else eos_token_ids)


class GrammarCompiler:
    """Compiles response formats for one tokenizer, keeping the last `cache_size` compiled grammars.

    Safe to call from several threads: a lock guards the cache, and compiles run outside it (the
    library releases the GIL while compiling), so a slow schema does not hold up a cached one."""

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], *,
                 cache_size: int = 128) -> None:
        """tokenizer: the model's Hugging Face fast tokenizer; eos_token_ids: the ids that end a
        sequence for this model (the engine's, as in Request.eos_token_ids)."""
        eos = tuple(sorted(set(eos_token_ids)))
        if not eos:
            raise ValueError("structured output needs the model's end-of-sequence token ids")
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.vocab_size = len(tokenizer)
        if max(eos) >= self.vocab_size:
            raise ValueError(f"EOS ids {eos} lie outside the tokenizer's {self.vocab_size} tokens")
        self.eos_token_ids = eos
        import llguidance.hf  # NOTE: imports transformers; the server's check never needs it

        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=list(eos))
        self.cache_size = cache_size
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_hits = 0
        self.num_misses = 0

    def compile(self, fmt: ResponseFormat) -> CompiledGrammar:
        """The compiled grammar of `fmt`, from the cache when an equal format (same key) was compiled
        lately. Raises UnsupportedSchemaError when the schema cannot be enforced."""
        key = fmt.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return compiled
            self.num_misses += 1
        # NOTE: two threads may compile one key at once; both results are equal, one is kept
        compiled = self._compile(fmt)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def compile_key(self, key: str) -> CompiledGrammar:
        """compile() from a ResponseFormat.key (what crosses the process queue)."""
        return self.compile(ResponseFormat.from_key(key))

    def new_state(self, fmt: ResponseFormat, eos_token_ids: Iterable[int] | None = None
                  ) -> GrammarState:
        return self.compile(fmt).new_state(eos_token_ids)

    def _compile(self, fmt: ResponseFormat) -> CompiledGrammar:
        # NOTE: the constructor never raises for a bad grammar; it leaves the matcher in error
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(fmt), log_level=0)
        if template.is_error():
            raise _unsupported(fmt, template.get_error())
        return CompiledGrammar(key=fmt.key, template=template, eos_token_ids=self.eos_token_ids,
                               vocab_size=self.vocab_size)


def _unsupported(fmt: ResponseFormat, message: str) -> UnsupportedSchemaError:
    reason = " ".join(message.split("<state>")[0].split())  # drop the parser-state dump
    if len(reason) > 300:
        reason = reason[:300] + "..."
    return UnsupportedSchemaError(f"{_WHERE[fmt.type]} cannot be enforced: {reason}")
