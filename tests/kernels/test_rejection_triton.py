"""The Triton rejection sampler on the CPU: exact agreement with the reference under TRITON_INTERPRET=1,
one small statistical run, and a compile for a real GPU target (the interpreter accepts code that the
compiler rejects, such as `break`)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_matches_reference_with_float64_uniforms_and_padding() -> None:
    args = random_inputs(MIXED_K, 100, has_draft_probs=True, greedy_fraction=0.0, seed=7)
    args = dict(args, uniform_samples=args["uniform_samples"].double(), max_spec_len=7)
    assert torch.equal(rejection_triton.rejection_sample(**args), reference(**args))


def test_matches_reference_over_several_vocab_blocks() -> None:
    args = random_inputs([2, 3, 0, 1], 5000, has_draft_probs=True, greedy_fraction=0.5, seed=3)
    assert torch.equal(rejection_triton.rejection_sample(**args), reference(**args))


def test_ties_across_blocks_go_to_the_lowest_token_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rejection_triton, "MAX_BLOCK_SIZE", 16)
    vocab_size = 100
    args = random_inputs([1, 1], vocab_size, has_draft_probs=False, greedy_fraction=0.0, seed=0)
    target_probs = torch.zeros(4, vocab_size)
    target_probs[:, [5, 37, 38, 90]] = 0.25  # equal maxima in blocks 0, 2 and 5
    args.update(target_probs=target_probs, is_greedy=torch.tensor([True, False]),
                draft_token_ids=torch.tensor([37, 5]), uniform_samples=torch.tensor([0.0, 0.5]),
                recovery_noise=torch.ones(2, vocab_size))
    # greedy: 37 is a maximum but not the argmax (5), so it is rejected and 5 recovered;
    # random: 5 is rejected (u = 0.5 >= 0.25), then 37 is the lowest of the remaining ties
    expected = torch.tensor([[5, -1], [37, -1]])
    assert torch.equal(reference(**args), expected)
    assert torch.equal(rejection_triton.rejection_sample(**args), expected)


@pytest.mark.parametrize("num_drafts", [[0, 0, 0], []], ids=["all_k_0", "empty_batch"])
def test_no_drafts(num_drafts: list[int]) -> None:
    args = random_inputs(num_drafts, 10, has_draft_probs=True, greedy_fraction=0.5, seed=0)
    out = rejection_triton.rejection_sample(**args)
    assert torch.equal(out, reference(**args))
    assert torch.equal(out[:, 0], args["bonus_token_ids"])


def test_first_token_follows_target_distribution() -> None:
    """Rows of k = 2 drafts drawn from q; the first emitted token must follow p (chi-square)."""
    gen = torch.Generator().manual_seed(0)
    num_rows, k, vocab_size = 2000, 2, 6
    p = (torch.randn(vocab_size, generator=gen) * 1.5).softmax(-1)
    q = (torch.randn(vocab_size, generator=gen) * 1.5).softmax(-1)
    noise = torch.empty(num_rows * k, vocab_size).exponential_(generator=gen)
    args = {
        "draft_token_ids": torch.multinomial(q, num_rows * k, replacement=True, generator=gen),
        "cu_num_draft_tokens": torch.arange(1, num_rows + 1) * k,
        "draft_probs": q.expand(num_rows * k, -1).contiguous(),
        "target_probs": p.expand(num_rows * (k + 1), -1).contiguous(),
        "bonus_token_ids": torch.multinomial(p, num_rows, replacement=True, generator=gen),
        "is_greedy": torch.zeros(num_rows, dtype=torch.bool),
        "uniform_samples": torch.rand(num_rows * k, generator=gen),
        "recovery_noise": noise.clamp_min_(torch.finfo(torch.float32).tiny),
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
    types = {"is_greedy_ptr": "*i1", "uniform_samples_ptr": uniform_type}
    for name in kernel.arg_names:
        if name.endswith("_ids_ptr") or name.startswith("cu_"):
            types[name] = "*i64"
        elif name.endswith("_probs_ptr") or name == "recovery_noise_ptr":
            types[name] = "*fp32"
    return {name: "constexpr" if name in constexprs else types.get(name, "i32")
            for name in kernel.arg_names}

variants = {
    "recovered_q": (rt._recovered_token_kernel, {"HAS_DRAFT_PROBS": True, "BLOCK_SIZE": 2048}, ""),
    "recovered_one_hot": (rt._recovered_token_kernel, {"HAS_DRAFT_PROBS": False, "BLOCK_SIZE": 1024},
                          ""),
    "accept_q_fp32": (rt._accept_kernel, {"HAS_DRAFT_PROBS": True, "BLOCK_K": 8}, "*fp32"),
    "accept_one_hot_fp64": (rt._accept_kernel, {"HAS_DRAFT_PROBS": False, "BLOCK_K": 4}, "*fp64"),
}
result = {}
for name, (kernel, constexprs, uniform_type) in variants.items():
    src = ASTSource(fn=kernel, signature=signature(kernel, constexprs, uniform_type),
                    constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"enable_fp_fusion": False})
    ptx = compiled.asm.get("ptx", "")
    result[name] = {"ptx": ".entry" in ptx, "divisions": sorted(set(re.findall(r"div\.\w+\.f32", ptx)))}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Compile every kernel variant in a fresh process: the interpreter flag must be off there."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton_cache")),
               TRITON_DEFAULT_FP_FUSION="0")
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", ["recovered_q", "recovered_one_hot", "accept_q_fp32",
                                     "accept_one_hot_fp64"])
def test_compiles_to_ptx_for_sm90(compiled: dict[str, dict], variant: str) -> None:
    assert compiled[variant]["ptx"]


def test_recovered_score_uses_ieee_division(compiled: dict[str, dict]) -> None:
    """div.rn (not the approximate div.full) keeps the GPU bit-identical to torch's r / noise."""
    assert compiled["recovered_q"]["divisions"] == ["div.rn.f32"]
