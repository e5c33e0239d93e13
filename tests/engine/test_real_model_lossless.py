"""The real embedded SmolLM2-135M-Instruct in float32: every proposer keeps greedy output
token-identical to decoding without speculation. The prompts are batched in one generate call, and
the KV cache is so small that requests get preempted and recomputed mid-answer.

Prompts ask the model to copy (a list, a paragraph, code to edit, a count), so drafts are accepted
and the paths that keep accepted blocks run, not only the ones that reject.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.arch import LlamaArch
from engine.models.loader import embedded_cache_dir, embedded_gguf_path
from engine.proposers.eagle_head import EagleConfig, EagleHead
from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from engine.training.train_eagle import choose_draft_vocab, extract_features, train_head
from engine.training.train_speculator import (
    TrainingSet,
    build_training_set,
    load_reference,
    train,
)

CONVERSATIONS = [
    "Count from 1 to 40, separated by commas.",
    "Repeat the following list exactly, one item per line, numbered: apple, banana, cherry, date, "
    "elderberry, fig, grape, honeydew, kiwi, lemon, mango.",
    "Copy this paragraph word for word: The old lighthouse stood at the edge of the cliff, its "
    "white paint peeling in the salty wind, while the keeper climbed the spiral stairs every night "
    "to light the lamp.",
    "Here is a Python function:\n```python\ndef add_numbers(first_value, second_value):\n"
    "    total_value = first_value + second_value\n    print(total_value)\n"
    "    return total_value\n```\nRename `total_value` to `result` and show the full code.",
]
MAX_TOKENS = 40
NUM_THREADS = 2
MAX_MODEL_LEN = 160  # the longest prompt (97 tokens) + MAX_TOKENS fits
# 14 blocks of 16 tokens: the first three prompts (3 + 5 + 5 blocks) are admitted together and
# need 6 + 7 + 7 blocks by their end, so newer ones are preempted (their blocks freed, recomputed
# from prompt + output when they come back) whatever the drafts do
NUM_KV_BLOCKS = 14
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
NUM_STAGES = 3  # the heads' depth, and k for the model-based proposers


@pytest.fixture(scope="module")
def plain() -> LLM:
    """No speculation and a roomy KV cache: the reference."""
    return LLM(None, dtype="float32", num_threads=NUM_THREADS, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def prompts(plain) -> list[list[int]]:
    prompts = [plain.tokenizer.encode(plain.apply_chat_template([{"role": "user", "content": c}]),
                                      add_special_tokens=False) for c in CONVERSATIONS]
    assert [len(p) for p in prompts] == [43, 68, 71, 97]  # NUM_KV_BLOCKS is sized for these
    return prompts


@pytest.fixture(scope="module")
def expected(plain, prompts) -> list[list[int]]:
    outs = plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert plain.engine.scheduler.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    """The target in transformers, float32: features and labels for the heads."""
    return load_reference(None)


# ---- small heads, trained for a few seconds on the reference answers ---------------------------
# NOTE: trained on the very text the test generates: the point is heads whose drafts are sometimes
# right on these prompts (so accepted blocks, partial ones included, are kept under preemption),
# not heads that generalise.


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, reference, prompts, expected) -> str:
    arch = LlamaArch.from_hf_config(reference.config)
    stream = extract_features(reference, [p + e for p, e in zip(prompts, expected)])
    draft_ids, _ = choose_draft_vocab(stream.labels, 256, arch.eos_token_ids, arch.vocab_size)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(arch, len(draft_ids)), arch)
    head.draft_token_ids.copy_(draft_ids)
    draft_head = head.draft_head_weight(reference.get_output_embeddings().weight.detach())
    train_head(head, reference.get_input_embeddings(), draft_head, stream, epochs=8,
               batch_size=4, window=32, num_steps=NUM_STAGES, learning_rate=3e-3,
               feature_weight=1.0, seed=0)
    folder = str(tmp_path_factory.mktemp("eagle_head"))
    head.save(folder)
    return folder


@pytest.fixture(scope="module")
def mlp_speculator(tmp_path_factory, reference, prompts, expected) -> str:
    """Trained against the LM-head rows of the answers' tokens plus 512 random others (the full
    49k-row head would cost ~50x more per step); served with the full head, the trained states
    still pick the right token often enough."""
    arch = LlamaArch.from_hf_config(reference.config)
    data = build_training_set(reference, [(p + e, len(p)) for p, e in zip(prompts, expected)],
                              num_stages=NUM_STAGES)
    generator = torch.Generator().manual_seed(0)
    rows = torch.unique(torch.cat([data.labels.flatten(), data.inputs.flatten(),
                                   torch.randperm(arch.vocab_size, generator=generator)[:512]]))
    row_of = torch.full((arch.vocab_size,), -1, dtype=torch.int64)
    row_of[rows] = torch.arange(len(rows))
    head = torch.nn.Linear(arch.hidden_size, len(rows), bias=False).requires_grad_(False)
    head.weight.copy_(reference.get_output_embeddings().weight.detach()[rows])
    torch.manual_seed(0)
    speculator = MLPSpeculator(MLPSpeculatorConfig(arch.hidden_size, arch.vocab_size, NUM_STAGES))
    train(speculator, reference.get_input_embeddings(), head,
          TrainingSet(data.hidden, data.inputs, row_of[data.labels]), epochs=6, batch_size=64,
          learning_rate=3e-3, seed=0)
    folder = str(tmp_path_factory.mktemp("mlp_speculator"))
    speculator.save(folder)
    return folder


# method -> (speculative config; the fixture naming its model folder, if any)
METHODS = {
    "ngram": ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, None),
    "suffix": ({"method": "suffix", "num_speculative_tokens": 4}, None),
    "adaptive_suffix": ({"method": "suffix", "num_speculative_tokens": 4, "adaptive": True}, None),
    "draft_model_itself": ({"method": "draft_model", "num_speculative_tokens": NUM_STAGES},
                           "embedded_folder"),
    "mlp_speculator": ({"method": "mlp_speculator", "num_speculative_tokens": NUM_STAGES},
                       "mlp_speculator"),
    "eagle": ({"method": "eagle", "num_speculative_tokens": NUM_STAGES}, "eagle_head"),
}


@pytest.fixture(scope="module")
def embedded_folder(plain) -> str:
    """The converted float32 folder of the embedded model (exists once `plain` loaded it)."""
    return embedded_cache_dir(embedded_gguf_path())


def mismatch_report(prompt: list[int], got: list[int], want: list[int], tokenizer) -> str:
    """Numerics policy: name the first mismatching position and the target's top-2 logit gap
    there (transformers, float32, on the reference's own prefix)."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if i == min(len(got), len(want)):
        return f"lengths differ: got {len(got)} tokens, want {len(want)}"
    with torch.no_grad():
        logits = load_reference(None)(torch.tensor([prompt + want[:i]])).logits[0, -1]
    top2 = torch.topk(logits, 2)
    gap = float(top2.values[0] - top2.values[1])
    return (f"first mismatch at output token {i}: got {got[i]} {tokenizer.decode([got[i]])!r}, "
            f"want {want[i]} {tokenizer.decode([want[i]])!r} after "
            f"{tokenizer.decode(want[:i])!r}; target top-2 {top2.indices.tolist()}, "
            f"logit gap {gap:.3e}")


@pytest.mark.parametrize("method", METHODS)
def test_greedy_is_token_identical_batched_and_preempted(request, prompts, expected, method):
    config, folder_fixture = METHODS[method]
    if folder_fixture is not None:
        config = {**config, "model": request.getfixturevalue(folder_fixture)}
    llm = LLM(None, dtype="float32", num_threads=NUM_THREADS, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=NUM_KV_BLOCKS, speculative_config=config)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for prompt, out, want in zip(prompts, outs, expected):
        got = out.outputs[0].token_ids
        assert got == want, mismatch_report(prompt, got, want, llm.tokenizer)

    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0, "the KV cache was meant to force preemption"
    assert scheduler.block_manager.num_free_blocks == NUM_KV_BLOCKS
    num_drafts = sum(o.spec_stats.num_draft_tokens for o in outs)
    num_accepted = sum(o.spec_stats.num_accepted_draft_tokens for o in outs)
    assert num_drafts > 0, f"{method} proposed nothing"
    assert num_accepted > 0, f"{method}: none of {num_drafts} drafts was accepted"
    if method == "draft_model_itself":
        # the target drafting for itself agrees with itself, row counts and preemption aside
        assert num_accepted == num_drafts, (num_accepted, num_drafts)
