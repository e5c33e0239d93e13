"""What verifying 1 + k rows costs against decoding one, and how far one row is from the memory floor:
the target pass (decoder layers and LM head) of one request at a given context, for k = 0 .. 8 draft
rows, timed through the engine's own worker; the floor is the weights' bytes over the machine's
measured read bandwidth.

Run: python -m benchmarks.bench_verify_cost [--context 100 800] [--repeats 30] [--threads N]
     [--dtype auto|float32]   (auto: packed GGUF weights, the default; float32: expanded)
The aims (issue 15): verifying 1 + k rows (k <= 8) costs at most 1.3x one row; one row within 1.25x
of the floor. The speedup speculation
can reach is tau * t(1) / (t(1 + k) + t_draft), so this ratio caps it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import cpu_name
from engine import LLM
from engine.models.attention import build_attention_metadata
from engine.models.packed_model import packed_bytes

AIM = 1.3
FLOOR_AIM = 1.25


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second torch reads with its threads: the best of a few sums over a 1 GiB tensor."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step streams: every parameter and buffer (oneDNN's packed weights included)
    and every packed (quantized) weight once, except the embedding table, of which a step reads one
    row per token (unless the LM head multiplies by that very tensor)."""
    lm_head = getattr(model.lm_head, "weight", None)
    seen, total = set(), packed_bytes(model)[0]
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if id(tensor) in seen or (name.startswith("embed_tokens") and tensor is not lm_head):
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def pass_seconds(llm: LLM, context: int, num_rows: int, repeats: int) -> float:
    """Median seconds of one target pass over `num_rows` new rows after `context` cached tokens."""
    worker = llm.engine.worker
    model, block_size = worker.model, worker.kv_spec.block_size
    seq_len = context + num_rows
    table = list(range(-(-seq_len // block_size)))  # blocks 0.. of the cache, as if allocated
    ids = torch.randint(0, worker.arch.vocab_size, (num_rows,), device=worker.device)
    positions = torch.arange(context, seq_len, device=worker.device)
    every_row = torch.arange(num_rows, device=worker.device)  # a verification samples each
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 3):
            meta = build_attention_metadata([num_rows], [seq_len], [table], block_size,
                                            worker.arch.sliding_window, worker.device)
            start = time.perf_counter()
            model.forward_with_logits(ids, positions, meta, worker.kv_caches, every_row)
            times.append(time.perf_counter() - start)
    return statistics.median(times[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[100, 800])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto",
                        help="auto: the GGUF's weights kept packed (the default); float32: expanded")
    args = parser.parse_args()
    llm = LLM(None, dtype=args.dtype, max_model_len=4096, num_threads=args.threads)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, {llm.engine.worker.linear_backend}, "
          f"median of {args.repeats}")
    bandwidth, size = read_bandwidth(), weight_bytes(llm.engine.worker.model)
    floor_ms = size / bandwidth * 1e3
    print(f"weights {size / 1e6:.0f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s: "
          f"floor {floor_ms:.1f} ms per decode step")
    print(f"{'context':>7} " + " ".join(f"{f'1+{k}':>7}" for k in range(9)) + "   (ms; ratio to 1 row)")
    worst = 0.0
    for context in args.context:
        # NOTE: interleaved row counts, repeated, so drift hits every size alike
        times = {k: [] for k in range(9)}
        for _ in range(3):
            for k in range(9):
                times[k].append(pass_seconds(llm, context, 1 + k, args.repeats // 3))
        ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"{context:>7} " + " ".join(f"{ms[k]:>7.1f}" for k in range(9)))
        print(f"{'':>7} " + " ".join(f"{ms[k] / ms[0]:>7.2f}" for k in range(9)))
        worst = max(worst, max(ms[k] / ms[0] for k in range(9)))
        one_row = ms[0] / floor_ms
        print(f"{'':>7} one row at context {context}: {one_row:.2f}x the floor (aim <= {FLOOR_AIM}: "
              f"{'met' if one_row <= FLOOR_AIM else 'NOT met'})")
    print(f"worst t(1+k)/t(1), k <= 8: {worst:.2f} (aim <= {AIM}: "
          f"{'met' if worst <= AIM else 'NOT met'})")


if __name__ == "__main__":
    main()
