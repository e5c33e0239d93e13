"""A stop string completed inside an accepted speculative block, for every proposer: the completion
keeps exactly the tokens up to the one that completes it (ids, logprobs, count) and the text before
it, as decoding one token per step does.

The tiny target speaks a character-level tokenizer (one character per token), so the stop string can
be aimed at a token that sits inside a block the proposer got accepted. The learned proposers (MLP
speculator, EAGLE) are trained on the target's own outputs first, so they get blocks accepted too.
"""

from __future__ import annotations

import pytest
import torch
from char_tokenizer import save_char_tokenizer
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.core import EngineCore
from engine.detokenizer import IncrementalDetokenizer

PROMPTS = [[1] + [(7 * i + j) % 90 + 2 for j in range(6)] for i in range(48)]
# stop strings tried per method, each in another request
NUM_CASES = 4
MAX_TOKENS = 40
ENGINE = {"dtype": "float64", "max_model_len": 256, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=31)
    return save_char_tokenizer(folder)


@pytest.fixture(scope="module")
def plain_outputs(target) -> list[list[int]]:
    outs = LLM(target, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def mlp_speculator(target, plain_outputs, tmp_path_factory) -> str:
    from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
    from engine.training.train_speculator import build_training_set, load_reference, train

    torch.manual_seed(0)
    reference = load_reference(target)
    data = build_training_set(reference, [(p + out, len(p)) for p, out in
                                          zip(PROMPTS, plain_outputs)], num_stages=3)
    speculator = MLPSpeculator(MLPSpeculatorConfig(hidden_size=64, vocab_size=96, num_stages=3))
    train(speculator, reference.get_input_embeddings(), reference.get_output_embeddings(), data,
          epochs=15, batch_size=64, learning_rate=3e-3, seed=0)
    folder = str(tmp_path_factory.mktemp("mlp"))
    speculator.save(folder)
    return folder


@pytest.fixture(scope="module")
def eagle_head(target, plain_outputs, tmp_path_factory) -> str:
    from engine.models.arch import LlamaArch
    from engine.models.loader import load_checkpoint
    from engine.proposers.eagle_head import EagleConfig, EagleHead
    from engine.training.train_eagle import choose_draft_vocab, extract_features, train_head
    from engine.training.train_speculator import load_reference

    torch.manual_seed(0)
    arch = LlamaArch.from_hf_config(load_checkpoint(target, torch.float32).hf_config)
    reference = load_reference(target)
    stream = extract_features(reference, [p + out for p, out in zip(PROMPTS, plain_outputs)])
    draft_ids, _ = choose_draft_vocab(stream.labels, 64, arch.eos_token_ids, arch.vocab_size)
    head = EagleHead(EagleConfig.for_target(arch, len(draft_ids)), arch)
    head.draft_token_ids.copy_(draft_ids)
    draft_head = head.draft_head_weight(reference.get_output_embeddings().weight.detach())
    train_head(head, reference.get_input_embeddings(), draft_head, stream, epochs=30, batch_size=8,
               window=32, num_steps=2, learning_rate=3e-3, feature_weight=1.0, seed=0)
    folder = str(tmp_path_factory.mktemp("eagle"))
    head.save(folder)
    return folder


def speculative_config(method: str, target: str, request) -> dict:
    config = {"method": method, "num_speculative_tokens": 4}
    if method == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    elif method == "draft_model":
        config["model"] = target  # the target as its own draft: every greedy draft is accepted
    elif method == "mlp_speculator":
        config.update(model=request.getfixturevalue("mlp_speculator"), num_speculative_tokens=3)
    elif method == "eagle":
        config.update(model=request.getfixturevalue("eagle_head"), num_speculative_tokens=3)
    return config


def blocks_of(core: EngineCore, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Per greedy request, run as one batch: the tokens each step committed (speculative blocks)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add_request(f"probe-{index}", prompt, params)
    blocks: list[list[list[int]]] = [[] for _ in prompts]
    while core.has_unfinished:
        for update in core.step():
            if update.new_token_ids:
                blocks[int(update.request_id.split("-")[1])].append(update.new_token_ids)
    return blocks


def stop_inside_a_block(tokenizer, prompt: list[int], blocks: list[list[int]]):
    """(stop string, index of the token completing it) for a token that adds text of its own, has a
    block-mate after it, and whose stop string first occurs right there; None if there is none."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    ends = []  # len(text) once each token is taken
    for token_id in (t for block in blocks for t in block):
        detok.update([token_id])
        ends.append(len(detok.text))
    start = 0
    for block in blocks:
        for position in range(max(1, start), start + len(block) - 1):
            stop = detok.text[max(0, ends[position] - 3):ends[position]]
            if ends[position] > ends[position - 1] and \
                    detok.text.find(stop) + len(stop) == ends[position]:
                return stop, position
        start += len(block)
    return None


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "mlp_speculator", "eagle"])
def test_a_stop_string_inside_an_accepted_block(target, plain_outputs, method, request):
    spec = LLM(target, **ENGINE, speculative_config=speculative_config(method, target, request))
    plain = LLM(target, **ENGINE)
    cases = []
    for prompt, want, blocks in zip(PROMPTS, plain_outputs, blocks_of(spec.engine, PROMPTS)):
        assert [t for b in blocks for t in b] == want  # lossless, before any stop string
        found = stop_inside_a_block(spec.tokenizer, prompt, blocks)
        if found is not None and len(cases) < NUM_CASES:
            cases.append((prompt, *found))
    assert cases, f"{method}: no request had a block long enough to hold a stop string"

    for prompt, stop, position in cases:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                stop=[stop], logprobs=1)
        got = spec.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        alone = plain.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
        full_text = spec.tokenizer.decode(plain_outputs[PROMPTS.index(prompt)],
                                         skip_special_tokens=True)
        assert got.token_ids == alone.token_ids == \
            plain_outputs[PROMPTS.index(prompt)][:position + 1]
        assert len(got.logprobs) == position + 1
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(
            [lp.logprob for lp in alone.logprobs], abs=1e-9)
        assert got.text == alone.text == full_text[:full_text.index(stop)]
        assert got.finish_reason == "stop" and got.stop_reason == stop
