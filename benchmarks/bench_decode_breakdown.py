"""Where one plain decode token's time goes on the CPU (issue 41): through HTTP, in the engine's step,
and inside the target's forward pass, at 1 and at 5 rows (a decode, a verification of 4 drafts).

The forward pass is split by wrapping the objects that do each part, on the real model at a real
context (the embedded model, packed, after a held-out prompt's prefill):

    matmuls      every packed linear of the 30 layers (QuantizedLinear)
    LM head      the rows' logits (compute_logits, its linear included)
    attention    the KV write and the paged attention, per layer
    other ops    RMSNorm (+ residual add), rotary, SiLU-and-multiply (the fused C++ ops)
    the rest     what no wrapper holds: the embedding lookup, Python and torch dispatch between the
                 ops, each op's thread-team fork and join, residual adds

On the native pass (engine/models/native_pass.py) the parts come from its own stage clock (thread 0,
each stage's barrier wait included): the matmul stages, rotary + KV write + attention, the norms,
the LM head (in the pass where the model's head is packed);
"the rest" is then the embedding, the rotary tables and the call itself. Both paths are measured pass
by pass alternately. The wrappers cost ~1 us a call (measured and reported; ~0.4 ms over a pass's ~400 calls), which
lands in the parts, not in "the rest". The engine's step is split as benchmarks/bench_host_work does
(forward against everything else: scheduling, inputs, sampling, committing); HTTP against the engine
is a streamed completion's time per token against the step's, on a server started here.

Run: python -m benchmarks.bench_decode_breakdown [--threads 2] [--passes 60] [--out r.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from benchmarks.common import cpu_name
from benchmarks.http_servers import SpecserveServer, free_port
from benchmarks.prompts_heldout import heldout_chat_prompts
from engine import LLM, SamplingParams
from engine.models import llama
from engine.models.cpu_linear import QuantizedLinear
from engine.step.types import SequenceRows

PARTS = ("matmuls", "LM head", "attention", "other ops")


def wrap(totals: dict[str, float], name: str, fn, active: list[bool] | None = None):
    """`fn`, its seconds added to totals[name]; with `active`, only the outermost wrapped call
    counts (the LM head's linear is the LM head's, not a matmul's)."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        if active is not None and active[0]:
            return fn(*args, **kwargs)
        if active is not None:
            active[0] = True
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
            if active is not None:
                active[0] = False
    return timed


class Wrapped:
    """Every part's callables wrapped while inside the `with`; `totals` accumulates seconds."""

    def __init__(self, model) -> None:
        self.model, self.totals = model, defaultdict(float)
        self.saved: list[tuple[object, str, object]] = []
        self.active = [False]

    def patch(self, owner, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)
        self.saved.append((owner, attribute, original))
        setattr(owner, attribute, wrap(self.totals, name, original, self.active))

    def __enter__(self) -> Wrapped:
        self.patch(QuantizedLinear, "forward", "matmuls")
        self.patch(self.model, "compute_logits", "LM head")
        self.patch(llama, "paged_attention", "attention")
        self.patch(llama, "write_kv", "attention")
        fused = self.model.layers[0].fused_ops
        if fused is not None:
            for op in ("rms_norm", "add_rms_norm", "rotary_", "silu_and_mul"):
                self.patch(fused, op, "other ops")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attribute, original in reversed(self.saved):
            setattr(owner, attribute, original)


def forward_parts(llm: LLM, seq_id: str, context: int, rows: int, passes: int
                  ) -> dict[str, dict[str, float]]:
    """Median ms of each part of one forward pass of `rows` rows after `context` tokens, on the
    torch path ("torch") and, where the model has it, the native pass ("native"), pass by pass
    alternately so both see the same machine."""
    worker = llm.engine.worker
    runner, model = worker.runner, worker.model
    native_pass = model.native_pass
    assert runner.reserve(seq_id, context + rows)
    inputs = runner.prepare([SequenceRows(seq_id, context, [42] * rows)])
    every_row = torch.arange(rows)  # a verification samples at every row
    paths = ("torch", "native") if native_pass is not None else ("torch",)
    samples = {path: defaultdict(list) for path in paths}
    try:
        with torch.inference_mode():
            for i in range(passes + 5):
                for path in paths:
                    model.native_pass = native_pass if path == "native" else None
                    if path == "native":
                        native_pass.set_profiling(True)
                    with Wrapped(model) as wrapped:
                        start = time.perf_counter()
                        runner.run_with_logits(inputs, every_row)
                        total = time.perf_counter() - start
                    if i < 5:  # warm-up passes are not counted
                        continue
                    parts = dict(wrapped.totals)
                    if path == "native":
                        parts.update(native_parts(native_pass.stage_seconds()))
                    got = samples[path]
                    got["pass"].append(total)
                    for part in PARTS:
                        got[part].append(parts.get(part, 0.0))
                    got["the rest"].append(total - sum(parts.get(p, 0.0) for p in PARTS))
    finally:
        model.native_pass = native_pass
        if native_pass is not None:
            native_pass.set_profiling(False)
    return {path: {name: statistics.median(values) * 1e3 for name, values in got.items()}
            for path, got in samples.items()}


def native_parts(stages: dict[str, float]) -> dict[str, float]:
    """The native pass's stage clock (thread 0, barrier waits included) in the table's parts."""
    parts = {"matmuls": sum(stages[s] for s in ("q|k|v", "o-projection", "gate|up + SiLU",
                                                "down-projection")),
             "attention": stages["rotary + KV write"] + stages["attention"],
             "other ops": stages["norms"]}
    if stages["LM head"]:  # else a separate op, timed by its wrapper
        parts["LM head"] = stages["LM head"]
    return parts


def wrapper_cost_us() -> float:
    totals: dict[str, float] = defaultdict(float)
    noop = wrap(totals, "x", lambda: None)
    start = time.perf_counter()
    for _ in range(20000):
        noop()
    return (time.perf_counter() - start) / 20000 * 1e6


def engine_step(llm: LLM, prompt: list[int], steps: int) -> dict[str, float]:
    """Median ms of a plain decode step and of its forward (the rest is the engine's host work)."""
    core = llm.engine
    core.add_request("step", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8,
                                                    ignore_eos=True))
    core.step()  # prefill
    core.step()
    model = core.worker.model
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        totals: dict[str, float] = defaultdict(float)
        forward = model.forward_with_logits  # the step's pass and its logits (worker.execute)
        model.forward_with_logits = wrap(totals, "forward", forward)
        start = time.perf_counter()
        core.step()
        samples["step"].append(time.perf_counter() - start)
        samples["forward"].append(totals["forward"])
        model.forward_with_logits = forward
    core.abort(["step"])
    return {name: statistics.median(values) * 1e3 for name, values in samples.items()}


