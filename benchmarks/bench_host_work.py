"""Host work per engine step: everything outside the target forward (scheduling, inputs and attention
metadata, sampling, commit, drafting), as a share of the step, at several batch sizes.

Each phase of EngineCore.step() is timed by wrapping the object that does it, so the numbers come from
the real step, not a re-implementation. Run: python -m benchmarks.bench_host_work [--batch 1 32]
[--steps 40] [--spec '{"method": "suffix", "num_speculative_tokens": 4}'] [--threads N]
The aim (issue 15): host work <= 10% of a step at batch 1 and at batch 32.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.common import cpu_name
from engine import LLM, SamplingParams
from engine.models.llama import LlamaForCausalLM
from loadtest.workloads import chat_prompts

AIM = 0.10


def timed(totals: dict[str, float], name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start
    return wrapper


def measure(llm: LLM, batch: int, steps: int) -> dict[str, float]:
    """Median seconds per decode step of each phase, with `batch` requests decoding."""
    core = llm.engine
    prompts = list(chat_prompts(llm.tokenizer).values())
    params = SamplingParams(temperature=0.0, max_tokens=steps * 10, min_tokens=steps * 10)
    for i in range(batch):
        core.add_request(f"b{batch}-{i}", prompts[i % len(prompts)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.requests.values()
              if r.request_id.startswith(f"b{batch}-")) or len(core.scheduler.waiting):
        core.step()  # prefill every request first: only decode steps are measured
    core.step()
    samples: dict[str, list[float]] = defaultdict(list)
    model = core.worker.model
    forward = model.forward_with_logits
    for _ in range(steps):
        totals: dict[str, float] = defaultdict(float)
        # NOTE: the target forward is the decoder layers and the LM head (worker.execute's call)
        model.forward_with_logits = timed(totals, "target forward", forward)
        start = time.perf_counter()
        core.step()
        totals["step"] = time.perf_counter() - start
        for name, seconds in totals.items():
            samples[name].append(seconds)
    model.forward_with_logits = forward
    core.abort([f"b{batch}-{i}" for i in range(batch)])
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--spec", default=None, help="speculative config JSON (default: none)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    llm = LLM(None, dtype="float32", max_model_len=4096, num_threads=args.threads,
              max_num_seqs=max(args.batch), speculative_config=args.spec)
    assert isinstance(llm.engine.worker.model, LlamaForCausalLM)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, speculation: {args.spec or 'none'}")
    print(f"{'batch':>5} {'step ms':>8} {'forward ms':>10} {'host ms':>8} {'host share':>10}")
    for batch in args.batch:
        phases = measure(llm, batch, args.steps)
        host = phases["step"] - phases["target forward"]
        share = host / phases["step"]
        print(f"{batch:>5} {phases['step'] * 1e3:>8.1f} {phases['target forward'] * 1e3:>10.1f} "
              f"{host * 1e3:>8.1f} {share:>10.1%}  (aim <= {AIM:.0%}: "
              f"{'met' if share <= AIM else 'NOT met'})")


if __name__ == "__main__":
    main()
