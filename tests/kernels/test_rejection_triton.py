"""The Triton rejection sampler on the CPU: exact agreement with the reference under TRITON_INTERPRET=1,
one small statistical run, and a compile for a real GPU target (the interpreter accepts code that the
compiler rejects, such as `break`)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
from sm90_compile import run_compile_script

from kernels.bench_rejection import random_inputs
from kernels.rejection_reference import rejection_sample as reference

# NOTE: triton reads this when kernels are decorated, so it is set before kernels.rejection_triton loads
os.environ["TRITON_INTERPRET"] = "1"
interpreter = pytest.importorskip("triton.runtime.interpreter")
from kernels import rejection_triton  # noqa: E402

if not isinstance(rejection_triton._accept_kernel, interpreter.InterpretedFunction):
    # imported earlier in this process without the interpreter: decorate the kernels again
    rejection_triton = importlib.reload(rejection_triton)

ROOT = Path(__file__).resolve().parents[2]
MIXED_K = [3, 0, 5, 1, 2, 4, 0, 5]


@pytest.mark.parametrize("vocab_size", [37, 1000])
@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
@pytest.mark.parametrize("seed", range(3))
def test_matches_reference(seed: int, has_draft_probs: bool, vocab_size: int) -> None:
    args = random_inputs(MIXED_K, vocab_size, has_draft_probs=has_draft_probs, greedy_fraction=0.4,
                         seed=seed)
    expected = reference(**args)
    assert torch.equal(rejection_triton.rejection_sample(**args), expected)
    # the inputs exercise acceptance, recovery and the bonus token
    num_emitted = (expected >= 0).sum(1)
    assert 1 in num_emitted.tolist() and (num_emitted > 1).any()


def test_matches_reference_with_float32_uniforms_and_padding() -> None:
    args = random_inputs(MIXED_K, 100, has_draft_probs=True, greedy_fraction=0.0, seed=7)
    args = dict(args, acceptance_uniforms=args["acceptance_uniforms"].double(),
                sample_uniforms=args["sample_uniforms"].float(), max_spec_len=7)
    assert torch.equal(rejection_triton.rejection_sample(**args), reference(**args))


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_matches_reference_over_several_vocab_blocks(has_draft_probs: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Draws land in every block of a 16-wide split, across the carry from block to block."""
    monkeypatch.setattr(rejection_triton, "MAX_BLOCK_SIZE", 16)
    args = random_inputs([2, 3, 0, 1] * 4, 100, has_draft_probs=has_draft_probs,
                         greedy_fraction=0.25, seed=3)
    flat = (torch.randn(args["target_probs"].shape, generator=torch.Generator().manual_seed(0))
            * 0.1).softmax(-1)  # nearly uniform p: the draws spread over all blocks
    args = dict(args, target_probs=flat, target_argmax=flat.argmax(-1))
    expected = reference(**args)
    assert torch.equal(rejection_triton.rejection_sample(**args), expected)
    assert len({t // 16 for t in expected[expected >= 0].tolist()}) >= 5


def test_matches_reference_at_a_serving_vocab() -> None:
    args = random_inputs([2, 3, 0, 1], 5000, has_draft_probs=True, greedy_fraction=0.5, seed=3)
    assert torch.equal(rejection_triton.rejection_sample(**args), reference(**args))


def test_all_greedy_needs_no_probabilities() -> None:
    args = random_inputs(MIXED_K, 50, has_draft_probs=True, greedy_fraction=1.0, seed=1)
    args = dict(args, target_probs=None, acceptance_uniforms=None, sample_uniforms=None)
    expected = reference(**args)
    assert torch.equal(rejection_triton.rejection_sample(**args), expected)
    assert (expected >= 0).sum() > len(MIXED_K)  # some drafts were accepted


@pytest.mark.parametrize("uniform", [0.0, 1 - 2**-53, 1.0])
def test_a_zero_probability_token_is_never_drawn(uniform: float,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Edges of the CDF with zeros around the mass, in blocks of 16: exactly the reference's tokens,
    each with probability > 0 (u = 0 the first such token, u near or at 1 the last)."""
    monkeypatch.setattr(rejection_triton, "MAX_BLOCK_SIZE", 16)
    vocab_size = 64
    target_probs = torch.zeros(4, vocab_size)
    target_probs[:, [3, 17, 40]] = torch.tensor([0.2, 0.5, 0.3])  # zeros before, between, after
    args = {
        "draft_token_ids": torch.tensor([17, 3]),
        "cu_num_draft_tokens": torch.tensor([1, 2]),
        "draft_probs": None,
        "target_probs": target_probs,
        "target_argmax": target_probs.argmax(-1),
        "is_greedy": torch.tensor([False, False]),
        "acceptance_uniforms": torch.tensor([0.9, 0.0]),  # 17 rejected, 3 accepted
        "sample_uniforms": torch.full((4,), uniform, dtype=torch.float64),
        "max_spec_len": 1,
    }
    expected = reference(**args)
    assert torch.equal(rejection_triton.rejection_sample(**args), expected)
    first, last = (3, 40) if uniform == 0.0 else (40, 40)
    assert expected.tolist() == [[first, -1], [3, last if uniform else 3]]


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_an_empty_residual_falls_back_to_p(has_draft_probs: bool) -> None:
    """p <= q everywhere (p == q but for rounding) leaves no residual: the draw then comes from p."""
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]])
    args = {
        "draft_token_ids": torch.tensor([2]),
        "cu_num_draft_tokens": torch.tensor([1]),
        "draft_probs": torch.tensor([[0.0, 0.5, 0.6, 0.0]]) if has_draft_probs else None,
        # one-hot: what p leaves beside x is below the fixed-point resolution (2^-42)
        "target_probs": p if has_draft_probs else torch.tensor([[1e-13, 0.0, 0.5, 0.0], p[1].tolist()]),
        "target_argmax": torch.tensor([0, 0]),  # unread: p has mass
        "is_greedy": torch.tensor([False]),
        "acceptance_uniforms": torch.tensor([0.99]),  # 0.99 * q(x) >= p(x) = 0.5: rejected
        "sample_uniforms": torch.tensor([0.25, 0.5], dtype=torch.float64),
        "max_spec_len": 1,
    }
    expected = reference(**args)
    assert torch.equal(rejection_triton.rejection_sample(**args), expected)
    assert expected.tolist() == [[1 if has_draft_probs else 2, -1]]


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_rows_without_mass_emit_target_argmax(has_draft_probs: bool) -> None:
    """Rows of p that the sampler zeroed (logits that left no probability): no draft is kept from
    them and the token is target_argmax there, never token 0, in both implementations."""
    args = random_inputs(MIXED_K, 40, has_draft_probs=has_draft_probs, greedy_fraction=0.25,
                         seed=5)
    num_rows = len(args["target_argmax"])
    cu = args["cu_num_draft_tokens"]
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))
    tested_at = torch.arange(len(args["draft_token_ids"])) + torch.repeat_interleave(
        torch.arange(len(cu)), num_drafts)  # [num_draft_tokens] the row each draft is tested at
    drafts = args["target_argmax"][tested_at]  # p's likeliest tokens: often kept where p has mass
    empty = torch.arange(num_rows) % 3 == 0  # [num_rows] a third of the rows
    peaked = args["target_probs"] ** 4  # same argmax, kept more often
    probs = (peaked / peaked.sum(dim=-1, keepdim=True)).masked_fill(empty[:, None], 0.0)
    argmax = torch.where(empty, 1 + torch.arange(num_rows) % 39, args["target_argmax"])
    args = dict(args, draft_token_ids=drafts, target_probs=probs, target_argmax=argmax)
    expected = reference(**args)
    assert torch.equal(rejection_triton.rejection_sample(**args), expected)
    cu = args["cu_num_draft_tokens"].tolist()
    for request, (start, end) in enumerate(zip([0] + cu, cu)):
        if args["is_greedy"][request]:
            continue
        num_kept = int((expected[request] >= 0).sum()) - 1
        rows = range(start + request, start + request + num_kept + 1)
        assert not any(empty[r] for r in rows[:-1]), "a draft was kept from a row without mass"
        if empty[rows[-1]]:
            assert expected[request, num_kept] == argmax[rows[-1]] != 0
    random = ~args["is_greedy"]
    assert int((expected[random] >= 0).sum()) >= int(random.sum()) + 3  # drafts were kept


@pytest.mark.parametrize("num_drafts", [[0, 0, 0], []], ids=["all_k_0", "empty_batch"])
def test_no_drafts(num_drafts: list[int]) -> None:
    args = random_inputs(num_drafts, 10, has_draft_probs=True, greedy_fraction=0.5, seed=0)
    out = rejection_triton.rejection_sample(**args)
    assert torch.equal(out, reference(**args))
    assert out.shape == (len(num_drafts), 1)


@pytest.mark.slow
def test_first_token_follows_target_distribution() -> None:
    """Rows of k = 2 drafts drawn from q; the first emitted token must follow p (chi-square)."""
    gen = torch.Generator().manual_seed(0)
    num_rows, k, vocab_size = 2000, 2, 6
    p = (torch.randn(vocab_size, generator=gen) * 1.5).softmax(-1)
    q = (torch.randn(vocab_size, generator=gen) * 1.5).softmax(-1)
    target_probs = p.expand(num_rows * (k + 1), -1).contiguous()
    args = {
        "draft_token_ids": torch.multinomial(q, num_rows * k, replacement=True, generator=gen),
        "cu_num_draft_tokens": torch.arange(1, num_rows + 1) * k,
        "draft_probs": q.expand(num_rows * k, -1).contiguous(),
        "target_probs": target_probs,
        "target_argmax": target_probs.argmax(-1),
        "is_greedy": torch.zeros(num_rows, dtype=torch.bool),
        "acceptance_uniforms": torch.rand(num_rows * k, generator=gen),
        "sample_uniforms": torch.rand(num_rows * (k + 1), generator=gen, dtype=torch.float64),
        "max_spec_len": k,
    }
    out = rejection_triton.rejection_sample(**args)
    assert torch.equal(out, reference(**args))
    counts = torch.bincount(out[:, 0], minlength=vocab_size).double()
    chisquare = pytest.importorskip("scipy.stats").chisquare
    expected = p.double() / p.double().sum() * num_rows
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-4


# ---- compile for a real GPU, without one -------------------------------------------------------------

COMPILE_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import rejection_triton as rt

def signature(kernel, constexprs, uniform_type):
    types = {"is_greedy_ptr": "*i1", "acceptance_uniforms_ptr": uniform_type,
             "sample_uniforms_ptr": uniform_type}
    for name in kernel.arg_names:
        if name.endswith(("_ids_ptr", "_argmax_ptr")) or name.startswith(("cu_", "num_")):
            types[name] = "*i64"
        elif name.endswith("_probs_ptr"):
            types[name] = "*fp32"
    return {name: "constexpr" if name in constexprs else types.get(name, "i32")
            for name in kernel.arg_names}

variants = {
    "final_q": (rt._final_token_kernel, {"HAS_DRAFT_PROBS": True, "BLOCK_SIZE": 2048}, "*fp64"),
    "final_one_hot": (rt._final_token_kernel, {"HAS_DRAFT_PROBS": False, "BLOCK_SIZE": 1024},
                      "*fp32"),
    "accept_q_fp32": (rt._accept_kernel, {"HAS_DRAFT_PROBS": True, "HAS_TARGET_PROBS": True,
                                          "BLOCK_K": 8}, "*fp32"),
    "accept_one_hot_fp64": (rt._accept_kernel, {"HAS_DRAFT_PROBS": False, "HAS_TARGET_PROBS": True,
                                                "BLOCK_K": 4}, "*fp64"),
    "accept_all_greedy": (rt._accept_kernel, {"HAS_DRAFT_PROBS": False, "HAS_TARGET_PROBS": False,
                                              "BLOCK_K": 4}, "*fp64"),
}
result = {}
for name, (kernel, constexprs, uniform_type) in variants.items():
    src = ASTSource(fn=kernel, signature=signature(kernel, constexprs, uniform_type),
                    constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"enable_fp_fusion": False})
    ptx = compiled.asm.get("ptx", "")
    result[name] = {"ptx": ".entry" in ptx, "fma": bool(re.search(r"\bfma\.", ptx)),
                    "conversions": sorted(set(re.findall(r"cvt\.\w+\.\w+\.\w+", ptx)))}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """Every kernel variant compiled for sm_90 (tests/helpers/sm90_compile.py)."""
    return run_compile_script(COMPILE_SCRIPT, timeout=300, TRITON_DEFAULT_FP_FUSION="0")


VARIANTS = ["final_q", "final_one_hot", "accept_q_fp32", "accept_one_hot_fp64", "accept_all_greedy"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiles_to_ptx_for_sm90_without_fused_multiply_adds(compiled: dict[str, dict],
                                                              variant: str) -> None:
    assert compiled[variant]["ptx"]
    assert not compiled[variant]["fma"]


@pytest.mark.slow
def test_the_draw_converts_as_torch_does(compiled: dict[str, dict]) -> None:
    """Probabilities to fixed point and u * total to an integer truncate (rzi), and the total becomes
    a double by round-to-nearest (rn), as torch's .to() does: the GPU finds the reference's token."""
    conversions = set(compiled["final_q"]["conversions"])
    assert {"cvt.rzi.s64.f32", "cvt.rn.f64.s64", "cvt.rzi.s64.f64"} <= conversions
