"""A stop string completed inside an accepted speculative block, for every proposer: the completion
keeps exactly the tokens up to the one that completes it (ids, logprobs, count) and the text before
it, as decoding one token per step does.

The tiny target speaks a character-level tokenizer (one character per token), so the stop string can
be aimed at a token that sits inside a block the proposer got accepted. The target is mostly bigram
and the learned proposers (MLP speculator, EAGLE, EAGLE-3) are built from its own weights, so they
get blocks accepted too; every tree-drafting method runs as well.
"""

from __future__ import annotations

import pytest
from bigram_drafters import (
    build_mostly_bigram_checkpoint,
    write_bigram_eagle3_head,
    write_bigram_eagle_head,
    write_bigram_mlp_speculator,
)
from char_tokenizer import save_char_tokenizer
from tiers import tiered

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
    """Mostly bigram (tests/helpers/bigram_drafters.py), so drafters built from its own weights
    get long blocks accepted; 4 layers, for EAGLE-3's three feature layers."""
    folder = build_mostly_bigram_checkpoint(tmp_path_factory.mktemp("target"))
    return save_char_tokenizer(folder)


@pytest.fixture(scope="module")
def plain(target) -> LLM:
    """No speculation, shared by every method's cases: a finished request leaves nothing behind
    that another one could see but cached prefixes, which change no token."""
    return LLM(target, **ENGINE)


@pytest.fixture(scope="module")
def plain_outputs(plain) -> list[list[int]]:
    outs = plain.generate([{"prompt_token_ids": p} for p in PROMPTS],
                          SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def drafters(target, tmp_path_factory) -> dict[str, str]:
    """The learned proposers' folders, built from the target's weights (no training needed)."""
    return {"mlp_speculator": write_bigram_mlp_speculator(target, str(tmp_path_factory.mktemp("m"))),
            "eagle": write_bigram_eagle_head(target, str(tmp_path_factory.mktemp("e"))),
            "eagle3": write_bigram_eagle3_head(target, str(tmp_path_factory.mktemp("e3")))}


METHODS = ["ngram", "suffix", "draft_model", "mlp_speculator", "eagle", "eagle3", "ngram_tree",
           "suffix_tree", "eagle_tree", "eagle3_tree"]


def speculative_config(method: str, target: str, request) -> dict:
    name = method.removesuffix("_tree")
    config = {"method": name, "num_speculative_tokens": 4}
    if name == "ngram":
        config.update(prompt_lookup_min=1, prompt_lookup_max=3)
    elif name == "draft_model":
        config["model"] = target  # the target as its own draft: every greedy draft is accepted
    elif name in ("mlp_speculator", "eagle", "eagle3"):
        config.update(model=request.getfixturevalue("drafters")[name], num_speculative_tokens=3)
    if method.endswith("_tree"):
        config.update(draft_tree=True, num_speculative_tokens=8)
    return config


def blocks_of(core: EngineCore, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Per greedy request, run as one batch: the tokens each step committed (speculative blocks)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        core.add_request(f"probe-{index}", prompt, params)
    blocks: list[list[list[int]]] = [[] for _ in prompts]
    while core.has_unfinished:
        for update in core.step().updates:
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


# NOTE: the quick tier runs n-gram drafting; the full suite every method and tree
@pytest.mark.parametrize("method", tiered(METHODS, {"ngram"}))
def test_a_stop_string_inside_an_accepted_block(target, plain_outputs, plain, method, request):
    spec = LLM(target, **ENGINE, speculative_config=speculative_config(method, target, request))
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
