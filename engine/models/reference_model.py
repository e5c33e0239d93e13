"""transformers' own model class on exactly the weights specserve serves: the reference that tests
and benchmarks compare against, and that speculator training learns from."""

from __future__ import annotations

import os

import torch
import transformers

from engine.models.gguf_checkpoint import read_gguf
from engine.models.loader import load_checkpoint


def load_transformers_model(
    model: str | None, dtype: torch.dtype = torch.float32
) -> transformers.PreTrainedModel:
    """`--model` in transformers, in eval mode. A folder loads as transformers loads it; a GGUF (or
    the embedded model, None) is read by specserve's reader, whose expanded tensors equal
    transformers' GGUF load bit for bit (tests/engine/test_gguf_checkpoint.py), in seconds
    instead of the ~25 s transformers takes to dequantize the whole file."""
    if model is not None and os.path.isdir(model):
        return transformers.AutoModelForCausalLM.from_pretrained(
            model, dtype=dtype, local_files_only=True).eval()
    if model is None:
        checkpoint = load_checkpoint(None, dtype)
        hf_config, weights = checkpoint.hf_config, checkpoint.weights
    else:  # a .gguf: its tokenizer is not needed here, and converting it takes seconds
        hf_config, weights = read_gguf(os.path.abspath(os.path.expanduser(model)), dtype,
                                       packed=False)
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    return model_class.from_pretrained(None, config=hf_config, state_dict=weights,
                                       dtype=dtype).eval()
