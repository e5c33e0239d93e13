"""The embedded model on a GPU (issue 46): served with --device cuda in float32, the SDK's greedy text
against transformers' on the same weights; in bfloat16, how many held-out prompts keep plain
decoding's tokens under speculation (and in a batch against alone); one stream's tokens/s.

Run on a GPU: python -m benchmarks.gpu_embedded --model SmolLM2-135M-Instruct.Q4_1.gguf --out r.json
Each part writes its numbers into the JSON as it ends, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from benchmarks.bench_spec import run_engine
from benchmarks.common import time_transformers
from benchmarks.prompts_heldout import heldout_chat_prompts
from engine import LLM, SamplingParams
from engine.models.reference_model import load_transformers_model
from engine.spec_config import DEFAULT_SERVE_SPECULATIVE_CONFIG

# the GPU step's variants, by name: LLM(...) keywords
VARIANTS = {
    "torch": {},
    "triton": {"gpu_kernels": "triton", "enforce_eager": True},
    "triton+graphs": {"gpu_kernels": "triton"},
    "invariant": {"batch_invariant": True, "enforce_eager": True},
    "invariant+graphs": {"batch_invariant": True},
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
DEFAULT = json.loads(DEFAULT_SERVE_SPECULATIVE_CONFIG)
# cuda; cpu only to smoke-test this script where there is no GPU
DEVICE = "cuda"


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (a smoke run)"


class Results:
    def __init__(self, path: str) -> None:
        self.path, self.data = path, {"device": device_name(),
                                      "torch": torch.__version__}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)
        print(f"== {key}: {json.dumps(value)[:2000]}", flush=True)


@torch.no_grad()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' argmax, token by token with its KV cache, never stopping at EOS and never
    masking it (what ignore_eos does in the engine; generate's min_new_tokens would mask EOS)."""
    ids = torch.tensor([prompt], device=model.device)
    out = model(ids, use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(max_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]], device=model.device), past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
    return tokens


def start_server(model: str, port: int, log_path: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--device", DEVICE,
               "--dtype", "float32", "--port", str(port), "--max-model-len", "2048"]
    return subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def wait_ready(port: int, server: subprocess.Popen, timeout: float = 240.0) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the server did not answer /health")


