"""Owns the target model, its KV cache and its block pool (one PagedRunner); runs one forward pass per
engine step."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import subprocess
import threading
from dataclasses import dataclass

import torch

from engine.config import CacheConfig, KVCacheSpec, ModelConfig, ParallelConfig
from engine.cpu_threads import usable_cpu_count
from engine.kv.block_manager import BlockManager
from engine.models.arch import DecoderArch
from engine.models.build import allocate_kv_cache, build_model, optimize_for_cpu
from engine.models.loader import Checkpoint, WeightPart, load_checkpoint
from engine.models.memory import MemoryReport, release_freed_memory, resident_bytes
from engine.models.packed_model import packed_bytes
from engine.models.vocab_heads import build_vocab_heads, vocab_weight_names, vocab_weights
from engine.runner.collectives import Rendezvous, TensorParallelGroup, free_port
from engine.runner.cuda_graphs import StepGraphs, graph_query_lens, why_no_graphs
from engine.runner.paged_runner import PagedRunner
from engine.runner.rank_messages import ExecutePass, KeepRows, KeptRows, StopRank
from engine.runner.ranks import start_rank_processes, stop_rank_processes
from engine.runner.sharding import ShardPlan, intermediate_unit, shard_spec, shard_weights
from engine.runner.target_handle import TargetHandle
from engine.step.scheduler_output import SchedulerOutput
from engine.step.types import ForwardInput, SampledTokens
from kernels.cpu_extension import PACKED_MODEL_KERNELS, build_cpu_libraries

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
    """One rank's share of the target. Without tensor parallelism, the whole model; with it, rank
    0 (the engine process) also starts its node's other ranks and sends each step's pass to every
    rank (engine/runner/ranks.py), and the others run those passes on their shards."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 parallel_config: ParallelConfig | None = None, rank: int = 0,
                 drafters_read_vocab: bool = False) -> None:
        """`drafters_read_vocab`: a drafter will read the target's embedding and LM head
        (EAGLE, the MLP speculator): under tensor parallelism rank 0 then keeps them whole too."""
        parallel = parallel_config or ParallelConfig()
        self.rank, self.tp_size = rank, parallel.tensor_parallel_size
        self.keeps_whole_vocab = rank == 0 and self.tp_size > 1 and drafters_read_vocab
        self.device = model_config.torch_device
        if self.device.type == "cuda" and self.tp_size > 1:
            self.device = torch.device("cuda", rank % parallel.ranks_per_node)
            torch.cuda.set_device(self.device)
        if model_config.num_threads is not None or self.device.type == "cpu":
            torch.set_num_threads(model_config.num_threads or max(
                1, usable_cpu_count() // (parallel.ranks_per_node if self.tp_size > 1 else 1)))
        self.dtype = model_config.torch_dtype
        if self.device.type == "cuda":
            # NOTE: cuDNN's SDPA builds a plan for every new KV length: measured 1.9 ms of CPU per call,
            # 60% of a decode step on an H100 (benchmarks/profile_step.py); the other backends need none
            torch.backends.cuda.enable_cudnn_sdp(False)
        if self.device.type == "cpu":  # NOTE: a first start compiles them, side by side, before
            # this node's other ranks start and look for them; a lone engine on a packed model
            # leaves out the float32 matmul, built only if a float32 linear asks for it
            lone_and_packed = model_config.keep_weights_packed and parallel.tensor_parallel_size == 1
            build_cpu_libraries(list(PACKED_MODEL_KERNELS) if lone_and_packed else None)
        # the other ranks of this node (rank 0 only), and the group every rank joins
        self.rank_processes: list[subprocess.Popen] = []
        self.tp_group: TensorParallelGroup | None = None
        if self.tp_size > 1:
            self.tp_group = self._join_ranks(model_config, cache_config, parallel)
        self.weights_packed = model_config.keep_weights_packed
        # what --model named (None: the embedded GGUF); MTP reads its own layers from there
        self.checkpoint_path = model_config.model
        checkpoint = load_checkpoint(model_config.model, self.dtype, packed=self.weights_packed,
                                     part_of=self._rank_part if self.tp_group else None,
                                     defer_tokenizer=True)
        # NOTE: the engine reads the tokenizer only to compile a response_format grammar, so a
        # start need not import transformers for it (the `tokenizer` property loads it then)
        self._tokenizer = checkpoint.tokenizer
        self._tokenizer_source = checkpoint.tokenizer_source
        self._tokenizer_lock = threading.Lock()
        # what was loaded, in words (logs and the server's start-up line)
        self.source = checkpoint.source
        self.hf_config = checkpoint.hf_config
        # the whole model's numbers (the vocabulary the sampler sees); `local_arch`: this rank's
        self.arch = DecoderArch.from_hf_config(checkpoint.hf_config)
        self.gpu_kernels = model_config.resolved_gpu_kernels(self.device, self.dtype)
        self.batch_invariant = model_config.resolved_batch_invariant(self.gpu_kernels, self.device,
                                                                     self.dtype)
        # the embedding and LM head whole, for drafters (keeps_whole_vocab), until they take them
        self._vocab_weights: dict | None = None
        local_arch, kv_heads, plan = self.arch, self.arch.num_kv_heads, None
        if self.tp_group is not None:
            checkpoint, plan = self._keep_this_ranks_share(checkpoint)
            local_arch, kv_heads = plan.local_arch(self.arch, rank), plan.max_kv_heads()
        self.model, self.linear_backend = build_model(checkpoint, self.dtype, self.device,
                                                      self.gpu_kernels, arch=local_arch,
                                                      batch_invariant=self.batch_invariant)
        if self.tp_group is not None:
            self.model.use_tensor_parallel(self.tp_group, plan.shards[rank].vocab.start,
                                           [len(shard.vocab) for shard in plan.shards])
            self.linear_backend += f", tensor-parallel rank {rank} of {self.tp_size}"
        self.kv_spec = self._size_kv_cache(model_config, cache_config, kv_heads)
        # the target's captured steps (capture_step_graphs); None = every step eager
        self.step_graphs: StepGraphs | None = None
        self.enforce_eager = model_config.enforce_eager
        self.cuda_graph_max_seqs = model_config.cuda_graph_max_seqs
        # NOTE: static steps (CUDA graphs) need a spare block past the pool for padding rows' K/V
        self.has_padding_block = (self.gpu_kernels == "triton" and self.tp_group is None
                                  and not self.enforce_eager)
        # NOTE: one pool per model, so the prefix cache's model identity can stay empty; under
        # tensor parallelism rank 0's pool decides, and every rank writes the same slots
        blocks = BlockManager(self.kv_spec.num_blocks, self.kv_spec.block_size,
                              enable_prefix_caching=cache_config.enable_prefix_caching)
        self.runner = PagedRunner(
            self.model, allocate_kv_cache(local_arch, self.kv_spec.num_blocks
                                          + int(self.has_padding_block), self.kv_spec.block_size,
                                          self.dtype, self.device),
            blocks, self.arch.sliding_window, self.device,
            "triton" if self.gpu_kernels == "triton" else "auto", self.arch.local_window)
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

    @property
    def tokenizer(self):  # -> transformers.PreTrainedTokenizerBase | None
        """The model's tokenizer (None if it has none), loaded at first use where deferred."""
        with self._tokenizer_lock:  # NOTE: grammars compile on other threads
            if self._tokenizer_source is not None:
                self._tokenizer, self._tokenizer_source = self._tokenizer_source(), None
        return self._tokenizer

    def _keep_this_ranks_share(self, checkpoint: Checkpoint) -> tuple[Checkpoint, ShardPlan]:
        """This rank's shard of every weight, and the split (the tables drafters read are first
        set aside whole, where they do)."""
        plan = ShardPlan.build(self.arch, self.tp_size, intermediate_unit(checkpoint.weights))
        if self.keeps_whole_vocab:
            self._vocab_weights = vocab_weights(checkpoint.weights)
        return dataclasses.replace(checkpoint, weights=shard_weights(
            checkpoint.weights, self.arch, plan, self.rank,
            already_sharded=checkpoint.partial)), plan

    def _rank_part(self, hf_config) -> WeightPart:
        """What this rank reads of each weight of a safetensors folder: its shard (and the
        embedding and LM head whole where drafters read them)."""
        arch = DecoderArch.from_hf_config(hf_config)
        plan = ShardPlan.build(arch, self.tp_size)  # NOTE: 16-bit and float weights split anywhere
        whole = set(vocab_weight_names()) if self.keeps_whole_vocab else set()
        return lambda name: None if name in whole else shard_spec(name, arch, plan, self.rank)

    def _join_ranks(self, model_config: ModelConfig, cache_config: CacheConfig,
                    parallel: ParallelConfig) -> TensorParallelGroup:
        """Rank 0 starts its node's other ranks first; every rank then joins the group. While
        rank 0 waits for them, a rank that exits (a bad model path, no memory) fails start-up."""
        port = parallel.master_port
        if self.rank == 0:
            port = port or free_port(parallel.master_addr)
            self.rank_processes = start_rank_processes(
                model_config, cache_config, dataclasses.replace(parallel, master_port=port),
                range(1, parallel.ranks_per_node))
            atexit.register(self.close)
        rendezvous = Rendezvous(parallel.master_addr, port, self.tp_size,
                                parallel.distributed_timeout_s)
        joined: dict[str, object] = {}

        def join() -> None:
            try:
                joined["group"] = TensorParallelGroup(rendezvous, self.rank, self.device)
            except BaseException as error:  # NOTE: re-raised on the caller's thread
                joined["error"] = error

        thread = threading.Thread(target=join, name="tensor-parallel-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            for process in self.rank_processes:
                if process.poll() is not None:
                    self.close()
                    raise RuntimeError(f"tensor-parallel rank process {process.pid} exited with "
                                       f"code {process.returncode} before joining")
        if "error" in joined:
            self.close()
            raise joined["error"]
        return joined["group"]

    def close(self) -> None:
        """Rank 0: tell the other ranks to leave and wait for them (idempotent)."""
        if self.rank != 0:
            return
        group, self.tp_group = self.tp_group, None
        if group is not None:
            try:
                group.send(StopRank())
            except RuntimeError:  # NOTE: the store is gone; the ranks exit with their parent
                pass
        stop_rank_processes(self.rank_processes)
        self.rank_processes = []
        if group is not None:
            group.close()

    def _size_kv_cache(self, model_config: ModelConfig, cache_config: CacheConfig,
                       kv_heads: int) -> KVCacheSpec:
        """Blocks for `kv_heads` heads per layer (under tensor parallelism, the most any rank
        holds, so every rank sizes its pool alike)."""
        arch = self.arch
        max_model_len = model_config.max_model_len or arch.max_position_embeddings
        if max_model_len > arch.max_position_embeddings:
            if not model_config.allow_long_max_model_len:
                raise ValueError(
                    f"max_model_len {max_model_len} exceeds the model's trained length "
                    f"(max_position_embeddings {arch.max_position_embeddings}); pass "
                    f"--allow-long-max-model-len (LLM(allow_long_max_model_len=True)) to serve "
                    f"positions the model never saw in training")
            logger.warning("max_model_len %d is above the model's trained length %d: output "
                           "past that length may degrade", max_model_len,
                           arch.max_position_embeddings)
        bytes_per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * self.dtype.itemsize
        num_blocks = cache_config.num_blocks or int(
            cache_config.kv_cache_memory_gib * 2**30 // (bytes_per_token * cache_config.block_size))
        capacity = num_blocks * cache_config.block_size
        if capacity < max_model_len and model_config.max_model_len is None:
            # NOTE: a long-context model on the default cache (Gemma 3 270M: 32k tokens of 36 KiB
            # each) serves the context the cache holds, as llama.cpp's and TGI's defaults do,
            # rather than refusing to start; an explicit max_model_len is held to
            logger.warning("max_model_len %d: what the KV cache (%d blocks) holds, below the model's "
                           "trained length %d; raise --kv-cache-memory-gib for more",
                           capacity, num_blocks, max_model_len)
            max_model_len = capacity
        if capacity < max_model_len:
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
        """What drafters may use of the target (engine/runner/target_handle.py)."""
        model = self.model
        if self.tp_group is not None:  # drafters run on rank 0, beside the shards: whole tables
            model = None
            if self._vocab_weights is not None:
                model = build_vocab_heads(self._vocab_weights, self.dtype, self.device)
                optimize_for_cpu(model, self.dtype, self.device)
                self._vocab_weights = None  # NOTE: the heads hold these tensors now
        return TargetHandle(self.arch, model, self.dtype, self.device,
                            self.kv_spec.num_blocks, self.kv_spec.block_size,
                            weights_packed=self.weights_packed, checkpoint=self.checkpoint_path)

    def capture_step_graphs(self, max_num_seqs: int, num_speculative_tokens: int,
                            use_cuda_graphs: bool = True) -> None:
        """At start-up, once the KV cache exists: capture the target's decode steps, and chain
        verification of `num_speculative_tokens` drafts (0: decode only), for up to
        min(max_num_seqs, cuda_graph_max_seqs) sequences, where graphs apply (why_no_graphs).
        `use_cuda_graphs=False` (tests, any device): the same static, padded steps, run eagerly."""
        reason = why_no_graphs(self.device, self.gpu_kernels, self.enforce_eager, self.tp_size)
        if not use_cuda_graphs:
            reason = None if self.has_padding_block else "static steps need gpu_kernels triton"
        if self.arch.local_window is not None:
            reason = "static steps take one attention window; this model mixes two"
        if reason is not None:
            if self.device.type == "cuda":
                logger.info("CUDA graphs off: %s", reason)
            return
        block_size = self.kv_spec.block_size
        graphs = StepGraphs(
            self.model, self.kv_caches, block_size, self.block_manager.block_table,
            min(max_num_seqs, self.cuda_graph_max_seqs), graph_query_lens(num_speculative_tokens),
            -(-self.kv_spec.max_model_len // block_size),
            padding_slot=self.kv_spec.num_blocks * block_size,  # the spare block's first slot
            sliding_window=self.arch.sliding_window, device=self.device,
            use_cuda_graphs=use_cuda_graphs)
        try:
            graphs.capture()
        except RuntimeError as error:  # NOTE: slower, but serving: the log says why
            logger.warning("CUDA graph capture failed, every step runs eagerly "
                           "(--enforce-eager skips the attempt): %s", error)
            return
        self.step_graphs = graphs
        logger.info("captured %s", graphs.describe())

    @torch.inference_mode()
    def execute(self, forward: ForwardInput,
                logits_indices: torch.Tensor | None = None) -> ModelRunnerOutput:
        """The step's target pass (the scheduler's ForwardInput); logits at its logits rows (under
        tensor parallelism rank 0 sends the pass to every rank first, and only it gets logits).
        `logits_indices`: those rows already on the device (the step layout's), else made here."""
        if self.tp_group is not None and self.rank == 0:
            self.tp_group.send(ExecutePass(forward))
        if logits_indices is None:
            logits_indices = torch.tensor(forward.logits_rows, dtype=torch.int64,
                                          device=self.device)
        hidden = None if self.step_graphs is None else self.step_graphs.run(forward.sequences)
        if hidden is None:  # a step no graph holds (a prefill, a tree, a big batch): eager
            hidden, logits = self.runner.run_with_logits(
                self.runner.prepare(forward.sequences), logits_indices)
        else:
            logits = self.runner.logits(hidden[logits_indices])
        if self.tp_group is not None and self.rank == 0:
            self.tp_group.forget_received()  # NOTE: this pass's sums needed every rank
        rows = hidden[logits_indices]
        token_hidden = self.model.aux_hidden_states if self.model.aux_hidden_layers else hidden
        return ModelRunnerOutput(logits=logits, hidden=rows, token_hidden=token_hidden)

    @torch.inference_mode()
    def keep_accepted_paths(self, output: SchedulerOutput, sampled: list[SampledTokens]) -> None:
        """Before commit: each tree's accepted path moves its K/V to the positions right after its
        known tokens, where the committed tokens belong. Bookkeeping alone when the path is the
        tree's first branch (its rows are already there); otherwise a copy of at most its depth
        rows per layer, on every rank."""
        moves: list[KeptRows] = []
        for item, kept in zip(output.sampling, sampled):
            if item.draft_parents is None:
                continue
            num_known = item.num_known_tokens
            rows = list(range(num_known)) + [num_known + draft for draft in kept.kept_drafts]
            if any(row != position for position, row in enumerate(rows)):
                request_id = item.request.request_id
                moves.append(KeptRows(request_id, item.request.num_computed_tokens, rows,
                                      self.block_manager.block_table(request_id)))
        if moves and self.tp_group is not None:
            self.tp_group.send(KeepRows(moves))
        self.keep_rows(moves)

    @torch.inference_mode()
    def keep_rows(self, moves: list[KeptRows]) -> None:
        for move in moves:
            self.runner.keep_rows(move.seq_id, move.start, move.rows, move.block_table)
