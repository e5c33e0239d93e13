"""The Triton fused decoder ops on the CPU: agreement with the torch ops of engine/models/llama.py
under TRITON_INTERPRET=1, a compile for a real GPU target (the interpreter accepts code the compiler
rejects), and a smoke run of the benchmark.

Rotary and the residual sum round exactly as the torch ops do: bit-identical in every dtype.
RMSNorm and SiLU-and-multiply differ by a few float32 ulps: the sum of squares is added in another
order, and torch's CPU rsqrt and exp are ~1-ulp approximations where the kernel's division and
square root are IEEE (numpy's exp under the interpreter). In float16 and bfloat16 such a difference
now and then moves the rounded intermediate (the normalised x, silu(gate)) by one ulp of the dtype,
which the product with the weight or up carries into at most two ulps of the result, on under 1% of
the elements.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sm90_compile import run_compile_script

from engine.models.llama import RMSNorm, apply_rotary

# NOTE: triton reads this when kernels are decorated: set before kernels.fused_ops_triton loads
os.environ["TRITON_INTERPRET"] = "1"
interpreter = pytest.importorskip("triton.runtime.interpreter")
import triton.language as tl  # noqa: E402

from kernels import fused_ops_triton  # noqa: E402

if not isinstance(fused_ops_triton._rms_norm_kernel, interpreter.InterpretedFunction):
    # imported earlier in this process without the interpreter: decorate the kernels again
    fused_ops_triton = importlib.reload(fused_ops_triton)

ROOT = Path(__file__).resolve().parents[2]
EPS = 1e-5
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_TOKENS = [1, 5, 33]


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    @property
    def qkv_sizes(self) -> list[int]:
        return [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2


SMOLLM2 = Shape(576, 9, 3, 64, 1536)
ODD = Shape(333, 5, 1, 24, 333)  # no power of 2 anywhere, half a head included (12)
LLAMA_8B = Shape(4096, 32, 8, 128, 14336)
SHAPES = pytest.mark.parametrize("shape", [SMOLLM2, ODD], ids=["smollm2", "odd"])


@pytest.fixture(autouse=True)
def bfloat16_rounds_to_nearest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter truncates float32 -> bfloat16 (triton 3.9 ignores the rounding mode there),
    where the GPU rounds to nearest even as torch does (test_bfloat16_rounds_to_nearest_on_the_gpu).
    Give the interpreter torch's rounding, so that bfloat16 is checked bit for bit like the rest."""
    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):  # noqa: ANN001, ANN202
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.ascontiguousarray(src.data)
            rounded = torch.from_numpy(data).to(torch.bfloat16).view(torch.int16).numpy()
            rounded = rounded.view(np.uint16).reshape(data.shape)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def randn(*size: int, scale: float = 1.0, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(*size, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def reference_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    norm = RMSNorm(x.shape[-1], EPS).to(weight.dtype)
    norm.weight.data = weight
    return norm(x)


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, D/2] at positions deep in a context, computed as RotaryEmbedding does."""
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = (1000 + 37 * torch.arange(num_tokens))[:, None].float() * inv_freq  # [T, D/2]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def assert_close_in_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 8 ulps (1e-6) in float32, where up to 4 are seen; within 2 in a 16-bit dtype, where
    99% must be bit-identical too (a kernel that truncated instead of rounding is within 2 ulps)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    finfo = torch.finfo(want.dtype)
    ulps = 8 if want.dtype == torch.float32 else 2
    torch.testing.assert_close(got, want, rtol=ulps * finfo.eps, atol=finfo.tiny)
    if want.dtype != torch.float32:
        assert (got == want).float().mean() >= 0.99


# ---- agreement with the torch reference under the interpreter ------------------------------------

@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SHAPES
def test_rms_norm_matches_the_reference(shape: Shape, dtype: torch.dtype, num_tokens: int) -> None:
    x = randn(num_tokens, shape.hidden_size, scale=3.0, dtype=dtype, seed=0)  # [T, H]
    weight = 1 + randn(shape.hidden_size, scale=0.5, dtype=dtype, seed=1)  # [H]
    assert_close_in_ulps(fused_ops_triton.rms_norm(x, weight, EPS), reference_norm(x, weight))


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SHAPES
def test_add_rms_norm_returns_the_exact_sum_and_its_norm(shape: Shape, dtype: torch.dtype,
                                                         num_tokens: int) -> None:
    x = randn(num_tokens, shape.hidden_size, scale=3.0, dtype=dtype, seed=2)  # [T, H]
    delta = randn(num_tokens, shape.hidden_size, dtype=dtype, seed=3)  # [T, H]
    weight = 1 + randn(shape.hidden_size, scale=0.5, dtype=dtype, seed=4)  # [H]
    x_before, delta_before = x.clone(), delta.clone()
    total, normed = fused_ops_triton.add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(total, x + delta)
    assert_close_in_ulps(normed, reference_norm(x + delta, weight))
    assert torch.equal(x, x_before) and torch.equal(delta, delta_before)


def _check_rotary(shape: Shape, num_rotated_heads: int, dtype: torch.dtype,
                  num_tokens: int) -> None:
    """qkv is a view with 8 more columns a row: the v heads and those columns must stay as they
    were."""
    width = sum(shape.qkv_sizes)
    buffer = randn(num_tokens, width + 8, scale=2.0, dtype=dtype, seed=5)  # [T, width + 8]
    qkv = buffer[:, :width]  # [T, (Hq + 2 Hkv) * D], row stride width + 8
    cos, sin = rope_tables(num_tokens, shape.head_dim, dtype)  # [T, D/2] each
    assert (cos < 0.9).any() and (sin.abs() > 0.1).any()  # not the identity
    heads = qkv.reshape(num_tokens, -1, shape.head_dim)  # [T, all heads, D]
    want = apply_rotary(heads[:, :num_rotated_heads], cos[:, None], sin[:, None])
    before = buffer.clone()
    fused_ops_triton.rotary_(qkv, cos, sin, num_rotated_heads, shape.head_dim)
    rotated = buffer[:, :num_rotated_heads * shape.head_dim]
    assert torch.equal(rotated.reshape(want.shape), want)
    untouched = num_rotated_heads * shape.head_dim
    assert torch.equal(buffer[:, untouched:], before[:, untouched:])


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SHAPES
def test_rotary_is_bit_identical_to_apply_rotary(shape: Shape, dtype: torch.dtype,
                                                 num_tokens: int) -> None:
    _check_rotary(shape, shape.num_heads + shape.num_kv_heads, dtype, num_tokens)


@pytest.mark.parametrize(("shape", "num_rotated_heads", "tile_size"),
                         [(ODD, 5, 32), (LLAMA_8B, 40, fused_ops_triton.ROTARY_TILE_SIZE)],
                         ids=["odd_in_programs_of_2_heads", "llama_8b_in_programs_of_16_heads"])
def test_rotary_over_several_programs_a_row(shape: Shape, num_rotated_heads: int, tile_size: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The last program of a row holds fewer heads than it has room for: the rest is masked."""
    monkeypatch.setattr(fused_ops_triton, "ROTARY_TILE_SIZE", tile_size)
    block_heads, _ = fused_ops_triton.rotary_launch_config(num_rotated_heads, shape.head_dim)
    assert num_rotated_heads % block_heads != 0 and num_rotated_heads > 2 * block_heads
    _check_rotary(shape, num_rotated_heads, torch.bfloat16, 2)


@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SHAPES
def test_silu_and_mul_matches_the_reference(shape: Shape, dtype: torch.dtype,
                                            num_tokens: int) -> None:
    gate_up = randn(num_tokens, 2 * shape.intermediate_size, scale=4.0, dtype=dtype, seed=6)
    assert_close_in_ulps(fused_ops_triton.silu_and_mul(gate_up), reference_silu_and_mul(gate_up))


def test_rows_with_a_stride_and_rows_alone() -> None:
    """Inputs may be views with a row stride; a row's result does not depend on the rows around
    it."""
    hidden, width = ODD.hidden_size, ODD.intermediate_size
    buffer = randn(6, 2 * hidden + 3, dtype=torch.float32, seed=7)
    x, delta = buffer[:, :hidden], buffer[:, hidden + 3:]  # [6, H] each, row stride 2H + 3
    weight = randn(hidden, dtype=torch.float32, seed=8)
    normed = fused_ops_triton.rms_norm(x, weight, EPS)
    assert_close_in_ulps(normed, reference_norm(x, weight))
    assert torch.equal(fused_ops_triton.rms_norm(x[2:3], weight, EPS), normed[2:3])
    total, normed = fused_ops_triton.add_rms_norm(x, delta, weight, EPS)
    assert torch.equal(total, x + delta)
    assert_close_in_ulps(normed, reference_norm(x + delta, weight))
    gate_up = randn(6, 2 * width + 5, dtype=torch.float32, seed=9)[:, :2 * width]
    out = fused_ops_triton.silu_and_mul(gate_up)
    assert_close_in_ulps(out, reference_silu_and_mul(gate_up))
    assert torch.equal(fused_ops_triton.silu_and_mul(gate_up[4:5]), out[4:5])


def test_an_empty_batch_launches_nothing() -> None:
    x = torch.empty(0, 64)
    assert fused_ops_triton.rms_norm(x, torch.ones(64), EPS).shape == (0, 64)
    total, normed = fused_ops_triton.add_rms_norm(x, x, torch.ones(64), EPS)
    assert total.shape == normed.shape == (0, 64)
    fused_ops_triton.rotary_(x, torch.empty(0, 8), torch.empty(0, 8), 4, 16)
    assert fused_ops_triton.silu_and_mul(x).shape == (0, 32)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        fused_ops_triton.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="contiguous rows"):
        fused_ops_triton.silu_and_mul(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="weight"):
        fused_ops_triton.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.float16), EPS)
    with pytest.raises(ValueError, match="delta"):
        fused_ops_triton.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="shapes do not match"):
        fused_ops_triton.rotary_(torch.randn(2, 64), torch.ones(2, 5), torch.ones(2, 5), 2, 32)
    with pytest.raises(ValueError, match="shapes do not match"):  # cos in another dtype
        fused_ops_triton.rotary_(torch.randn(2, 64), torch.ones(2, 16, dtype=torch.float16),
                                 torch.ones(2, 16, dtype=torch.float16), 2, 32)
    with pytest.raises(ValueError, match="even width"):
        fused_ops_triton.silu_and_mul(torch.randn(2, 7))


