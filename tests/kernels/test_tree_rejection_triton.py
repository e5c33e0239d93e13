"""The Triton tree rejection sampler on the CPU: exact agreement with the torch reference under
TRITON_INTERPRET=1 (same uniforms, token for token and path for path), and a compile for a real GPU
target (the interpreter accepts code that the compiler rejects)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest
import torch
from sm90_compile import run_compile_script

from kernels.tree_rejection import random_tree_inputs
from kernels.tree_rejection import tree_rejection_sample_reference as reference

# NOTE: triton reads this when kernels are decorated, so it is set before the kernel module loads
os.environ["TRITON_INTERPRET"] = "1"
interpreter = pytest.importorskip("triton.runtime.interpreter")
from kernels import tree_rejection_triton  # noqa: E402

if not isinstance(tree_rejection_triton._tree_kernel, interpreter.InterpretedFunction):
    # imported earlier in this process without the interpreter: decorate the kernel again
    tree_rejection_triton = importlib.reload(tree_rejection_triton)

ROOT = Path(__file__).resolve().parents[2]
MIXED = [3, 0, 7, 1, 5, 10, 0, 4]


def assert_matches_reference(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    expected = reference(**args)
    got = tree_rejection_triton.tree_rejection_sample(**args)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    return expected


@pytest.mark.parametrize("vocab_size", [16, 300])
@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_matches_reference(has_draft_probs: bool, vocab_size: int) -> None:
    num_emitted = []
    for seed in range(3):
        args = random_tree_inputs(MIXED, vocab_size, has_draft_probs=has_draft_probs,
                                  greedy_fraction=0.4, seed=seed)
        output_token_ids, _ = assert_matches_reference(args)
        num_emitted += (output_token_ids >= 0).sum(1).tolist()
    assert 1 in num_emitted and max(num_emitted) > 2


def test_matches_reference_with_float32_uniforms_and_padding() -> None:
    args = random_tree_inputs(MIXED, 100, has_draft_probs=True, greedy_fraction=0.0, seed=7)
    assert_matches_reference(dict(args, acceptance_uniforms=args["acceptance_uniforms"].double(),
                                  sample_uniforms=args["sample_uniforms"].float(), max_spec_len=12))


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_matches_reference_over_several_vocab_tiles(has_draft_probs: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Residual passes and draws across 16-wide tiles, with draws landing in most of them."""
    monkeypatch.setattr(tree_rejection_triton, "MAX_BLOCK_SIZE", 16)
    args = random_tree_inputs([4, 6, 0, 2] * 3, 100, has_draft_probs=has_draft_probs,
                              greedy_fraction=0.25, seed=3)
    flat = (torch.randn(args["target_probs"].shape, generator=torch.Generator().manual_seed(0))
            * 0.1).softmax(-1)  # nearly uniform p: many rejections, draws spread over all tiles
    output_token_ids, _ = assert_matches_reference(
        dict(args, target_probs=flat, target_argmax=flat.argmax(-1)))
    assert len({t // 16 for t in output_token_ids[output_token_ids >= 0].tolist()}) >= 5


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_matches_reference_at_a_serving_vocab(has_draft_probs: bool) -> None:
    args = random_tree_inputs([3, 6, 0, 2], 50_000, has_draft_probs=has_draft_probs,
                              greedy_fraction=0.25, seed=1)
    assert_matches_reference(args)


@pytest.mark.parametrize("has_draft_probs", [True, False], ids=["q", "one_hot"])
def test_rows_without_mass_emit_target_argmax(has_draft_probs: bool) -> None:
    """Rows of p that the sampler zeroed (logits that left no probability): no draft is kept from
    them and the token is target_argmax there, never token 0, in both implementations."""
    args = random_tree_inputs(MIXED, 40, has_draft_probs=has_draft_probs, greedy_fraction=0.0,
                              seed=5)
    num_rows = len(args["target_argmax"])
    cu = args["cu_num_draft_tokens"]
    num_drafts = torch.diff(cu, prepend=cu.new_zeros(1))
    root_row = (cu - num_drafts + torch.arange(len(cu))).repeat_interleave(num_drafts)
    tested_at = root_row + args["draft_parents"] + 1  # [num_draft_tokens] the parent's row
    drafts = args["target_argmax"][tested_at]  # p's likeliest tokens: often kept where p has mass
    empty = torch.arange(num_rows) % 3 == 1  # [num_rows] a third of the rows, roots included
    peaked = args["target_probs"] ** 4  # same argmax, kept more often
    probs = (peaked / peaked.sum(dim=-1, keepdim=True)).masked_fill(empty[:, None], 0.0)
    argmax = torch.where(empty, 1 + torch.arange(num_rows) % 39, args["target_argmax"])
    args = dict(args, draft_token_ids=drafts, target_probs=probs, target_argmax=argmax)
    output, accepted = assert_matches_reference(args)
    cu = args["cu_num_draft_tokens"].tolist()
    for request, (start, end) in enumerate(zip([0] + cu, cu)):
        if args["is_greedy"][request]:
            continue
        kept = [d for d in accepted[request].tolist() if d >= 0]
        row = start + request + (kept[-1] + 1 if kept else 0)  # the row that emitted the token
        # the rows each kept draft was tested at: the root's, then the previous kept draft's
        parent_rows = [start + request + (d + 1 if d >= 0 else 0) for d in [-1] + kept[:-1]]
        parent_rows = parent_rows[:len(kept)]
        assert not any(empty[r] for r in parent_rows), "a draft was kept from a row without mass"
        if empty[row]:
            assert output[request, len(kept)] == argmax[row] != 0
    assert int((accepted >= 0).sum()) >= 3  # drafts were kept


def test_all_greedy_needs_no_probabilities() -> None:
    args = random_tree_inputs(MIXED, 50, has_draft_probs=False, greedy_fraction=1.0, seed=1)
    output_token_ids, _ = assert_matches_reference(
        dict(args, target_probs=None, acceptance_uniforms=None, sample_uniforms=None))
    assert (output_token_ids >= 0).sum() > len(MIXED)  # some drafts were accepted


@pytest.mark.parametrize("num_drafts", [[0, 0, 0], []], ids=["no_drafts", "empty_batch"])
def test_no_drafts(num_drafts: list[int]) -> None:
    args = random_tree_inputs(num_drafts, 10, has_draft_probs=True, greedy_fraction=0.5, seed=0)
    output_token_ids, accepted_drafts = assert_matches_reference(args)
    assert output_token_ids.shape == (len(num_drafts), 1)
    assert accepted_drafts.shape == (len(num_drafts), 0)


def _siblings(p: list[list[float]], q: list[list[float]] | None, tokens: list[int],
              acceptance: list[float], sample: float) -> dict:
    """One request whose drafts are all children of the root: p's rows, their q (or one-hot)."""
    target_probs = torch.tensor(p)
    return {
        "draft_token_ids": torch.tensor(tokens),
        "draft_parents": torch.full((len(tokens),), -1),
        "cu_num_draft_tokens": torch.tensor([len(tokens)]),
        "draft_probs": None if q is None else torch.tensor(q),
        "target_probs": target_probs,
        "target_argmax": torch.full((len(p),), len(p[0]) - 1),
        "is_greedy": torch.tensor([False]),
        "acceptance_uniforms": torch.tensor(acceptance, dtype=torch.float64),
        "sample_uniforms": torch.full((len(p),), sample, dtype=torch.float64),
        "max_spec_len": len(tokens),
    }


EDGES = {
    # the second rejection leaves no mass: the first one's residual stays
    "empty_second_residual": _siblings([[0.5, 0.5, 0.0, 0.0]] * 3, [[0.0, 0.0, 1.0, 0.0],
                                       [0.5, 0.6, 0.0, 0.0]], [2, 1], [0.5, 0.99], 0.25),
    # a residual below the fixed-point resolution: none (the draw is from p)
    "residual_below_resolution": _siblings([[0.5, 0.5, 1e-13, 2e-13], [0.25] * 4],
                                           [[0.5, 0.5, 3e-13, 0.0]], [2], [0.9], 0.1),
    # one-hot siblings repeating a token: the second is rejected against the zeroed residual
    "one_hot_repeated": _siblings([[0.6, 0.3, 0.1]] * 4, None, [0, 0, 1], [0.7, 0.0, 0.9], 0.5),
    # q(x) = 0 accepts whenever p(x) > 0
    "q_of_draft_zero": _siblings([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], [[1.0, 0.0, 0.0]], [1],
                                 [0.5], 0.9),
    # no mass in p: target_argmax
    "p_without_mass": _siblings([[0.0] * 3, [0.0] * 3], [[1.0, 0.0, 0.0]], [0], [0.5], 0.5),
    # the CDF's edges, zeros around the mass: u = 0, just below 1, and 1 (out of contract)
    "u_zero": _siblings([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0]] * 2, None, [5], [0.5], 0.0),
    "u_below_one": _siblings([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0]] * 2, None, [5], [0.5], 1 - 2**-53),
    "u_one": _siblings([[0.0, 0.2, 0.0, 0.5, 0.3, 0.0]] * 2, None, [5], [0.5], 1.0),
}


