"""Owns the target model and its KV cache; runs one forward pass per engine step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import CacheConfig, KVCacheSpec, ModelConfig
from engine.input_batch import build_model_inputs
from engine.models.arch import LlamaArch
from engine.models.cpu_linear import optimize_linears_for_cpu
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_checkpoint
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    # [num_sampling_rows, vocab]: per sampling request, 1 + num_draft_tokens rows (input_batch.py)
    logits: torch.Tensor


class Worker:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        if model_config.num_threads is not None:
            torch.set_num_threads(model_config.num_threads)
        self.device = model_config.torch_device
        self.dtype = model_config.torch_dtype
        checkpoint = load_checkpoint(model_config.model, self.dtype)
        self.tokenizer = checkpoint.tokenizer
        self.hf_config = checkpoint.hf_config
        self.arch = LlamaArch.from_hf_config(checkpoint.hf_config)
        with torch.device("meta"):
            model = LlamaForCausalLM(self.arch)
        model = model.to_empty(device=self.device).to(self.dtype)
        # NOTE: rotary frequencies stay float32 whatever the weights' dtype, as in the reference
        model.rotary.inv_freq = torch.tensor(self.arch.rope_inv_freq, dtype=torch.float32,
                                             device=self.device)
        model.load_weights(checkpoint.weights)
        if self.arch.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        self.linear_backend = "torch"
        if self.device.type == "cpu":
            self.linear_backend = optimize_linears_for_cpu(model)
        self.model = model.eval()
        self.kv_spec = self._size_kv_cache(model_config, cache_config)
        self.kv_caches = [
            torch.zeros(2, self.arch.num_kv_heads, self.kv_spec.num_blocks, self.kv_spec.block_size,
                        self.arch.head_dim, dtype=self.dtype, device=self.device)
            for _ in range(self.arch.num_layers)
        ]  # per layer: [2, num_kv_heads, num_blocks, block_size, head_dim]
        logger.info("loaded %s: %d layers, %s on %s (%s matmuls); KV cache %d blocks x %d tokens",
                    checkpoint.source, self.arch.num_layers, self.dtype, self.device,
                    self.linear_backend,
                    self.kv_spec.num_blocks, self.kv_spec.block_size)

    def _size_kv_cache(self, model_config: ModelConfig, cache_config: CacheConfig) -> KVCacheSpec:
        arch = self.arch
        max_model_len = model_config.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{arch.max_position_embeddings}")
        bytes_per_token = 2 * arch.num_layers * arch.kv_size * self.dtype.itemsize
        num_blocks = cache_config.num_blocks or int(
            cache_config.kv_cache_memory_gib * 2**30 // (bytes_per_token * cache_config.block_size))
        if num_blocks * cache_config.block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * cache_config.block_size} tokens, fewer than "
                f"max_model_len {max_model_len}: raise the KV cache memory or lower max_model_len")
        return KVCacheSpec(num_blocks, cache_config.block_size, max_model_len, bytes_per_token)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, block_manager) -> ModelRunnerOutput:
        inputs = build_model_inputs(output, block_manager, self.arch.sliding_window, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn_metadata, self.kv_caches)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [rows, vocab]
        return ModelRunnerOutput(logits=logits)