# ---- compile for a real GPU, without one ---------------------------------------------------------

COMPILE_SCRIPT = r"""
import json, re, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import fused_ops_triton as ft

def variants(hidden, heads, kv_heads, head_dim, intermediate):
    qkv_width, rotated = (heads + 2 * kv_heads) * head_dim, heads + kv_heads
    norm_block, norm_warps = ft.norm_launch_config(hidden)
    block_heads, block_half = ft.rotary_launch_config(rotated, head_dim)
    # kernel, its integer arguments' values (for the divisibility hints), constexprs, num_warps
    return {
        "rms_norm": (ft._rms_norm_kernel, {"x_row_stride": hidden, "n_cols": hidden},
                     {"BLOCK_SIZE": norm_block}, norm_warps),
        "add_rms_norm": (ft._add_rms_norm_kernel,
                         {"x_row_stride": hidden, "delta_row_stride": hidden, "n_cols": hidden},
                         {"BLOCK_SIZE": norm_block}, norm_warps),
        "rotary": (ft._rotary_kernel,
                   {"qkv_row_stride": qkv_width, "cos_row_stride": head_dim // 2,
                    "sin_row_stride": head_dim // 2, "num_rotated_heads": rotated,
                    "head_dim": head_dim},
                   {"BLOCK_HEADS": block_heads, "BLOCK_HALF": block_half},
                   ft.ELEMENTWISE_NUM_WARPS),
        "silu_and_mul": (ft._silu_and_mul_kernel,
                         {"gate_up_row_stride": 2 * intermediate, "width": intermediate},
                         {"BLOCK_SIZE": ft.silu_block_size(intermediate)},
                         ft.ELEMENTWISE_NUM_WARPS),
    }

def compile_one(kernel, ints, constexprs, num_warps, dtype):
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name], attrs[(i,)] = "*" + dtype, [["tt.divisibility", 16]]
        elif name == "eps":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "enable_fp_fusion": False})

cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
scratch = Path(tempfile.mkdtemp())
jobs = [(size, dtype) for dtype in ("fp32", "fp16", "bf16") for size in ["llama_8b"]]
jobs.append(("smollm2", "bf16"))
sizes = {"llama_8b": (4096, 32, 8, 128, 14336), "smollm2": (576, 9, 3, 64, 1536)}
result = {}
for size, dtype in jobs:
    for name, (kernel, ints, constexprs, num_warps) in variants(*sizes[size]).items():
        compiled = compile_one(kernel, ints, constexprs, num_warps, dtype)
        ptx = compiled.asm["ptx"]
        usage = ""
        if cuobjdump.exists():  # registers and local (spill) memory per thread, from the cubin
            cubin = scratch / f"{name}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True,
                                   text=True).stdout
        registers, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
        result[f"{name}-{size}-{dtype}"] = {
            "ptx": ".entry" in ptx, "fma": bool(re.search(r"\bfma\.", ptx)),
            "ops": sorted(set(re.findall(r"\b(?:cvt|div|sqrt|mul|add|sub)\.[\w.]+", ptx))),
            "shared": compiled.metadata.shared, "num_warps": compiled.metadata.num_warps,
            "expected_num_warps": num_warps,
            "registers": int(registers.group(1)) if registers else None,
            "local_bytes": int(local.group(1)) if local else None,
        }
print(json.dumps(result))
"""

