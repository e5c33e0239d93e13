"""Tensor parallelism on this machine, one run: a model's decode step on 1 rank against 2 ranks (issue 30).

Two models, each greedy, batch 1, plain decoding (no speculation), token-identical across setups:
- the target, the embedded SmolLM2-135M (packed Q4_1, the serve default);
- a draft-sized model, a layer-skip cut of it (its first and last 2 layers, benchmarks/make_draft.py),
  the size a draft model has beside that target. Its step at 1 rank is what a drafter pays on rank 0
  beside a split target (draft_tensor_parallel_size 1); at 2 ranks, what a drafter sharded like the
  target would pay.
Setups: 1 rank with all cores' threads, 1 rank with one core's threads (what rank 0 has when the
target's ranks share the machine), and 2 ranks of one core's threads each. Prints ms per decode step
(median over prompts and repeats, after the prefill) and the ratios.

Run: python -m benchmarks.bench_tensor_parallel [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks.common import cpu_name
from benchmarks.make_draft import make_layer_skip_draft
from engine import LLM, SamplingParams
from engine.cpu_threads import usable_cpu_count
from loadtest.workloads import chat_prompts


def step_ms(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int) -> tuple[float,
                                                                                          list]:
    """Median ms per decode step (generation of max_tokens minus that of 1 token, per token), and
    the tokens."""
    def timed(prompt: list[int], tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt, "cache_salt": str(time.time())}], params)
        return time.perf_counter() - start, out[0].outputs[0].token_ids

    timed(prompts[0], 4)  # warm-up: kernels, first allocations
    samples, tokens = [], []
    for _ in range(repeats):
        for prompt in prompts:
            whole, ids = timed(prompt, max_tokens)
            first, _ = timed(prompt, 1)
            samples.append((whole - first) / (max_tokens - 1) * 1000)
            tokens.append(ids)
    return statistics.median(samples), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cores = usable_cpu_count()
    prompts = list(chat_prompts(LLM(None, num_threads=1).tokenizer).values())
    with tempfile.TemporaryDirectory() as folder:
        models = {"target (SmolLM2-135M, packed)": None,
                  "draft-sized (4 of its 30 layers)": make_layer_skip_draft(2, 2, folder)}
        setups = {f"1 rank x {cores} threads": {"num_threads": cores},
                  "1 rank x 1 thread": {"num_threads": 1},
                  "2 ranks x 1 thread": {"tensor_parallel_size": 2, "num_threads": 1}}
        print(f"CPU: {cpu_name()}, {cores} usable cores; greedy, batch 1, {args.max_tokens} "
              f"tokens, median of {args.repeats} x {len(prompts)} prompts")
        print(f"{'model':36} " + " ".join(f"{name:>20}" for name in setups)
              + "   2 ranks / 1 rank x 1   2 ranks / 1 rank x all")
        for label, model in models.items():
            times, outputs = {}, {}
            for name, settings in setups.items():
                llm = LLM(model, max_model_len=1024, kv_cache_memory_gib=0.1, **settings)
                try:
                    times[name], outputs[name] = step_ms(llm, prompts, args.max_tokens,
                                                         args.repeats)
                finally:
                    llm.close()
            same = all(tokens == outputs[next(iter(setups))] for tokens in outputs.values())
            two, one, full = (times[name] for name in
                              ("2 ranks x 1 thread", "1 rank x 1 thread", f"1 rank x {cores} threads"))
            print(f"{label:36} " + " ".join(f"{times[n]:17.1f} ms" for n in setups)
                  + f"   {two / one:21.2f}   {two / full:22.2f}"
                  + ("" if same else "   (tokens differ between setups!)"))


if __name__ == "__main__":
    main()
