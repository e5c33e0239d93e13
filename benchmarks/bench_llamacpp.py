"""specserve beside llama.cpp's llama-server on the same GGUF, over HTTP, in one run (issue 29).

llama.cpp serves the GGUF file itself (the embedded Q4_1 one, or --gguf) and the F32 GGUF made
from it, each without
speculation and with its best n-gram speculation; specserve serves the same file packed (its
default) and expanded to float32, each with no speculation, its default speculation and fixed
suffix k = 8. Every configuration gets the same token ids (the chat workloads and the held-out
prompts, per kind), greedy, a fixed number of output tokens, requests interleaved configuration by
configuration. The table gives end-to-end tokens/s (prompt processing included) and decode tokens/s
(after the first token), per kind, from per-prompt medians over repeats; then the ratios the issue
aims at; then how many prompts each configuration answers with transformers' greedy text.

Run: python -m benchmarks.bench_llamacpp --llama-server PATH/llama-server [--max-tokens 128]
     [--repeats 3] [--threads 2] [--weights packed float32] [--configs none default suffix]
     [--gguf F.gguf] [--llama-files file F32] [--sets chat heldout] [--no-reference] [--by-file]
     [--save F.json]
Without --llama-server (or when the binary is missing) only specserve is measured, with a message.
The F32 GGUF is made once from the file with llama-quantize (next to llama-server), so it holds
exactly the dequantized weights. A model without a chat template (a base model) gets each
workload's message as plain text. ../shared/TOOLCHAIN.md: how to build llama.cpp.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import cpu_name
from benchmarks.cpu_share import CpuShare
from benchmarks.http_servers import (
    LlamaCppServer,
    Server,
    SpecserveServer,
    Timing,
    free_port,
)
from engine.models.loader import embedded_gguf_path, load_tokenizer
from engine.spec_config import DEFAULT_SERVE_SPECULATIVE_CONFIG
from loadtest.workloads import chat_prompts

# specserve speculative configs by name; "none" turns speculation off
SPECSERVE_CONFIGS = {
    "none": "none",
    "default": DEFAULT_SERVE_SPECULATIVE_CONFIG,  # what `specserve serve` runs when not told
    "ngram": json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 4}),
    "suffix": json.dumps({"method": "suffix", "num_speculative_tokens": 8}),
    "suffix-adaptive": json.dumps({"method": "suffix", "num_speculative_tokens": 8,
                                   "adaptive": True}),
}
# how specserve holds the weights: packed GGUF blocks (its CPU default) or expanded to float32
SPECSERVE_WEIGHTS = {"packed": [], "float32": ["--dtype", "float32"]}
# llama.cpp's n-gram speculation at its best here (TOOLCHAIN.md)
LLAMACPP_NGRAM = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                  "--spec-ngram-simple-size-m", "8"]
LLAMACPP_SPECS = {"none": [], "ngram": LLAMACPP_NGRAM}
# the GGUF whose weights each specserve weight mode runs: the ratios pair them
SAME_FILE = {"packed": "file", "float32": "F32"}


@dataclass(frozen=True)
class Prompt:
    kind: str  # "<set> <kind>", e.g. "heldout extraction"
    token_ids: list[int] = field(hash=False)


def f32_gguf(llama_server: Path, out_dir: Path, source: str) -> Path:
    """`source`'s weights dequantized to an F32 GGUF, as transformers and specserve run them."""
    target = out_dir / f"{Path(source).stem}-f32.gguf"
    if not target.exists():
        subprocess.run([str(llama_server.parent / "llama-quantize"), "--allow-requantize",
                        source, str(target), "F32"], check=True,
                       capture_output=True, env=_llama_env(llama_server))
    return target


def _llama_env(llama_server: Path) -> dict:
    return {**os.environ, "LD_LIBRARY_PATH": str(llama_server.parent)}


def server_groups(args: argparse.Namespace) -> list[tuple[list[str], list[str]]]:
    """(specserve weights, llama.cpp files) up at once: all of them, or with --by-file each
    weight mode beside llama.cpp on the same file (what the ratios pair), one group after the
    other, to bound memory."""
    if not args.by_file:
        return [(args.weights, args.llama_files)]
    groups = [([w], [SAME_FILE[w]] if SAME_FILE[w] in args.llama_files else [])
              for w in args.weights]
    paired = {SAME_FILE[w] for w in args.weights}
    return groups + [([], [f]) for f in args.llama_files if f not in paired]


