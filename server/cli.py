"""`specserve` command line: `serve` runs the OpenAI-compatible server; `generate` runs the offline
engine on one chat message; `train-speculator` trains a speculator (an MLP speculator, EAGLE,
EAGLE-3 or Medusa heads, or an MTP layer) for a model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping

API_KEY_ENV = "SPECSERVE_API_KEY"
QUANTIZATION_HELP = ("auto: keep the checkpoint's quantized or 16-bit weights packed on the CPU "
                     "(GGUF blocks, bf16/f16) and compute in float32; none: expand them to --dtype "
                     "(default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(commands)
    from engine.training.arguments import add_arguments as add_training_arguments

    add_training_arguments(commands.add_parser(
        "train-speculator", help="train a speculator (--method) on the model's own answers"))
    gen = commands.add_parser("generate", help="generate a reply to one chat message, offline")
    gen.add_argument("message", help="the user message (the chat template is applied)")
    gen.add_argument("--model", default=None,
                     help="local Hugging Face folder or .gguf file (default: embedded SmolLM2-135M)")
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    gen.add_argument("--quantization", default="auto", help=QUANTIZATION_HELP)
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


def _add_serve_parser(commands) -> None:
    from engine.spec_config import DEFAULT_SERVE_SPECULATIVE_CONFIG
    from server.tools.parser_names import TOOL_CALL_PARSER_NAMES

    serve = commands.add_parser("serve", help="serve the OpenAI API (default: the embedded model)")
    serve.add_argument("--model", default=None,
                       help="local Hugging Face folder or .gguf file (default: embedded SmolLM2-135M)")
    serve.add_argument("--served-model-name", default=None,
                       help="the name clients pass as `model` (default: from the model path)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None,
                       help=f"require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on /v1, "
                            f"/tokenize and /detokenize; repeat it for several keys, each its "
                            f"own cache tenant (default: ${API_KEY_ENV}, one key; "
                            f"none set: no key is asked for; set but empty: refused)")
    serve.add_argument("--api-key-file", default=None,
                       help="a file of API keys, one per line (blank lines and lines starting "
                            "with # are skipped), added to any --api-key")
    serve.add_argument("--speculative-config", default=DEFAULT_SERVE_SPECULATIVE_CONFIG,
                       help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'; '
                            '"none" turns speculation off (default: %(default)s)')
    serve.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    serve.add_argument("--quantization", default="auto", help=QUANTIZATION_HELP)
    serve.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's trained "
                            "length)")
    serve.add_argument("--allow-long-max-model-len", action="store_true",
                       help="allow --max-model-len above the model's trained length, with a "
                            "warning (output past that length may degrade)")
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=2048)
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    serve.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="reuse the K/V of cached prompt prefixes within a tenant (API key + "
                            "cache_salt); on by default, --no-enable-prefix-caching turns it off")
    serve.add_argument("--gpu-kernels", default="auto", choices=["auto", "torch", "triton"],
                       help="what runs attention, norms, rotary and SiLU on CUDA: specserve's "
                            "Triton kernels, which CUDA graphs capture (auto, where triton is "
                            "installed), or torch ops (default: %(default)s)")
    serve.add_argument("--enforce-eager", action="store_true",
                       help="never capture CUDA graphs; by default the target's decode and "
                            "verification steps replay graphs captured at start-up (on CUDA with "
                            "the Triton kernels and one rank)")
    serve.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                       help="every row's numbers independent of what else is batched with it, so "
                            "greedy output with speculation equals output without in bfloat16 "
                            "too; on by default with the Triton kernels in bfloat16/float16 on "
                            "CUDA (--no-batch-invariant: up to ~19%% faster plain decoding, "
                            "docs/perf.md)")
    serve.add_argument("--cuda-graph-max-seqs", type=int, default=16,
                       help="the most sequences a captured step holds; larger steps run "
                            "eagerly (default: %(default)s)")
    serve.add_argument("--max-waiting-requests", type=int, default=256,
                       help="queued requests before new ones get 429")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds SIGTERM waits for in-flight requests")
    serve.add_argument("--max-body-mib", type=float, default=16.0,
                       help="request bodies above this many MiB get 413")
    serve.add_argument("--read-timeout", type=float, default=30.0,
                       help="seconds a client has to send its request headers, and again its "
                            "body; a slower one gets 408 and is disconnected")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="open HTTP connections beyond this get 503 and are closed")
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--override-generation-config", default=None,
                       help='defaults for the sampling fields a request leaves out, as JSON, '
                            'e.g. \'{"temperature": 0}\' (greedy unless a request asks '
                            'otherwise; agents such as Claude Code send no temperature)')
    serve.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSER_NAMES,
                       help="how tool calls are written and parsed (default: from the chat "
                            "template; hermes for a template that knows no tools)")
    parallel = serve.add_argument_group(
        "tensor parallelism", "the model split over ranks, one process (one GPU) each; across "
        "machines, every node runs this command with its --node-rank, node 0 the server")
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                          help="ranks the target is split over (all nodes together)")
    parallel.add_argument("--nnodes", type=int, default=1, help="machines the ranks spread over")
    parallel.add_argument("--node-rank", type=int, default=0,
                          help="this machine's place: 0 serves HTTP and schedules; others only "
                               "run their ranks")
    parallel.add_argument("--master-addr", default="127.0.0.1",
                          help="node 0's address, where the ranks meet")
    parallel.add_argument("--master-port", type=int, default=None,
                          help="node 0's port for the ranks (a free one on one node)")
    parallel.add_argument("--distributed-timeout", type=float, default=60.0,
                          help="seconds a step waits for a rank that died or hangs before the "
                               "engine reports dead")


def run_serve(args: argparse.Namespace) -> int:
    import asyncio

    # NOTE: first, before anything loads
    api_keys = resolve_api_keys(args.api_key, args.api_key_file, os.environ)
    from server.sampling_defaults import parse_generation_config

    sampling_defaults = parse_generation_config(args.override_generation_config)

    from engine.engine_args import EngineArgs

    engine_args = EngineArgs(
        model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
        max_model_len=args.max_model_len, allow_long_max_model_len=args.allow_long_max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_memory_gib=args.kv_cache_memory_gib,
        num_threads=args.num_threads, gpu_kernels=args.gpu_kernels,
        enforce_eager=args.enforce_eager, cuda_graph_max_seqs=args.cuda_graph_max_seqs,
        batch_invariant=args.batch_invariant,
        enable_prefix_caching=args.enable_prefix_caching,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
        distributed_timeout_s=args.distributed_timeout)
    engine_args.configs()  # NOTE: bad settings fail here, before the engine process starts
    engine_args.parallel_config()
    if args.model is not None and not os.path.exists(args.model):
        raise FileNotFoundError(f"--model {args.model}: no such file or folder")
    if args.node_rank > 0:
        from engine.runner.ranks import run_node

        return run_node(engine_args)
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be at least 1, got {args.max_waiting_requests}")
    if not args.max_body_mib > 0:
        raise ValueError(f"--max-body-mib must be positive, got {args.max_body_mib}")
    if not args.read_timeout > 0:
        raise ValueError(f"--read-timeout must be positive, got {args.read_timeout}")
    if args.max_connections < 1:
        raise ValueError(f"--max-connections must be at least 1, got {args.max_connections}")
    # NOTE: the engine process starts now, and loads the model while this process imports the
    # HTTP side (FastAPI, uvicorn, the tokenizer): nothing heavy is imported before this line
    from server.engine_launch import launch_engine

    launch = launch_engine(engine_args)
    from server.serve import ServerArgs, serve

    server_args = ServerArgs(host=args.host, port=args.port, api_keys=api_keys,
                             read_timeout=args.read_timeout, max_connections=args.max_connections,
                             served_model_name=args.served_model_name,
                             max_waiting_requests=args.max_waiting_requests,
                             drain_timeout=args.drain_timeout, log_level=args.log_level,
                             max_body_bytes=int(args.max_body_mib * 2**20),
                             tool_call_parser=args.tool_call_parser,
                             sampling_defaults=sampling_defaults)
    return asyncio.run(serve(engine_args, server_args, launch))


def resolve_api_keys(flags: list[str] | str | None, key_file: str | None,
                     environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys /v1 asks for, each its own tenant: every --api-key and every line of
    --api-key-file; with neither, $SPECSERVE_API_KEY; () when none is set (no key asked for)."""
    if isinstance(flags, str):
        flags = [flags]
    keys = [resolve_api_key(flag, environ) for flag in flags or []]
    if key_file is not None:
        keys += _read_key_file(key_file)
    if not keys:
        key = resolve_api_key(None, environ)
        keys = [] if key is None else [key]
    return tuple(dict.fromkeys(keys))


