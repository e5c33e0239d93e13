"""Does batching scale? Output tokens/s of the offline engine at 1, 4, 16 and 32 concurrent requests
(greedy, no speculation, the embedded model, the three chat workloads' prompts in turn), with
attention on the CPU kernel and on the torch path (gather + padded mask + SDPA), in ONE process.

One stream serves the three prompts one after another; b concurrent requests cycle through them.
Tokens/s is end to end (prompt processing included); decode tokens/s is b over the median
decode-only step, the steady state once every prompt is in. The paths alternate run by run (the
cores are shared: A/B in turn, medians over repeats). Every request carries a fresh cache_salt, so
no run reuses another's prefix-cache blocks.
Run: python -m benchmarks.bench_batching [--batch-sizes 1,4,16,32] [--max-tokens 128] [--repeats 2]
     [--attention torch,kernel] [--threads 2]
The aim (issue 15): tokens/s at 16 concurrent >= 3x one stream.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import time
from collections import defaultdict
from unittest import mock

import torch

import engine.models.attention
from benchmarks.common import add_model_args, cpu_name, engine_kwargs
from engine import LLM, SamplingParams
from kernels.paged_attention_cpu import paged_attention_cpu_available
from loadtest.workloads import chat_prompts

AIM = 3.0
_run_ids = itertools.count()


def attention_path(name: str) -> contextlib.AbstractContextManager:
    """'kernel': the engine's default on the CPU; 'torch': the metadata is built as on a machine
    without the kernel, so every layer gathers a padded copy and runs SDPA."""
    if name == "kernel":
        return contextlib.nullcontext()
    return mock.patch.object(engine.models.attention, "paged_attention_cpu_available", lambda: False)


@contextlib.contextmanager
def phase_timer(llm: LLM, totals: dict[str, list[float]]):
    """Record each engine step's seconds under 'prefill' (some prompt tokens left) or 'decode'."""
    core = llm.engine
    step = core.step

    def timed_step():
        scheduler = core.scheduler
        has_prefill = len(scheduler.waiting) > 0 or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.requests.values())
        start = time.perf_counter()
        out = step()
        totals["prefill" if has_prefill else "decode"].append(time.perf_counter() - start)
        return out

    core.step = timed_step
    try:
        yield
    finally:
        core.step = step


def run(llm: LLM, waves: list[list[list[int]]], max_tokens: int) -> dict[str, float]:
    """Generate for each wave of prompts in turn (the prompts of a wave concurrently); tokens/s and
    where the time went."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    steps: dict[str, list[float]] = defaultdict(list)
    num_tokens, seconds = 0, 0.0
    with phase_timer(llm, steps):
        for prompts in waves:
            run_id = next(_run_ids)
            requests = [{"prompt_token_ids": p, "cache_salt": f"bench-{run_id}-{i}"}
                        for i, p in enumerate(prompts)]
            start = time.perf_counter()
            outs = llm.generate(requests, params)
            seconds += time.perf_counter() - start
            num_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    decode_step = statistics.median(steps["decode"]) if steps["decode"] else float("nan")
    return {"tok/s": num_tokens / seconds, "seconds": seconds,
            "prefill s": sum(steps["prefill"]), "decode s": sum(steps["decode"]),
            "decode step ms": 1e3 * decode_step,
            "decode tok/s": len(waves[0]) / decode_step}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,16,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--attention", default="torch,kernel",
                        help="paths to compare, in turn: torch and/or kernel")
    add_model_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    paths = args.attention.split(",")
    if "kernel" in paths and not paged_attention_cpu_available():
        raise SystemExit("the CPU attention kernel is not available (no compiler, or "
                         "SPECSERVE_CPU_KERNELS=0)")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    llm = LLM(args.model, **engine_kwargs(args), max_num_seqs=max(batch_sizes))
    cycle = list(chat_prompts(llm.tokenizer).values())
    print(f"CPU: {cpu_name()}, {args.threads} threads, torch {torch.__version__}, {args.dtype}; "
          f"greedy, no speculation, {args.max_tokens} output tokens per request; prompts of "
          f"{'/'.join(str(len(p)) for p in cycle)} tokens in turn; medians of {args.repeats}")
    for path in paths:  # warm-up: kernel build and load, allocator, oneDNN primitive caches
        with attention_path(path):
            run(llm, [cycle[:2]], 4)

    results: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for _ in range(args.repeats):
        for batch in batch_sizes:
            waves = ([[p] for p in cycle] if batch == 1 else
                     [[cycle[i % len(cycle)] for i in range(batch)]])
            for path in paths:
                with attention_path(path):
                    results[path, batch].append(run(llm, waves, args.max_tokens))

    def median(path: str, batch: int, key: str) -> float:
        return statistics.median(r[key] for r in results[path, batch])

    def versus_one(path: str, batch: int, key: str) -> float:
        return median(path, batch, key) / median(path, 1, key) if 1 in batch_sizes else float("nan")

    print(f"\n{'attention':<10}{'batch':>6}{'tok/s':>8}{'x 1':>7}{'wall s':>8}{'prefill s':>10}"
          f"{'decode s':>9}{'step ms':>9}{'decode tok/s':>13}{'x 1':>7}")
    for path in paths:
        for batch in batch_sizes:
            print(f"{path:<10}{batch:>6}{median(path, batch, 'tok/s'):>8.1f}"
                  f"{versus_one(path, batch, 'tok/s'):>6.2f}x{median(path, batch, 'seconds'):>8.1f}"
                  f"{median(path, batch, 'prefill s'):>10.1f}"
                  f"{median(path, batch, 'decode s'):>9.1f}"
                  f"{median(path, batch, 'decode step ms'):>9.1f}"
                  f"{median(path, batch, 'decode tok/s'):>13.1f}"
                  f"{versus_one(path, batch, 'decode tok/s'):>6.2f}x")
    if 1 in batch_sizes and 16 in batch_sizes:
        for path in paths:
            ratio = versus_one(path, 16, "tok/s")
            decode_ratio = versus_one(path, 16, "decode tok/s")
            verdict = "met" if ratio >= AIM else "NOT met"
            print(f"{path}: 16 concurrent / 1 stream = {ratio:.2f}x end to end (aim >= {AIM:.0f}x: "
                  f"{verdict}), {decode_ratio:.2f}x in decode")
    if len(paths) == 2:
        for batch in batch_sizes:
            speedup = median(paths[1], batch, "tok/s") / median(paths[0], batch, "tok/s")
            print(f"batch {batch:>2}: {paths[1]} / {paths[0]} tokens/s = {speedup:.2f}x")


if __name__ == "__main__":
    main()
