"""Random speculative decoding under a grammar, on the embedded model's tokenizer: drafts that are
partly right, cut at the first rejected token, verified under the masks of every position, partly
accepted, then committed with a recovered or bonus token. Whatever the draws, the text parses as JSON
and validates against its schema."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch
from embedded_tokenizer import load_embedded_tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine.structured import (
    GrammarCompiler,
    allocate_token_bitmask,
    bitmask_to_bool,
    fill_batch_masks,
    parse_response_format,
)

EOS = 2
NUM_WALKS = 12
MAX_STEPS = 400  # verification steps per walk; each emits at least one token
CLOSERS = frozenset(b'"}]')

SCHEMAS = {
    "json_object": None,
    "flat": {"type": "object",
             "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                            "ok": {"type": "boolean"}},
             "required": ["name", "age", "ok"], "additionalProperties": False},
    "enum_nested_array": {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "closed"]},
            "owner": {"type": "object", "properties": {"id": {"type": "integer"}},
                      "required": ["id"], "additionalProperties": False},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                     "minItems": 1, "maxItems": 3}},
        "required": ["status", "owner", "tags"], "additionalProperties": False},
    "pattern_format": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                       "day": {"type": "string", "format": "date"},
                       "uid": {"type": "string", "format": "uuid"}},
        "required": ["code", "day", "uid"], "additionalProperties": False},
    "number_ranges": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        "required": ["age", "score"], "additionalProperties": False},
    "anyof_ref_required_subset": {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"at": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
                       "label": {"type": ["string", "null"]},
                       "n": {"type": "integer"}},
        "required": ["at"], "additionalProperties": False},
}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Masks are small tensors: with 2 threads on 2 shared cores, torch's spinning threads make
    each unpack ~100 times slower than with 1."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def tokenizer():
    return load_embedded_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, [EOS])


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    """The bytes each token adds to the text (byte-level BPE); control tokens as their text."""
    to_byte = {u: b for b, u in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    table = [b""] * len(tokenizer)
    for piece, token_id in tokenizer.get_vocab().items():
        table[token_id] = (piece.encode() if token_id in special
                           else bytes(to_byte[c] for c in piece))
    return table


class Walker:
    """Draws allowed tokens: freely at first, then steering to a close so that walks end."""

    def __init__(self, token_bytes: list[bytes], rng: random.Random) -> None:
        self.rng = rng
        self.is_closer = np.array([bool(b) and set(b) <= CLOSERS for b in token_bytes])
        self.is_short = np.array([len(b.strip()) == 1 and len(b) == 1 for b in token_bytes])

    def draw(self, allowed_row, closing: bool) -> int:
        allowed = np.flatnonzero(allowed_row.numpy())
        if closing and EOS in allowed:
            return EOS
        others = allowed[allowed != EOS]
        if len(others) == 0:
            return EOS
        if closing:
            for keep, p in ((self.is_closer[others], 0.5), (self.is_short[others], 0.95)):
                if keep.any() and self.rng.random() < p:
                    others = others[keep]
                    break
        return int(others[self.rng.randrange(len(others))])


def propose(state, walker, vocab_size, k, closing):
    """A draft-model-like proposer: a masked walk on a fork of the state, then maybe a wrong token
    spliced in (what an n-gram or suffix proposer might offer)."""
    fork = state.fork()
    bitmask = allocate_token_bitmask(1, vocab_size)
    draft = []
    for _ in range(k):
        if fork.is_terminated():
            break
        fork.fill_masks([], bitmask, 0)
        token_id = walker.draw(bitmask_to_bool(bitmask, vocab_size)[0], closing)
        fork.commit([token_id])
        draft.append(token_id)
    if draft and walker.rng.random() < 0.4:
        draft[walker.rng.randrange(len(draft))] = walker.rng.randrange(vocab_size + 64)
    return draft


def speculative_walk(compiled, walker, vocab_size, soft_len):
    """Returns the emitted token ids; asserts the protocol's invariants on the way."""
    state = compiled.new_state()
    output: list[int] = []
    for _ in range(MAX_STEPS):
        closing = len(output) >= soft_len
        draft = propose(state, walker, vocab_size, walker.rng.randrange(0, 7), closing)
        num_valid = state.valid_draft_prefix(draft)
        draft = draft[:num_valid]  # the proposer's draft, cut before scheduling
        bitmask = allocate_token_bitmask(len(draft) + 2, vocab_size)
        assert fill_batch_masks([state], [draft], bitmask, [1]) == [len(draft)]
        allowed = bitmask_to_bool(bitmask, vocab_size)[1:]  # [1 + k, vocab]
        # verification: the "target" keeps each draft token with probability 0.7 (it must be
        # allowed at its row), else draws its own recovered token; after k kept, a bonus token
        emitted = []
        for j in range(len(draft) + 1):
            if j < len(draft):
                assert allowed[j, draft[j]]
                if walker.rng.random() < 0.7:
                    emitted.append(draft[j])
                    continue
            emitted.append(walker.draw(allowed[j], closing))
            break
        if EOS in emitted:  # the request ends at its EOS; the rest of the block is dropped
            emitted = emitted[:emitted.index(EOS) + 1]
        state.commit(emitted)
        output += emitted
        if state.is_terminated():
            return output
    raise AssertionError(f"walk did not end in {MAX_STEPS} steps")


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_speculative_walks_always_give_valid_json(name, compiler, token_bytes):
    schema = SCHEMAS[name]
    fmt = parse_response_format(
        {"type": "json_object"} if schema is None else
        {"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    compiled = compiler.compile(fmt)
    validator = jsonschema.Draft202012Validator(
        schema or {"type": "object"}, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    rng = random.Random(f"walks-{name}")
    walker = Walker(token_bytes, rng)
    for soft_len in [0, 10] + [rng.randrange(20, 120) for _ in range(NUM_WALKS - 2)]:
        token_ids = speculative_walk(compiled, walker, compiler.vocab_size, soft_len)
        assert token_ids[-1] == EOS and EOS not in token_ids[:-1]
        text = b"".join(token_bytes[t] for t in token_ids[:-1]).decode("utf-8")
        value = json.loads(text)
        errors = [error.message for error in validator.iter_errors(value)]
        assert not errors, f"{text!r}: {errors}"
