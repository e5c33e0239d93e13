"""The CPU paged-attention kernel against the torch path (gather + padded mask + SDPA) for a decode
(or verification) batch, with the embedded model's shapes; prints time per layer and the GB/s of K/V
each reads (every sequence's context once).

A sample is one pass over `--layers` layers, each with its own cache (as a step is, so the K/V come
from memory, not from the last call's cache lines, up to --max-cache-mb in all). Passes alternate
kernel / torch and medians are printed, since this machine's cores are shared.
Run: python -m benchmarks.bench_paged_attention_cpu [--batch 1 16 32] [--context 128 800 2000]
     [--rows 1] [--threads 2] [--layers 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from benchmarks.common import cpu_name
from engine.models.attention import build_attention_metadata, paged_attention, torch_paged_attention
from kernels.paged_attention_cpu import paged_attention_cpu_available

# SmolLM2-135M: 9 query heads over 3 kv heads of 64
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def make_batch(batch: int, context: int, rows: int, num_layers: int, seed: int = 0):
    """`batch` sequences of about `context` tokens on shuffled blocks, `rows` query rows each, and
    one cache per layer."""
    rng = random.Random(seed)
    seq_lens = [max(rows, int(context * rng.uniform(0.75, 1.25))) for _ in range(batch)]
    blocks_needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    pool = list(range(sum(blocks_needed) + 8))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in blocks_needed]
    caches = [torch.randn(2, KV_HEADS, sum(blocks_needed) + 8, BLOCK_SIZE, HEAD_DIM)
              for _ in range(num_layers)]
    query = torch.randn(batch * rows, HEADS, HEAD_DIM)
    meta = build_attention_metadata([rows] * batch, seq_lens, tables, BLOCK_SIZE, None,
                                    torch.device("cpu"))
    kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * caches[0].element_size()
    return query, caches, meta, kv_bytes


def time_alternating(fns, repeats: int) -> list[float]:
    """Median seconds of each function, called in turn `repeats` times."""
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 800, 2000])
    parser.add_argument("--rows", type=int, default=1, help="query rows per sequence (1 + k)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30, help="layers per step")
    parser.add_argument("--max-cache-mb", type=int, default=1500,
                        help="fewer layers (caches) when a step's K/V would exceed this")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not paged_attention_cpu_available():
        raise SystemExit("the CPU kernel is not available (no compiler, or "
                         "SPECSERVE_CPU_KERNELS=0)")
    scale = HEAD_DIM**-0.5
    print(f"CPU: {cpu_name()}, {args.threads} threads; {HEADS} heads / {KV_HEADS} kv heads x "
          f"{HEAD_DIM}, block {BLOCK_SIZE}, {args.rows} row(s) per sequence, float32")
    print(f"{'batch':>5} {'context':>7} {'KV MB/layer':>11} {'kernel us':>10} {'torch us':>9} "
          f"{'speed-up':>8} {'kernel GB/s':>11} {'torch GB/s':>10} {'step ms kernel/torch':>20}")
    for batch in args.batch:
        for context in args.context:
            probe = make_batch(batch, context, args.rows, 1)[3]
            num_layers = max(1, min(args.layers, args.max_cache_mb * 10**6 // probe))
            query, caches, meta, kv_bytes = make_batch(batch, context, args.rows, num_layers)
            torch.testing.assert_close(paged_attention(query, caches[0], meta, scale),
                                       torch_paged_attention(query, caches[0], meta, scale),
                                       rtol=1e-5, atol=1e-5)
            kernel, reference = (seconds / num_layers for seconds in time_alternating(
                [lambda: [paged_attention(query, c, meta, scale) for c in caches],
                 lambda: [torch_paged_attention(query, c, meta, scale) for c in caches]],
                args.repeats))
            print(f"{batch:>5} {context:>7} {kv_bytes / 1e6:>11.2f} {kernel * 1e6:>10.0f} "
                  f"{reference * 1e6:>9.0f} {reference / kernel:>7.1f}x "
                  f"{kv_bytes / kernel / 1e9:>11.1f} {kv_bytes / reference / 1e9:>10.1f} "
                  f"{kernel * args.layers * 1e3:>10.1f}/{reference * args.layers * 1e3:<9.1f}")


if __name__ == "__main__":
    main()
