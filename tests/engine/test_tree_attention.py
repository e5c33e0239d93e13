"""One pass of the target verifies a tree of drafts: every tree row's hidden state is the one a
causal chain pass of its root-to-row path gives, on each attention path (the C++ kernel, the torch
reference, Triton under the interpreter), in a batch whose prefill chunk and chain verification the
tree leaves bit for bit alone; `keep_rows` then keeps an accepted side branch as if it had run as a
chain."""

from __future__ import annotations

import pytest
import torch

import engine.models.attention as attention
from engine.kv.block_manager import BlockManager
from engine.models.arch import DecoderArch
from engine.models.build import allocate_kv_cache, build_model
from engine.models.loader import load_checkpoint
from engine.runner.paged_runner import PagedRunner
from engine.step.types import SequenceRows
from kernels.paged_attention_cpu import paged_attention_cpu_available

CPU = torch.device("cpu")
BLOCK_SIZE, NUM_BLOCKS = 4, 96
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}

# the newest token (row 0) and 10 drafts under it, depths up to 4:
#
#   row 0 ─┬─ 1 ─┬─ 2 ── 3 ── 4
#          │     └─ 8 ── 9
#          ├─ 5 ── 6 ── 7
#          └─ 10
PARENTS = [-1, 0, 1, 2, 3, 0, 5, 6, 1, 8, 0]
TREE_TOKENS = [7, 31, 4, 58, 90, 12, 66, 23, 45, 3, 81]
CONTEXT = [5, 17, 29, 41, 53, 65, 77, 89, 11, 23, 35, 47, 59]  # the tree starts at position 13
OTHER_PROMPT = list(range(10, 30))  # prefilled in two chunks: 0..7, then 8..19 beside the tree
CHAIN_CONTEXT, CHAIN_ROWS = [2, 4, 6, 8, 10, 12, 14, 16, 18], [20, 22, 24, 26]

BACKENDS = [
    pytest.param("kernel", marks=pytest.mark.skipif(
        not paged_attention_cpu_available(), reason="no C++ compiler, or SPECSERVE_CPU_KERNELS=0")),
    "torch",
    "triton",
]


def path_to(row: int) -> list[int]:
    """The rows from the root to `row`, root first."""
    path = []
    while row >= 0:
        path.append(row)
        row = PARENTS[row]
    return path[::-1]


LEAVES = [row for row in range(len(PARENTS)) if row not in PARENTS]


@pytest.fixture(scope="module")
def model(tiny_llama):
    checkpoint = load_checkpoint(tiny_llama, torch.float32)
    built, _ = build_model(checkpoint, torch.float32, CPU)
    return built, DecoderArch.from_hf_config(checkpoint.hf_config)


