"""The packed matmul kernel alone: the 120 decoder matmuls of one step of the embedded model (30 layers'
q|k|v, o, gate|up and down, on the packed weights the engine loads), back to back, at 1 to 12 rows and
1 and 2 threads, the working tree's kernel against a baseline build of it, interleaved.

The baseline is `git show HEAD:kernels/csrc/quantized_gemm.cpp` (or --baseline FILE), compiled with the
same flags as the engine's build under another op namespace (`specserve_baseline`) in a temporary
folder (~30 s), so both run in one process on the same weights and inputs. Every output of the two is
compared bit for bit before timing.

Run: SPECSERVE_CACHE_DIR=/tmp/ssc python -m benchmarks.bench_packed_matmul [--rows 1 2 5] [--rounds 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import cpu_name
from engine import LLM
from kernels.cpu_extension import LDFLAGS, SOURCE_DIR, cflags, cpu_arch

PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def baseline_source(path: str | None) -> str:
    if path is not None:
        return Path(path).read_text()
    return subprocess.run(["git", "show", "HEAD:kernels/csrc/quantized_gemm.cpp"], check=True,
                          capture_output=True, text=True, cwd=SOURCE_DIR.parent.parent).stdout


def build_as(source: str, namespace: str, folder: Path):
    """Compile `source` with its ops in another namespace (its anonymous-namespace symbols do not
    clash with the engine's own build); its quantized_linear op."""
    marker = "TORCH_LIBRARY_FRAGMENT(specserve, m)"
    if marker not in source:
        raise SystemExit(f"kernel source lacks {marker!r}")
    folder.mkdir()
    for header in SOURCE_DIR.glob("*.h"):
        shutil.copy(header, folder / header.name)
    cpp = folder / f"quantized_gemm_{namespace}.cpp"
    cpp.write_text(source.replace(marker, f"TORCH_LIBRARY_FRAGMENT({namespace}, m)"))
    from torch.utils import cpp_extension

    cpp_extension.load(name=f"{namespace}_quantized_gemm", sources=[str(cpp)],
                       extra_cflags=list(cflags(cpu_arch())), extra_ldflags=list(LDFLAGS),
                       build_directory=str(folder), is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace).quantized_linear


def step_seconds(op, weights, inputs) -> float:
    """One step's matmuls back to back."""
    start = time.perf_counter()
    for (groups, format_id, out_features, _), x in zip(weights, inputs):
        op(x, groups, format_id, None, out_features)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per (kernel, shape)")
    parser.add_argument("--repeats", type=int, default=5, help="steps per round (its mean)")
    parser.add_argument("--baseline", default=None, help="baseline source (default: HEAD's)")
    parser.add_argument("--candidate", default=None,
                        help="source to time against it (default: the working tree's, as the "
                             "engine builds it)")
    args = parser.parse_args()

    model = LLM(None, num_threads=max(args.threads)).engine.worker.model
    weights = []  # (groups, format id, out features, in features) of each matmul, in step order
    for layer in model.layers:
        for name in PROJECTIONS:
            weights += [(part.groups, part.format_id, *part.shape)
                        for part in layer.get_submodule(name).parts]
    with tempfile.TemporaryDirectory(prefix="bench_packed_matmul-") as folder:
        start = time.perf_counter()
        kernels = {"baseline": build_as(baseline_source(args.baseline), "specserve_baseline",
                                        Path(folder) / "baseline"),
                   "new": torch.ops.specserve.quantized_linear if args.candidate is None else
                   build_as(Path(args.candidate).read_text(), "specserve_candidate",
                            Path(folder) / "candidate")}
        print(f"built in {time.perf_counter() - start:.0f} s", flush=True)
        formats = sorted({weight[1] for weight in weights})
        print(f"CPU: {cpu_name()}; {len(weights)} matmuls per step, "
              f"{sum(w[0].numel() for w in weights) / 1e6:.1f} MB of weights, format ids {formats}; "
              f"median over {args.rounds} rounds of the mean of {args.repeats} steps, the two "
              f"kernels interleaved")
        results = {}
        for rows in args.rows:
            generator = torch.Generator().manual_seed(rows)
            inputs = [torch.randn(rows, in_features, generator=generator)
                      for *_, in_features in weights]
            for (groups, fmt, out, _), x in zip(weights, inputs):
                expected = kernels["baseline"](x, groups, fmt, None, out)
                if not torch.equal(kernels["new"](x, groups, fmt, None, out), expected):
                    raise SystemExit(f"new kernel's bits differ from the baseline at {rows} rows")
            for threads in args.threads:
                torch.set_num_threads(threads)
                times = {name: [] for name in kernels}
                for name, op in kernels.items():  # warm both
                    step_seconds(op, weights, inputs)
                for _ in range(args.rounds):
                    for name, op in kernels.items():
                        times[name].append(sum(step_seconds(op, weights, inputs)
                                               for _ in range(args.repeats)) / args.repeats)
                results[rows, threads] = {name: statistics.median(t) * 1e3
                                          for name, t in times.items()}
                print(f"rows {rows}, {threads} thread(s): " + ", ".join(
                    f"{name} {ms:.2f} ms" for name, ms in results[rows, threads].items()),
                    flush=True)
        torch.set_num_threads(max(args.threads))

    header = "".join(f" | {t} thr base | {t} thr new | ratio" for t in args.threads)
    print(f"| rows{header} |")
    print("|---:" + "|---:|---:|---:" * len(args.threads) + "|")
    for rows in args.rows:
        cells = ""
        for threads in args.threads:
            base, new = (results[rows, threads][name] for name in ("baseline", "new"))
            cells += f" | {base:.2f} | {new:.2f} | {new / base:.2f}"
        print(f"| {rows}{cells} |")
    for threads in args.threads:
        one = results[args.rows[0], threads]
        print(f"{threads} thread(s), cost relative to {args.rows[0]} row: " + ", ".join(
            f"{rows}: {results[rows, threads]['baseline'] / one['baseline']:.2f} -> "
            f"{results[rows, threads]['new'] / one['new']:.2f}" for rows in args.rows))


if __name__ == "__main__":
    main()