def _read_key_file(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--api-key-file {path}: cannot read it: {error}") from None
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:  # NOTE: an empty file must not mean "no key asked for"
        raise ValueError(f"--api-key-file {path} holds no keys: refusing to serve /v1 without one")
    if any(len(key.split()) != 1 for key in keys):
        raise ValueError(f"--api-key-file {path}: a key contains whitespace; no client could "
                         f"send it")
    return keys


def resolve_api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """One key: --api-key, else $SPECSERVE_API_KEY, else None (no key asked for).

    A key that is set but empty or blank is refused: it would let every `Bearer ` header in, and
    it usually means a deployment lost its secret (an empty Kubernetes Secret, an unset variable
    passed on as ""), which must not silently turn authentication off. Whitespace around a key is
    refused too: no client can send it in a header, so nobody could get in.
    """
    if flag is not None:
        source, key = "--api-key", flag
    else:
        source, key = API_KEY_ENV, environ.get(API_KEY_ENV)
    if key is None:
        return None
    if not key.strip():
        raise ValueError(f"{source} is set but empty: refusing to serve /v1 without a key. Set a "
                         f"non-empty key, or leave {source} unset to serve without API keys")
    if key != key.strip():
        raise ValueError(f"{source} starts or ends with whitespace (a trailing newline from a "
                         f"file?); no client could send it: strip it")
    return key


def run_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
              max_model_len=args.max_model_len,
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
        if args.command == "train-speculator":
            from engine.training.train_speculator import run as run_training

            return run_training(args)
        return run_serve(args) if args.command == "serve" else run_generate(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"specserve: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:  # server.engine_client.EngineStartError: the engine could not load
        print(f"specserve: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