def start_servers(args: argparse.Namespace, weights_modes: list[str],
                  llama_files: list[str]) -> list[Server]:
    servers: list[Server] = []
    for weights in weights_modes:
        for name in args.configs:
            port = free_port()
            command = [sys.executable, "-m", "server.cli", "serve", "--port", str(port),
                       "--max-model-len", "4096", "--kv-cache-memory-gib", "0.25",
                       "--speculative-config", SPECSERVE_CONFIGS[name],
                       *SPECSERVE_WEIGHTS[weights]]
            if args.gguf is not None:
                command += ["--model", args.gguf]
            if args.threads is not None:
                command += ["--num-threads", str(args.threads)]
            servers.append(SpecserveServer(f"specserve {weights} {name}", command, port,
                                           env={"SPECSERVE_NO_PROGRESS": "1"},
                                           weights=weights, spec=name))
    binary = Path(args.llama_server) if args.llama_server else None
    if not llama_files:
        return servers
    if binary is None or not binary.exists():
        print(f"llama.cpp skipped: {'no --llama-server given' if binary is None else binary} "
              "(build it as ../shared/TOOLCHAIN.md says)")
        return servers
    source = args.gguf or embedded_gguf_path()
    files = {"file": source, "F32": str(f32_gguf(binary, Path(args.gguf_dir), source))}
    threads = str(args.threads or os.cpu_count())
    for file in llama_files:
        for spec, extra in LLAMACPP_SPECS.items():
            port = free_port()
            command = [str(binary), "-m", files[file], "--host", "127.0.0.1", "--port", str(port),
                       "-t", threads, "-tb", threads, "-c", "4096", "-np", "1", *extra,
                       *args.llama_args]
            servers.append(LlamaCppServer(f"llama.cpp {file} {spec}", command, port,
                                          env=_llama_env(binary), weights=file, spec=spec))
    return servers


def workload_prompts(tokenizer, sets: list[str]) -> list[Prompt]:
    """The chat workloads (one prompt per kind) and the held-out prompts (several per kind)."""
    prompts = []
    if "chat" in sets:
        prompts += [Prompt(f"chat {kind}", ids) for kind, ids in chat_prompts(tokenizer).items()]
    if "heldout" in sets:
        try:
            from benchmarks.prompts_heldout import heldout_chat_prompts
        except ImportError:
            print("held-out prompts skipped: benchmarks/prompts_heldout.py is missing")
            return prompts
        for kind, many in heldout_chat_prompts(tokenizer).items():
            prompts += [Prompt(f"heldout {kind}", ids) for ids in many]
    return prompts


def reference_texts(prompts: list[Prompt], tokenizer, args) -> list[tuple[list[int], str]]:
    """transformers' greedy tokens and text for each prompt: fp32 on the dequantized weights.
    Kept in --reference-cache (keyed by prompt and length), since a CPU shared with other work
    takes minutes to make them."""
    cache_path = Path(args.reference_cache)
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    model = "" if args.gguf is None else f"{Path(args.gguf).name}:"
    keys = [f"{model}{args.max_tokens}:{','.join(map(str, p.token_ids))}" for p in prompts]
    missing = [i for i, key in enumerate(keys) if key not in cache]
    if missing:
        import torch

        from benchmarks.common import time_transformers
        from engine.models.reference_model import load_transformers_model

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        model = load_transformers_model(args.gguf, torch.float32)
        for n, index in enumerate(missing):
            print(f"transformers reference {n + 1}/{len(missing)}", file=sys.stderr)
            _, cache[keys[index]] = time_transformers(model, prompts[index].token_ids,
                                                      args.max_tokens)
            cache_path.write_text(json.dumps(cache))  # NOTE: each one: a long run may be cut
    return [(cache[key], tokenizer.decode(cache[key], skip_special_tokens=True)) for key in keys]


