"""Drafting's cost per step: the proposer's seconds in each engine step (its passes and its sampling),
for EAGLE, EAGLE-3 and the draft model on the embedded model, greedy and sampled, one request and a
batch of four. Run it on two trees (a worktree of the old commit, then this one) to compare a
change to the drafting path; within one run the methods are measured one after the other.

The heads are random (seed 0), so their drafts are rarely accepted: the steps measured are every
step's drafting, whatever the verification keeps. The draft model is the embedded model itself.

Run: python -m benchmarks.bench_drafting [--steps 40] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace

from benchmarks.common import cpu_name
from benchmarks.output_fingerprint import random_heads
from engine import LLM, SamplingParams
from engine.models.loader import embedded_gguf_path

PROMPTS = ["Write a short story about a lighthouse keeper.",
           "List ten fruits and say one thing about each.",
           "Explain how a hash map works, step by step.",
           "Describe the water cycle to a child."]
SAMPLING = {"greedy": SamplingParams(temperature=0.0, ignore_eos=True),
            "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=1, ignore_eos=True)}


def draft_ms_per_step(llm: LLM, prompts: list[str], params: SamplingParams, steps: int) -> float:
    """Median ms the proposer takes in a decode step, over `steps` steps after the prefill."""
    core = llm.engine
    proposer = core.proposer
    spent: list[float] = []
    propose = proposer.propose

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return propose(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    proposer.propose = timed
    try:
        llm.generate(prompts, replace(params, max_tokens=steps + 8))
    finally:
        proposer.propose = propose
    return statistics.median(spent[2:]) * 1e3  # NOTE: the prefill's step and the first are warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"cpu": cpu_name()}
    with tempfile.TemporaryDirectory(prefix="bench_drafting-") as folder:
        plain = LLM(None, num_threads=2)
        prompts = [plain.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
        heads = random_heads(plain, folder)
        plain.close()
        configs = {"eagle": {"method": "eagle", "model": heads["eagle"]},
                   "eagle3": {"method": "eagle3", "model": heads["eagle3"]},
                   "draft_model": {"method": "draft_model", "model": embedded_gguf_path()}}
        print(f"CPU: {result['cpu']}; median ms of drafting per engine step, k = 4")
        for method, config in configs.items():
            llm = LLM(None, num_threads=2, max_num_seqs=4,
                      speculative_config={**config, "num_speculative_tokens": 4})
            for name, params in SAMPLING.items():
                for batch in (1, 4):
                    ms = draft_ms_per_step(llm, prompts[:batch], params, args.steps)
                    result[f"{method} {name} batch {batch}"] = round(ms, 3)
                    print(f"{method:>12} {name:>8} batch {batch}: {ms:7.2f} ms", flush=True)
            llm.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
