"""Both sides of issue 29, replayed on fixed cost curves: the default speculation (adaptive suffix,
k <= 8) under load on text its drafts mostly miss, and alone on the held-out prompts.

1. Saturation: the held-out prompts (benchmarks/prompts_heldout.py) sampled at temperature 1 (seed i
   for prompt i), 24 requests at concurrency 8, one joining as one finishes (a load tester):
   adaptive / no speculation, and fixed k 8 / none. The aim: adaptive / none >= 0.995.
2. Batch 1: their greedy outputs, one request after another (the i-th prompt of every kind in
   turn), adaptive / the best fixed k in {2, 4, 8}, one engine for all (`persistent`) or a new one
   per request (`fresh`, the policy's cold start). The aim: >= 0.97 overall.

The outputs are decoded once (cached with --references), then every configuration is replayed
(benchmarks/adaptive_replay.py): deterministic, so the ratios do not move with the machine's load.
A step costs base + per_row * rows on each curve: `1t` 47 + 3.2 ms (1 thread, float32), `f32` 24 +
0.85 (2 threads), `q4` 7 + 0.85, `packed` 10 + 1.6 (Q4_1 weights, the CPU default: the pass is
cheap, extra rows are not).

Run: python -m benchmarks.bench_adaptive_saturation [--references refs.json]
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

from benchmarks.adaptive_replay import adaptive_policy, affine_curve, replay
from benchmarks.common import add_model_args, engine_kwargs
from benchmarks.prompts_heldout import heldout_chat_prompts

SPEC = {"method": "suffix", "num_speculative_tokens": 8, "adaptive": True}
CURVES = {"1t": (0.047, 0.0032), "f32": (0.024, 0.00085), "q4": (0.007, 0.00085),
          "packed": (0.010, 0.0016)}
FIXED_KS = (2, 4, 8)
CONCURRENCY = 8


def decode_references(args: argparse.Namespace) -> dict[str, list[dict]]:
    """{"greedy": [...], "sampled": [...]}: a {"kind", "prompt", "output"} per held-out prompt."""
    from engine import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    flat = [(kind, p) for kind, ps in heldout_chat_prompts(llm.tokenizer).items() for p in ps]
    prompts = [p for _, p in flat]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                  min_tokens=args.max_tokens))
    sampled = llm.generate(prompts, [SamplingParams(temperature=1.0, seed=i,
                                                    max_tokens=args.sampled_tokens,
                                                    min_tokens=args.sampled_tokens)
                                     for i in range(len(prompts))])
    return {name: [{"kind": kind, "prompt": prompt, "output": out.outputs[0].token_ids}
                   for (kind, prompt), out in zip(flat, outs)]
            for name, outs in (("greedy", greedy), ("sampled", sampled))}


def saturation(sampled: list[dict]) -> None:
    cases = [(r["prompt"], r["output"]) for r in sampled]
    cases = cases[0::2] + cases[1::2]  # kinds mixed in the queue
    print(f"\nSaturation: {len(cases)} sampled outputs at concurrency {CONCURRENCY}")
    print(f"{'curve':<8}{'adaptive/none':>15}{'k8/none':>9}{'verified':>10}{'kept':>6}")
    for name, (base, per_row) in CURVES.items():
        curve = affine_curve(base, per_row)
        runs = {config: replay(cases, SPEC, curve, fixed_k,
                               adaptive_policy(SPEC, curve) if fixed_k is None else None,
                               max_batch=CONCURRENCY)
                for config, fixed_k in (("none", 0), ("k8", 8), ("adaptive", None))}
        rate = {config: run.tokens_per_second for config, run in runs.items()}
        print(f"{name:<8}{rate['adaptive'] / rate['none']:>15.4f}{rate['k8'] / rate['none']:>9.3f}"
              f"{runs['adaptive'].num_draft_tokens:>10}{runs['adaptive'].num_accepted:>6}")


def batch_one(greedy: list[dict]) -> None:
    kinds = list(dict.fromkeys(r["kind"] for r in greedy))
    by_kind = {kind: [r for r in greedy if r["kind"] == kind] for kind in kinds}
    # mixed traffic: the i-th prompt of every kind in turn
    order = [r for i in range(len(by_kind[kinds[0]])) for kind in kinds
             for r in by_kind[kind][i:i + 1]]
    print(f"\nBatch 1: {len(order)} greedy outputs, adaptive / best fixed k")
    print(f"{'curve':<8}{'state':<12}" + "".join(f"{kind[:12]:>13}" for kind in kinds)
          + f"{'all':>8}{'k8/none':>9}")
    for name, (base, per_row) in CURVES.items():
        curve = affine_curve(base, per_row)
        for state in ("persistent", "fresh"):
            totals = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
            configs = [("none", 0), *((f"k{k}", k) for k in FIXED_KS), ("adaptive", None)]
            for config, fixed_k in configs:
                policy = adaptive_policy(SPEC, curve) if fixed_k is None else None
                for r in order:
                    if state == "fresh" and fixed_k is None:
                        policy = adaptive_policy(SPEC, curve)
                    run = replay([(r["prompt"], r["output"])], SPEC, curve, fixed_k, policy)
                    totals[config][r["kind"]][0] += run.num_tokens
                    totals[config][r["kind"]][1] += run.seconds

            def rate(config: str, of: list[str]) -> float:
                return (sum(totals[config][k][0] for k in of)
                        / sum(totals[config][k][1] for k in of))

            ratios = [rate("adaptive", of) / max(rate(f"k{k}", of) for k in FIXED_KS)
                      for of in [*([kind] for kind in kinds), kinds]]
            print(f"{name:<8}{state:<12}" + "".join(f"{r:>13.3f}" for r in ratios[:-1])
                  + f"{ratios[-1]:>8.3f}{rate('k8', kinds) / rate('none', kinds):>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--references",
                        help="JSON cache of the decoded outputs (written if absent)")
    parser.add_argument("--max-tokens", type=int, default=128, help="greedy output length")
    parser.add_argument("--sampled-tokens", type=int, default=96, help="sampled output length")
    add_model_args(parser)
    parser.set_defaults(threads=1)
    args = parser.parse_args()
    if args.references and os.path.exists(args.references):
        with open(args.references) as f:
            references = json.load(f)
    else:
        references = decode_references(args)
        if args.references:
            with open(args.references, "w") as f:
                json.dump(references, f)
    print(f"default {SPEC}; curves (base ms + ms per row): "
          + ", ".join(f"{n} {b * 1e3:g} + {r * 1e3:g}" for n, (b, r) in CURVES.items()))
    saturation(references["sampled"])
    batch_one(references["greedy"])


if __name__ == "__main__":
    main()
