"""Batch-invariant inference: each row's numbers depend on that row alone, never on the step's others.

On a GPU in bfloat16 the library matmul and attention choose their kernels by shape, so a token
verified among 1 + k rows is rounded differently from the same token decoded alone, and greedy
decoding with speculation drifts from greedy decoding without it (docs/perf.md, issue 46: on an
H200 only 13-16 of 24 held-out prompts kept plain decoding's tokens). With every linear through
`kernels/batch_invariant_matmul.py`, the Triton attention at one tile shape and the row-wise Triton
norms, rotary and SiLU, a verification row is bit for bit the decode row it stands for, and a
request's tokens do not depend on what else is batched with it.
"""

from __future__ import annotations

from torch import Tensor, nn

from engine.models.llama import Attention
from kernels.batch_invariant_matmul import invariant_linear


class BatchInvariantLinear(nn.Linear):
    """nn.Linear whose rows round the same in any batch (the weights and bias are nn.Linear's)."""

    def forward(self, x: Tensor) -> Tensor:
        return invariant_linear(x, self.weight, self.bias)


def use_batch_invariant(model: nn.Module) -> None:
    """Every plain linear of `model` and its attention become batch-invariant. Needs the Triton
    per-layer ops installed first (build_model with gpu_kernels "triton"): torch's reductions
    may also choose their strategy by the number of rows."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = BatchInvariantLinear
        elif isinstance(module, Attention):
            module.batch_invariant = True
