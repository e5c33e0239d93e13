"""The real embedded SmolLM2-135M-Instruct as served by default (packed Q4_1/Q8_0 weights): every
proposer keeps greedy output token-identical to decoding without speculation. The prompts are batched in one generate call, and
the KV cache is so small that requests get preempted and recomputed mid-answer.

Prompts ask the model to copy (a list, a paragraph, code to edit, a count), so drafts are accepted
and the paths that keep accepted blocks run, not only the ones that reject. Every proposer runs as a
chain and every tree-drafting one as a tree too, with prefix caching on; a perturbed copy of the
target drafts as a draft model that is sometimes wrong, so rollback runs in both models.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from tiers import tiered

from engine import LLM, SamplingParams
from engine.models.arch import DecoderArch
from engine.models.loader import embedded_gguf_path, load_checkpoint, prepare_embedded_cache
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head, default_feature_layers
from engine.proposers.eagle_head import EagleConfig, EagleHead
from engine.proposers.mlp_speculator import MLPSpeculator, MLPSpeculatorConfig
from engine.spec_config import DEFAULT_SERVE_SPECULATIVE_CONFIG
from engine.training.train_eagle import (
    FeatureStream,
    choose_draft_vocab,
    extract_features,
    train_head,
)
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
PERTURBATION = 0.15  # the relative noise on the weights of the draft model that is not the target


@pytest.fixture(scope="module")
def plain(embedded_llm) -> LLM:
    """No speculation and a roomy KV cache: the reference (shared by the session)."""
    return embedded_llm


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
def reference(embedded_reference):
    """The target in transformers, float32: features and labels for the heads."""
    return embedded_reference


# ---- small heads, trained for a few seconds on the reference answers ---------------------------
# NOTE: trained on the very text the test generates: the point is heads whose drafts are sometimes
# right on these prompts (so accepted blocks, partial ones included, are kept under preemption),
# not heads that generalise.


@pytest.fixture(scope="module")
def feature_stream(reference, prompts, expected) -> FeatureStream:
    """The target's features on the reference answers, with the three streams EAGLE-3 reads
    (its default layers 2, 15, 27): one extraction for both heads."""
    layers = default_feature_layers(reference.config.num_hidden_layers)
    with torch.no_grad():
        return extract_features(reference, [p + e for p, e in zip(prompts, expected)],
                                aux_layers=layers)


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, reference, feature_stream) -> str:
    arch = DecoderArch.from_hf_config(reference.config)
    stream = replace(feature_stream, aux=None)  # EAGLE-1 reads the final features only
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
    arch = DecoderArch.from_hf_config(reference.config)
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


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory, reference, feature_stream) -> str:
    """An EAGLE-3 head reading EAGLE-3's default layers (2, 15, 27), trained as eagle_head is."""
    arch = DecoderArch.from_hf_config(reference.config)
    layers = default_feature_layers(arch.num_layers)
    stream = feature_stream
    draft_ids, _ = choose_draft_vocab(stream.labels, 256, arch.eos_token_ids, arch.vocab_size)
    config = Eagle3Config.for_target(arch, len(draft_ids), layers)
    torch.manual_seed(0)
    head = Eagle3Head(config, config.layer_arch(arch), has_embeddings=False)
    head.draft_token_ids.copy_(draft_ids)
    draft_head = reference.get_output_embeddings().weight.detach()[draft_ids]
    with torch.no_grad():
        head.lm_head.weight.copy_(draft_head)  # as `train-speculator` starts it
    train_head(head, reference.get_input_embeddings(), draft_head, stream, epochs=8,
               batch_size=4, window=32, num_steps=NUM_STAGES, learning_rate=3e-3,
               feature_weight=1.0, seed=0)
    folder = str(tmp_path_factory.mktemp("eagle3_head"))
    head.save(folder, "test")
    return folder


@pytest.fixture(scope="module")
def perturbed_folder(tmp_path_factory, plain) -> str:
    """A draft model that is not the target: the embedded model with every layer's matrices scaled
    by 1 + PERTURBATION * N(0, 1), element by element. It agrees with the target on most tokens
    and not all (a copy truncated to its first 10-20 layers agreed on under 7% here), so draft KV
    is rolled back in the draft model and in the target."""
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("perturbed")
    generator = torch.Generator().manual_seed(0)
    weights = load_checkpoint(None, torch.float32).weights
    for name, tensor in weights.items():
        if name.startswith("model.layers.") and tensor.ndim == 2:
            tensor.mul_(1 + PERTURBATION * torch.randn(tensor.shape, generator=generator))
    save_file(weights, str(folder / "model.safetensors"))
    cache = prepare_embedded_cache()  # config.json and the tokenizer files
    for name in os.listdir(cache):
        if name.endswith((".json", ".jinja")):
            shutil.copy(os.path.join(cache, name), folder)
    return str(folder)


# method -> (speculative config; the fixture naming its model folder, if any)
METHODS = {
    "ngram": ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, None),
    "suffix": ({"method": "suffix", "num_speculative_tokens": 4}, None),
    # `specserve serve`'s own default: adaptive suffix decoding
    "serve_default": (json.loads(DEFAULT_SERVE_SPECULATIVE_CONFIG), None),
    "draft_model_itself": ({"method": "draft_model", "num_speculative_tokens": NUM_STAGES},
                           "embedded_gguf"),
    "mlp_speculator": ({"method": "mlp_speculator", "num_speculative_tokens": NUM_STAGES},
                       "mlp_speculator"),
    "eagle": ({"method": "eagle", "num_speculative_tokens": NUM_STAGES}, "eagle_head"),
    "eagle3": ({"method": "eagle3", "num_speculative_tokens": NUM_STAGES}, "eagle3_head"),
    "draft_model_perturbed": ({"method": "draft_model", "num_speculative_tokens": NUM_STAGES},
                              "perturbed_folder"),
    # draft trees, verified under the tree mask, preempted with prefix caching on
    "ngram_tree": ({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3,
                    "draft_tree": True}, None),
    "suffix_tree": ({"method": "suffix", "num_speculative_tokens": 8, "draft_tree": True}, None),
    "eagle_tree": ({"method": "eagle", "num_speculative_tokens": 6, "draft_tree": True},
                   "eagle_head"),
    "eagle3_tree": ({"method": "eagle3", "num_speculative_tokens": 6, "draft_tree": True},
                    "eagle3_head"),
}


@pytest.fixture(scope="module")
def embedded_gguf() -> str:
    """The embedded model's own file, drafting for itself."""
    return embedded_gguf_path()


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


# NOTE: the quick tier runs the serve default; the full suite every method and tree
@pytest.mark.parametrize("method", tiered(METHODS, {"serve_default"},
                                          promise="serve-default-real-model"))
def test_greedy_is_token_identical_batched_and_preempted(request, prompts, expected, method):
    config, folder_fixture = METHODS[method]
    if folder_fixture is not None:
        config = {**config, "model": request.getfixturevalue(folder_fixture)}
    llm = LLM(None, num_threads=NUM_THREADS, max_model_len=MAX_MODEL_LEN,
              num_kv_blocks=NUM_KV_BLOCKS, enable_prefix_caching=True, speculative_config=config)
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
    if method == "draft_model_perturbed":
        assert num_accepted < num_drafts, "the perturbed draft model was never wrong"
    print(f"{method}: {num_accepted} of {num_drafts} drafts accepted")
