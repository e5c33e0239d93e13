"""GrammarState on the embedded model's real tokenizer: the compile cache, draft cutting, the masks at
every verification position against a token-by-token reference, commit after a partly accepted block,
and the end of sequence."""

from __future__ import annotations

import pytest
import torch
from embedded_tokenizer import load_embedded_tokenizer

from engine.structured import (
    GrammarCompiler,
    GrammarStateError,
    UnsupportedSchemaError,
    allocate_token_bitmask,
    bitmask_to_bool,
    fill_batch_masks,
    parse_response_format,
)

EOS = 2  # <|im_end|>
PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


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
def person(compiler):
    return compiler.compile(parse_response_format(json_schema(PERSON)))


@pytest.fixture
def encode(tokenizer):
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def json_schema(schema):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}


def masks_of(state, draft, vocab_size):
    """bool [1 + len(draft), vocab] from fill_masks at row 2 of a larger bitmask."""
    bitmask = allocate_token_bitmask(len(draft) + 4, vocab_size)
    state.fill_masks(draft, bitmask, 2)
    return bitmask_to_bool(bitmask, vocab_size)[2:3 + len(draft)]


def reference_masks(compiled, committed, draft, vocab_size):
    """Token by token: row j = the mask of a fresh state that committed committed + draft[:j]; the
    rows past the first rejected token copy the mask at the rejection."""
    rows = []
    state = compiled.new_state()
    state.commit(committed)
    for j in range(len(draft) + 1):
        rows.append(masks_of(state, [], vocab_size)[0])
        if j < len(draft):
            if not rows[-1][draft[j]]:
                rows += [rows[-1]] * (len(draft) - j)
                break
            state.commit([draft[j]])
    return torch.stack(rows)


# ---------------------------------------------------------------- compiling


