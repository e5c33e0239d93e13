"""Start-up cost of loading a checkpoint: the embedded model packed and expanded, a .gguf given by
path (its config and tokenizer cached, and a first start that converts them), and (with
--float32-folder) a float32 Hugging Face folder such as the ~538 MB cache older specserve versions
converted the embedded model into. Each load runs in a fresh process (a server starts once), the
configurations interleaved round by round; medians are printed.

Run: python -m benchmarks.bench_checkpoint_load [--rounds 3] [--float32-folder DIR]
     [--transformers-gguf]  (also time transformers' whole-model GGUF load, ~25 s a round)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import cpu_name

LOAD = """
import time, torch
from engine.models.loader import load_checkpoint
start = time.perf_counter()
load_checkpoint({model!r}, torch.float32, packed={packed})
print(time.perf_counter() - start)
"""
TRANSFORMERS_GGUF = """
import os, time, torch, transformers
folder, name = os.path.split({model!r})
start = time.perf_counter()
transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
print(time.perf_counter() - start)
"""


def seconds(code: str, cache_dir: str | None = None) -> float:
    env = dict(os.environ, **({"SPECSERVE_CACHE_DIR": cache_dir} if cache_dir else {}))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env=env)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--float32-folder", default=None)
    parser.add_argument("--transformers-gguf", action="store_true")
    args = parser.parse_args()

    from engine.models.gguf_cache import prepare_metadata_cache
    from engine.models.loader import embedded_gguf_path, prepare_embedded_cache

    prepare_embedded_cache()  # built once, not part of any start-up measured here
    with tempfile.TemporaryDirectory() as tmp:
        # another name: a file of its own, with a cache folder of its own
        gguf_copy = shutil.copy(embedded_gguf_path(), os.path.join(tmp, "model.gguf"))
        prepare_metadata_cache(gguf_copy)
        cases = {
            "embedded, packed": (LOAD.format(model=None, packed=True), None),
            "embedded, expanded float32": (LOAD.format(model=None, packed=False), None),
            ".gguf by path, packed": (LOAD.format(model=gguf_copy, packed=True), None),
            ".gguf by path, expanded float32": (LOAD.format(model=gguf_copy, packed=False), None),
            ".gguf by path, packed, first start": (LOAD.format(model=gguf_copy, packed=True),
                                                   "fresh"),
        }
        if args.float32_folder:
            cases["float32 HF folder"] = (LOAD.format(model=args.float32_folder, packed=False),
                                          None)
        if args.transformers_gguf:
            cases["transformers whole-model GGUF load"] = (
                TRANSFORMERS_GGUF.format(model=gguf_copy), None)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for round_index in range(args.rounds):
            for name, (code, cache) in cases.items():
                # "fresh": an empty cache folder, so the config and tokenizer are converted
                cache_dir = os.path.join(tmp, f"cache-{round_index}") if cache else None
                times[name].append(seconds(code, cache_dir))
    print(f"CPU: {cpu_name()}, load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds, "
          f"fresh process each; seconds inside the load call (imports excluded)")
    for name, values in times.items():
        print(f"  {name:36s} median {statistics.median(values):6.2f} s   "
              f"({', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
