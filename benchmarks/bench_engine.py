"""Single-stream and batched decoding speed of engine.LLM against transformers' greedy generate.

Both load the same embedded weights in float32 with the same thread count; configurations are
interleaved prompt by prompt after a warm-up, and medians over repeats are printed with their ratio.
Run: python -m benchmarks.bench_engine [--max-tokens 128] [--repeats 3] [--threads 2]
     [--model PATH --device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import (
    add_model_args,
    engine_kwargs,
    hardware_name,
    load_reference,
    synchronize,
    time_transformers,
)
from engine import LLM, SamplingParams
from loadtest.workloads import chat_prompts


def time_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    synchronize(str(llm.engine.worker.device))
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,4,16")
    add_model_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(args.model, **engine_kwargs(args))
    reference = load_reference(args)
    prompts = chat_prompts(llm.tokenizer)
    print(f"{hardware_name(args)}, torch {torch.__version__}, {args.dtype}, "
          f"greedy, {args.max_tokens} tokens, batch 1; tokens/s include prompt processing")

    # ---- warm-up: first calls pay for allocator and kernel-selection costs ----
    time_engine(llm, [prompts["open_chat"]], 8)
    time_transformers(reference, prompts["open_chat"], 8)

    print(f"\n{'workload':<14}{'prompt':>7}{'transformers':>14}{'specserve':>11}{'ratio':>7}  same tokens")
    ratios = []
    for name, prompt in prompts.items():
        hf_rates, our_rates, same = [], [], True
        for _ in range(args.repeats):  # interleaved: each repeat runs both back to back
            seconds, hf_tokens = time_transformers(reference, prompt, args.max_tokens)
            hf_rates.append(args.max_tokens / seconds)
            seconds, _ = time_engine(llm, [prompt], args.max_tokens)
            our_rates.append(args.max_tokens / seconds)
        ours = llm.generate({"prompt_token_ids": prompt},
                            SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                           ignore_eos=True))[0].outputs[0].token_ids
        same = ours == hf_tokens
        hf, us = statistics.median(hf_rates), statistics.median(our_rates)
        ratios.append(us / hf)
        print(f"{name:<14}{len(prompt):>7}{hf:>14.1f}{us:>11.1f}{us / hf:>6.2f}x  {same}")
    print(f"geometric-mean ratio: {statistics.geometric_mean(ratios):.2f}x")

    print("\nprompt processing (prompt tokens/s: a request for ONE output token, i.e. time to first "
          "token)")
    print(f"{'workload':<14}{'prompt':>7}{'transformers':>14}{'specserve':>11}{'ratio':>7}")
    prefill_ratios = []
    for name, prompt in prompts.items():
        hf_rates, our_rates = [], []
        for _ in range(args.repeats):
            hf_rates.append(len(prompt) / time_transformers(reference, prompt, 1)[0])
            our_rates.append(len(prompt) / time_engine(llm, [prompt], 1)[0])
        hf, us = statistics.median(hf_rates), statistics.median(our_rates)
        prefill_ratios.append(us / hf)
        print(f"{name:<14}{len(prompt):>7}{hf:>14.1f}{us:>11.1f}{us / hf:>6.2f}x")
    print(f"geometric-mean ratio: {statistics.geometric_mean(prefill_ratios):.2f}x "
          f"(aim, issue 15: >= 1, prompt processing at least transformers' rate)")

    print(f"\nbatched throughput (output tokens/s over all requests, {args.max_tokens} tokens each)")
    cycle = list(prompts.values())
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        batch_prompts = [cycle[i % len(cycle)] for i in range(batch)]
        rates = []
        for _ in range(args.repeats):
            seconds, num_tokens = time_engine(llm, batch_prompts, args.max_tokens)
            rates.append(num_tokens / seconds)
        print(f"  {batch:>3} concurrent: {statistics.median(rates):8.1f} tokens/s")


if __name__ == "__main__":
    main()
