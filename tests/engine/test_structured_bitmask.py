"""Token bitmasks: unpacking agrees with a bit-by-bit reference, and masking logits sets exactly the
disallowed ids to -inf, ids past the grammar's vocabulary (a padded lm_head) included."""

from __future__ import annotations

import pytest
import torch

from engine.structured import (
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_to_bool,
    num_bitmask_words,
)
from engine.structured.bitmask import any_token_bit, set_token_bits

VOCAB = 100  # not a multiple of 32: the last word is partly padding


def random_bitmask(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (num_rows, num_bitmask_words(vocab_size)),
                         dtype=torch.int32, generator=generator)


def reference_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bit by bit, in Python: the specification."""
    allowed = torch.zeros((bitmask.shape[0], vocab_size), dtype=torch.bool)
    for row in range(bitmask.shape[0]):
        for token in range(vocab_size):
            word = int(bitmask[row, token // 32]) & 0xFFFFFFFF
            allowed[row, token] = bool((word >> (token % 32)) & 1)
    return allowed


def test_allocate_is_all_disallowed():
    bitmask = allocate_token_bitmask(3, VOCAB)
    assert bitmask.shape == (3, 4) and bitmask.dtype == torch.int32
    assert not bitmask_to_bool(bitmask, VOCAB).any()


def test_unpack_matches_reference():
    bitmask = random_bitmask(4, VOCAB, seed=0)
    bitmask[0, 0] = -2**31  # only bit 31: token 31
    assert torch.equal(bitmask_to_bool(bitmask, VOCAB), reference_allowed(bitmask, VOCAB))
    assert bitmask_to_bool(bitmask, VOCAB)[0, :32].nonzero().flatten().tolist() == [31]
    with pytest.raises(ValueError, match="covers 128 tokens"):
        bitmask_to_bool(bitmask, 129)


def test_set_and_read_single_bits():
    bitmask = allocate_token_bitmask(2, VOCAB)
    set_token_bits(bitmask, 1, [0, 31, 32, 99], True)
    assert bitmask_to_bool(bitmask, VOCAB)[1].nonzero().flatten().tolist() == [0, 31, 32, 99]
    assert any_token_bit(bitmask, 1, [5, 31]) and not any_token_bit(bitmask, 0, [31])
    set_token_bits(bitmask, 1, [31, 99], False)
    assert bitmask_to_bool(bitmask, VOCAB)[1].nonzero().flatten().tolist() == [0, 32]


@pytest.mark.parametrize("model_vocab", [VOCAB, VOCAB + 13, VOCAB - 4])
def test_apply_masks_exactly_the_disallowed_rows(model_vocab):
    """Mask rows 0, 1, 2 go to logits rows 4, 0, 2; rows 1 and 3 are another request's, untouched."""
    logits = torch.randn(5, model_vocab, dtype=torch.float32)
    before = logits.clone()
    bitmask = random_bitmask(3, VOCAB, seed=1)
    rows = torch.tensor([4, 0, 2])
    apply_token_bitmask_(logits, bitmask, VOCAB, rows)
    allowed = reference_allowed(bitmask, VOCAB)
    covered = min(VOCAB, model_vocab)
    for mask_row, logits_row in enumerate(rows.tolist()):
        expected = before[logits_row].clone()
        expected[:covered][~allowed[mask_row, :covered]] = float("-inf")
        expected[covered:] = float("-inf")  # past the tokenizer: padding ids, never allowed
        assert torch.equal(logits[logits_row], expected)
    assert torch.equal(logits[[1, 3]], before[[1, 3]])


def test_apply_without_rows_is_row_to_row_and_keeps_dtype():
    logits = torch.randn(2, VOCAB + 28, dtype=torch.float64)
    before = logits.clone()
    bitmask = random_bitmask(2, VOCAB, seed=2)
    apply_token_bitmask_(logits, bitmask, VOCAB)
    allowed = torch.cat([reference_allowed(bitmask, VOCAB), torch.zeros(2, 28, dtype=torch.bool)],
                        dim=1)
    assert torch.equal(torch.isneginf(logits), ~allowed)
    assert torch.equal(logits[allowed], before[allowed])  # allowed logits untouched, bit for bit
    assert logits.dtype == torch.float64
