"""One-stream decode speed with and without CUDA graphs, torch against Triton kernels, on a GPU.

A random-weights checkpoint with SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads,
intermediate 1536, vocabulary 49152, tied embeddings) in bfloat16: the speed of a decode step does
not depend on what the weights say, and no download is needed. Each configuration decodes
--tokens tokens (ignore_eos) after a short warm-up; the best of --repeats runs is kept (one run
when it took over SLOW_RUN_S).

Run on a CUDA GPU: python -m benchmarks.bench_cuda_graphs --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "0"  # NOTE: before triton is imported

import torch  # noqa: E402

SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "max_position_embeddings": 2048, "tie_word_embeddings": True,
                "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "bos_token_id": 1,
                "eos_token_id": 2}
# (gpu_kernels, enforce_eager); graphs need the Triton kernels, so torch runs eagerly either way
CONFIGS = [("torch", True), ("triton", True), ("triton", False)]
# a configuration whose first run took longer than this is not run again (keeps the script short)
SLOW_RUN_S = 4.0


def build_checkpoint(path: str, dtype: torch.dtype, seed: int = 0) -> str:
    """A Hugging Face folder (config.json + model.safetensors) of random weights, std 0.02."""
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**SMOLLM2_135M)
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim

    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": randn(config.vocab_size, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        tensors.update({
            prefix + "self_attn.q_proj.weight": randn(hidden, hidden),
            prefix + "self_attn.k_proj.weight": randn(kv, hidden),
            prefix + "self_attn.v_proj.weight": randn(kv, hidden),
            prefix + "self_attn.o_proj.weight": randn(hidden, hidden),
            prefix + "mlp.gate_proj.weight": randn(inter, hidden),
            prefix + "mlp.up_proj.weight": randn(inter, hidden),
            prefix + "mlp.down_proj.weight": randn(hidden, inter),
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
        })
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def measure(checkpoint: str, kernels: str, enforce_eager: bool, prompt: list[int], tokens: int,
            repeats: int) -> dict:
    from engine import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(checkpoint, dtype="bfloat16", device="cuda", max_model_len=1024,
              kv_cache_memory_gib=0.25, max_num_seqs=16, gpu_kernels=kernels,
              enforce_eager=enforce_eager)
    startup_s = time.perf_counter() - start
    graphs = llm.engine.worker.step_graphs
    request = [{"prompt_token_ids": prompt}]
    llm.generate(request, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    best, replays_before, runs = float("inf"), graphs.num_replays if graphs else 0, 0
    while runs < repeats and not (runs and best > SLOW_RUN_S):  # NOTE: a slow run is long enough
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = llm.generate(request, params)
        seconds = time.perf_counter() - start  # NOTE: the tokens are on the host: synced
        assert len(out[0].outputs[0].token_ids) == tokens
        best, runs = min(best, seconds), runs + 1
    result = {
        "gpu_kernels": kernels, "enforce_eager": enforce_eager, "cuda_graphs": graphs is not None,
        "tok_s": tokens / best, "ms_per_token": 1e3 * best / tokens, "startup_s": startup_s,
        "graphs_captured": len(graphs.captured) if graphs else 0,
        "capture_s": graphs.capture_seconds if graphs else 0.0,
        "runs": runs,
        "replays_per_run": (graphs.num_replays - replays_before) / runs if graphs else 0,
    }
    del llm
    torch.cuda.empty_cache()
    return result


def mode(result: dict) -> str:
    """eager (enforce_eager), graphs (captured), or "no-graph" (asked for, none captured)."""
    if result["enforce_eager"]:
        return "eager"
    return "graphs" if result["cuda_graphs"] else "no-graph"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the results as JSON")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=16)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda_graphs needs a CUDA GPU")
    import triton

    rng = random.Random(0)
    prompt = [rng.randrange(3, SMOLLM2_135M["vocab_size"]) for _ in range(args.prompt_len)]
    results = []
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        checkpoint = build_checkpoint(folder, torch.bfloat16)
        build_s = time.perf_counter() - start
        for kernels, enforce_eager in CONFIGS:
            results.append(measure(checkpoint, kernels, enforce_eager, prompt, args.tokens,
                                   args.repeats))
            r = results[-1]
            print(f"  {kernels:6s} {mode(r):8s} {r['tok_s']:8.1f} tok/s", flush=True)
    eager_torch = results[0]["tok_s"]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; SmolLM2-135M shape, random bf16 weights, one stream, "
          f"{args.tokens} tokens, prompt {args.prompt_len}, best of up to {args.repeats}")
    print(f"{'kernels':8s} {'mode':8s} {'tok/s':>8s} {'ms/tok':>7s} {'vs torch':>8s} "
          f"{'graphs':>6s} {'capture':>8s} {'start-up':>9s}")
    for r in results:
        print(f"{r['gpu_kernels']:8s} {mode(r):8s} "
              f"{r['tok_s']:8.1f} {r['ms_per_token']:7.2f} {r['tok_s'] / eager_torch:7.2f}x "
              f"{r['graphs_captured']:6d} {r['capture_s']:7.2f}s {r['startup_s']:8.2f}s")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "model": "SmolLM2-135M shape, random weights", "dtype": "bfloat16",
              "tokens": args.tokens, "prompt_len": args.prompt_len, "repeats": args.repeats,
              "checkpoint_build_s": build_s, "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
