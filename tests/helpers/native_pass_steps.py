"""What the native CPU pass's tests (tests/kernels/test_native_*.py) run: a tiny GGUF's formats, a
tiny Hugging Face folder's linears in half precision, and a conversation of passes that covers
every shape of step the engine makes."""

from __future__ import annotations

import os
import random

import torch
from safetensors.torch import load_file, save_file

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


# a folder's linears stored as float16 (the rest bfloat16), so q|k|v and gate|up load as parts of
# two packed formats side by side
_FLOAT16_LINEARS = ("k_proj", "up_proj", "o_proj")


def store_linears_in_half_precision(folder: str) -> None:
    """Rewrite a Hugging Face folder's matrices (tests/helpers/tiny_models.py's) as bfloat16 and
    float16, which a packed load keeps as BF16 and F16 groups; norms stay float32."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for name, tensor in tensors.items():
        if tensor.dim() == 2:
            half = torch.float16 if any(part in name for part in _FLOAT16_LINEARS) else \
                torch.bfloat16
            tensors[name] = tensor.to(half)
    save_file(tensors, path, metadata={"format": "pt"})


def steps(rng: random.Random) -> list[list[SequenceRows]]:
    """A conversation of passes: two prompts batched, decode, growing verification, a batch of a
    decode and a verification, a tree, and a deeper tree (9 levels: its rows' masks are cut by a
    window of 6 or 8)."""
    tokens = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    passes = [[SequenceRows("a", 0, tokens(30)), SequenceRows("b", 0, tokens(7))],
              [SequenceRows("a", 30, tokens(1))]]
    start = 31
    for rows in (2, 3, 4, 5, 6, 7, 12):
        passes.append([SequenceRows("a", start, tokens(rows))])
        start += rows
    passes.append([SequenceRows("a", start, tokens(1)), SequenceRows("b", 7, tokens(5))])
    passes.append([SequenceRows("b", 12, tokens(6), parents=[-1, 0, 0, 1, 1, 2])])
    passes.append([SequenceRows("a", start + 1, tokens(10),
                                parents=[-1, 0, 1, 2, 3, 4, 5, 6, 7, 3])])
    return passes
