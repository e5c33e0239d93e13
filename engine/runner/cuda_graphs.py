"""CUDA graphs over the target's decode and chain-verification steps.

A small model's decode step on a GPU is bound by kernel launches, not by math (~10 launches a layer
from Python, each a few microseconds of host time). A graph records the whole forward once per
bucket (sequences x query rows, engine/runner/static_inputs.py) and replays it with one launch:

    start-up   for each bucket, largest first: warm up once (compiles the Triton kernels, plans
               cuBLAS), then capture the forward over the static buffers, into one shared pool
    a step     fits a bucket (chain rows only, few enough sequences, short enough)?
                 yes: write its inputs into the static buffers (one copy), replay, keep real rows
                 no:  the eager forward with exact shapes (prefill chunks, trees, big batches)

The choice is by shape alone: a prompt chunk no longer than the bucket's rows (a short prompt, the
tail of a cached prefix) replays too, since to the kernels it is the same causal rows.

Only the Triton attention path (`gpu_kernels="triton"`) is capturable: it reads the step's metadata
from device tensors and launches a grid fixed by the bucket. The torch path builds its mask from
host values and gathers a context whose length follows the step, so with `gpu_kernels="torch"`
every step runs eagerly. Logits are taken outside the graph, from the real rows only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.runner.static_inputs import StaticStep, StaticStepInputs, StepBucket
from engine.step.types import SequenceRows

logger = logging.getLogger(__name__)


@dataclass
class CapturedStep:
    """One bucket's graph and the buffers it reads and writes."""

    # the static views it was captured over (a replay reads whatever `load` last wrote there)
    step: StaticStep
    # [bucket.num_tokens, hidden]: the final-norm hidden states the graph writes
    hidden: torch.Tensor
    # [bucket.num_tokens, n * hidden]: with model.aux_hidden_layers (EAGLE-3), else None
    aux_hidden: torch.Tensor | None
    # None where graphs are not used (use_cuda_graphs=False): a replay then runs the forward
    graph: torch.cuda.CUDAGraph | None


