"""The native CPU pass (engine/models/native_pass.py) gives the torch path's hidden states, logits
(its LM head on the rows that sample), KV cache and EAGLE-3 features bit for bit: prefill chunks, decode, 2-12 verification rows, batched
sequences, trees and a sliding window, on q/k/v and gate/up parts of different formats, with and
without a q/k/v bias, on one thread, two, and more threads than cores."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kv.block_manager import BlockManager
from engine.models.build import allocate_kv_cache, build_model
from engine.models.loader import load_checkpoint
from engine.runner.paged_runner import PagedRunner
from engine.step.types import SequenceRows
from kernels.native_decoder import native_decoder_available
from tests.helpers.native_pass_steps import ALL_PACKED, steps
from tests.helpers.tiny_gguf import VOCAB, write_tiny_gguf

pytestmark = pytest.mark.skipif(not native_decoder_available(),
                                reason="no C++ compiler with AVX2 and F16C for the CPU kernels")

CPU = torch.device("cpu")
NUM_BLOCKS, BLOCK_SIZE = 64, 8
@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("native") / f"{request.param}.gguf"
    write_tiny_gguf(path, request.param, ALL_PACKED)
    module, backend = build_model(load_checkpoint(str(path), torch.float32, packed=True),
                                  torch.float32, CPU)
    assert module.native_pass is not None and "native pass" in backend
    assert module.native_pass.has_head  # the Q4_1 output.weight runs in the pass
    return module


def runner(module, sliding_window):
    return PagedRunner(module, allocate_kv_cache(module.arch, NUM_BLOCKS, BLOCK_SIZE,
                                                 torch.float32, CPU),
                       BlockManager(NUM_BLOCKS, BLOCK_SIZE), sliding_window, CPU)


def sampling_rows(sequences: list[SequenceRows], rng: random.Random) -> torch.Tensor:
    """Rows whose logits a step wants: each sequence's last, or every row, or a few in any order."""
    num_rows = sum(len(rows.token_ids) for rows in sequences)
    choice = rng.randrange(3)
    if choice == 0:
        ends = torch.tensor([len(rows.token_ids) for rows in sequences]).cumsum(0)
        return ends - 1
    if choice == 1:
        return torch.arange(num_rows)
    return torch.tensor([rng.randrange(num_rows) for _ in range(rng.randint(1, 13))])


# 3 threads on a 2-core machine: the OS keeps descheduling one, so stages finish with a thread
# away (its pieces taken by the others) and threads arrive late to stages already done
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("sliding_window", [None, 8])
def test_native_pass_equals_the_torch_path_bit_for_bit(model, threads, sliding_window):
    native_pass = model.native_pass
    native, reference = runner(model, sliding_window), runner(model, sliding_window)
    model.aux_hidden_layers = (1, 0)  # NOTE: out of order: both paths give them in layer order
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    rng = random.Random(threads)
    try:
        for sequences in steps(rng):
            outputs = []
            logits_rows = sampling_rows(sequences, rng)
            for run, pass_ in ((native, native_pass), (reference, None)):
                for rows in sequences:
                    assert run.reserve(rows.seq_id, rows.start + len(rows.token_ids))
                model.native_pass = pass_
                hidden, logits = run.run_with_logits(run.prepare(sequences), logits_rows)
                outputs.append((hidden, model.aux_hidden_states, logits))
            (hidden, aux, logits), (expected, expected_aux, expected_logits) = outputs
            assert hidden.shape == expected.shape
            assert torch.equal(hidden, expected), (hidden - expected).abs().max()
            assert torch.equal(aux, expected_aux)
            assert logits.shape == (len(logits_rows), VOCAB)
            assert torch.equal(logits, expected_logits)
        for ours, theirs in zip(native.kv_caches, reference.kv_caches):
            assert torch.equal(ours, theirs)
    finally:
        model.native_pass = native_pass
        model.aux_hidden_layers = ()
        model.aux_hidden_states = None
        torch.set_num_threads(saved_threads)


def test_a_long_run_with_more_threads_than_cores_keeps_every_bit(model):
    """Many passes with threads taking each other's pieces: every one equals the 1-thread pass."""
    native_pass = model.native_pass
    rng = random.Random(7)
    saved_threads = torch.get_num_threads()
    runs = {threads: runner(model, None) for threads in (1, 3)}
    hidden, logits = {}, {}
    try:
        start = 0
        for rows in [24] + [rng.choice([1, 1, 2, 5, 9]) for _ in range(40)]:
            tokens = [rng.randrange(VOCAB) for _ in range(rows)]
            for threads, run in runs.items():
                torch.set_num_threads(threads)
                assert run.reserve("s", start + rows)
                hidden[threads], logits[threads] = run.run_with_logits(
                    run.prepare([SequenceRows("s", start, tokens)]), torch.arange(rows))
            assert torch.equal(hidden[1], hidden[3])
            assert torch.equal(logits[1], logits[3])
            start += rows
    finally:
        model.native_pass = native_pass
        torch.set_num_threads(saved_threads)


def test_a_float32_model_runs_the_pass_with_the_float32_kernels_bits(tmp_path, monkeypatch):
    """A float32 model's layers take the kernel's float32 layout for the pass; its hidden states
    equal the same model's on the float32 matmul kernel and torch's ops, step by step."""
    path = tmp_path / "f32.gguf"
    write_tiny_gguf(path, "qwen2", ALL_PACKED)
    checkpoint = load_checkpoint(str(path), torch.float32)  # expanded to float32 tensors
    native, backend = build_model(checkpoint, torch.float32, CPU)
    assert native.native_pass is not None and "native pass" in backend
    assert native.layers[0].mlp.down_proj.parts[0].format == "F32"
    monkeypatch.setenv("SPECSERVE_NATIVE_PASS", "0")
    reference, _ = build_model(checkpoint, torch.float32, CPU)
    assert reference.native_pass is None
    assert not isinstance(reference.layers[0].mlp.down_proj, type(native.layers[0].mlp.down_proj))
    runs = [(runner(native, None), native), (runner(reference, None), reference)]
    for sequences in steps(random.Random(3)):
        hidden = []
        for run, module in runs:
            for rows in sequences:
                assert run.reserve(rows.seq_id, rows.start + len(rows.token_ids))
            hidden.append(run.run(run.prepare(sequences)))
        assert torch.equal(*hidden)


def test_the_pass_is_left_out_where_it_cannot_run(tmp_path, monkeypatch):
    path = tmp_path / "mixed.gguf"
    write_tiny_gguf(path)  # layer 0's down projection is Q5_0, which is expanded to float32
    checkpoint = load_checkpoint(str(path), torch.float32, packed=True)
    assert build_model(checkpoint, torch.float32, CPU)[0].native_pass is None
    monkeypatch.setenv("SPECSERVE_NATIVE_PASS", "0")
    path = tmp_path / "packed.gguf"
    write_tiny_gguf(path, formats=ALL_PACKED)
    checkpoint = load_checkpoint(str(path), torch.float32, packed=True)
    assert build_model(checkpoint, torch.float32, CPU)[0].native_pass is None
