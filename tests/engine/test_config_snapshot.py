"""A warm engine start reads the GGUF's config from a snapshot of plain values and defers the
tokenizer, so it never imports transformers; the snapshot must give the engine exactly the model the
transformers config gives (same DecoderArch, same weights), for the embedded Llama and for Qwen 3 and
Gemma 3 files, and a config the snapshot cannot stand for (a scaled rope, for any layer type) is
never snapshotted."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import transformers
from real_gemma import real_gemma_path
from tiny_gguf import HEAD_DIMS, write_tiny_gguf

from engine.models import config_snapshot, loader
from engine.models.arch import DecoderArch


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_snapshot_gives_the_same_model_as_the_transformers_config(cache_dir):
    eager = loader.load_checkpoint(None, torch.float32, packed=True)  # converts, then snapshots
    warm = loader.load_checkpoint(None, torch.float32, packed=True, defer_tokenizer=True)
    assert isinstance(eager.hf_config, transformers.PretrainedConfig)
    assert isinstance(warm.hf_config, config_snapshot.ConfigSnapshot)
    assert DecoderArch.from_hf_config(warm.hf_config) == DecoderArch.from_hf_config(eager.hf_config)
    assert warm.hf_config.to_dict() == eager.hf_config.to_dict()
    assert warm.weights.keys() == eager.weights.keys()
    for name, weight in eager.weights.items():
        other = warm.weights[name]
        assert torch.equal(getattr(weight, "data", weight), getattr(other, "data", other)), name
    # the tokenizer comes when asked for, and is the eager one
    assert warm.tokenizer is None and warm.tokenizer_source is not None
    tokenizer = warm.tokenizer_source()
    text = "The capital of France is"
    assert tokenizer(text)["input_ids"] == eager.tokenizer(text)["input_ids"]
    assert tokenizer.chat_template == eager.tokenizer.chat_template


def test_a_warm_engine_load_imports_no_transformers(cache_dir):
    loader.load_checkpoint(None, torch.float32, packed=True)  # the first start: cache + snapshot
    code = ("import sys, torch\n"
            "from engine.models.loader import load_checkpoint\n"
            "c = load_checkpoint(None, torch.float32, packed=True, defer_tokenizer=True)\n"
            "print(type(c.hf_config).__name__, 'transformers' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "SPECSERVE_CACHE_DIR": str(cache_dir)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ConfigSnapshot", "False"]


def gemma3_rope(full: dict, sliding: dict) -> dict:
    """Gemma 3's rope parameters: one set per layer type."""
    return {"rope_parameters": {"full_attention": {"rope_theta": 1e6, **full},
                                "sliding_attention": {"rope_theta": 1e4, **sliding}}}