def is_same_every_time(runs: list[Timing], reference: tuple[list[int], str]) -> bool:
    """Every repeat gave transformers' answer: the token ids where the server returns them, else
    the text (specserve skips special tokens, as the reference's text does)."""
    ids, text = reference
    return all(t.token_ids == ids if t.token_ids is not None else t.text == text for t in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server")
    parser.add_argument("--llama-args", nargs="*", default=[],
                        help="more llama-server arguments, e.g. --llama-args=--no-repack where its "
                             "AMX path dies (a VM that hides AMX from a Xeon that has it)")
    parser.add_argument("--gguf-dir", default=tempfile.gettempdir(),
                        help="where the F32 GGUF for llama.cpp is written once")
    parser.add_argument("--weights", nargs="+", default=["packed", "float32"],
                        choices=sorted(SPECSERVE_WEIGHTS))
    parser.add_argument("--configs", nargs="+", default=["none", "default", "suffix"],
                        choices=sorted(SPECSERVE_CONFIGS), help="specserve speculation")
    parser.add_argument("--gguf", default=None,
                        help="the GGUF both servers run (default: the embedded Q4_1 model)")
    parser.add_argument("--llama-files", nargs="+", default=["file", "F32"],
                        choices=["file", "F32"],
                        help="llama.cpp on the file as it is, and on its F32 expansion")
    parser.add_argument("--sets", nargs="+", default=["chat", "heldout"],
                        choices=["chat", "heldout"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for every server (default: each server's own default)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip transformers' greedy text (and the match column)")
    parser.add_argument("--by-file", action="store_true",
                        help="one group at a time (packed beside llama.cpp on the file, then float32 "
                             "beside F32) instead of every server up at once: less memory")
    parser.add_argument("--reference-cache",
                        default=Path(tempfile.gettempdir()) / "bench-llamacpp-reference.json",
                        help="transformers' greedy tokens, made once per prompt and length")
    parser.add_argument("--max-others", type=float, default=0.25,
                        help="cores other processes may use while a request is timed: wait for "
                             "that before each request and time it again if they used more "
                             "(a large value turns this off)")
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--quiet-timeout", type=float, default=900.0,
                        help="seconds to wait for quiet before timing anyway")
    parser.add_argument("--save", default=None,
                        help="write every request's timing here (JSON), after each prompt's round")
    parser.add_argument("--resume", action="store_true",
                        help="keep the timings already in --save and measure only what is missing")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.gguf)
    prompts = workload_prompts(tokenizer, args.sets)
    references = None if args.no_reference else reference_texts(prompts, tokenizer, args)
    timings = load_timings(args, prompts) if args.resume else {}
    quiet = Quiet()
    servers: list[Server] = []
    for weights_modes, llama_files in server_groups(args):
        group = start_servers(args, weights_modes, llama_files)
        servers += group
        try:
            measure(group, prompts, args, timings, quiet)
        finally:
            for server in group:
                server.stop()
    others = [t.others_cores for runs in timings.values() for t in runs]
    print(f"CPU: {cpu_name()}, threads: {args.threads or 'each server default'}, "
          f"{args.max_tokens} tokens, median of {args.repeats}; other work on the machine while "
          f"timing: median {statistics.median(others):.2f} cores, max {max(others):.2f}; "
          f"{quiet.num_retried} of {quiet.num_requests} requests timed again, "
          f"{quiet.num_contended} kept contended, {quiet.waited_s / 60:.0f} min waited for quiet")
    print_tables(prompts, servers, timings, references)


def save_timings(args: argparse.Namespace, prompts: list[Prompt],
                 timings: dict[tuple[int, str], list[Timing]]) -> None:
    if not args.save:
        return
    state = {"max_tokens": args.max_tokens, "prompts": [[p.kind, p.token_ids] for p in prompts],
             "timings": [[index, label, [dataclasses.asdict(t) for t in runs]]
                         for (index, label), runs in timings.items()]}
    Path(args.save + ".tmp").write_text(json.dumps(state))
    os.replace(args.save + ".tmp", args.save)  # NOTE: atomic: a run killed meanwhile loses none


def load_timings(args: argparse.Namespace,
                 prompts: list[Prompt]) -> dict[tuple[int, str], list[Timing]]:
    if not args.save or not os.path.exists(args.save):
        return {}
    state = json.loads(Path(args.save).read_text())
    if (state["max_tokens"] != args.max_tokens
            or state["prompts"] != [[p.kind, p.token_ids] for p in prompts]):
        raise SystemExit(f"--resume: {args.save} measured other prompts or lengths")
    return {(index, label): [Timing(**t) for t in runs] for index, label, runs in state["timings"]}


@dataclass
class Quiet:
    """How quiet the shared machine was: after a request that others disturbed (used
    --max-others cores or more meanwhile), the next waits for quiet, and a disturbed one is timed
    again, up to --retries times."""

    share: CpuShare = field(default_factory=CpuShare)
    num_requests: int = 0
    num_retried: int = 0  # timings thrown away because others ran meanwhile
    num_contended: int = 0  # kept though others ran meanwhile (retries used up)
    waited_s: float = 0.0
    was_quiet: bool = False  # the last request ran undisturbed: no need to wait before the next

    def time(self, server: Server, prompt: list[int], args: argparse.Namespace) -> Timing:
        self.num_requests += 1
        for attempt in range(args.retries + 1):
            if not self.was_quiet:
                self.waited_s += self.share.wait_quiet(args.max_others,
                                                       timeout_s=args.quiet_timeout)
            since = self.share.snapshot()
            timing = server.time_request(prompt, args.max_tokens)
            timing.others_cores = self.share.others_cores(since)
            self.was_quiet = timing.others_cores < args.max_others
            if self.was_quiet:
                return timing
            self.num_retried += attempt < args.retries
        self.num_contended += 1
        return timing


def measure(servers: list[Server], prompts: list[Prompt], args: argparse.Namespace,
            timings: dict[tuple[int, str], list[Timing]], quiet: Quiet) -> None:
    if all(len(timings.get((index, server.label), [])) >= args.repeats
           for index in range(len(prompts)) for server in servers):
        return
    for server in servers:
        server.wait_ready()
    # warm-up: one short request each, so no server pays for its first call in the table
    for server in servers:
        server.time_request(prompts[0].token_ids, 8)
    for repeat in range(args.repeats):
        for index, prompt in enumerate(prompts):
            # NOTE: interleaved, so drift hits every server alike; the first server rotates
            turn = (repeat * len(prompts) + index) % len(servers)
            for server in servers[turn:] + servers[:turn]:
                runs = timings.setdefault((index, server.label), [])
                if len(runs) <= repeat:  # NOTE: what --resume found is not measured again
                    runs.append(quiet.time(server, prompt.token_ids, args))
            save_timings(args, prompts, timings)


def kind_rates(prompts: list[Prompt],
               runs: dict[int, list[Timing]]) -> dict[str, tuple[float, float]]:
    """(e2e, decode) tokens/s per kind, per set and over all prompts: tokens over seconds, each
    prompt at its median over repeats."""
    totals: dict[str, list[float]] = {}
    for index, prompt in enumerate(prompts):
        ts = runs[index]
        seconds = statistics.median(t.seconds for t in ts)
        decode_seconds = statistics.median(t.seconds - t.first_token_seconds for t in ts)
        num_tokens = statistics.median(t.num_tokens for t in ts)
        for kind in kind_groups(prompt):
            row = totals.setdefault(kind, [0.0, 0.0, 0.0, 0.0])
            row[0] += num_tokens
            row[1] += seconds
            row[2] += num_tokens - 1
            row[3] += decode_seconds
    return {kind: (row[0] / row[1], row[2] / max(1e-9, row[3])) for kind, row in totals.items()}


def kind_groups(prompt: Prompt) -> tuple[str, str, str]:
    """The rows a prompt counts in: its kind, its set's "all" and the overall "all"."""
    return prompt.kind, f"{prompt.kind.split()[0]} all", "all"


def print_tables(prompts, servers, timings, references) -> None:
    """One markdown row per configuration, "e2e / decode" tokens/s per kind, then the ratios."""
    kinds = list(dict.fromkeys(k for p in prompts for k in kind_groups(p)))
    kinds = [k for k in kinds if not k.endswith("all")] + [k for k in kinds if k.endswith("all")]
    rates = {s.label: kind_rates(prompts, {i: timings[(i, s.label)] for i in range(len(prompts))})
             for s in servers}
    print("\ne2e / decode tokens/s" + ("" if references is None else
                                       "; same text: prompts answered as transformers does"))
    print("| configuration | " + " | ".join(kinds) + ("" if references is None else " | same text")
          + " |")
    print("|---" * (len(kinds) + 1 + (references is not None)) + "|")
    for server in servers:
        cells = [f"{rates[server.label][k][0]:.1f} / {rates[server.label][k][1]:.1f}"
                 for k in kinds]
        if references is not None:
            same = sum(is_same_every_time(timings[(i, server.label)], references[i])
                       for i in range(len(prompts)))
            cells.append(f"{same}/{len(prompts)}")
        print(f"| {server.label} | " + " | ".join(cells) + " |")
    print_ratios(kinds, servers, rates)


def print_ratios(kinds, servers, rates) -> None:
    """specserve none / llama.cpp none on the same file (aim >= 1.0 every kind), specserve default
    / llama.cpp's faster configuration on the same file (aim >= 1.5 overall, >= 1.0 every kind);
    "e2e / decode" ratios, each metric against llama.cpp's best in that metric."""
    by_key = {(s.weights, s.spec): s.label for s in servers}
    columns = []
    for weights, file in SAME_FILE.items():
        llama = [by_key[(file, spec)] for spec in LLAMACPP_SPECS if (file, spec) in by_key]
        if (weights, "none") in by_key and (file, "none") in by_key:
            columns.append((f"{weights} none / {file} none", by_key[(weights, "none")],
                            [by_key[(file, "none")]]))
        if (weights, "default") in by_key and llama:
            columns.append((f"{weights} default / {file} best", by_key[(weights, "default")],
                            llama))
    if not columns:
        return
    print("\nratios, e2e / decode")
    print("| kind | " + " | ".join(name for name, _, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for kind in kinds:
        cells = []
        for _, ours, theirs in columns:
            e2e, decode = (rates[ours][kind][m] / max(rates[label][kind][m] for label in theirs)
                           for m in (0, 1))
            cells.append(f"{e2e:.2f} / {decode:.2f}")
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