def test_cache_returns_the_same_object_for_the_same_format(compiler, person):
    shuffled = {"required": ["name", "age"], "additionalProperties": False, "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    hits = compiler.num_hits
    again = compiler.compile(parse_response_format(
        {"json_schema": {"schema": shuffled, "name": "other", "strict": True},
         "type": "json_schema"}))
    assert again is person and compiler.num_hits == hits + 1
    assert compiler.compile_key(person.key) is person


def test_cache_evicts_the_least_recently_used(tokenizer):
    compiler = GrammarCompiler(tokenizer, [EOS], cache_size=2)
    a, b, c = (parse_response_format(json_schema({"type": kind}))
               for kind in ("object", "array", "string"))
    compiled_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is compiled_a  # a is now the most recent
    compiler.compile(c)  # evicts b
    assert compiler.compile(a) is compiled_a
    misses = compiler.num_misses
    compiler.compile(b)
    assert compiler.num_misses == misses + 1


def test_compile_refuses_what_it_cannot_enforce(compiler):
    with pytest.raises(UnsupportedSchemaError, match="uniqueItems"):
        compiler.compile(parse_response_format(json_schema({"type": "array",
                                                            "uniqueItems": True})))


# ---------------------------------------------------------------- drafts


def test_valid_draft_prefix_cuts_at_the_first_rejected_token(person, encode, compiler):
    state = person.new_state()
    state.commit(encode('{"name": "Ada"'))
    before = masks_of(state, [], compiler.vocab_size)
    good = encode(', "age": 36}')
    draft = good[:3] + encode("{") + good[4:]  # only "age" may follow: position 3 is wrong
    assert len(draft) >= 5
    assert state.valid_draft_prefix(draft) == 3
    assert state.valid_draft_prefix(good) == len(good)
    assert state.valid_draft_prefix(good + [EOS, 5]) == len(good) + 1
    assert state.valid_draft_prefix([]) == 0
    assert state.valid_draft_prefix([compiler.vocab_size + 5]) == 0  # a padding id of the lm_head
    # nothing moved
    assert torch.equal(masks_of(state, [], compiler.vocab_size), before)
    assert state.num_committed == len(encode('{"name": "Ada"'))
    assert not state.accepts_eos() and not state.is_terminated()


DRAFTS = [
    ('{"', 'name": "Al", "age": 3}'),  # runs to the end of the object
    ('{"', 'name": "Al", "age": 3}<EOS>'),  # and takes the EOS
    ('{"name": "A', 'da", "age": 7}<EOS><EOS>x'),  # EOS repeated, then a token after it
    ("{", '"name": 5'),  # rejected in the middle: 5 is not a string
    ('{"name": "Bo", "age": 4', "<EOS>}"),  # EOS before the object is complete
    ("", "<EOS>"),
]


@pytest.mark.parametrize("committed,draft", DRAFTS)
def test_fill_masks_equals_token_by_token_reference(person, encode, compiler, committed, draft):
    def tokens(text):
        parts = text.split("<EOS>")
        out = encode(parts[0]) if parts[0] else []
        for part in parts[1:]:
            out += [EOS] + (encode(part) if part else [])
        return out

    committed_ids, draft_ids = tokens(committed), tokens(draft)
    state = person.new_state()
    state.commit(committed_ids)
    before = masks_of(state, [], compiler.vocab_size)
    got = masks_of(state, draft_ids, compiler.vocab_size)
    expected = reference_masks(person, committed_ids, draft_ids, compiler.vocab_size)
    assert torch.equal(got, expected)
    # the committed state is unchanged
    assert torch.equal(masks_of(state, [], compiler.vocab_size), before)
    assert state.num_committed == len(committed_ids) and not state.is_terminated()
    # every draft token before the cut is allowed at its row, the one at the cut is not
    num_valid = state.valid_draft_prefix(draft_ids)
    for j, token_id in enumerate(draft_ids[:num_valid + 1]):
        assert bool(got[j, token_id]) == (j < num_valid)


def test_batch_fill_writes_each_state_at_its_rows_only(person, encode, compiler):
    states = [person.new_state() for _ in range(3)]
    states[1].commit(encode('{"name": "X'))
    states[2].commit(encode('{"name": "Y'))
    drafts = [encode('{"name'), [], encode('", "age": 1}') + [EOS]]
    starts = [0, 6, 8]
    bitmask = allocate_token_bitmask(9 + len(drafts[2]) + 2, compiler.vocab_size)
    assert starts[0] + len(drafts[0]) < 5
    bitmask[5] = 12345  # rows of other requests stay as they were
    bitmask[7] = 12345
    bitmask[-1] = 12345
    prefixes = fill_batch_masks(states, drafts, bitmask, starts)
    assert prefixes == [len(drafts[0]), 0, len(drafts[2])]
    allowed = bitmask_to_bool(bitmask, compiler.vocab_size)
    for state, draft, start in zip(states, drafts, starts):
        assert torch.equal(allowed[start:start + len(draft) + 1],
                           masks_of(state, draft, compiler.vocab_size))
    assert all((bitmask[row] == 12345).all() for row in (5, 7, -1))


# ---------------------------------------------------------------- commit, rollback, end of sequence


def test_partly_accepted_block_then_continue(person, encode, tokenizer, compiler):
    """A draft of 6 where the target accepts 2 and then samples its own (recovered) token."""
    state = person.new_state()
    state.commit(encode('{"name": "'))
    draft = encode('Ada", "age": 36}')
    bitmask = allocate_token_bitmask(len(draft) + 1, compiler.vocab_size)
    assert state.fill_masks(draft, bitmask, 0) == len(draft)
    allowed = bitmask_to_bool(bitmask, compiler.vocab_size)
    recovered = encode('"')[0]  # closes the string early: allowed at row 2 (after 'Ada' + ...)
    accepted = draft[:2]
    assert allowed[2, recovered] and recovered != draft[2]
    state.commit(accepted + [recovered])
    rest = encode(', "age": 36}')
    assert state.valid_draft_prefix(rest) == len(rest)
    state.commit(rest)
    assert state.accepts_eos() and not state.is_terminated()
    text = tokenizer.decode(encode('{"name": "') + accepted + [recovered] + rest)
    assert text.startswith('{"name": "') and text.endswith('", "age": 36}')


def test_commit_of_a_disallowed_token_raises_and_commits_nothing(person, encode, compiler):
    state = person.new_state()
    state.commit(encode("{"))
    before = masks_of(state, [], compiler.vocab_size)
    with pytest.raises(GrammarStateError, match="not allowed"):
        state.commit(encode('"name": 5'))
    with pytest.raises(GrammarStateError):
        state.commit([EOS])  # the object is not complete
    assert torch.equal(masks_of(state, [], compiler.vocab_size), before)
    assert state.num_committed == 1


def test_only_eos_once_complete_and_after_termination(person, encode, compiler):
    state = person.new_state()
    state.commit(encode('{"name": "Al", "age": 3}'))
    only_eos = torch.zeros(compiler.vocab_size, dtype=torch.bool)
    only_eos[EOS] = True
    assert torch.equal(masks_of(state, [], compiler.vocab_size)[0], only_eos)
    assert state.accepts_eos() and state.valid_draft_prefix([EOS, EOS, 5]) == 2
    state.commit([EOS])
    assert state.is_terminated()
    assert state.valid_draft_prefix([EOS, 7]) == 1
    masks = masks_of(state, [EOS, 7], compiler.vocab_size)
    assert all(torch.equal(row, only_eos) for row in masks)
    state.commit([EOS])  # EOS stays allowed (ignore_eos keeps sampling)
    with pytest.raises(GrammarStateError):
        state.commit([7])


def test_request_eos_ids_replace_the_grammars(person, encode, compiler):
    """The request's EOS ids are what a complete grammar allows, whatever the compiler was given."""
    state = person.new_state(eos_token_ids={EOS, 0})
    ids = encode('{"name": "Al", "age": 3')
    masks = masks_of(state, ids + encode("}"), compiler.vocab_size)
    assert not masks[-2, 0] and not masks[-2, EOS]  # inside the object: neither
    assert masks[-1].nonzero().flatten().tolist() == [0, EOS]  # complete: both, nothing else
    other = person.new_state(eos_token_ids={0})
    other.commit(ids + encode("}"))
    assert masks_of(other, [], compiler.vocab_size)[0].nonzero().flatten().tolist() == [0]
    assert other.valid_draft_prefix([EOS]) == 0 and other.valid_draft_prefix([0]) == 1


def test_compiler_with_several_eos_ids(tokenizer, encode):
    compiler = GrammarCompiler(tokenizer, [EOS, 0])
    state = compiler.new_state(parse_response_format({"type": "json_object"}))
    state.commit(encode("{}"))
    assert masks_of(state, [], compiler.vocab_size)[0].nonzero().flatten().tolist() == [0, EOS]


def test_fork_is_independent(person, encode, compiler):
    state = person.new_state()
    state.commit(encode('{"name": "'))
    twin = state.fork()
    twin.commit(encode('Al", "age": 3}'))
    assert twin.accepts_eos() and not state.accepts_eos()
    assert state.valid_draft_prefix(encode('Bo"')) == len(encode('Bo"'))
    assert state.num_committed == len(encode('{"name": "'))


def test_misuse_fails_clearly(person, tokenizer, compiler):
    state = person.new_state()
    with pytest.raises(ValueError, match="words a row"):
        state.fill_masks([], allocate_token_bitmask(2, compiler.vocab_size + 64), 0)
    with pytest.raises(ValueError, match="do not fit"):
        state.fill_masks([5, 6], allocate_token_bitmask(2, compiler.vocab_size), 0)
    with pytest.raises(ValueError, match="end-of-sequence"):
        GrammarCompiler(tokenizer, [])
    with pytest.raises(ValueError, match="EOS token id"):
        person.new_state(eos_token_ids=[])
