"""`specserve train-speculator --method mtp`: the folder it writes is the target plus one MTP layer in
DeepSeek-V3's layout, which loads back as the layer that was trained and serves losslessly; training
makes the layer guess what the target says; on the embedded model, the whole command end to end."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from safetensors import safe_open
from spec_outputs import pooled_acceptance_rate, token_ids
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.models.arch import DecoderArch
from engine.models.attention import build_attention_metadata
from engine.proposers.mtp_head import read_mtp_head
from engine.training.arguments import add_arguments

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
PROMPTS = [[1] + [(7 * i + j) % 90 + 2 for j in range(6)] for i in range(48)]


def mtp_args(out: str, model: str | None, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", out, "--method", "mtp", "--draft-vocab-size", "64",
                              "--window", "32", "--unroll-steps", "2", *flags]
                             + ([] if model is None else ["--model", model]))
    args.batch_size = 8
    return args


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=41)


@pytest.fixture(scope="module")
def answers(target) -> list:
    """The target's greedy answers to PROMPTS (float32, as training generates them)."""
    plain = LLM(target, dtype="float32", max_model_len=256, num_kv_blocks=64)
    return plain.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)


def sequences(outs) -> list[tuple[list[int], int]]:
    return [(o.prompt_token_ids + o.outputs[0].token_ids, len(o.prompt_token_ids)) for o in outs]


def mtp_llm(folder: str) -> LLM:
    return LLM(folder, dtype="float32", max_model_len=256, num_kv_blocks=64,
               speculative_config={"method": "mtp", "num_speculative_tokens": 3})


def test_the_written_folder_is_the_target_plus_the_trained_layer(target, answers, tmp_path,
                                                                 monkeypatch):
    """One short epoch: config.json names one MTP layer, model.safetensors holds every target
    tensor and the layer's under model.layers.{L}.; read back, the layer computes what the trained
    one did; served, the tokens are the target's."""
    import engine.training.train_mtp as train_mtp
    from engine.training.train_speculator import load_reference

    trained = {}
    write = train_mtp.write_model_folder

    def keep(out, model, layer, tokenizer):
        trained["layer"] = layer
        write(out, model, layer, tokenizer)

    monkeypatch.setattr(train_mtp, "write_model_folder", keep)
    out = str(tmp_path / "model")
    summary = train_mtp.run_mtp(mtp_args(out, target, "--epochs", "1"), load_reference(target),
                                None, sequences(answers[:24]))
    assert "MTP layer" in summary and out in summary
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 2
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as saved, \
            safe_open(os.path.join(target, "model.safetensors"), "pt") as original:
        names = set(saved.keys())
        assert set(original.keys()) <= names
        for name in original.keys():
            assert torch.equal(saved.get_tensor(name), original.get_tensor(name)), name
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight",
            "model.layers.2.hnorm.weight", "model.layers.2.shared_head.norm.weight",
            "model.layers.2.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight"} <= names
    arch = DecoderArch.from_hf_config(load_reference(target).config)
    loaded = read_mtp_head(out, arch).layers[0]
    torch.manual_seed(0)
    embeds, states = torch.randn(2, 5, arch.hidden_size)
    outputs = []
    for layer in (trained["layer"], loaded):
        kv = [torch.zeros(2, arch.num_kv_heads, 1, 8, arch.head_dim)]
        meta = build_attention_metadata([5], [5], [[0]], 8, None, torch.device("cpu"))
        with torch.no_grad():
            outputs.append(layer(embeds, states, torch.arange(5), meta, kv))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    test = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    assert token_ids(mtp_llm(out).generate(test, GREEDY)) == token_ids(answers[:4])


@pytest.mark.slow
def test_training_makes_the_layer_guess_what_the_target_says(target, answers, tmp_path):
    """Held-out agreement jumps, and so does online acceptance (on the held-out prompts, which
    hold_out_prompts sets aside: the first tenth)."""
    from engine.training.train_mtp import run_mtp
    from engine.training.train_speculator import load_reference

    out = str(tmp_path / "model")
    summary = run_mtp(mtp_args(out, target, "--epochs", "30"), load_reference(target), None,
                      sequences(answers))
    agreement = summary.split("whole vocabulary: ")[1]
    after = [float(a) for a in agreement.split(" (")[0].split(", ")]
    before = [float(a) for a in agreement.split("untrained: ")[1].split(")")[0].split(", ")]
    assert after[0] > before[0] + 0.1, summary
    test = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    outs = mtp_llm(out).generate(test, GREEDY)
    assert token_ids(outs) == token_ids(answers[:4])
    assert pooled_acceptance_rate(outs) > 0.05, summary


@pytest.mark.slow
def test_the_command_on_the_embedded_model_writes_a_model_that_serves(tmp_path):
    """`specserve train-speculator --method mtp` on the embedded SmolLM2, tiny settings: the folder
    loads as a Hugging Face model (tokenizer and chat template included) whose greedy tokens with
    MTP speculation equal the embedded model's without."""
    from server.cli import main

    out = str(tmp_path / "smollm2-mtp")
    assert main(["train-speculator", "--method", "mtp", "--out", out, "--num-prompts", "12",
                 "--max-tokens", "24", "--epochs", "1", "--window", "16", "--unroll-steps", "2",
                 "--draft-vocab-size", "256"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    plain = LLM(None, dtype="float32", max_model_len=512)
    spec = LLM(out, dtype="float32", max_model_len=512,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    conversation = [[{"role": "user", "content": "Name three colours."}]]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    want = plain.chat(conversation, params)[0].outputs[0]
    got = spec.chat(conversation, params)
    assert got[0].outputs[0].token_ids == want.token_ids
    assert got[0].spec_stats.num_draft_tokens > 0
