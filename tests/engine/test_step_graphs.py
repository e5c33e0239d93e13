"""The captured-step path (engine/runner/cuda_graphs.py) on the CPU, with the graph's replay run
eagerly over the same static, padded buffers (the Triton attention under TRITON_INTERPRET=1): the
engine keeps the eager path's greedy tokens with and without speculation, steps that fit no bucket
run eagerly, and --enforce-eager reaches the engine. tests/cuda/test_cuda_graphs.py replays real
graphs on a GPU."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from engine.runner.cuda_graphs import graph_query_lens, why_no_graphs
from engine.runner.static_inputs import StepBucket
from engine.step.types import SequenceRows
from server.cli import build_parser, run_serve

os.environ["TRITON_INTERPRET"] = "1"
interpreter = pytest.importorskip("triton.runtime.interpreter")
from kernels import fused_ops_triton, paged_attention_triton  # noqa: E402

if not isinstance(paged_attention_triton._paged_attention_kernel, interpreter.InterpretedFunction):
    importlib.reload(paged_attention_triton)
    importlib.reload(fused_ops_triton)

# NOTE: a padding row's attention output is never written (it belongs to no sequence), so the
# interpreter may overflow on it in the next layer; rows never mix, and padding rows are dropped
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

# three sequences of different lengths: 10, 33 (prefilled in chunks of 16) and 9 prompt tokens
PROMPTS = [[1, 5, 9, 13, 2, 7, 5, 9, 13, 2], [1] + list(range(30, 50)) + list(range(30, 42)),
           [1, 11, 12, 13, 11, 12, 13, 11, 12]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
CPU = torch.device("cpu")


def triton_llm(checkpoint, speculative_config=None, **kwargs) -> LLM:
    return LLM(checkpoint, dtype="float32", device="cpu", max_model_len=128, num_kv_blocks=64,
               max_num_seqs=4, max_num_batched_tokens=16, gpu_kernels="triton",
               enable_prefix_caching=False, speculative_config=speculative_config, **kwargs)


class EagerSteps:
    """Counts the steps the worker ran eagerly (through the runner's prepare)."""

    def __init__(self, runner) -> None:
        self.count, self._prepare = 0, runner.prepare
        runner.prepare = self

    def __call__(self, sequences):
        self.count += 1
        return self._prepare(sequences)


@pytest.mark.slow  # NOTE: the whole engine under the interpreter, as test_triton_step_interpreted
@pytest.mark.parametrize("speculative_config", [None, NGRAM], ids=["plain", "ngram"])
def test_static_steps_keep_the_eager_greedy_tokens(tiny_llama, speculative_config):
    """One engine, the same prompts twice: every step eager, then decode and verification steps
    through the padded static buffers (prefill chunks still eager)."""
    # NOTE: n-gram drafts start being accepted after ~10 tokens on these prompts
    params = SamplingParams(temperature=0.0, max_tokens=12 if speculative_config else 6,
                            ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    llm = triton_llm(tiny_llama, speculative_config)
    worker = llm.engine.worker
    assert worker.step_graphs is None  # NOTE: on the CPU the engine captures nothing itself
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    worker.capture_step_graphs(4, 3 if speculative_config else 0, use_cuda_graphs=False)
    graphs = worker.step_graphs
    buckets = graphs.buckets  # largest first: the later captures reuse the first's pool
    assert {(b.num_seqs, b.max_query_len) for b in buckets} == {
        (s, q) for s in (1, 2, 4) for q in ([1, 4] if speculative_config else [1])}
    assert [b.num_tokens for b in buckets] == sorted((b.num_tokens for b in buckets),
                                                     reverse=True)
    eager_steps = EagerSteps(worker.runner)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == eager
    assert graphs.num_replays >= 5 and eager_steps.count >= 3  # prompts in chunks: eager
    if speculative_config is not None:
        assert sum(o.spec_stats.num_accepted_draft_tokens for o in outs) > 0


@pytest.fixture(scope="module")
def static_llm(tiny_llama):
    llm = triton_llm(tiny_llama, NGRAM)
    llm.engine.worker.capture_step_graphs(8, 3, use_cuda_graphs=False)
    return llm


def rows(seq_id, start, num_rows, table=None, parents=None):
    return SequenceRows(seq_id, start, [7] * num_rows, parents, table or [0, 1, 2, 3])


def test_buckets_and_the_eager_fallback(static_llm):
    graphs = static_llm.engine.worker.step_graphs
    assert graphs.inputs.seq_buckets == [1, 2, 4, 8]
    assert graph_query_lens(3) == [1, 4] and graph_query_lens(0) == [1]
    assert graphs.bucket_for([rows("a", 5, 1)]) == StepBucket(1, 1)
    assert graphs.bucket_for([rows(s, 5, 1) for s in "abc"]) == StepBucket(4, 1)
    # verification of k = 3, 0 and 2 drafts pads to 1 + k = 4 rows a sequence
    assert graphs.bucket_for([rows("a", 5, 4), rows("b", 5, 1), rows("c", 5, 3)]) == \
        StepBucket(4, 4)
    assert graphs.bucket_for([rows("a", 0, 16)]) is None  # a prefill chunk
    assert graphs.bucket_for([rows("a", 5, 1), rows("b", 0, 12)]) is None  # mixed with one
    assert graphs.bucket_for([rows("a", 5, 3, parents=[-1, 0, 0])]) is None  # a tree
    assert graphs.bucket_for([rows(str(s), 5, 1) for s in range(9)]) is None  # too many
    # fits a bucket but its context needs more blocks than its table holds: eager
    assert graphs.run([rows("a", 63, 2, table=[0, 1, 2, 3])]) is None


@torch.inference_mode()
def test_a_padded_step_gives_the_rows_of_the_eager_step(static_llm):
    """Three sequences verifying 3, 0 and 2 drafts in bucket (4, 4): the static step's real rows
    are the eager step's, and the padding rows wrote K/V only into the spare block."""
    worker = static_llm.engine.worker
    blocks = worker.block_manager
    batch = [("a", 20, 4), ("b", 9, 1), ("c", 31, 3)]
    for seq_id, start, num_rows in batch:
        blocks.allocate(seq_id, start + num_rows)
    try:
        sequences = [SequenceRows(s, start, [(5 * start + i) % 90 + 3 for i in range(n)])
                     for s, start, n in batch]
        caches = worker.kv_caches
        for cache in caches:
            cache.normal_()
        before = [c.clone() for c in caches]
        eager = worker.runner.run(worker.runner.prepare(sequences))
        eager_caches = [c.clone() for c in caches]
        for cache, saved in zip(caches, before):
            cache.copy_(saved)
        static = worker.step_graphs.run(sequences)
        assert static.shape == eager.shape == (8, worker.arch.hidden_size)
        torch.testing.assert_close(static, eager, rtol=1e-6, atol=1e-6)
        assert torch.equal(worker.runner.logits(static).argmax(-1),
                           worker.runner.logits(eager).argmax(-1))
        num_blocks = worker.kv_spec.num_blocks
        for cache, eager_cache, saved in zip(caches, eager_caches, before):
            torch.testing.assert_close(cache[:, :, :num_blocks], eager_cache[:, :, :num_blocks],
                                       rtol=1e-6, atol=1e-6)
            spare = cache[:, :, num_blocks]  # [2, kvH, block_size, D]
            assert not torch.equal(spare[:, :, 0], saved[:, :, num_blocks, 0])  # the padding slot
            assert torch.equal(spare[:, :, 1:], saved[:, :, num_blocks, 1:])
    finally:
        for seq_id, _, _ in batch:
            blocks.free(seq_id)


# ops that wait for the device (a value read back to the host) or give a shape that depends on
# data: a CUDA graph can hold none of them (.tolist() and .numpy() show as resolve_conj/_neg)
HOST_SYNCING_OPS = {"aten._local_scalar_dense", "aten.is_nonzero", "aten.nonzero",
                    "aten.masked_select", "aten._unique2", "aten.unique_consecutive", "aten.equal",
                    "aten.item", "aten.resolve_conj", "aten.resolve_neg"}


class RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def test_the_captured_forward_never_syncs_the_host(static_llm):
    """What the GPU captures: the forward over the largest bucket's static buffers."""
    graphs = static_llm.engine.worker.step_graphs
    bucket = graphs.buckets[0]
    step = graphs.inputs.load(bucket, [], [], [], [], [], graphs.block_size)
    with RecordOps() as recorded:
        graphs._forward(step)
    assert "aten.embedding" in recorded.ops and "aten.index_copy_" in recorded.ops
    assert not recorded.ops & HOST_SYNCING_OPS


def test_why_no_graphs():
    cuda = torch.device("cuda")
    assert why_no_graphs(cuda, "triton", False, 1) is None
    assert "enforce" in why_no_graphs(cuda, "triton", True, 1)
    assert "gpu_kernels triton" in why_no_graphs(cuda, "torch", False, 1)
    assert "tensor parallel" in why_no_graphs(cuda, "triton", False, 2)
    assert "cpu" in why_no_graphs(CPU, "triton", False, 1)


def test_enforce_eager_turns_the_static_steps_off(tiny_llama):
    llm = triton_llm(tiny_llama, enforce_eager=True)
    worker = llm.engine.worker
    assert worker.enforce_eager and not worker.has_padding_block
    assert worker.kv_caches[0].shape[2] == worker.kv_spec.num_blocks  # no spare block
    worker.capture_step_graphs(4, 0, use_cuda_graphs=False)
    assert worker.step_graphs is None
    with pytest.raises(ValueError, match="cuda_graph_max_seqs"):
        LLM(tiny_llama, cuda_graph_max_seqs=0)


def test_enforce_eager_flag_reaches_the_engine(monkeypatch):
    args = build_parser().parse_args(["serve", "--enforce-eager", "--cuda-graph-max-seqs", "8"])
    assert args.enforce_eager and args.cuda_graph_max_seqs == 8
    defaults = build_parser().parse_args(["serve"])
    assert not defaults.enforce_eager and defaults.cuda_graph_max_seqs == 16
    launched: list[EngineArgs] = []

    class Launched(Exception):
        pass

    def launch_engine(engine_args):
        launched.append(engine_args)
        raise Launched

    import server.engine_launch
    monkeypatch.setattr(server.engine_launch, "launch_engine", launch_engine)
    with pytest.raises(Launched):
        run_serve(args)
    model_config = launched[0].configs()[0]
    assert model_config.enforce_eager and model_config.cuda_graph_max_seqs == 8
