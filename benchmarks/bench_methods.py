"""Every speculation method side by side on the embedded model, one run: tokens/s, α and τ per
workload (greedy, batch 1, float32), and whether each method's tokens equal plain decoding's.

Run: python -m benchmarks.bench_methods [--speculator DIR] [--eagle DIR] [--eagle3 DIR] [--draft DIR]
     [--medusa DIR] [--medusa-k 3]
     [--max-tokens 128] [--tree-budget 10] [--adaptive]
     [--repeats 2] [--threads 2] [--workloads code_editing,extraction,open_chat] [--methods ngram,...]
The MLP speculator row needs --speculator, the EAGLE row --eagle and the EAGLE-3 row --eagle3
(folders from `specserve train-speculator [--method eagle|eagle3]`, or published heads); the draft
model defaults to the layer-skip cut of benchmarks/make_draft.py. "suffix" drafts from the request's
own tokens only; "suffix+cache" also from earlier requests' outputs, which here include the same
prompt's previous repeat: the case of a repeated or agentic request, not of a fresh one. With
--tree-budget N, every method that drafts trees also runs as "<method> tree" with N nodes: chain
against tree, τ counting tokens per target pass either way. With --adaptive, every chain also runs
as "<method> adaptive": k chosen per step (at most the chain's) from measured costs and acceptance
(and each tree as "<method> tree adaptive": its node count, and which nodes, chosen alike).
The Medusa row needs --medusa (a folder from `specserve train-speculator --method medusa`, or
FasterDecoding's or vLLM's published heads).
The MTP row needs --mtp DIR: the target with its own MTP layers (a folder from `specserve
train-speculator --method mtp`, holding the embedded model's weights); that row serves DIR itself.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

from benchmarks.bench_spec import run_engine
from benchmarks.common import add_model_args, engine_kwargs, hardware_name
from benchmarks.make_draft import make_layer_skip_draft
from engine import LLM
from engine.spec_config import TREE_METHODS
from loadtest.workloads import chat_prompts


def method_configs(args: argparse.Namespace) -> dict[str, dict | None]:
    draft = args.draft or make_layer_skip_draft(4, 2, tempfile.mkdtemp(prefix="specserve-draft-"),
                                                args.model)
    configs: dict[str, dict | None] = {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
        # NOTE: without the cross-request cache: repeats of one prompt would otherwise draft from
        # the previous repeat's output (the "suffix+cache" row shows that repeated-request case)
        "suffix": {"method": "suffix", "num_speculative_tokens": 5, "suffix_max_cached_tokens": 0},
        "suffix+cache": {"method": "suffix", "num_speculative_tokens": 5},
        "draft_model": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
    }
    if args.speculator:
        configs["mlp_speculator"] = {"method": "mlp_speculator", "model": args.speculator,
                                     "num_speculative_tokens": 3}
    if args.eagle:
        configs["eagle"] = {"method": "eagle", "model": args.eagle,
                            "num_speculative_tokens": args.eagle_k}
    if args.eagle3:
        configs["eagle3"] = {"method": "eagle3", "model": args.eagle3,
                             "num_speculative_tokens": args.eagle_k}
    if args.medusa:
        configs["medusa"] = {"method": "medusa", "model": args.medusa,
                             "num_speculative_tokens": args.medusa_k}
    if args.mtp:
        configs["mtp"] = {"method": "mtp", "num_speculative_tokens": args.eagle_k}
    chains = [(name, config) for name, config in configs.items() if config is not None]
    if args.adaptive:
        for name, config in chains:
            configs[f"{name} adaptive"] = {**config, "adaptive": True}
    if args.tree_budget:
        # each chain beside its tree: the same method drafting several guesses, verified together
        for name, config in chains:
            if config["method"] in TREE_METHODS:
                tree = {**config, "draft_tree": True, "num_speculative_tokens": args.tree_budget}
                configs[f"{name} tree"] = tree
                if args.adaptive:
                    configs[f"{name} tree adaptive"] = {**tree, "adaptive": True}
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--speculator", default=None, help="MLP speculator folder")
    parser.add_argument("--eagle", default=None, help="EAGLE head folder")
    parser.add_argument("--eagle3", default=None, help="EAGLE-3 head folder")
    parser.add_argument("--eagle-k", type=int, default=3,
                        help="EAGLE and EAGLE-3 draft tokens per step")
    parser.add_argument("--medusa", default=None, help="Medusa heads folder")
    parser.add_argument("--medusa-k", type=int, default=3,
                        help="Medusa draft tokens per step (at most its number of heads)")
    parser.add_argument("--mtp", default=None,
                        help="the target with MTP layers (its row serves it; k is --eagle-k)")
    parser.add_argument("--draft", default=None, help="draft model folder (default: layer-skip)")
    parser.add_argument("--tree-budget", type=int, default=0,
                        help="also run each method that drafts trees with a tree of this many "
                             "nodes (0: chains only)")
    parser.add_argument("--adaptive", action="store_true",
                        help="also run each chain with adaptive k (at most the chain's)")
    parser.add_argument("--workloads", default="code_editing,extraction,open_chat")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of the rows (plain always runs)")
    add_model_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    wanted = None if args.methods is None else {"plain", *args.methods.split(",")}
    engines = {name: LLM(args.mtp if config and config["method"] == "mtp" else args.model,
                         **engine_kwargs(args), speculative_config=config)
               for name, config in method_configs(args).items()
               if wanted is None or name.split(" ")[0] in wanted}
    prompts = chat_prompts(engines["plain"].tokenizer)
    for llm in engines.values():
        run_engine(llm, prompts["open_chat"], 8)  # warm-up
    print(f"{hardware_name(args)}, torch {torch.__version__}, {args.dtype}, greedy, "
          f"{args.max_tokens} tokens, batch 1; tokens/s include prompt processing; "
          f"medians of {args.repeats}\n")
    print(f"{'workload':<14}{'method':<20}{'tok/s':>8}{'vs plain':>10}{'alpha':>7}{'tau':>6}"
          f"{'same':>6}")
    for workload in args.workloads.split(","):
        prompt = prompts[workload]
        rates: dict[str, list[float]] = {name: [] for name in engines}
        stats: dict[str, tuple[float, float]] = {}
        tokens: dict[str, list[int]] = {}
        for _ in range(args.repeats):  # interleaved: every method once per repeat
            for name, llm in engines.items():
                run = run_engine(llm, prompt, args.max_tokens)
                rates[name].append(run.rate)
                stats[name] = (float("nan") if run.alpha is None else run.alpha, run.tau)
                tokens[name] = run.token_ids
        plain_rate = statistics.median(rates["plain"])
        for name in engines:
            rate = statistics.median(rates[name])
            alpha, tau = stats[name]
            print(f"{workload:<14}{name:<20}{rate:>8.1f}{rate / plain_rate:>9.2f}x{alpha:>7.2f}"
                  f"{tau:>6.2f}{str(tokens[name] == tokens['plain']):>6}")


if __name__ == "__main__":
    main()
