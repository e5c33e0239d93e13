"""The default speculation (adaptive suffix, k <= 8) against fixed suffix k in {2, 4, 8} and no
speculation, on held-out prompts (benchmarks/prompts_heldout.py) the policy was never tuned on.

Two measurements, side by side:
1. The engine, one request at a time, greedy, the configurations interleaved request by request
   (each prompt runs once per configuration before the next prompt): decode tokens/s, target
   passes, α. Each output is checked token-identical to no speculation's.
2. The same requests replayed (benchmarks/adaptive_replay.py) on the adaptive engine's own
   calibrated cost curve, with the policy learning as it goes: deterministic, so the ratios do not
   move with whatever else runs on the machine. `--replay-only` skips the engine runs' timing
   (the references are still decoded once) and also replays each kind's prompts as one batch.

Run: python -m benchmarks.bench_adaptive_heldout [--prompts-per-kind 6] [--max-tokens 128]
     [--threads 1] [--replay-only]
The aim (issue 29): adaptive >= 97% of the best fixed k on every kind and overall.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from benchmarks.adaptive_replay import adaptive_policy, replay
from benchmarks.common import add_model_args, engine_kwargs, hardware_name
from benchmarks.prompts_heldout import heldout_chat_prompts
from engine import LLM, SamplingParams
from engine.spec_config import DEFAULT_SERVE_SPECULATIVE_CONFIG, SpeculativeConfig

FIXED_KS = (2, 4, 8)
CONFIGS = ("none", *(f"k{k}" for k in FIXED_KS), "adaptive")
AIM = 0.97


def build_engines(args: argparse.Namespace) -> dict[str, LLM]:
    common = engine_kwargs(args)
    default = SpeculativeConfig.from_json(DEFAULT_SERVE_SPECULATIVE_CONFIG)
    engines = {"none": LLM(args.model, **common)}
    for k in FIXED_KS:
        engines[f"k{k}"] = LLM(args.model, **common, speculative_config={
            "method": default.method, "num_speculative_tokens": k})
    engines["adaptive"] = LLM(args.model, **common,
                              speculative_config=DEFAULT_SERVE_SPECULATIVE_CONFIG)
    return engines


def decode_one(llm: LLM, prompt: list[int], max_tokens: int, salt: str) -> dict:
    """One request alone: its tokens, decode seconds (after the prefill step), passes, drafts."""
    core = llm.engine
    core.add_request(salt, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                  min_tokens=max_tokens), cache_salt=salt)
    tokens = []
    for update in core.step().updates:  # prefill
        tokens += update.new_token_ids
    start, num_steps, num_drafts, num_accepted = time.perf_counter(), 0, 0, 0
    while core.has_unfinished:
        result = core.step()
        for update in result.updates:
            tokens += update.new_token_ids
        num_steps += 1
        num_drafts += result.stats.num_draft_tokens
        num_accepted += result.stats.num_accepted_tokens
    return {"tokens": tokens, "seconds": time.perf_counter() - start, "steps": num_steps,
            "decoded": len(tokens) - 1, "drafts": num_drafts, "accepted": num_accepted}


def print_table(title: str, totals: dict[str, dict[str, dict[str, float]]], kinds: list[str]) -> None:
    """totals[kind][config] = {"tokens", "seconds", "steps", "drafts", "accepted"}."""
    print(f"\n{title}")
    print(f"{'kind':<13}" + "".join(f"{c + ' tok/s':>15}" for c in CONFIGS)
          + f"{'ad/best k':>11}{'ad/none':>9}{'α k8':>6}{'α ad':>6}{'steps k8':>9}{'steps ad':>9}")
    for kind in [*kinds, "all"]:
        rows = {c: _sum(totals, kinds if kind == "all" else [kind], c) for c in CONFIGS}
        rate = {c: r["tokens"] / r["seconds"] for c, r in rows.items()}
        best = max(rate[f"k{k}"] for k in FIXED_KS)
        ratio = rate["adaptive"] / best
        print(f"{kind:<13}" + "".join(f"{rate[c]:>15.1f}" for c in CONFIGS)
              + f"{ratio:>10.3f}{'' if ratio >= AIM else '!'}{rate['adaptive'] / rate['none']:>9.3f}"
              + f"{_alpha(rows['k8']):>6}{_alpha(rows['adaptive']):>6}"
              + f"{rows['k8']['steps']:>9.0f}{rows['adaptive']['steps']:>9.0f}")


def _sum(totals, kinds, config) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for kind in kinds:
        for key, value in totals[kind][config].items():
            out[key] += value
    return out


def _alpha(row: dict[str, float]) -> str:
    return f"{row['accepted'] / row['drafts']:.2f}" if row["drafts"] else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-per-kind", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--replay-only", action="store_true",
                        help="decode the references once without speculation, replay the rest")
    add_model_args(parser)
    parser.set_defaults(threads=1)
    args = parser.parse_args()
    engines = ({"none": LLM(args.model, **engine_kwargs(args)),
                "adaptive": LLM(args.model, **engine_kwargs(args),
                                speculative_config=DEFAULT_SERVE_SPECULATIVE_CONFIG)}
               if args.replay_only else build_engines(args))
    prompts = heldout_chat_prompts(engines["none"].tokenizer)
    kinds = list(prompts)
    # mixed traffic: the i-th prompt of every kind in turn
    order = [(kind, i) for i in range(args.prompts_per_kind) for kind in kinds]
    print(f"{hardware_name(args)}, {args.dtype}, greedy, {args.max_tokens} tokens, batch 1, "
          f"default {DEFAULT_SERVE_SPECULATIVE_CONFIG}; {len(order)} held-out prompts")
    calibrated = engines["adaptive"].engine.adaptive.cost
    tokens_at = np.array(sorted(p[0] for p in calibrated._points.values()))
    curve_points = calibrated.verify_seconds(tokens_at)
    print("adaptive engine's calibrated pass (ms): " + " ".join(
        f"{int(n)}:{s * 1e3:.1f}" for n, s in zip(tokens_at, curve_points)))

    measured = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
    references: dict[tuple[str, int], list[int]] = {}
    mismatches = []
    configs = ["none"] if args.replay_only else list(CONFIGS)
    for turn, (kind, i) in enumerate(order):
        rotated = configs[turn % len(configs):] + configs[:turn % len(configs)]
        outputs = {}
        for config in rotated:
            run = decode_one(engines[config], prompts[kind][i], args.max_tokens,
                             f"{config}-{kind}-{i}")
            outputs[config] = run["tokens"]
            for key in ("seconds", "steps", "drafts", "accepted"):
                measured[kind][config][key] += run[key]
            measured[kind][config]["tokens"] += run["decoded"]
        references[kind, i] = outputs["none"]
        mismatches += [f"{config} {kind} {i}" for config, tokens in outputs.items()
                       if tokens != outputs["none"]]
        print(f"  {turn + 1}/{len(order)} {kind} {i}", flush=True)
    if not args.replay_only:
        print_table("Engine (decode tokens/s, interleaved request by request):", measured, kinds)
        print("greedy output identical to no speculation: "
              + ("yes, every request" if not mismatches else f"NO: {mismatches}"))

    def curve(n):
        return calibrated.verify_seconds(np.asarray(n))

    spec = SpeculativeConfig.from_json(DEFAULT_SERVE_SPECULATIVE_CONFIG)
    spec_dict = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                 "adaptive": True}
    for is_batched in (False, True) if args.replay_only else (False,):
        replayed = defaultdict(lambda: defaultdict(lambda: defaultdict(float)))
        policy = adaptive_policy(spec_dict, curve)
        for config in CONFIGS:
            fixed_k = None if config == "adaptive" else (0 if config == "none" else int(config[1:]))
            groups = ([[(kind, i) for i in range(args.prompts_per_kind)] for kind in kinds]
                      if is_batched else [[key] for key in order])
            for group in groups:
                cases = [(prompts[kind][i], references[kind, i]) for kind, i in group]
                result = replay(cases, spec_dict, curve, fixed_k, policy)
                row = replayed[group[0][0]][config]
                # NOTE: the first token comes from prefill, as in the engine's decode count
                row["tokens"] += result.num_tokens
                row["seconds"] += result.seconds
                row["steps"] += result.num_steps
                row["drafts"] += result.num_draft_tokens
                row["accepted"] += result.num_accepted
        batch = f"each kind's {args.prompts_per_kind} as one batch" if is_batched else "batch 1"
        print_table(f"Replayed on that curve ({batch}, deterministic):", replayed, kinds)


if __name__ == "__main__":
    main()
