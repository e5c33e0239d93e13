"""`specserve train-speculator --method medusa` (engine/training/train_medusa.py): each head is taught the
right token (the target's choice i + 2 places on, never across sequences), and training on a tiny
target's own text makes the heads' drafts accepted, through the engine, losslessly."""

from __future__ import annotations

import argparse

import pytest
import torch
from spec_outputs import pooled_acceptance_rate, token_ids
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.training.arguments import add_arguments
from engine.training.train_eagle import FeatureStream
from engine.training.train_medusa import (
    agreement,
    head_targets,
    initial_heads,
    run_medusa,
    train_heads,
)
from engine.training.train_speculator import load_reference


def test_head_i_learns_the_targets_choice_i_plus_two_places_on():
    # two sequences of 4 and 3 positions; labels[p]: the target's choice after p
    stream = FeatureStream(token_ids=torch.arange(7), features=torch.zeros(7, 2),
                           labels=torch.tensor([10, 11, 12, 13, 20, 21, 22]),
                           doc_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1]),
                           is_answer=torch.tensor([False, True, True, True, True, True, True]))
    targets = head_targets(stream, num_heads=2)
    # head 0 at p: labels[p + 1]; head 1: labels[p + 2]
    assert targets.labels[0].tolist() == [11, 12] and targets.labels[4].tolist() == [21, 22]
    assert targets.is_valid.tolist() == [[True, True], [True, True], [True, False],
                                         [False, False], [True, True], [True, False],
                                         [False, False]]
    assert targets.is_answer[0].tolist() == [True, True]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=31)


def training_args(out: str, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", out, "--method", "medusa", "--num-stages", "3"])
    for name, value in {"batch_size": 64, **overrides}.items():
        setattr(args, name, value)
    return args


@pytest.mark.slow
@pytest.mark.parametrize("own_projections, num_layers", [(False, 2), (True, 1)])
def test_training_makes_the_heads_drafts_accepted(target, tmp_path, own_projections, num_layers):
    """On the target's own greedy text (48 prompts, 40 tokens): agreement rises well above the
    untrained heads' (which guess the next token again), and the trained folder drafts accepted
    tokens through the engine with the target's greedy output unchanged. Heads that share this
    random target's LM head (hidden 64 < vocabulary 96) need two blocks to fit its text."""
    plain = LLM(target, dtype="float32", max_model_len=256, num_kv_blocks=64)
    prompts = [[1] + [(7 * i + j) % 90 + 2 for j in range(6)] for i in range(48)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    sequences = [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids))
                 for o in outs]
    reference = load_reference(target)
    reference.requires_grad_(False)
    args = training_args(str(tmp_path), medusa_own_projections=own_projections,
                         medusa_layers=num_layers, epochs=30, learning_rate=1e-2)
    summary = run_medusa(args, reference, sequences, "test")
    assert "saved to" in summary

    from engine.training.train_eagle import extract_features

    stream = extract_features(reference, [ids for ids, _ in sequences],
                              prompt_lens=[n for _, n in sequences])
    targets = head_targets(stream, 3)
    lm_head = None if own_projections else reference.get_output_embeddings()
    untrained = initial_heads(reference, 3, num_layers, own_projections, "untrained")
    before, _ = agreement(untrained, lm_head, stream, targets)
    untrained.save(str(tmp_path / "untrained"))
    from engine.proposers.medusa_heads import MedusaHeads

    after, _ = agreement(MedusaHeads.read(str(tmp_path)), lm_head, stream, targets)
    assert after[0] > before[0] + 0.3, (before, after)

    rates = []
    for folder in (str(tmp_path / "untrained"), str(tmp_path)):
        spec = LLM(target, dtype="float32", max_model_len=256, num_kv_blocks=64,
                   speculative_config={"method": "medusa", "model": folder,
                                       "num_speculative_tokens": 3})
        # NOTE: prompts it trained on (run_medusa holds out the first tenth)
        spec_outs = spec.generate([{"prompt_token_ids": p} for p in prompts[-6:]], greedy)
        assert token_ids(spec_outs) == token_ids(outs[-6:])
        rates.append(pooled_acceptance_rate(spec_outs))
    assert rates[1] > max(0.1, 2 * rates[0]), rates


def test_a_short_training_run_writes_a_folder_the_engine_serves(target, tmp_path):
    """The quick tier's check of the whole road: train for a moment, serve it, same tokens."""
    plain = LLM(target, dtype="float32", max_model_len=128, num_kv_blocks=32)
    prompts = [[1] + [(5 * i + j) % 90 + 2 for j in range(5)] for i in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    sequences = [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids))
                 for o in outs]
    reference = load_reference(target)
    reference.requires_grad_(False)
    summary = run_medusa(training_args(str(tmp_path), epochs=1), reference, sequences, "test")
    assert "held-out top-1 agreement" in summary, summary
    spec = LLM(target, dtype="float32", max_model_len=128, num_kv_blocks=32,
               speculative_config={"method": "medusa", "model": str(tmp_path),
                                   "num_speculative_tokens": 3, "draft_tree": True})
    assert token_ids(spec.generate([{"prompt_token_ids": p} for p in prompts[:3]], greedy)) == \
        token_ids(outs[:3])


def test_train_heads_moves_only_the_heads(target):
    reference = load_reference(target)
    reference.requires_grad_(False)
    before = reference.get_output_embeddings().weight.clone()
    heads = initial_heads(reference, 2, 1, False, "test")
    stream = FeatureStream(torch.arange(8), torch.randn(8, 64), torch.randint(0, 96, (8,)),
                           torch.zeros(8, dtype=torch.int64), torch.ones(8, dtype=torch.bool))
    train_heads(heads, reference.get_output_embeddings(), stream, head_targets(stream, 2),
                epochs=2, batch_size=4, learning_rate=1e-2, seed=0)
    assert torch.equal(reference.get_output_embeddings().weight, before)
    assert any(layer.weight.abs().sum() > 0 for block in heads.blocks for layer in block.layers)
