"""Engine configuration: one frozen dataclass per concern, each validated where it is built.

Values only known after loading (the resolved context length, the number of KV blocks) are not written back
here: they come back as `KVCacheSpec`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# NOTE: torch is imported where a value needs it, not here: the HTTP process validates these
# configs before it starts the engine process, and importing torch first would delay that start.
# The dtypes by torch's names; float64 exists for tests: greedy ties can never flip on rounding there
DTYPES = ("float32", "float16", "bfloat16", "float64")
# what runs attention, the norms, rotary and SiLU-and-multiply of a model on CUDA: "torch" = torch ops
# and SDPA over a gathered copy of the context; "triton" = specserve's Triton kernels (kernels/),
# which CUDA graphs can capture: 10-14x torch's one-stream speed on an H200 (docs/perf.md);
# "auto" = triton on CUDA where the triton package is installed, else torch
GPU_KERNELS = ("auto", "torch", "triton")
# the dtypes in which batch invariance is on by default (float32 rows already agree: docs/perf.md)
BATCH_INVARIANT_DTYPES = ("bfloat16", "float16")
# "auto": keep the checkpoint's quantized or 16-bit weights packed on the CPU (GGUF blocks,
# bf16/f16) and compute in float32; "none": expand them to the dtype
QUANTIZATION_MODES = ("auto", "none")
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                 "bf16": "bfloat16", "fp64": "float64", "double": "float64"}


def _cuda_is_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class ModelConfig:
    # local Hugging Face folder, a .gguf file, or None for the embedded SmolLM2-135M-Instruct
    model: str | None = None
    # "auto" = float32 on the CPU (bf16 matmuls are slow without bf16 units), bfloat16 on CUDA
    dtype: str = "auto"
    # "auto" = cuda when available, else cpu
    device: str = "auto"
    # longest prompt + output in tokens; None = the model's max_position_embeddings
    max_model_len: int | None = None
    # allow a max_model_len above the model's trained length (max_position_embeddings): positions
    # it never saw in training, so quality may fall off; refused unless asked for (vLLM's rule)
    allow_long_max_model_len: bool = False
    # torch intra-op threads on the CPU; None = leave torch's default
    num_threads: int | None = None
    # one of GPU_KERNELS, resolved to "torch" or "triton" when built; "triton" on the CPU only
    # under TRITON_INTERPRET=1 (tests)
    gpu_kernels: str = "auto"
    # one of QUANTIZATION_MODES; see keep_weights_packed for when "auto" packs
    quantization: str = "auto"
    # True: never capture CUDA graphs (engine/runner/cuda_graphs.py); they apply on CUDA with
    # gpu_kernels "triton" and one rank, where they are on by default
    enforce_eager: bool = False
    # the most sequences a captured decode / verification step holds; larger steps run eagerly
    cuda_graph_max_seqs: int = 16
    # every row's numbers independent of its batch (engine/models/batch_invariant.py): greedy
    # with speculation = without, batched = alone, in bfloat16 too; needs gpu_kernels "triton".
    # None = on with the Triton kernels in bfloat16 and float16 on CUDA
    batch_invariant: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and DTYPE_ALIASES.get(self.dtype, self.dtype) not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda") and not _cuda_is_available():
            raise ValueError(f"device {self.device!r} asked for, but torch sees no CUDA device")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be at least 1, got {self.num_threads}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization (--quantization) must be one of "
                             f"{', '.join(QUANTIZATION_MODES)}, got {self.quantization!r}")
        if self.cuda_graph_max_seqs < 1:
            raise ValueError(f"cuda_graph_max_seqs must be at least 1, got "
                             f"{self.cuda_graph_max_seqs}")
        if self.gpu_kernels not in GPU_KERNELS:
            raise ValueError(f"gpu_kernels must be one of {', '.join(GPU_KERNELS)}, "
                             f"got {self.gpu_kernels!r}")
        if self.batch_invariant and self.gpu_kernels == "torch":
            raise ValueError("batch_invariant (--batch-invariant) needs the Triton kernels: "
                             "gpu_kernels triton or auto, not torch")
        # NOTE: torch_device imports torch (to see a GPU); only an explicit batch_invariant pays it
        if (self.batch_invariant and os.environ.get("TRITON_INTERPRET") != "1"
                and self.torch_device.type != "cuda"):
            raise ValueError("batch_invariant (--batch-invariant) runs on CUDA devices: the CPU's "
                             "rows already agree in float32")
        if self.gpu_kernels == "triton":
            if importlib.util.find_spec("triton") is None:
                raise ValueError("gpu_kernels triton needs the triton package: pip install triton")
            if self.torch_device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("gpu_kernels triton runs on CUDA devices (or on the CPU under "
                                 "TRITON_INTERPRET=1, for tests)")

    def resolved_gpu_kernels(self, device: torch.device, dtype: torch.dtype) -> str:
        """"torch" or "triton" for `device` and `dtype` (the kernels take float32, float16 and
        bfloat16; float64 test models keep torch). NOTE: resolved in the engine process: the HTTP
        process validates this config without importing torch."""
        if self.gpu_kernels != "auto":
            return self.gpu_kernels
        if self.batch_invariant:
            return "triton"
        has_triton = importlib.util.find_spec("triton") is not None
        triton_dtype = str(dtype).removeprefix("torch.") in ("float32", "float16", "bfloat16")
        return "triton" if device.type == "cuda" and has_triton and triton_dtype else "torch"

    def resolved_batch_invariant(self, gpu_kernels: str, device: torch.device,
                                 dtype: torch.dtype) -> bool:
        if self.batch_invariant is not None:
            return self.batch_invariant
        return (gpu_kernels == "triton" and device.type == "cuda"
                and str(dtype).removeprefix("torch.") in BATCH_INVARIANT_DTYPES)

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def keep_weights_packed(self) -> bool:
        """Load the weights packed (kernels/packed_weight.py): with quantization and dtype
        both "auto", on the CPU only. An explicit dtype (float32 included) expands them, as does
        CUDA, which runs bfloat16."""
        return (self.quantization == "auto" and self.dtype == "auto"
                and self.torch_device.type == "cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, DTYPE_ALIASES.get(self.dtype, self.dtype))


@dataclass(frozen=True)
class CacheConfig:
    # tokens per KV block
    block_size: int = 16
    # memory for the KV cache; ignored when num_blocks is given
    kv_cache_memory_gib: float = 1.0
    # exact number of KV blocks (tests use a few to force preemption)
    num_blocks: int | None = None
    # reuse the K/V of full blocks of a prefix computed before, within a tenant (cache_salt);
    # on by default, as in vLLM, SGLang and llama.cpp
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    # requests decoding at once (continuous batching width)
    max_num_seqs: int = 64
    # tokens in one forward pass: prefill chunks + decode tokens (+ draft tokens when speculating)
    max_num_batched_tokens: int = 2048
    # requests allowed to wait before new ones are refused (the server answers 429)
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_waiting_requests < 1:
            raise ValueError(
                f"max_waiting_requests must be at least 1, got {self.max_waiting_requests}")


@dataclass(frozen=True)
class KVCacheSpec:
    """What loading and sizing decided: measured at start-up, never written into the configs above."""

    num_blocks: int
    block_size: int
    max_model_len: int
    # bytes of K and V for one token across all layers
    bytes_per_token: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: the target split over `tensor_parallel_size` ranks, one process each,
    spread evenly over `nnodes` machines that meet at rank 0's `master_addr:master_port`
    (engine/runner/ranks.py)."""

    tensor_parallel_size: int = 1
    nnodes: int = 1
    # this machine's place among the nodes; node 0 runs the scheduler (rank 0) and the server
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    # None: a free port, picked by node 0 (one node only; several nodes must agree on one)
    master_port: int | None = None
    # seconds a collective may wait for a rank that died or hangs before the engine reports dead
    distributed_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got "
                             f"{self.tensor_parallel_size}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes must be at least 1 and divide tensor_parallel_size "
                             f"{self.tensor_parallel_size}, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need --master-port: the port every node meets rank 0 at")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be positive, got "
                             f"{self.distributed_timeout_s}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The ranks this node runs."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

