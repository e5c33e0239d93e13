"""The embedded model's target pass on its packed Q4_1/Q8_0 weights against the same model expanded to
float32, side by side in one process, interleaved: 1 to 9 rows (decode and verification) and a
prefill chunk; the packed decode step against its floor (the packed bytes at the measured read
bandwidth) and, where it is compute-bound, the FLOP rate it reaches.

Run: python -m benchmarks.bench_packed_weights [--rows 1 2 5 9] [--prefill 512] [--repeats 15]
The aims (issue 29): a packed decode step <= 1.3x its floor, or the FLOP rate where compute-bound;
packed prefill at least as fast as float32's.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_verify_cost import pass_seconds, read_bandwidth, weight_bytes
from benchmarks.common import cpu_name
from engine import LLM

FLOOR_AIM = 1.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    engines = {name: LLM(None, dtype=dtype, max_model_len=2048, num_threads=args.threads)
               for name, dtype in (("packed", "auto"), ("float32", "float32"))}
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; median of {args.repeats} passes "
          f"per size, the two engines interleaved in 3 rounds")
    bandwidth = read_bandwidth()
    sizes = {name: weight_bytes(llm.engine.worker.model) for name, llm in engines.items()}
    arch = engines["packed"].engine.worker.arch
    # multiply-adds per row: every decoder matmul and the LM head
    params = arch.num_layers * (arch.hidden_size * (arch.q_size + 2 * arch.kv_size)
                                + arch.q_size * arch.hidden_size
                                + 3 * arch.hidden_size * arch.intermediate_size) \
        + arch.vocab_size * arch.hidden_size
    for name, size in sizes.items():
        print(f"{name}: {size / 1e6:.0f} MB streamed per pass, floor {size / bandwidth * 1e3:.1f} ms "
              f"at {bandwidth / 1e9:.1f} GB/s read")
    shapes = [(args.context, rows) for rows in args.rows] + [(0, args.prefill)]
    times = {(name, shape): [] for name in engines for shape in shapes}
    for _ in range(3):
        for shape in shapes:
            for name, llm in engines.items():
                repeats = max(3, args.repeats // 3 if shape[1] <= 16 else 1)
                times[name, shape].append(pass_seconds(llm, shape[0], shape[1], repeats))
    print(f"{'rows':>6} {'packed ms':>10} {'float32 ms':>11} {'packed/f32':>11} {'GFLOP/s':>8}")
    for shape in shapes:
        packed = statistics.median(times["packed", shape]) * 1e3
        expanded = statistics.median(times["float32", shape]) * 1e3
        gflops = 2 * params * shape[1] / (packed / 1e3) / 1e9
        label = f"{shape[1]}" + (" (prefill)" if shape[0] == 0 else "")
        print(f"{label:>6} {packed:>10.1f} {expanded:>11.1f} {packed / expanded:>11.2f} {gflops:>8.1f}")
    one_row = statistics.median(times["packed", shapes[0]])
    floor = sizes["packed"] / bandwidth
    print(f"packed decode step ({args.rows[0]} row): {one_row / floor:.2f}x its floor (aim <= "
          f"{FLOOR_AIM}: {'met' if one_row / floor <= FLOOR_AIM else 'NOT met'}); "
          f"{2 * params / one_row / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
