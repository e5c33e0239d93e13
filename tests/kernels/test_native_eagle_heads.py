"""EAGLE's and EAGLE-3's draft heads on the native CPU pass (engine/proposers/eagle.py's
optimize_head) give the torch path's states and KV cache bit for bit: the EAGLE-1 layer with and
without its input norm (the authors' heads have none), and the EAGLE-3 layer, whose q|k|v read the
token's embedding and a feature side by side, with the residual the feature or its norm; for a
Llama target and a Gemma 3 one (whose heads' layers are plain Llama layers of its sizes)."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from engine.kv.block_manager import BlockManager
from engine.models.arch import DecoderArch
from engine.models.build import allocate_kv_cache
from engine.models.loader import load_checkpoint
from engine.proposers.eagle import optimize_head
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head
from engine.proposers.eagle_head import EagleConfig, EagleHead
from engine.runner.paged_runner import PagedRunner
from kernels.native_decoder import native_decoder_available
from tests.helpers.native_pass_steps import ALL_PACKED, steps
from tests.helpers.tiny_gguf import write_tiny_gguf
from tests.helpers.tiny_models import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(not native_decoder_available(),
                                reason="no C++ compiler with AVX2 and F16C for the CPU kernels")

CPU = torch.device("cpu")
NUM_BLOCKS, BLOCK_SIZE = 64, 8


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def target_arch(request, tmp_path_factory) -> DecoderArch:
    folder = tmp_path_factory.mktemp("heads")
    if request.param == "gemma3":
        path = build_tiny_checkpoint(folder / "gemma3", "gemma3")
    else:
        path = str(folder / "llama.gguf")
        write_tiny_gguf(path, "llama", ALL_PACKED)
    return DecoderArch.from_hf_config(load_checkpoint(path, torch.float32).hf_config)


def randomized(head: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight random, norms included (a norm of ones would hide a missing or swapped one)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3
                        + (1.0 if param.dim() == 1 else 0.0))
    return head.eval()


def eagle_head(arch: DecoderArch, input_norm: bool):
    config = replace(EagleConfig.for_target(arch, arch.vocab_size), input_norm=input_norm)
    head = randomized(EagleHead(config, arch), seed=int(input_norm))
    optimize_head(head, [head.layer], SimpleNamespace(dtype=torch.float32, device=CPU))
    return head, config.layer_arch(arch)


def eagle3_head(arch: DecoderArch, norm_before_residual: bool):
    config = replace(Eagle3Config.for_target(arch, arch.vocab_size, (0, 1, 1)),
                     norm_before_residual=norm_before_residual)
    layer_arch = config.layer_arch(arch)
    head = randomized(Eagle3Head(config, layer_arch, has_embeddings=False), seed=2)
    optimize_head(head, [head], SimpleNamespace(dtype=torch.float32, device=CPU),
                  feature_norm=head.hidden_norm, norm_before_residual=norm_before_residual)
    return head, layer_arch


HEADS = {"eagle": lambda arch: eagle_head(arch, True),
         "eagle, no input norm": lambda arch: eagle_head(arch, False),
         "eagle3": lambda arch: eagle3_head(arch, False),
         "eagle3, norm before residual": lambda arch: eagle3_head(arch, True)}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", list(HEADS))
def test_a_draft_heads_pass_equals_its_torch_path_bit_for_bit(target_arch, kind, threads):
    head, layer_arch = HEADS[kind](target_arch)
    native_pass = head.native_pass
    assert native_pass is not None, "the pass should take this head"
    runs = [(PagedRunner(head, allocate_kv_cache(layer_arch, NUM_BLOCKS, BLOCK_SIZE,
                                                 torch.float32, CPU),
                         BlockManager(NUM_BLOCKS, BLOCK_SIZE), None, CPU), pass_)
            for pass_ in (native_pass, None)]
    generator = torch.Generator().manual_seed(threads)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    native_pass.set_profiling(True)  # its stage clock shows that the pass ran
    try:
        for sequences in steps(random.Random(threads)):
            num_rows = sum(len(rows.token_ids) for rows in sequences)
            embeds, features = torch.randn(2, num_rows, target_arch.hidden_size,
                                           generator=generator)
            states = []
            for run, pass_ in runs:
                for rows in sequences:
                    assert run.reserve(rows.seq_id, rows.start + len(rows.token_ids))
                head.native_pass = pass_
                states.append(run.run(run.prepare(sequences), embeds, features))
            assert states[0].shape == (num_rows, target_arch.hidden_size)
            assert torch.equal(*states), (states[0] - states[1]).abs().max()
        assert torch.equal(runs[0][0].kv_caches[0], runs[1][0].kv_caches[0])
        assert native_pass.stage_seconds()["q|k|v"] > 0
    finally:
        native_pass.set_profiling(False)
        head.native_pass = native_pass
        torch.set_num_threads(saved_threads)


def test_the_pass_leaves_a_head_it_cannot_run_to_torch(target_arch, monkeypatch):
    monkeypatch.setenv("SPECSERVE_NATIVE_PASS", "0")
    head, _ = eagle_head(target_arch, True)
    assert head.native_pass is None
    assert type(head.layer.mlp.down_proj).__name__ != "QuantizedLinear"
