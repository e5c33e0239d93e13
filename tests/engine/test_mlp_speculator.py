"""The MLP speculator: lossless whatever its weights, seeded sampling independent of the batch, and
the trainer teaches it to guess what the target says (acceptance rises after training)."""

from __future__ import annotations

import pytest
import torch
from bigram_drafters import (
    check_lossless_when_mostly_right,
    write_bigram_mlp_speculator,
)
from spec_outputs import pooled_acceptance_rate, token_ids
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from engine.training.train_speculator import (
    build_training_set,
    load_reference,
    stage_accuracy,
    train,
)

PROMPTS = [[1, 5, 9, 13, 2, 7], [1] + list(range(30, 62)), [1, 60], [1, 11, 12, 13, 14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=31)


@pytest.fixture(scope="module")
def untrained(target, tmp_path_factory) -> str:
    torch.manual_seed(0)
    folder = str(tmp_path_factory.mktemp("untrained"))
    MLPSpeculator(MLPSpeculatorConfig(hidden_size=64, vocab_size=96, num_stages=3)).save(folder)
    return folder


def spec_llm(target: str, speculator: str, k: int = 3) -> LLM:
    return LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64,
               speculative_config={"method": "mlp_speculator", "model": speculator,
                                   "num_speculative_tokens": k})


def test_greedy_is_token_identical_in_mixed_batches(target, untrained):
    plain = LLM(target, dtype="float64", max_model_len=256, num_kv_blocks=64)
    want = token_ids(plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             num_speculative_tokens=cap) for cap in (None, 0, 1, 2)]
    outs = spec_llm(target, untrained).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert token_ids(outs) == want
    assert outs[1].spec_stats.num_draft_tokens == 0 and outs[0].spec_stats.num_draft_tokens > 0
    assert len(outs[2].spec_stats.accepted_per_position) <= 1


@pytest.mark.promise("greedy-lossless:mlp_speculator")
def test_greedy_is_lossless_when_the_drafts_are_mostly_right(tmp_path):
    check_lossless_when_mostly_right(tmp_path, "mlp_speculator", write_bigram_mlp_speculator)


def test_seeded_sampling_does_not_depend_on_the_batch(target, untrained):
    params = [SamplingParams(temperature=0.9, max_tokens=16, seed=s, ignore_eos=True,
                             num_speculative_tokens=cap) for s, cap in zip(range(4), (3, 1, 2, 3))]
    together = token_ids(spec_llm(target, untrained).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params))
    alone = token_ids(spec_llm(target, untrained).generate({"prompt_token_ids": PROMPTS[3]},
                                                           params[3]))
    assert together[3] == alone[0]


@pytest.mark.slow
def test_the_trainer_raises_acceptance(target, untrained, tmp_path):
    plain = LLM(target, dtype="float32", max_model_len=256, num_kv_blocks=64)
    prompts = [[1] + [(7 * i + j) % 90 + 2 for j in range(6)] for i in range(48)]
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    sequences = [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids))
                 for o in outs]
    reference = load_reference(target)
    embed, head = reference.get_input_embeddings(), reference.get_output_embeddings()
    data = build_training_set(reference, sequences, num_stages=3)
    speculator = MLPSpeculator.load(untrained, torch.float32, torch.device("cpu"))
    before = stage_accuracy(speculator, embed, head, data)
    train(speculator, embed, head, data, epochs=15, batch_size=64, learning_rate=3e-3, seed=0)
    after = stage_accuracy(speculator, embed, head, data)
    assert sum(after) / 3 > sum(before) / 3 + 0.2, (before, after)
    speculator.save(str(tmp_path))

    test_prompts = [{"prompt_token_ids": p} for p in prompts[:6]]
    rates = []
    for folder in (untrained, str(tmp_path)):
        spec_outs = spec_llm(target, folder).generate(test_prompts, SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True))
        assert token_ids(spec_outs) == [o.outputs[0].token_ids for o in outs[:6]]
        rates.append(pooled_acceptance_rate(spec_outs))
    assert rates[1] > max(0.05, 3 * rates[0]), rates


def test_a_speculator_for_another_model_is_refused(target, tmp_path):
    MLPSpeculator(MLPSpeculatorConfig(hidden_size=32, vocab_size=96, num_stages=2)).save(
        str(tmp_path))
    with pytest.raises(ValueError, match="hidden size 32"):
        spec_llm(target, str(tmp_path))