def http_token_ms(prompt: list[int], tokens: int, threads: int | None) -> float:
    """ms per token of a streamed greedy completion, no speculation, after a warm-up request."""
    port = free_port()
    command = [sys.executable, "-m", "server.cli", "serve", "--port", str(port),
               "--speculative-config", "none"]
    command += ["--num-threads", str(threads)] if threads else []
    server = SpecserveServer("plain", command, port)
    try:
        server.wait_ready(600)
        server.time_request(prompt, 16)
        timings = [server.time_request(prompt, tokens) for _ in range(2)]
    finally:
        server.stop()
    return min(1e3 / t.decode_tokens_per_s for t in timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--passes", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per HTTP request")
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    llm = LLM(None, num_threads=args.threads, max_model_len=2048)
    prompt = heldout_chat_prompts(llm.engine.worker.tokenizer)["open_chat"][0]
    # a context of the prompt plus some output, as a decode step mid-answer sees
    core = llm.engine
    core.add_request("ctx", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while core.has_unfinished:
        core.step()
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(),
              "context": len(prompt) + 64, "wrapper_us_per_call": round(wrapper_cost_us(), 2)}
    core.worker.runner.reserve("bench", len(prompt) + 80)
    for rows in (1, 5):
        for path, parts in forward_parts(llm, "bench", len(prompt) + 64, rows,
                                         args.passes).items():
            result[f"forward_{path}_{rows}_rows_ms"] = {k: round(v, 2) for k, v in parts.items()}
    core.worker.runner.free("bench")
    result["engine_step_ms"] = {k: round(v, 2) for k, v in
                                engine_step(llm, prompt, args.passes).items()}
    llm.close()
    if not args.no_http:
        result["http_token_ms"] = round(http_token_ms(prompt, args.tokens, args.threads), 2)
    print_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def print_table(result: dict) -> None:
    print(f"CPU: {result['cpu']}, {result['threads']} threads, context {result['context']} "
          f"tokens; wrappers {result['wrapper_us_per_call']} us a call")
    paths = [p for p in ("torch", "native") if f"forward_{p}_1_rows_ms" in result]
    header = "".join(f"{p + ', ' + str(r) + ' row' + ('s' if r > 1 else '') + ' ms':>20}"
                     for p in paths for r in (1, 5))
    print(f"{'part':<34}{header}")
    for part in (*PARTS, "the rest", "pass"):
        cells = "".join(f"{result[f'forward_{p}_{r}_rows_ms'][part]:>20.2f}"
                        for p in paths for r in (1, 5))
        print(f"{'  forward: ' + part:<34}{cells}")
    step = result["engine_step_ms"]
    print(f"{'engine step (plain decode)':<34}{step['step']:>10.2f}")
    print(f"{'  of which the forward':<34}{step['forward']:>10.2f}")
    print(f"{'  host work (schedule, sample...)':<34}{step['step'] - step['forward']:>10.2f}")
    if "http_token_ms" in result:
        http = result["http_token_ms"]
        print(f"{'token through HTTP (streamed)':<34}{http:>10.2f}")
        print(f"{'  IPC + HTTP process':<34}{http - step['step']:>10.2f}")


if __name__ == "__main__":
    main()