class StepGraphs:
    """The target's captured steps and the choice, per step, between replaying one and eager.

    `use_cuda_graphs=False` keeps everything but the graph itself: a "replay" runs the forward
    eagerly over the same static, padded buffers, with the metadata object built at capture (how
    the CPU tests check the padded path, and that nothing but the buffers' contents changes)."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 block_table_of: Callable[[str], list[int]], max_num_seqs: int,
                 query_lens: list[int], max_num_blocks_per_seq: int, padding_slot: int,
                 sliding_window: int | None, device: torch.device,
                 use_cuda_graphs: bool = True) -> None:
        """query_lens: the layouts, [1] for decode, plus 1 + k when verifying k drafts;
        padding_slot: a KV slot in a block no block table holds (padding rows write there)."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.block_table_of = block_table_of
        self.use_cuda_graphs = use_cuda_graphs
        self.inputs = StaticStepInputs(max_num_seqs, query_lens, max_num_blocks_per_seq,
                                       padding_slot, sliding_window, device)
        self.captured: dict[StepBucket, CapturedStep] = {}
        # steps that replayed a graph, and what capturing them took at start-up
        self.num_replays = 0
        self.capture_seconds = 0.0

    @property
    def buckets(self) -> list[StepBucket]:
        """Every bucket, largest first (captured in this order, later graphs reuse the pool)."""
        return sorted((StepBucket(s, q) for q in self.inputs.query_len_buckets
                       for s in self.inputs.seq_buckets),
                      key=lambda b: (b.num_tokens, b.num_seqs), reverse=True)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket. The steps captured hold no real sequence: their
        padding rows write K/V to the padding slot alone, so the cache is left as it was."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        for bucket in self.buckets:
            step = self.inputs.load(bucket, [], [], [], [], [], self.block_size)
            if not self.use_cuda_graphs:
                self.captured[bucket] = CapturedStep(step, None, None, None)
                continue
            self._forward(step)  # NOTE: the warm-up: Triton compiles here, never inside a capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # NOTE: thread_local: another thread of the engine process (a grammar compiling) may
            # call CUDA while this one captures; only this thread's calls are recorded
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                hidden = self._forward(step)
                aux = self.model.aux_hidden_states if self.model.aux_hidden_layers else None
            self.captured[bucket] = CapturedStep(step, hidden, aux, graph)
        if self.use_cuda_graphs:
            torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start

    def bucket_for(self, sequences: list[SequenceRows]) -> StepBucket | None:
        """The captured bucket that holds this step, or None: the step runs eagerly."""
        if any(rows.tree_parents() is not None for rows in sequences):
            return None  # NOTE: a tree's rows need their mask and depth positions: eager
        bucket = self.inputs.bucket_for([len(rows.token_ids) for rows in sequences])
        return bucket if bucket in self.captured else None

    def run(self, sequences: list[SequenceRows]) -> torch.Tensor | None:
        """The hidden states of the step's rows, [num_rows, hidden], from a replay; None when the
        step fits no bucket (the caller runs it eagerly). As the eager forward does, it leaves
        model.aux_hidden_states set for those rows when the model keeps them."""
        bucket = self.bucket_for(sequences)
        if bucket is None:
            return None
        token_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for rows in sequences:
            end = rows.start + len(rows.token_ids)
            table = rows.block_table if rows.block_table is not None else self.block_table_of(
                rows.seq_id)
            num_blocks = -(-end // self.block_size)
            if num_blocks > self.inputs.max_num_blocks or num_blocks > len(table):
                return None
            token_ids += rows.token_ids
            positions += range(rows.start, end)
            query_lens.append(len(rows.token_ids))
            seq_lens.append(end)
            tables.append(table[:num_blocks])
        captured = self.captured[bucket]
        step = self.inputs.load(bucket, token_ids, positions, query_lens, seq_lens, tables,
                                self.block_size)
        num_rows = step.num_real_tokens
        self.num_replays += 1
        if captured.graph is None:  # NOTE: the step as captured, as a graph would replay it
            hidden = self._forward(captured.step)[:num_rows]
            if self.model.aux_hidden_layers:
                self.model.aux_hidden_states = self.model.aux_hidden_states[:num_rows]
            return hidden
        captured.graph.replay()
        if captured.aux_hidden is not None:
            self.model.aux_hidden_states = captured.aux_hidden[:num_rows].clone()
        # NOTE: a copy: the graph's buffer is rewritten by its next replay, and a proposer may
        # keep the rows it reads past this step
        return captured.hidden[:num_rows].clone()

    def _forward(self, step: StaticStep) -> torch.Tensor:
        return self.model(step.input_ids, step.positions, step.attn_metadata, self.kv_caches)

    def describe(self) -> str:
        seqs = self.inputs.seq_buckets
        rows = ", ".join(map(str, self.inputs.query_len_buckets))
        return (f"{len(self.captured)} {'CUDA graphs' if self.use_cuda_graphs else 'static steps'}"
                f" ({seqs[0]}-{seqs[-1]} sequences x {rows} query rows) in "
                f"{self.capture_seconds:.2f} s")


def graph_query_lens(num_speculative_tokens: int) -> list[int]:
    """The layouts worth capturing: decode (1 row), and chain verification of k drafts (1 + k).
    A step verifying fewer drafts pads up to 1 + k."""
    return sorted({1, 1 + num_speculative_tokens})


def why_no_graphs(device: torch.device, gpu_kernels: str, enforce_eager: bool,
                  tensor_parallel_size: int) -> str | None:
    """None when the target's steps can be captured; else the reason, in words for the log."""
    if enforce_eager:
        return "enforce_eager (--enforce-eager) is set"
    if device.type != "cuda":
        return f"the model runs on {device.type}"
    if gpu_kernels != "triton":
        return ("they need gpu_kernels triton (--gpu-kernels triton): the torch attention path "
                "builds its mask and context length on the host each step")
    if tensor_parallel_size > 1:
        return "tensor parallelism: every rank would have to replay in step (not built)"
    return None
