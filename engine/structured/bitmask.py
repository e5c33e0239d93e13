"""Token bitmasks: one row per verification position, bit t of a row set when token t is allowed.

Layout (llguidance's, and xgrammar's): int32 [num_rows, ceil(vocab_size / 32)], token t at bit t % 32
of word t // 32. Packed bits are what the grammar library writes fastest (6 KiB a row for a 49152
vocabulary, 8 times less than bytes), and they cross to a GPU cheaply; they are unpacked to bool only
where the logits are, in one vectorised step.
"""

from __future__ import annotations

import sys

import torch

# NOTE: int32 words are unpacked as bytes, least significant first (x86, ARM and CUDA all are)
assert sys.byteorder == "little", "token bitmasks assume a little-endian host"
# rows unpacked at a time on the CPU: their temporaries (49152 bytes a row) stay in cache, which
# makes masking a [288, 49152] batch (32 requests, k = 8) about twice as fast as one pass
_CPU_CHUNK_ROWS = 16


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """Zeroed (nothing allowed) int32 [num_rows, ceil(vocab_size / 32)] on the CPU, where the grammar
    library writes."""
    return torch.zeros((num_rows, num_bitmask_words(vocab_size)), dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] -> bool [rows, vocab_size], True where allowed (on bitmask's device)."""
    assert bitmask.dtype == torch.int32 and bitmask.ndim == 2, "expected int32 [rows, words]"
    if vocab_size > 32 * bitmask.shape[1]:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words covers {32 * bitmask.shape[1]} "
                         f"tokens, not {vocab_size}")
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [rows, 4 * words]
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [rows, 4 * words, 8] of 0 / 1
    return bits.view(torch.bool).reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int,
                         rows: torch.Tensor | None = None) -> None:
    """Set logits to -inf, in place, wherever the grammar disallows the token.

    logits: [num_logits_rows, model_vocab] float, on any device; model_vocab may exceed the
        grammar's vocabulary (an lm_head padded past the tokenizer): those ids are always -inf.
    bitmask: int32 [num_mask_rows, words] from the grammar; vocab_size: the grammar's vocabulary
        (the tokenizer's), whose ids the mask covers.
    rows: int64 [num_mask_rows], the logits row each mask row applies to; None = row i to row i.
    """
    assert logits.ndim == 2 and bitmask.ndim == 2, "expected [rows, vocab] logits, [rows, words]"
    num_rows = bitmask.shape[0] if rows is None else rows.shape[0]
    assert num_rows == bitmask.shape[0], "one mask row per masked logits row"
    if num_rows == 0:
        return
    covered = min(vocab_size, logits.shape[1])
    bitmask = bitmask.to(logits.device, non_blocking=True)
    rows = None if rows is None else rows.to(logits.device)
    chunk = _CPU_CHUNK_ROWS if logits.device.type == "cpu" else num_rows
    for start in range(0, num_rows, chunk):
        end = min(start + chunk, num_rows)
        disallowed = ~bitmask_to_bool(bitmask[start:end], covered)  # [end - start, covered]
        if rows is None:
            target = logits[start:end]  # a view: written in place
        else:
            target = logits.index_select(0, rows[start:end])  # a copy, written back below
        target[:, :covered].masked_fill_(disallowed, float("-inf"))
        target[:, covered:] = float("-inf")
        if rows is not None:
            logits.index_copy_(0, rows[start:end], target)


def set_token_bits(bitmask: torch.Tensor, row: int, token_ids: list[int], allowed: bool) -> None:
    """Allow (or disallow) a few tokens in one row (EOS bookkeeping; not for long lists)."""
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        value = 1 << bit
        value = value - (1 << 32) if value >= 1 << 31 else value  # as a signed int32
        if allowed:
            bitmask[row, word] |= value
        else:
            bitmask[row, word] &= ~value


def any_token_bit(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> bool:
    """Whether any of `token_ids` is allowed in `row`."""
    return any((int(bitmask[row, t // 32]) >> (t % 32)) & 1 for t in token_ids)
