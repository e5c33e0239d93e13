"""What the native CPU pass's tests (tests/kernels/test_native_*.py) run: a tiny GGUF's formats and
a conversation of passes that covers every shape of step the engine makes."""

from __future__ import annotations

import random

from engine.step.types import SequenceRows
from tests.helpers.tiny_gguf import VOCAB

# every linear packed: layer 0's q/k/v in three formats and gate/up in two (parts side by side),
# layer 1's in one format each (one fused part)
ALL_PACKED = {
    "token_embd.weight": "Q8_0", "output.weight": "Q4_1",
    "blk.0.attn_q.weight": "F16", "blk.0.attn_k.weight": "Q8_0", "blk.0.attn_v.weight": "Q4_0",
    "blk.0.attn_output.weight": "BF16", "blk.0.ffn_gate.weight": "Q4_1",
    "blk.0.ffn_up.weight": "Q8_0", "blk.0.ffn_down.weight": "Q8_0",
    "blk.1.attn_q.weight": "Q4_0", "blk.1.attn_k.weight": "Q4_0", "blk.1.attn_v.weight": "Q4_0",
    "blk.1.attn_output.weight": "Q4_1", "blk.1.ffn_gate.weight": "Q4_0",
    "blk.1.ffn_up.weight": "Q4_0", "blk.1.ffn_down.weight": "Q4_1",
}


def steps(rng: random.Random) -> list[list[SequenceRows]]:
    """A conversation of passes: two prompts batched, decode, growing verification, a batch of a
    decode and a verification, a tree."""
    tokens = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    passes = [[SequenceRows("a", 0, tokens(30)), SequenceRows("b", 0, tokens(7))],
              [SequenceRows("a", 30, tokens(1))]]
    start = 31
    for rows in (2, 3, 4, 5, 6, 7, 12):
        passes.append([SequenceRows("a", start, tokens(rows))])
        start += rows
    passes.append([SequenceRows("a", start, tokens(1)), SequenceRows("b", 7, tokens(5))])
    passes.append([SequenceRows("b", 12, tokens(6), parents=[-1, 0, 0, 1, 1, 2])])
    return passes
