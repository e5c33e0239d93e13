"""`specserve` command line. `generate` runs the offline engine on one prompt; `serve` comes with the server."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a reply to one chat message, offline")
    gen.add_argument("message", help="the user message (the chat template is applied)")
    gen.add_argument("--model", default=None,
                     help="local Hugging Face folder or .gguf file (default: embedded SmolLM2-135M)")
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    gen.add_argument("--speculative-config", default=None,
                     help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    gen.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              num_threads=args.num_threads, speculative_config=args.speculative_config)
    start = time.perf_counter()
    result = llm.chat([{"role": "user", "content": args.message}], params)[0]
    output = result.outputs[0]
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps({"text": output.text, "token_ids": output.token_ids,
                          "finish_reason": output.finish_reason, "seconds": seconds,
                          "speculative_decoding": result.spec_stats.as_dict()}))
    else:
        print(output.text)
        tau = result.spec_stats.mean_acceptance_length
        print(f"[{len(output.token_ids)} tokens in {seconds:.2f} s, "
              f"{len(output.token_ids) / seconds:.1f} tokens/s, tau {tau:.2f}, "
              f"finish: {output.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return run_generate(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"specserve: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
