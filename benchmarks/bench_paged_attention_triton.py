"""The Triton paged attention against the torch path (gather + padded mask + SDPA) on a GPU, for
decode and verification batches; prints each one's time and the GB/s of K/V it reads (every
sequence's context once), against the GPU's copy bandwidth measured in the same run.

Run on a CUDA GPU: python -m benchmarks.bench_paged_attention_triton [--batch 1 16 64]
    [--context 512 2048 8192] [--rows 1 5] [--model llama8b smollm2]
Without CUDA, `--smoke` under TRITON_INTERPRET=1 runs the script end to end on tiny sizes (its
timings are the interpreter's, which say nothing of a GPU): tests use it to keep the script working.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from engine.models.attention import build_attention_metadata, paged_attention, torch_paged_attention

# (query heads, KV heads, head_dim)
MODELS = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
BLOCK_SIZE = 16


def make_batch(model: str, batch: int, context: int, rows: int, dtype: torch.dtype,
               device: torch.device, seed: int = 0):
    """`batch` sequences of about `context` tokens on shuffled blocks, `rows` query rows each."""
    heads, kv_heads, head_dim = MODELS[model]
    rng = random.Random(seed)
    seq_lens = [max(rows, int(context * rng.uniform(0.75, 1.25))) for _ in range(batch)]
    blocks_needed = [-(-s // BLOCK_SIZE) for s in seq_lens]
    pool = list(range(sum(blocks_needed) + 8))
    rng.shuffle(pool)
    tables = [[pool.pop() for _ in range(n)] for n in blocks_needed]
    cache = torch.randn(2, kv_heads, len(pool) + sum(blocks_needed), BLOCK_SIZE, head_dim,
                        dtype=dtype, device=device)
    query = torch.randn(batch * rows, heads, head_dim, dtype=dtype, device=device)
    metas = {backend: build_attention_metadata([rows] * batch, seq_lens, tables, BLOCK_SIZE, None,
                                               device, backend)
             for backend in ("auto", "triton")}
    kv_bytes = sum(seq_lens) * kv_heads * head_dim * 2 * cache.element_size()
    return query, cache, metas, kv_bytes, head_dim**-0.5


def timer(device: torch.device):
    """Seconds of one call of fn: CUDA events on a GPU, the wall clock elsewhere."""
    def run(fn) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        start_s = time.perf_counter()
        fn()
        return time.perf_counter() - start_s
    return run


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write), median of repeats."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    time_one = timer(device)
    seconds = statistics.median(time_one(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["smollm2", "llama8b"], choices=list(MODELS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5],
                        help="query rows per sequence (1 + k)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes under TRITON_INTERPRET=1, to prove the script runs")
    args = parser.parse_args()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not (args.smoke and interpreted):
        print("needs a CUDA GPU (or --smoke with TRITON_INTERPRET=1)", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda" if torch.cuda.is_available() and not interpreted else "cpu")
    dtype = getattr(torch, args.dtype)
    if args.smoke:
        args.model, args.batch, args.context, args.repeats = ["smollm2"], [2], [40], 2
        dtype = torch.float32  # NOTE: the interpreter multiplies bfloat16 dots wrongly (triton 3.9)
    time_one = timer(device)
    floor = copy_bandwidth(device, 20)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, Triton interpreter"
    print(f"device: {name}; {dtype}; block size {BLOCK_SIZE}; copy bandwidth "
          f"{floor / 1e9:.0f} GB/s (1 GiB device-to-device)")
    print(f"{'model':>8} {'batch':>5} {'context':>7} {'rows':>4} {'KV MB':>7} {'triton us':>10} "
          f"{'torch us':>9} {'speed-up':>8} {'triton GB/s':>11} {'of copy bw':>10} {'max err':>8}")
    for model in args.model:
        for rows in args.rows:
            for batch in args.batch:
                for context in args.context:
                    query, cache, metas, kv_bytes, scale = make_batch(model, batch, context, rows,
                                                                      dtype, device)
                    run_triton = lambda: paged_attention(query, cache, metas["triton"], scale)  # noqa: E731
                    run_torch = lambda: torch_paged_attention(query, cache, metas["auto"], scale)  # noqa: E731
                    error = (run_triton().float() - run_torch().float()).abs().max().item()
                    for _ in range(3):  # warm-up: compile and caches
                        run_triton(), run_torch()
                    samples = [[], []]
                    for _ in range(args.repeats):  # interleaved, so drift hits both alike
                        samples[0].append(time_one(run_triton))
                        samples[1].append(time_one(run_torch))
                    triton_s, torch_s = (statistics.median(s) for s in samples)
                    print(f"{model:>8} {batch:>5} {context:>7} {rows:>4} {kv_bytes / 1e6:>7.1f} "
                          f"{triton_s * 1e6:>10.1f} {torch_s * 1e6:>9.1f} "
                          f"{torch_s / triton_s:>8.2f} {kv_bytes / triton_s / 1e9:>11.1f} "
                          f"{kv_bytes / triton_s / floor:>10.2f} {error:>8.1e}")


if __name__ == "__main__":
    main()
