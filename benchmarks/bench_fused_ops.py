"""Triton fused decoder ops vs the torch ops they replace: `python -m benchmarks.bench_fused_ops`.

On CUDA: decode (T = 1, 8, 64) and prefill (T = 2048) shapes of SmolLM2-135M and Llama-3.1-8B in
bfloat16, median of CUDA-event timings, each call queued behind an L2 flush: GPU time with a cold
cache, the CPU's launch cost hidden (as under CUDA graphs). GB/s is the Triton kernel's floor of
bytes (each input read once, each output written once) over its time. Without CUDA,
`TRITON_INTERPRET=1 python -m benchmarks.bench_fused_ops --smoke` runs tiny shapes under the
interpreter only to show the script works: those timings measure Python, not a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.models.llama import RMSNorm, apply_rotary

OPS = ("rms_norm", "add_rms_norm", "rotary_", "silu_and_mul")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EPS = 1e-5


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int


MODELS = [ModelShape("SmolLM2-135M", 576, 9, 3, 64, 1536),
          ModelShape("Llama-3.1-8B", 4096, 32, 8, 128, 14336)]
NUM_TOKENS = [1, 8, 64, 2048]  # decode batches, then one prefill chunk
SMOKE_MODELS = [ModelShape("smoke", 96, 3, 1, 24, 160)]  # not powers of 2, like the real ones
SMOKE_NUM_TOKENS = [1, 3]


@dataclass
class Case:
    op: str
    shape: str
    reference: Callable[[], object]  # the torch ops of engine/models/llama.py
    triton: Callable[[], object]
    num_bytes: int  # the Triton kernel's floor: inputs read once, outputs written once
    max_abs_diff: float  # Triton vs reference on the same inputs


def _max_abs_diff(got: Tensor, want: Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


def make_cases(ops: ModuleType, model: ModelShape, num_tokens: int, dtype: torch.dtype,
               device: str) -> list[Case]:
    """One case per op at this model's sizes; `ops` is the kernels.fused_ops_triton module."""
    gen = torch.Generator(device).manual_seed(0)
    rand = {"generator": gen, "device": device}
    hidden, head_dim, width = model.hidden_size, model.head_dim, model.intermediate_size
    size = dtype.itemsize
    x = torch.randn(num_tokens, hidden, **rand).to(dtype)  # [T, H]
    delta = torch.randn(num_tokens, hidden, **rand).to(dtype)  # [T, H]
    norm = RMSNorm(hidden, EPS).to(device=device, dtype=dtype)
    norm.weight.data = (1 + 0.1 * torch.randn(hidden, **rand)).to(dtype)
    weight = norm.weight.detach()  # [H]

    def reference_add_rms_norm() -> tuple[Tensor, Tensor]:
        total = x + delta
        return total, norm(total)

    num_rotated = model.num_heads + model.num_kv_heads
    qkv_sizes = [model.num_heads * head_dim, model.num_kv_heads * head_dim,
                 model.num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(qkv_sizes), **rand).to(dtype)  # [T, (Hq + 2 Hkv) * D]
    positions = 1000 + torch.arange(num_tokens, device=device)[:, None]  # [T, 1] deep in a context
    angles = positions * torch.rand(head_dim // 2, **rand)  # [T, D/2]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)  # [T, D/2] each

    def reference_rotary() -> tuple[Tensor, Tensor]:
        q, k, _ = qkv.split(qkv_sizes, dim=-1)
        q = q.view(num_tokens, model.num_heads, head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, model.num_kv_heads, head_dim)  # [T, Hkv, D]
        cos_heads, sin_heads = cos[:, None], sin[:, None]  # [T, 1, D/2] each
        return apply_rotary(q, cos_heads, sin_heads), apply_rotary(k, cos_heads, sin_heads)

    rotated = qkv.clone()
    ops.rotary_(rotated, cos, sin, num_rotated, head_dim)
    rotary_diff = _max_abs_diff(rotated[:, :num_rotated * head_dim],
                                torch.cat([t.flatten(1) for t in reference_rotary()], 1))
    gate_up = torch.randn(num_tokens, 2 * width, **rand).to(dtype)  # [T, 2I]

    def reference_silu_and_mul() -> Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    return [
        Case("rms_norm", f"[{num_tokens}, {hidden}]", lambda: norm(x),
             lambda: ops.rms_norm(x, weight, EPS), (2 * num_tokens * hidden + hidden) * size,
             _max_abs_diff(ops.rms_norm(x, weight, EPS), norm(x))),
        Case("add_rms_norm", f"[{num_tokens}, {hidden}]", reference_add_rms_norm,
             lambda: ops.add_rms_norm(x, delta, weight, EPS),
             (4 * num_tokens * hidden + hidden) * size,
             max(map(_max_abs_diff, ops.add_rms_norm(x, delta, weight, EPS),
                     reference_add_rms_norm()))),
        Case("rotary_", f"[{num_tokens}, {num_rotated}x{head_dim}]", reference_rotary,
             lambda: ops.rotary_(qkv, cos, sin, num_rotated, head_dim),
             (2 * num_rotated * head_dim + head_dim) * num_tokens * size, rotary_diff),
        Case("silu_and_mul", f"[{num_tokens}, 2x{width}]", reference_silu_and_mul,
             lambda: ops.silu_and_mul(gate_up), 3 * num_tokens * width * size,
             _max_abs_diff(ops.silu_and_mul(gate_up), reference_silu_and_mul())),
    ]


def _median_us(fn: Callable[[], object], warmup: int, repeats: int,
               l2_flush: Tensor | None) -> float:
    """Median microseconds of one call: CUDA events around each call, behind an L2 flush (in a
    decode step a layer's weights stream through L2 between these ops), else wall-clock time."""
    for _ in range(warmup):
        fn()
    if l2_flush is None:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(repeats)]
    for start, end in events:
        l2_flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) * 1e3 for start, end in events)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, few iterations: only shows the script runs end to end")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default bfloat16 on CUDA; float32 under the interpreter, which "
                             "truncates float32 -> bfloat16 where a GPU rounds to nearest")
    args = parser.parse_args()
    is_cuda = torch.cuda.is_available()
    is_interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    if not is_cuda and not (is_interpreter and args.smoke):
        print("bench_fused_ops: no CUDA device; to check the script on the CPU run "
              "`TRITON_INTERPRET=1 python -m benchmarks.bench_fused_ops --smoke`", file=sys.stderr)
        return 2
    from kernels import fused_ops_triton  # NOTE: after the check: imports triton

    device = "cuda" if is_cuda else "cpu"
    dtype = DTYPES[args.dtype or ("bfloat16" if is_cuda else "float32")]
    models, token_counts = (SMOKE_MODELS, SMOKE_NUM_TOKENS) if args.smoke else (MODELS, NUM_TOKENS)
    warmup, repeats = (1, 3) if args.smoke else (10, 100)
    l2_flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if is_cuda else None
    if is_cuda:
        print(f"device: {torch.cuda.get_device_name()}, {dtype}, median of {repeats} calls, "
              "cold L2")
    else:
        print(f"no CUDA: Triton under TRITON_INTERPRET=1, {dtype}; timings are MEANINGLESS "
              "interpreter timings (Python speed, not a GPU), printed only to show the script runs")
    print(f"{'op':<13} {'model':<13} {'shape':<18} {'torch us':>9} {'triton us':>9} {'speedup':>7} "
          f"{'triton GB/s':>11} {'max |diff|':>10}")
    for model in models:
        for num_tokens in token_counts:
            for case in make_cases(fused_ops_triton, model, num_tokens, dtype, device):
                torch_us = _median_us(case.reference, warmup, repeats, l2_flush)
                triton_us = _median_us(case.triton, warmup, repeats, l2_flush)
                print(f"{case.op:<13} {model.name:<13} {case.shape:<18} {torch_us:>9.1f} "
                      f"{triton_us:>9.1f} {torch_us / triton_us:>7.2f} "
                      f"{case.num_bytes / triton_us / 1e3:>11.1f} {case.max_abs_diff:>10.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
