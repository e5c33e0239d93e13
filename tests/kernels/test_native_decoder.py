"""The native CPU pass (engine/models/native_pass.py) gives the torch path's hidden states, logits
(its LM head on the rows that sample), KV cache and EAGLE-3 features bit for bit: prefill chunks,
decode, 2-12 verification rows, batched sequences, trees and a sliding window, on q/k/v and gate/up
parts of different formats, with and without a q/k/v bias, on one thread, two, and more threads
than cores; for Llama, Qwen2, Qwen3 (per-head q/k norms) and Gemma 3 (those, output norms, GeGLU,
and sliding layers with their own window, tree masks and RoPE tables beside full ones)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kv.block_manager import BlockManager
from engine.models.build import allocate_kv_cache, build_model
from engine.models.loader import load_checkpoint
from engine.runner.paged_runner import PagedRunner
from engine.step.types import SequenceRows
from kernels.native_decoder import native_decoder_available, new_native_decoder
from tests.helpers.native_pass_steps import ALL_PACKED, steps, store_linears_in_half_precision
from tests.helpers.tiny_gguf import VOCAB, write_tiny_gguf
from tests.helpers.tiny_models import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(not native_decoder_available(),
                                reason="no C++ compiler with AVX2 and F16C for the CPU kernels")

CPU = torch.device("cpu")
NUM_BLOCKS, BLOCK_SIZE = 64, 8


def tiny_model_file(folder, family: str, storage: str = "packed") -> str:
    """llama and qwen2: a GGUF of packed formats (ALL_PACKED); qwen3 and gemma3: a Hugging Face
    folder, its linears in bfloat16 and float16 ("packed") or in float32 (the pass then runs the
    float32 kernel's layout)."""
    if family in ("llama", "qwen2"):
        path = folder / f"{family}.gguf"
        write_tiny_gguf(path, family, ALL_PACKED)
        return str(path)
    path = build_tiny_checkpoint(folder / family, family)
    if storage == "packed":
        store_linears_in_half_precision(path)
    return path


@pytest.fixture(scope="module",
                params=["llama", "qwen2", "qwen3", "gemma3", "gemma3 float32"])
def model(request, tmp_path_factory):
    family, _, storage = request.param.partition(" ")
    path = tiny_model_file(tmp_path_factory.mktemp("native"), family, storage or "packed")
    module, backend = build_model(load_checkpoint(path, torch.float32, packed=True),
                                  torch.float32, CPU)
    assert module.native_pass is not None and "native pass" in backend
    # the packed LM head (a GGUF's Q4_1 output.weight, a folder's bfloat16 one) runs in the pass
    assert module.native_pass.has_head == (storage != "float32")
    if family == "gemma3":  # sliding layers with their own RoPE, output norms, GeGLU
        assert [layer.self_attn.sliding for layer in module.layers] == [True, True, False]
        assert module.local_rotary is not None and module.layers[0].mlp_output_norm is not None
        assert module.layers[0].mlp.hidden_act == "gelu_pytorch_tanh"
    if family in ("qwen3", "gemma3"):
        assert module.layers[0].self_attn.q_norm is not None
    return module


def runner(module, sliding_window):
    """sliding_window: over the model's full layers (Gemma 3's sliding layers keep their own)."""
    return PagedRunner(module, allocate_kv_cache(module.arch, NUM_BLOCKS, BLOCK_SIZE,
                                                 torch.float32, CPU),
                       BlockManager(NUM_BLOCKS, BLOCK_SIZE), sliding_window, CPU,
                       local_window=module.arch.local_window)


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


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3"])
def test_a_float32_model_runs_the_pass_with_the_float32_kernels_bits(tmp_path, monkeypatch,
                                                                     family):
    """A float32 model's layers take the kernel's float32 layout for the pass; its hidden states
    equal the same model's on the float32 matmul kernel and specserve's decoder ops (the CPU
    float32 path without the pass), step by step."""
    path = tiny_model_file(tmp_path, family, "float32")
    checkpoint = load_checkpoint(path, torch.float32)  # expanded to float32 tensors
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
    write_tiny_gguf(path)  # layer 0's down projection is MXFP4, which is expanded to float32
    checkpoint = load_checkpoint(str(path), torch.float32, packed=True)
    assert build_model(checkpoint, torch.float32, CPU)[0].native_pass is None
    monkeypatch.setenv("SPECSERVE_NATIVE_PASS", "0")
    path = tmp_path / "packed.gguf"
    write_tiny_gguf(path, formats=ALL_PACKED)
    checkpoint = load_checkpoint(str(path), torch.float32, packed=True)
    assert build_model(checkpoint, torch.float32, CPU)[0].native_pass is None


def test_a_layers_switches_are_checked():
    decoder = new_native_decoder(64, 4, 2, 16, 128, 1e-6, 0.25, None)
    decoder.add_layer(torch.ones(64), torch.ones(64))
    decoder.set_head_norms(0, torch.ones(16), torch.ones(16))
    decoder.set_activation(0, "gelu_pytorch_tanh")
    with pytest.raises(RuntimeError, match="no activation named relu"):
        decoder.set_activation(0, "relu")
    with pytest.raises(RuntimeError, match="q norm must be contiguous float32 \\[16\\]"):
        decoder.set_head_norms(0, torch.ones(64), torch.ones(16))
    with pytest.raises(RuntimeError, match="MLP output norm"):
        decoder.set_output_norms(0, torch.ones(64), torch.ones(16))
    with pytest.raises(RuntimeError, match="no layer 1"):
        decoder.set_sliding(1, True)
