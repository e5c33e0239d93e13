"""Speculation on the embedded model, one run: transformers greedy and prompt lookup, specserve without
speculation, with n-gram and with a draft model, on the three workloads (greedy, 128 tokens, batch 1,
float32). The draft defaults to a layer-skip cut of the target (benchmarks/make_draft.py).

Prints tokens/s (prompt processing included), τ, and how much of the speedup τ predicts was realised:
τ is the speedup if a verification pass cost what a plain decode pass costs; realised = measured decode
speedup over plain / τ (the rest is the extra cost of verifying 1 + k rows and of drafting).
Run: python -m benchmarks.bench_spec [--max-tokens 128] [--repeats 3] [--threads 2] [--k 5] [--draft DIR]
     [--model PATH --device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import NamedTuple

import torch

from benchmarks.common import (
    add_model_args,
    engine_kwargs,
    hardware_name,
    load_reference,
    synchronize,
    time_transformers,
)
from benchmarks.make_draft import make_layer_skip_draft
from engine import LLM, SamplingParams
from loadtest.workloads import chat_prompts


def run_transformers(model, prompt: list[int], max_tokens: int, lookup: int | None) -> float:
    return max_tokens / time_transformers(model, prompt, max_tokens, lookup)[0]


class EngineRun(NamedTuple):
    rate: float  # tokens/s end to end
    tau: float  # tokens per target pass over the decode steps
    decode_rate: float  # tokens/s over the decode steps
    token_ids: list[int]  # decoded after the prefill step
    alpha: float | None  # draft acceptance rate (None: nothing drafted)


def run_engine(llm: LLM, prompt: list[int], max_tokens: int) -> EngineRun:
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    core.add_request("bench", prompt, params)
    core.step()  # prefill (no drafts yet)
    steps_before, decode_start = core.totals.num_steps, time.perf_counter()
    updates = []
    while core.has_unfinished:
        updates += core.step().updates
    synchronize(str(core.worker.device))
    end = time.perf_counter()
    num_decode_tokens = sum(len(u.new_token_ids) for u in updates)
    tau = num_decode_tokens / (core.totals.num_steps - steps_before)
    return EngineRun(max_tokens / (end - start), tau, num_decode_tokens / (end - decode_start),
                     [t for u in updates for t in u.new_token_ids],
                     updates[-1].spec_stats.draft_acceptance_rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--draft-k", type=int, default=3)
    parser.add_argument("--draft", default=None, help="draft model folder (default: layer-skip)")
    parser.add_argument("--workloads", default="code_editing,extraction,open_chat")
    add_model_args(parser)
    args = parser.parse_args()
    draft = args.draft or make_layer_skip_draft(4, 2, tempfile.mkdtemp(prefix="specserve-draft-"),
                                                args.model)
    torch.set_num_threads(args.threads)
    common = engine_kwargs(args)
    plain = LLM(args.model, **common)
    ngram = LLM(args.model, **common, speculative_config={
        "method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4})
    drafted = LLM(args.model, **common, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": args.draft_k})
    reference = load_reference(args)
    prompts = chat_prompts(plain.tokenizer)
    for runner in (lambda p: run_engine(plain, p, 8), lambda p: run_engine(ngram, p, 8),
                   lambda p: run_engine(drafted, p, 8),
                   lambda p: run_transformers(reference, p, 8, None)):
        runner(prompts["open_chat"])  # warm-up
    print(f"{hardware_name(args)}, torch {torch.__version__}, {args.dtype}, greedy, "
          f"{args.max_tokens} tokens, batch 1, k={args.k}; tokens/s include prompt processing\n")
    header = ("workload", "hf greedy", "hf lookup", "plain", "ngram", "tau", "vs hf",
              "vs plain", "decode x", "realised", "draft", "tau", "same")
    print("{:<13}{:>10}{:>10}{:>8}{:>8}{:>6}{:>7}{:>9}{:>10}{:>9}{:>7}{:>6}{:>6}".format(*header))
    for name in args.workloads.split(","):
        prompt = prompts[name]
        rows = {"hf": [], "lookup": [], "plain": [], "ngram": [], "tau": [], "decode_plain": [],
                "decode_spec": [], "draft": [], "tau_draft": []}
        same = True
        for _ in range(args.repeats):  # interleaved, prompt by prompt
            rows["hf"].append(run_transformers(reference, prompt, args.max_tokens, None))
            rows["lookup"].append(run_transformers(reference, prompt, args.max_tokens, args.k))
            rate, _, decode_rate, plain_ids, _ = run_engine(plain, prompt, args.max_tokens)
            rows["plain"].append(rate)
            rows["decode_plain"].append(decode_rate)
            rate, tau, decode_rate, spec_ids, _ = run_engine(ngram, prompt, args.max_tokens)
            rows["ngram"].append(rate)
            rows["tau"].append(tau)
            rows["decode_spec"].append(decode_rate)
            rate, tau, _, draft_ids, _ = run_engine(drafted, prompt, args.max_tokens)
            rows["draft"].append(rate)
            rows["tau_draft"].append(tau)
            same &= plain_ids == spec_ids == draft_ids
        m = {key: statistics.median(values) for key, values in rows.items()}
        decode_speedup = m["decode_spec"] / m["decode_plain"]
        print(f"{name:<13}{m['hf']:>10.1f}{m['lookup']:>10.1f}{m['plain']:>8.1f}{m['ngram']:>8.1f}"
              f"{m['tau']:>6.2f}{m['ngram'] / m['hf']:>6.2f}x{m['ngram'] / m['plain']:>8.2f}x"
              f"{decode_speedup:>9.2f}x{decode_speedup / m['tau']:>8.0%}{m['draft']:>7.1f}"
              f"{m['tau_draft']:>6.2f}{str(same):>6}")
    print("\ndecode x = ngram decode tokens/s over plain (prompt processing excluded); "
          "realised = decode x / tau; draft = draft_model tokens/s and its tau; same = greedy "
          "tokens identical across plain, ngram and draft")


if __name__ == "__main__":
    main()