@pytest.mark.parametrize("rope, can", [
    ({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}, True),
    ({"rope_parameters": {"rope_theta": 1e5}}, True),
    ({}, True),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}, False),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, False),
    (gemma3_rope({"rope_type": "default"}, {"rope_type": "default"}), True),
    (gemma3_rope({}, {}), True),
    # Gemma 3 4B and up: linear scaling on the full layers only
    (gemma3_rope({"rope_type": "linear", "factor": 8.0}, {"rope_type": "default"}), False),
    (gemma3_rope({"rope_type": "default"}, {"rope_type": "yarn", "factor": 4.0}), False),
])
def test_only_a_default_rope_is_snapshotted(rope, can):
    assert config_snapshot.can_snapshot(SimpleNamespace(**rope)) is can


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_a_qwen3_or_gemma3_snapshot_gives_the_same_model(cache_dir, tmp_path, architecture):
    """Six layers, so Gemma 3's sixth is a full-attention layer among sliding ones."""
    path = tmp_path / f"{architecture}.gguf"
    write_tiny_gguf(path, architecture, num_layers=6, tie_word_embeddings=architecture == "gemma3")

    eager = loader.load_checkpoint(str(path), torch.float32, packed=True)  # converts, snapshots
    warm = loader.load_checkpoint(str(path), torch.float32, packed=True, defer_tokenizer=True)

    assert isinstance(eager.hf_config, transformers.PretrainedConfig)
    assert isinstance(warm.hf_config, config_snapshot.ConfigSnapshot)
    assert warm.hf_config.to_dict() == eager.hf_config.to_dict()
    assert DecoderArch.from_hf_config(warm.hf_config) == DecoderArch.from_hf_config(eager.hf_config)
    assert warm.hf_config.head_dim == HEAD_DIMS[architecture]
    if architecture == "gemma3":  # what the engine reads of a Gemma 3 config, as plain values
        assert warm.hf_config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        assert warm.hf_config.rope_parameters == eager.hf_config.rope_parameters
        assert set(warm.hf_config.rope_parameters) == {"full_attention", "sliding_attention"}
        assert warm.hf_config.query_pre_attn_scalar == 256
        assert warm.hf_config.hidden_activation == "gelu_pytorch_tanh"
        assert warm.hf_config.sliding_window == 16
    assert warm.weights.keys() == eager.weights.keys()
    for name, weight in eager.weights.items():
        other = warm.weights[name]
        assert torch.equal(getattr(weight, "data", weight), getattr(other, "data", other)), name


@pytest.mark.slow
def test_the_real_gemma3_snapshot_and_tokenizer(cache_dir):
    """The real Gemma 3 270M (~70 s: its config and 262k-token tokenizer converted once): the
    snapshot gives the model the transformers config gives, and the deferred tokenizer is the
    eager one and transformers' own from the file."""
    path = str(real_gemma_path())

    eager = loader.load_checkpoint(path, torch.float32, packed=True)
    warm = loader.load_checkpoint(path, torch.float32, packed=True, defer_tokenizer=True)

    assert isinstance(warm.hf_config, config_snapshot.ConfigSnapshot)
    assert warm.hf_config.to_dict() == eager.hf_config.to_dict()
    assert DecoderArch.from_hf_config(warm.hf_config) == DecoderArch.from_hf_config(eager.hf_config)
    text = "The capital of France is Paris. Ünïcödé 日本語 <start_of_turn>user"
    from_file = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), local_files_only=True)
    assert (warm.tokenizer_source()(text).input_ids == eager.tokenizer(text).input_ids
            == from_file(text).input_ids)


def test_an_unreadable_or_foreign_snapshot_is_ignored(tmp_path):
    assert config_snapshot.read_snapshot(str(tmp_path)) is None
    path = tmp_path / config_snapshot.SNAPSHOT_NAME
    path.write_text("{not json")
    assert config_snapshot.read_snapshot(str(tmp_path)) is None
    path.write_text('{"format": 999, "config": {"vocab_size": 1}}')
    assert config_snapshot.read_snapshot(str(tmp_path)) is None
    config_snapshot.write_snapshot(str(tmp_path), SimpleNamespace(to_dict=lambda: {"a": 1}))
    assert config_snapshot.read_snapshot(str(tmp_path)).to_dict() == {"a": 1}


def test_the_http_process_tokenizer_comes_without_loading_the_config_class(cache_dir):
    """With the snapshot at hand AutoTokenizer skips loading the config itself (LlamaConfig's
    module chain, seconds); the tokenizer it builds is the one it builds without."""
    eager = loader.load_checkpoint(None, torch.float32, packed=True)  # converts, then snapshots
    light = loader.load_tokenizer(None)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ünï 日本"}]
    assert (light.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == eager.tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True))
    assert {k: str(v) for k, v in vars(light).items()} == {
        k: str(v) for k, v in vars(eager.tokenizer).items()}
    code = ("import sys\n"
            "from engine.models.loader import load_tokenizer\n"
            "print(type(load_tokenizer(None)).__name__, 'sympy' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "SPECSERVE_CACHE_DIR": str(cache_dir)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1] == "False"