def served_float32(args, results: Results, prompts: list[list[int]], tokenizer) -> None:
    """The server (default speculation) through the SDK against transformers, float32."""
    import openai

    torch.backends.cuda.matmul.allow_tf32 = False
    server = start_server(args.model, args.port, os.path.join(args.logs, "server_fp32.log"))
    try:
        reference = load_transformers_model(args.model, torch.float32).to(DEVICE).eval()
        started = time.perf_counter()
        want = [reference_greedy(reference, p, args.max_tokens) for p in prompts]
        reference_s = time.perf_counter() - started
        del reference
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        ready_s = wait_ready(args.port, server)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="unused")
        name = client.models.list().data[0].id

        def complete(prompt: list[int]) -> tuple[str, dict]:
            response = client.completions.create(
                model=name, prompt=prompt, max_tokens=args.max_tokens, temperature=0.0,
                extra_body={"ignore_eos": True})
            extra = response.model_extra or {}
            return response.choices[0].text, extra.get("spec_stats") or {}

        started = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(complete, prompts))
        serve_s = time.perf_counter() - started
        same = [text == tokenizer.decode(tokens, skip_special_tokens=True)
                for (text, _), tokens in zip(answers, want)]
        chat = client.chat.completions.create(
            model=name, temperature=0.0, max_tokens=args.max_tokens,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        results.put("served_float32", {
            "prompts": len(prompts), "identical_text": sum(same),
            "mismatches": [i for i, s in enumerate(same) if not s],
            "first_mismatch": next(({"got": answers[i][0], "want": tokenizer.decode(
                want[i], skip_special_tokens=True)} for i, s in enumerate(same) if not s), None),
            "server_ready_s": round(ready_s, 1), "reference_s": round(reference_s, 1),
            "served_s_8_concurrent": round(serve_s, 1),
            "chat_answer": chat.choices[0].message.content,
            "spec_stats_first": answers[0][1]})
    finally:
        server.terminate()
        server.wait(30)


def served_defaults(args, results: Results, prompts: list[list[int]],
                    workloads: dict[str, list[int]]) -> None:
    """`specserve serve --device cuda` as a user starts it (bfloat16, the GPU defaults), with its
    default speculation and with none: the same greedy text for every prompt through the SDK,
    and one stream's tokens/s through HTTP (streamed completions, 128 tokens)."""
    import openai

    from benchmarks.http_servers import SpecserveServer

    texts, speeds = {}, {}
    for label, spec in (("default", None), ("none", "none")):
        command = [sys.executable, "-m", "server.cli", "serve", "--model", args.model,
                   "--device", DEVICE, "--port", str(args.port), "--max-model-len", "2048"]
        command += ["--speculative-config", spec] if spec else []
        started = time.perf_counter()
        server = SpecserveServer(label, command, args.port)
        try:
            server.wait_ready(240)
            speeds[f"{label}/ready_s"] = round(time.perf_counter() - started, 1)
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
            name = client.models.list().data[0].id

            def complete(prompt: list[int]) -> str:
                return client.completions.create(
                    model=name, prompt=prompt, max_tokens=args.max_tokens, temperature=0.0,
                    extra_body={"ignore_eos": True}).choices[0].text

            with ThreadPoolExecutor(8) as pool:
                texts[label] = list(pool.map(complete, prompts))
            for kind, prompt in workloads.items():
                server.time_request(prompt, 16)
                timing = server.time_request(prompt, args.speed_tokens)
                speeds[f"{label}/{kind}"] = round(timing.decode_tokens_per_s, 1)
        finally:
            server.stop()
            server.log.seek(0)
            log = server.log.read()
            speeds[f"{label}/log"] = [line[-160:] for line in log.splitlines()
                                      if "graph" in line or "engine ready" in line][-3:]
    results.put("served_bf16_defaults", {
        "prompts": len(prompts),
        "identical_text_spec_vs_none": sum(a == b for a, b in zip(texts["default"],
                                                                   texts["none"])),
        "http_one_stream_tok_s": speeds})


def bf16_matches(args, results: Results, prompts: list[list[int]]) -> None:
    for variant in args.bf16_variants:
        bf16_matches_of(args, results, prompts, variant)


def bf16_matches_of(args, results: Results, prompts: list[list[int]], variant: str) -> None:
    """bfloat16: each speculation method's tokens against plain decoding's, batched and alone."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    kwargs = VARIANTS[variant]
    plain = LLM(args.model, dtype="bfloat16", device=DEVICE, max_model_len=2048, **kwargs)
    want = [o.outputs[0].token_ids for o in plain.generate(batch, params)]
    # alone: a few prompts of each kind, one at a time (each one a stream of its own)
    solo = list(range(0, len(batch), max(1, len(batch) // args.alone)))[:args.alone]
    alone = [plain.generate(batch[i], params)[0].outputs[0].token_ids for i in solo]
    out = {"prompts": len(prompts), "alone_prompts": len(solo),
           "plain_batched_vs_alone": sum(want[i] == a for i, a in zip(solo, alone))}
    plain.close()
    for label, config in (("ngram", NGRAM), ("default", DEFAULT)):
        llm = LLM(args.model, dtype="bfloat16", device=DEVICE, max_model_len=2048,
                  speculative_config=config, **kwargs)
        got = llm.generate(batch, params)
        out[f"{label}_batched_vs_plain_batched"] = sum(
            o.outputs[0].token_ids == w for o, w in zip(got, want))
        got_alone = [llm.generate(batch[i], params)[0] for i in solo]
        out[f"{label}_alone_vs_plain_alone"] = sum(
            o.outputs[0].token_ids == w for o, w in zip(got_alone, alone))
        out[f"{label}_accepted"] = sum(o.spec_stats.num_accepted_draft_tokens for o in got)
        llm.close()
    results.put(f"bf16_matches {variant}", out)


def speed(args, results: Results, workloads: dict[str, list[int]]) -> None:
    """One stream, bfloat16, greedy, ignore_eos: decode tokens/s after a warm-up run."""
    table = {}
    if args.transformers_speed:
        reference = load_transformers_model(args.model, torch.bfloat16).to(DEVICE).eval()
        for kind, prompt in workloads.items():
            time_transformers(reference, prompt, 16)
            seconds, _ = time_transformers(reference, prompt, args.speed_tokens)
            table[f"transformers/{kind}"] = round(args.speed_tokens / seconds, 1)
        del reference
    methods = {"plain": None, "ngram": NGRAM, "default": DEFAULT}
    for label in args.speed_configs:
        method, variant = label.split(" ")
        try:
            started = time.perf_counter()
            llm = LLM(args.model, dtype="bfloat16", device=DEVICE, max_model_len=2048,
                      speculative_config=methods[method], **VARIANTS[variant])
            table[f"{label}/start_s"] = round(time.perf_counter() - started, 1)
        except (TypeError, ValueError) as error:  # a flag this build does not have
            table[label] = f"skipped: {error}"
            continue
        for kind, prompt in workloads.items():
            run_engine(llm, prompt, 16)
            run = run_engine(llm, prompt, args.speed_tokens)
            table[f"{label}/{kind}"] = {"tok_s": round(run.decode_rate, 1),
                                        "tau": round(run.tau, 2)}
        llm.close()
        results.put("speed_bf16_one_stream", table)
    results.put("speed_bf16_one_stream", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--logs", default=".")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--speed-tokens", type=int, default=128)
    parser.add_argument("--alone", type=int, default=8, help="prompts also run one at a time")
    parser.add_argument("--workloads", default="code_editing,open_chat")
    parser.add_argument("--parts", default="served,bf16,speed")
    parser.add_argument("--bf16-variants", default="torch",
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--speed-configs",
                        default="plain torch,plain triton,ngram torch,default torch",
                        help="comma-separated 'METHOD VARIANT' (plain, ngram or default; a variant)")
    parser.add_argument("--transformers-speed", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--device", default="cuda", help="cuda; cpu to smoke-test the script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    args.bf16_variants = [v for v in args.bf16_variants.split(",") if v]
    args.speed_configs = [c for c in args.speed_configs.split(",") if c]
    results = Results(args.out)
    llm_tokenizer = LLM(args.model, dtype="bfloat16", device=DEVICE, max_model_len=2048)
    tokenizer = llm_tokenizer.engine.worker.tokenizer
    llm_tokenizer.close()
    by_kind = heldout_chat_prompts(tokenizer)
    prompts = [p for kind in by_kind.values() for p in kind]
    parts = args.parts.split(",")
    workloads = {k: by_kind[k][0] for k in args.workloads.split(",")}
    for part, run in (("served", lambda: served_float32(args, results, prompts, tokenizer)),
                      ("served_bf16", lambda: served_defaults(args, results, prompts, workloads)),
                      ("bf16", lambda: bf16_matches(args, results, prompts)),
                      ("speed", lambda: speed(args, results, workloads))):
        if part in parts:
            started = time.perf_counter()
            try:
                run()
            except Exception as error:  # noqa: BLE001 -- report and go on to the next part
                results.put(f"{part}_error", repr(error))
            results.put(f"{part}_seconds", round(time.perf_counter() - started, 1))


if __name__ == "__main__":
    main()
