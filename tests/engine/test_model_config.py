"""engine/config.py ModelConfig: --quantization is validated, and weights stay packed only with
quantization and dtype both "auto" on the CPU."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.engine_args import EngineArgs
from server.cli import build_parser


@pytest.mark.parametrize("quantization, dtype, is_packed", [
    ("auto", "auto", True),
    ("auto", "float32", False),  # an explicit dtype expands, float32 included
    ("auto", "bfloat16", False),
    ("none", "auto", False),
    ("none", "float32", False),
])
def test_weights_stay_packed_only_with_both_auto_on_the_cpu(quantization, dtype, is_packed):
    config = ModelConfig(quantization=quantization, dtype=dtype, device="cpu")
    assert config.keep_weights_packed is is_packed


def test_cuda_never_packs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = ModelConfig()  # device auto: resolves to CUDA, which runs bfloat16 expanded
    assert config.torch_device.type == "cuda" and not config.keep_weights_packed


def test_bad_quantization_names_the_flag():
    with pytest.raises(ValueError, match=r"--quantization.*auto, none.*'q4'"):
        ModelConfig(quantization="q4")


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_cli_flag_reaches_the_model_config(command):
    args = build_parser().parse_args([*command, "--quantization", "none"])
    assert args.quantization == "none"
    assert build_parser().parse_args(command).quantization == "auto"
    model_config = EngineArgs(quantization=args.quantization).configs()[0]
    assert model_config.quantization == "none" and not model_config.keep_weights_packed
