"""The target sampler's cost per row (engine/step/rejection.RejectionSampler, the whole step:
processing, p, uniforms, kernels, the output transfer), unseeded beside seeded, now beside an
earlier commit's, from one run: `python -m benchmarks.bench_sampler [--before REV]`.

--before REV exports that commit (`git archive`) into a temporary folder and times the same cases
there, in subprocesses alternating with the working tree's, round after round, each case's best
kept: the two columns come from the same machine and the same minutes. Cases:
batch 8 at vocabulary 49152 (SmolLM's), k 0 (plain decoding) and k 5 (one-hot drafts, n-gram
style, half of them right), temperature 0.8 with top-p 0.95 (the sort is most of p's cost) and
without top-p (temperature alone: what the rest costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CASES = [(8, 0, 0.95), (8, 5, 0.95), (8, 0, 1.0), (8, 5, 1.0)]  # (batch, k, top_p)
VOCAB = 49152
MODES = ("unseeded", "seeded")


def time_case(batch: int, k: int, top_p: float, seeded: bool, repeats: int, device: str) -> float:
    """Median seconds of one sampler step over `batch` requests with k one-hot drafts each."""
    from engine.request import Request
    from engine.sampling_params import SamplingParams
    from engine.step.layout import StepLayout
    try:
        from engine.step.rejection import RejectionSampler
    except ImportError:  # a --before commit from before the sampler moved to engine/step/
        from engine.sample.rejection import RejectionSampler
    from engine.step.types import ScheduledRequest

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch * (k + 1), VOCAB, generator=gen) * 4  # [rows, vocab]
    argmax = logits.argmax(dim=-1).tolist()
    items = []
    for i in range(batch):
        params = SamplingParams(temperature=0.8, top_p=top_p, seed=i if seeded else None)
        request = Request(f"r{i}", [1, 2, 3], params, frozenset({0}))
        request.output_token_ids = [5] * (10 + i)
        # NOTE: half the drafts are the rows' argmax (likely kept), half are not
        drafts = [argmax[i * (k + 1) + j] if j % 2 == 0 else 7 for j in range(k)]
        items.append(ScheduledRequest(request, 1 + k, True, drafts))
    logits = logits.to(device)
    sampler = RejectionSampler()
    times = []
    for _ in range(repeats + 2):
        # NOTE: the layout is built by the scheduler, outside the sampler's time, as in the engine
        layout = StepLayout.build(items, torch.device(device))
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        sampler(logits, layout)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def measure(repeats: int, device: str) -> dict[str, float]:
    """{"batch,k,top_p,mode": microseconds per row}."""
    results = {}
    for batch, k, top_p in CASES:
        for mode in MODES:
            seconds = time_case(batch, k, top_p, mode == "seeded", repeats, device)
            results[f"{batch},{k},{top_p},{mode}"] = seconds / (batch * (k + 1)) * 1e6
    return results


def measure_at(tree: str, repeats: int, device: str, threads: int) -> dict[str, float]:
    """The same measurement run by this script on the engine in folder `tree`, in a subprocess."""
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--json", "--repeats", str(repeats),
         "--device", device, "--threads", str(threads)],
        cwd=tree, env={**os.environ, "PYTHONPATH": tree}, check=True, capture_output=True,
        text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(revision: str | None, rounds: int, repeats: int, device: str,
            threads: int) -> tuple[dict[str, float], dict[str, float]]:
    """(now, before): each case's best over `rounds` rounds that alternate the working tree and
    `revision`'s, so that load from other work on the machine weighs on both alike."""
    now: dict[str, float] = {}
    before: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        if revision:
            archive = subprocess.run(["git", "archive", revision], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        for _ in range(rounds):
            trees = [(now, str(ROOT))] + ([(before, folder)] if revision else [])
            for best, tree in trees:
                for key, value in measure_at(tree, repeats, device, threads).items():
                    best[key] = min(best.get(key, value), value)
    return now, before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="a git revision to time beside the working tree")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--json", action="store_true", help="print this tree's numbers as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.json:
        print(json.dumps(measure(args.repeats, args.device)))
        return
    now, before = compare(args.before, args.rounds, args.repeats, args.device, args.threads)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"sampler cost per row, us (best of {args.rounds} rounds' medians of {args.repeats}), "
          f"vocab {VOCAB}, {device}")
    header = f"{'batch':>5} {'k':>2} {'top_p':>5} {'mode':>9} {'now':>9}"
    print(header + (f" {'before':>9} {'now/before':>10}" if before else ""))
    for key, value in now.items():
        batch, k, top_p, mode = key.split(",")
        line = f"{batch:>5} {k:>2} {top_p:>5} {mode:>9} {value:>9.1f}"
        if key in before:
            line += f" {before[key]:>9.1f} {value / before[key]:>10.2f}"
        print(line)


if __name__ == "__main__":
    main()
