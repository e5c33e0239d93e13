"""Owns the target model, its KV cache and its block pool (one PagedRunner); runs one forward pass per
engine step."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager
from engine.config import CacheConfig, KVCacheSpec, ModelConfig
from engine.cpu_threads import usable_cpu_count
from engine.draft_tree import row_parents
from engine.models.arch import LlamaArch
from engine.models.build import allocate_kv_cache, build_model
from engine.models.loader import load_checkpoint
from engine.models.memory import MemoryReport, release_freed_memory, resident_bytes
from engine.models.packed_model import packed_bytes
from engine.paged_runner import PagedRunner, SequenceRows
from engine.proposers.base import TargetHandle
from engine.scheduler import SampledTokens, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelRunnerOutput:
    # [num_sampling_rows, vocab]: per sampling request, 1 + num_draft_tokens rows (step_layout.py)
    logits: torch.Tensor
    # [num_sampling_rows, hidden]: the final-norm hidden states those logits came from (proposers
    # that draft from the target's features read them)
    hidden: torch.Tensor
    # [num_tokens, features]: what EAGLE reads at every row of the flattened batch, in the scheduled
    # order: the final-norm hidden state, or with capture_aux_hidden (EAGLE-3) the residual streams
    # entering the chosen layers, side by side
    token_hidden: torch.Tensor


class Worker:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        self.device = model_config.torch_device
        if model_config.num_threads is not None or self.device.type == "cpu":
            torch.set_num_threads(model_config.num_threads or usable_cpu_count())
        self.dtype = model_config.torch_dtype
        if self.device.type == "cuda":
            # NOTE: cuDNN's SDPA builds a plan for every new KV length: measured 1.9 ms of CPU per call,
            # 60% of a decode step on an H100 (benchmarks/profile_step.py); the other backends need none
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.weights_packed = model_config.keep_weights_packed
        checkpoint = load_checkpoint(model_config.model, self.dtype, packed=self.weights_packed)
        self.tokenizer = checkpoint.tokenizer
        # what was loaded, in words (logs and the server's start-up line)
        self.source = checkpoint.source
        self.hf_config = checkpoint.hf_config
        self.arch = LlamaArch.from_hf_config(checkpoint.hf_config)
        self.gpu_kernels = model_config.gpu_kernels
        self.model, self.linear_backend = build_model(checkpoint, self.dtype, self.device,
                                                      self.gpu_kernels)
        self.kv_spec = self._size_kv_cache(model_config, cache_config)
        # NOTE: one pool per model, so the prefix cache's model identity can stay empty
        blocks = BlockManager(self.kv_spec.num_blocks, self.kv_spec.block_size,
                              enable_prefix_caching=cache_config.enable_prefix_caching)
        self.runner = PagedRunner(
            self.model, allocate_kv_cache(self.arch, self.kv_spec.num_blocks,
                                          self.kv_spec.block_size, self.dtype, self.device),
            blocks, self.arch.sliding_window, self.device,
            "triton" if self.gpu_kernels == "triton" else "auto")
        del checkpoint  # the file's tensors now live in the model; the rest is scratch
        release_freed_memory()
        packed, dense = packed_bytes(self.model)
        # what start-up reports: the weights as held (packed + float), the KV cache, the process
        self.memory = MemoryReport(packed, dense, self.kv_spec.num_blocks * self.kv_spec.block_size
                                   * self.kv_spec.bytes_per_token, resident_bytes())
        logger.info("loaded %s: %d layers, %s on %s (%s matmuls); KV cache %d blocks x %d tokens; "
                    "%s", self.source, self.arch.num_layers, self.dtype, self.device,
                    self.linear_backend, self.kv_spec.num_blocks, self.kv_spec.block_size,
                    self.memory.describe())

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

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.runner.kv_caches

    @property
    def block_manager(self) -> BlockManager:
        """The target's pool; the scheduler fills it."""
        return self.runner.blocks

    def capture_aux_hidden(self, layer_ids: tuple[int, ...]) -> None:
        """From now on, token_hidden holds the residual streams entering these layers (EAGLE-3)."""
        if not all(0 <= i < self.arch.num_layers for i in layer_ids):
            raise ValueError(f"feature layers {list(layer_ids)} out of the target's "
                             f"{self.arch.num_layers} layers")
        self.model.aux_hidden_layers = tuple(layer_ids)

    def target_handle(self) -> TargetHandle:
        """What drafters may use of the target (engine/proposers/base.py)."""
        return TargetHandle(self.arch, self.model, self.dtype, self.device,
                            self.kv_spec.num_blocks, self.kv_spec.block_size,
                            weights_packed=self.weights_packed)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """The scheduled step: each request's next known tokens, then its drafts, from the position
        its computed K/V ends at; logits at the step layout's rows."""
        sequences = []
        for item in output.scheduled:
            request = item.request
            start = request.num_computed_tokens
            known = request.token_ids_between(start, start + item.num_known_tokens)
            parents = None if item.draft_parents is None else row_parents(
                item.num_known_tokens, item.draft_parents, item.num_draft_tokens)
            sequences.append(SequenceRows(request.request_id, start,
                                          known + item.draft_token_ids, parents))
        inputs = self.runner.prepare(sequences)
        hidden = self.runner.run(inputs)
        rows = hidden[output.layout.logits_indices.to(self.device)]  # [rows, hidden]
        token_hidden = self.model.aux_hidden_states if self.model.aux_hidden_layers else hidden
        return ModelRunnerOutput(logits=self.runner.logits(rows), hidden=rows,
                                 token_hidden=token_hidden)

    @torch.inference_mode()
    def keep_accepted_paths(self, output: SchedulerOutput, sampled: list[SampledTokens]) -> None:
        """Before commit: each tree's accepted path moves its K/V to the positions right after its
        known tokens, where the committed tokens belong. Bookkeeping alone when the path is the
        tree's first branch (its rows are already there); otherwise a copy of at most its depth
        rows per layer."""
        for item, kept in zip(output.sampling, sampled):
            if item.draft_parents is None:
                continue
            num_known = item.num_known_tokens
            rows = list(range(num_known)) + [num_known + draft for draft in kept.kept_drafts]
            if any(row != position for position, row in enumerate(rows)):
                self.runner.keep_rows(item.request.request_id, item.request.num_computed_tokens,
                                      rows)
