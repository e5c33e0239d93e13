"""Structured output (`response_format`): JSON object / JSON schema grammars as token masks applied at
every verification position of a speculative step. See grammar_state.py for the step's protocol and
docs/grammar_choice.md for why llguidance."""

from engine.structured.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_to_bool,
    num_bitmask_words,
)
from engine.structured.compiler import (
    CompiledGrammar,
    GrammarCompiler,
    check_grammar_support,
    check_response_format,
)
from engine.structured.errors import (
    GrammarStateError,
    InvalidResponseFormatError,
    ResponseFormatError,
    UnsupportedSchemaError,
)
from engine.structured.grammar_state import GrammarState, fill_batch_masks
from engine.structured.response_format import ResponseFormat, parse_response_format

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarState",
    "GrammarStateError",
    "InvalidResponseFormatError",
    "ResponseFormat",
    "ResponseFormatError",
    "UnsupportedSchemaError",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "bitmask_to_bool",
    "check_grammar_support",
    "check_response_format",
    "fill_batch_masks",
    "num_bitmask_words",
    "parse_response_format",
]
