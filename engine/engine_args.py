"""Every engine setting in one flat, picklable record: what `LLM(...)` takes as keywords, what
`specserve serve` takes as flags, and what the server hands to the engine process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.spec_config import SpeculativeConfig


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None
    dtype: str = "auto"
    # "auto" keeps quantized / 16-bit weights packed on the CPU, "none" expands them (engine/config.py)
    quantization: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    # a max_model_len above the model's trained length, with a warning (engine/config.py)
    allow_long_max_model_len: bool = False
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_gib: float = 1.0
    num_kv_blocks: int | None = None
    num_threads: int | None = None
    # reuse cached prefix blocks within a tenant (engine/kv/block_manager.py)
    enable_prefix_caching: bool = True
    # "torch" or "triton": what runs attention and the per-layer ops on CUDA (engine/config.py)
    gpu_kernels: str = "auto"
    # no CUDA graphs (engine/runner/cuda_graphs.py), and the most sequences a graph holds
    enforce_eager: bool = False
    cuda_graph_max_seqs: int = 16
    # rows independent of their batch: greedy speculation = plain decoding in bfloat16 (needs
    # the Triton kernels; engine/models/batch_invariant.py); None = on in bf16/fp16 on CUDA
    batch_invariant: bool | None = None
    # vLLM-style JSON text or dict (engine/spec_config.py); None or "none" = no speculation
    speculative_config: str | dict[str, Any] | None = None
    # tensor parallelism (engine/config.py's ParallelConfig)
    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    distributed_timeout_s: float = 60.0

    def configs(self) -> tuple[ModelConfig, CacheConfig, SchedulerConfig, SpeculativeConfig | None]:
        """Validated configs; every bad value raises ValueError naming it, before anything loads."""
        spec = self.speculative_config
        return (
            ModelConfig(model=self.model, dtype=self.dtype, device=self.device,
                        max_model_len=self.max_model_len,
                        allow_long_max_model_len=self.allow_long_max_model_len,
                        num_threads=self.num_threads,
                        gpu_kernels=self.gpu_kernels, quantization=self.quantization,
                        enforce_eager=self.enforce_eager,
                        cuda_graph_max_seqs=self.cuda_graph_max_seqs,
                        batch_invariant=self.batch_invariant),
            CacheConfig(block_size=self.block_size, kv_cache_memory_gib=self.kv_cache_memory_gib,
                        num_blocks=self.num_kv_blocks,
                        enable_prefix_caching=self.enable_prefix_caching),
            SchedulerConfig(max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens),
            None if spec is None or spec == "none" else SpeculativeConfig.from_json(spec),
        )

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size, nnodes=self.nnodes,
                              node_rank=self.node_rank, master_addr=self.master_addr,
                              master_port=self.master_port,
                              distributed_timeout_s=self.distributed_timeout_s)