KERNELS = ["rms_norm", "add_rms_norm", "rotary", "silu_and_mul"]
VARIANTS = [f"{kernel}-llama_8b-{dtype}" for kernel in KERNELS
            for dtype in ("fp32", "fp16", "bf16")]
VARIANTS += [f"{kernel}-smollm2-bf16" for kernel in KERNELS]
H100_SHARED_MEMORY_BYTES = 232448  # per block, opted in
REGISTERS_PER_SM = 65536


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """Every kernel compiled for sm_90 (tests/helpers/sm90_compile.py)."""
    return run_compile_script(COMPILE_SCRIPT, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_for_sm90_within_h100_limits(compiled: dict[str, dict], variant: str) -> None:
    result = compiled[variant]
    assert result["ptx"]
    assert not result["fma"]  # rotary's products round on their own, as torch's do
    assert result["shared"] <= H100_SHARED_MEMORY_BYTES
    assert result["num_warps"] == result["expected_num_warps"]
    if result["registers"] is None:
        pytest.skip("no cuobjdump beside triton's ptxas to read register use from the cubin")
    # a block of num_warps * 32 threads fits the register file, and nothing spills to local memory
    assert result["registers"] * result["num_warps"] * 32 <= REGISTERS_PER_SM
    assert result["local_bytes"] == 0


@pytest.mark.slow
def test_norms_divide_and_take_square_roots_as_ieee(compiled: dict[str, dict]) -> None:
    """The GPU's default `/` and sqrt are approximate; the norms ask for round-to-nearest ones."""
    for kernel in ("rms_norm", "add_rms_norm"):
        assert {"div.rn.f32", "sqrt.rn.f32"} <= set(compiled[f"{kernel}-llama_8b-fp32"]["ops"])


@pytest.mark.slow
def test_bfloat16_rounds_to_nearest_on_the_gpu(compiled: dict[str, dict]) -> None:
    """What the bfloat16_rounds_to_nearest fixture gives the interpreter: every op that makes a
    bfloat16 rounds to nearest (cvt.rn, or mul.rn / sub.rn, which LLVM folds a float32 op and its
    rounding into: exact, as float32 holds over twice bfloat16's precision)."""
    for kernel in KERNELS:
        ops = compiled[f"{kernel}-llama_8b-bf16"]["ops"]
        rounding = [op for op in ops if ".bf16" in op and not op.startswith("cvt.f32.bf16")]
        assert rounding and all(".rn." in op for op in rounding), ops


# ---- the benchmark script ------------------------------------------------------------------------

@pytest.mark.slow
def test_benchmark_smoke_run_covers_every_op() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_fused_ops", "--smoke"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "MEANINGLESS" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()]
    for op in ("rms_norm", "add_rms_norm", "rotary_", "silu_and_mul"):
        assert any(row and row[0] == op for row in rows), proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_benchmark_without_cuda_or_interpreter_exits_with_2() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_fused_ops"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "no CUDA device" in proc.stderr
