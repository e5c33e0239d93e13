"""Where a decode step's time goes: wall time per step against the device's busy time, and the ops that
cost most, from torch.profiler over a few steps of one request.

Run: python -m benchmarks.profile_step [--model PATH --device cuda --dtype bfloat16] [--steps 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import add_model_args, engine_kwargs, hardware_name, synchronize
from engine import LLM, SamplingParams
from loadtest.workloads import chat_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    add_model_args(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, **engine_kwargs(args))
    core = llm.engine
    prompt = chat_prompts(llm.tokenizer)["open_chat"]
    params = SamplingParams(temperature=0.0, max_tokens=10 * args.steps, ignore_eos=True)
    core.add_request("warm", prompt, params)
    for _ in range(args.steps):  # prefill and warm-up
        core.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    synchronize(args.device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            core.step()
        synchronize(args.device)
    wall = (time.perf_counter() - start) / args.steps
    print(f"{hardware_name(args)}, {args.dtype}: {wall * 1e3:.2f} ms per decode step (profiled)")
    events = prof.key_averages()
    if args.device == "cuda":
        busy = sum(e.self_device_time_total for e in events) / 1e3 / args.steps
        launches = sum(e.count for e in events if e.self_device_time_total > 0) / args.steps
        print(f"GPU busy {busy:.2f} ms per step ({busy / (wall * 1e3):.0%} of wall), "
              f"~{launches:.0f} kernels per step")
        print(events.table(sort_by="self_cuda_time_total", row_limit=12))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