@pytest.mark.parametrize("case", EDGES)
def test_matches_reference_at_the_edges(case: str) -> None:
    output_token_ids, _ = assert_matches_reference(EDGES[case])
    if case.startswith("u_"):  # the first token with mass, else the last
        assert output_token_ids[0, 0] == (1 if case == "u_zero" else 4)


# ---- compile for a real GPU, without one ---------------------------------------------------------

COMPILE_SCRIPT = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.tree_rejection_triton import _tree_kernel as kernel

def signature(constexprs, uniform_type):
    types = {"is_greedy_ptr": "*i1", "acceptance_uniforms_ptr": uniform_type,
             "sample_uniforms_ptr": uniform_type, "scratch_ptr": "*fp32"}
    for name in kernel.arg_names:
        if name.endswith(("_ids_ptr", "_parents_ptr", "_drafts_ptr", "_argmax_ptr")) \
                or name.startswith("cu_"):
            types[name] = "*i64"
        elif name.endswith("_probs_ptr"):
            types[name] = "*fp32"
    return {name: "constexpr" if name in constexprs else types.get(name, "i32")
            for name in kernel.arg_names}

variants = {
    "q_fp64": ({"HAS_DRAFT_PROBS": True, "HAS_TARGET_PROBS": True, "BLOCK_SIZE": 2048}, "*fp64"),
    "one_hot_fp32": ({"HAS_DRAFT_PROBS": False, "HAS_TARGET_PROBS": True, "BLOCK_SIZE": 1024},
                     "*fp32"),
    "all_greedy": ({"HAS_DRAFT_PROBS": False, "HAS_TARGET_PROBS": False, "BLOCK_SIZE": 1},
                   "*fp32"),
}
result = {}
for name, (constexprs, uniform_type) in variants.items():
    src = ASTSource(fn=kernel, signature=signature(constexprs, uniform_type), constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"enable_fp_fusion": False})
    ptx = compiled.asm.get("ptx", "")
    result[name] = {"ptx": ".entry" in ptx, "fma": bool(re.search(r"\bfma\.", ptx)),
                    "ftz": ".ftz" in ptx, "barriers": ptx.count("bar.sync")}
print(json.dumps(result))
"""


@pytest.mark.slow
def test_compiles_to_ptx_for_sm90_without_fused_multiply_adds() -> None:
    """In a fresh process, where the interpreter flag is off; the residual's writes are followed by
    a barrier (the q and one-hot variants), and no float op flushes subnormals or fuses."""
    compiled = run_compile_script(COMPILE_SCRIPT, timeout=300)
    for name, facts in compiled.items():
        assert facts["ptx"] and not facts["fma"] and not facts["ftz"], name
    assert compiled["q_fp64"]["barriers"] > 0 and compiled["one_hot_fp32"]["barriers"] > 0