@pytest.fixture(params=BACKENDS)
def make_runner(request, model, monkeypatch):
    """Fresh runners reading the cache through one attention path."""
    backend = request.param
    if backend == "torch":  # as a machine without the kernel: the padded mask, eagerly
        monkeypatch.setattr(attention, "paged_attention_cpu_available", lambda: False)
    module, arch = model

    def make(sliding_window: int | None = None) -> PagedRunner:
        kv_caches = allocate_kv_cache(arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
        return PagedRunner(module, kv_caches, BlockManager(NUM_BLOCKS, BLOCK_SIZE), sliding_window,
                           CPU, "triton" if backend == "triton" else "auto")

    make.backend = backend
    return make


@torch.inference_mode()
def run_pass(runner: PagedRunner, sequences: list[SequenceRows]) -> list[torch.Tensor]:
    """Each sequence's hidden states, [rows, hidden], after one pass over all of them."""
    for rows in sequences:
        assert runner.reserve(rows.seq_id, rows.start + len(rows.token_ids))
    hidden = runner.run(runner.prepare(sequences))
    return list(hidden.split([len(rows.token_ids) for rows in sequences]))


def chain_hidden(runner: PagedRunner, seq_id: str, tokens: list[int]) -> torch.Tensor:
    """A causal chain pass of `tokens` after CONTEXT, on a sequence already holding CONTEXT."""
    return run_pass(runner, [SequenceRows(seq_id, len(CONTEXT), tokens)])[0]


def tree_batch(parents: list[int] | None) -> list[SequenceRows]:
    """A prefill chunk, the tree (or its rows as a chain) and a chain verification, in one pass."""
    return [SequenceRows("prefill", 8, OTHER_PROMPT[8:]),
            SequenceRows("tree", len(CONTEXT), TREE_TOKENS, parents),
            SequenceRows("chain", len(CHAIN_CONTEXT), CHAIN_ROWS)]


def prefill_all(runner: PagedRunner, path_ids: list[str]) -> None:
    run_pass(runner, [SequenceRows("prefill", 0, OTHER_PROMPT[:8]),
                      SequenceRows("tree", 0, CONTEXT),
                      SequenceRows("chain", 0, CHAIN_CONTEXT)])
    # the reference chains get the same context, each prefilled alone as "tree" was not: the
    # comparison below is to float32 rounding, not bits
    for seq_id in path_ids:
        run_pass(runner, [SequenceRows(seq_id, 0, CONTEXT)])


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_each_tree_row_equals_a_chain_pass_of_its_path(make_runner, sliding_window):
    runner = make_runner(sliding_window)
    prefill_all(runner, [f"path{leaf}" for leaf in LEAVES])
    chunk, tree, chain = run_pass(runner, tree_batch(PARENTS))
    # the same pass with the tree's rows as a chain: the other sequences must not notice the tree
    chunk_alone, _, chain_alone = run_pass(runner, tree_batch(None))
    assert torch.equal(chunk, chunk_alone) and torch.equal(chain, chain_alone)

    seen = set()
    for leaf in LEAVES:
        path = path_to(leaf)
        expected = chain_hidden(runner, f"path{leaf}", [TREE_TOKENS[row] for row in path])
        torch.testing.assert_close(tree[path], expected, **TOLERANCE)
        seen.update(path)
    assert seen == set(range(len(PARENTS)))


def test_keep_rows_keeps_a_side_branch_as_if_it_ran_as_a_chain(make_runner):
    runner = make_runner()
    prefill_all(runner, ["reference"])
    run_pass(runner, tree_batch(PARENTS))
    kept = path_to(7)  # rows 0, 5, 6, 7: the root's second branch
    runner.keep_rows("tree", len(CONTEXT), kept)
    next_token = 42
    decoded = run_pass(runner, [SequenceRows("tree", len(CONTEXT) + len(kept), [next_token])])[0]
    expected = chain_hidden(runner, "reference", [TREE_TOKENS[row] for row in kept] + [next_token])
    torch.testing.assert_close(decoded[0], expected[-1], **TOLERANCE)


def test_a_chain_given_as_parents_is_bit_for_bit_no_parents(make_runner):
    runner = make_runner()
    prefill_all(runner, [])
    chain = list(range(-1, len(TREE_TOKENS) - 1))
    assert all(torch.equal(a, b) for a, b in zip(run_pass(runner, tree_batch(chain)),
                                                 run_pass(runner, tree_batch(None))))


def test_keeping_the_first_branch_copies_nothing(make_runner):
    runner = make_runner()
    prefill_all(runner, [])
    run_pass(runner, tree_batch(PARENTS))
    versions = [kv._version for kv in runner.kv_caches]  # counts in-place writes
    runner.keep_rows("tree", len(CONTEXT), path_to(4))  # rows 0 1 2 3 4: already in place
    assert [kv._version for kv in runner.kv_caches] == versions


@pytest.mark.parametrize("parents, rows, match", [
    ([-1, 0, 0] + list(range(2, 64)), None, "at most 64 rows"),  # 66 rows, not a chain
    (None, [0, 2, 1], "must increase"),
    (None, [0, 0], "must increase"),
    (None, [0, 1, 90], "no slot"),
])
def test_refusals(model, parents, rows, match):
    module, arch = model
    runner = PagedRunner(module, allocate_kv_cache(arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32,
                                                   CPU), BlockManager(NUM_BLOCKS, BLOCK_SIZE),
                         None, CPU)
    assert runner.reserve("s", 80)
    with pytest.raises(ValueError, match=match):
        if rows is None:
            runner.prepare([SequenceRows("s", 0, [1] * len(parents), parents)])
        else:
            runner.keep_rows("s", 0, rows)
