"""Which grammar library constrains `response_format` best here: xgrammar, llguidance or outlines-core.

For each library, with the embedded model's tokenizer (SmolLM2, vocabulary 49152), over JSON schemas of
increasing difficulty: tokenizer and grammar compile time; the cost of one full-vocabulary mask (median
and p99 over random masked walks); the cost of speculative use (k = 8 draft tokens, a mask at each, then
a rollback of 5); whether every walk's text parses and validates (`jsonschema`); and which schema
features each library refuses, or accepts and then ignores. Run: python -m benchmarks.bench_grammar_libraries
[--walks 40] [--probe-walks 20] [--seed 0] [--only xgrammar,llguidance]. Results: docs/grammar_choice.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import numpy as np
import torch

from benchmarks.common import cpu_name
from benchmarks.grammar_backends import (
    BACKENDS,
    Backend,
    K,
    SpecserveBackend,
    Vocab,
    allowed_ids,
    load_vocab,
)
from benchmarks.grammar_schemas import FEATURE_PROBES, SCHEMAS

NUM_ROLLBACK = 5  # rejected drafts rolled back after verification
SOFT_LEN = 200  # a timing walk runs this many tokens before it steers to a close
HARD_LEN = 1000  # a walk that has not ended by then counts as unfinished

def validation_schema(schema: dict[str, Any] | None) -> dict[str, Any]:
    return {"type": "object"} if schema is None else schema


# ---------------------------------------------------------------- the tokenizer
@dataclass
class WalkStats:
    mask_us: list[float] = field(default_factory=list)
    spec_us: list[float] = field(default_factory=list)  # k masks + k accepts + rollback 5
    native_spec_us: list[float] = field(default_factory=list)  # the library's own 1 + k call
    num_native_mismatches: int = 0  # blocks where the native masks differ from token-by-token ones
    num_walks: int = 0
    num_valid: int = 0
    num_unfinished: int = 0
    num_special_leaks: int = 0  # walks that emitted a control token (<|im_start|>, ...) as text
    failures: list[str] = field(default_factory=list)


def choose(rng: random.Random, allowed: np.ndarray, vocab: Vocab, closing: bool) -> int:
    """Before `closing`: avoid EOS and (mostly) tokens that close a bracket, so walks grow. After:
    EOS if allowed, else often a closing token, else mostly a one-byte token that is not
    whitespace (a format such as email needs its '@' found among them), so walks end."""
    is_eos = np.isin(allowed, vocab.eos_ids)
    eos, others = allowed[is_eos], allowed[~is_eos]
    if len(eos) and (closing or len(others) == 0):
        return int(eos[0])
    if closing:
        one_byte = vocab.is_one_byte[others] & ~vocab.is_blank[others]
        preferences = [(vocab.is_closer[others], 0.5), (one_byte, 0.9),
                       (~vocab.is_blank[others], 1.0)]
    else:
        preferences = [(~vocab.has_bracket_close[others], 0.9)]
    for keep, probability in preferences:
        if keep.any() and rng.random() < probability:
            others = others[keep]
            break
    return int(others[rng.randrange(len(others))])


def walk(backend: Backend, compiled: Any, vocab: Vocab, rng: random.Random, soft_len: int,
         stats: WalkStats, schema: dict[str, Any], bitmask: torch.Tensor,
         time_speculation: bool) -> None:
    matcher = backend.matcher(compiled)
    token_ids: list[int] = []
    ended = False
    for step in range(HARD_LEN):
        if time_speculation and step % 20 == 5:
            time_block(backend, matcher, vocab, rng, stats, bitmask)
        start = time.perf_counter()
        backend.fill(matcher, bitmask, 0)
        stats.mask_us.append((time.perf_counter() - start) * 1e6)
        allowed = allowed_ids(bitmask[0], vocab.vocab_size)
        if len(allowed) == 0:
            stats.failures.append(f"dead end after {len(token_ids)} tokens")
            return
        token_id = choose(rng, allowed, vocab, closing=step >= soft_len)
        if token_id in vocab.eos_ids:
            ended = True
            break
        if not backend.accept(matcher, token_id):
            stats.failures.append(f"mask allowed {token_id} but the matcher rejected it")
            return
        token_ids.append(token_id)
    stats.num_walks += 1
    if not ended:
        stats.num_unfinished += 1
        return
    if any(t in vocab.special_ids for t in token_ids):
        stats.num_special_leaks += 1
    text = b"".join(vocab.token_bytes[t] for t in token_ids if t not in vocab.special_ids)
    problem = check_text(text, schema)
    if problem is None:
        stats.num_valid += 1
    elif len(stats.failures) < 5:
        stats.failures.append(f"{problem}: {text[:120]!r}")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_VALIDATORS: dict[str, jsonschema.Draft202012Validator] = {}


def check_text(text: bytes, schema: dict[str, Any]) -> str | None:
    try:
        value = json.loads(text.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError) as error:
        return f"does not parse ({type(error).__name__}: {str(error)[:60]})"
    key = json.dumps(schema, sort_keys=True)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    validator = _VALIDATORS[key]
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"invalid ({error.message[:80]})"


def time_block(backend: Backend, matcher: Any, vocab: Vocab, rng: random.Random,
               stats: WalkStats, bitmask: torch.Tensor) -> None:
    """Speculative use: a mask at each of k draft positions while advancing, then roll back 5; and
    the library's own call for the 1 + k masks, when it has one."""
    draft = backend.pick_draft(matcher, vocab, rng, bitmask)
    if len(draft) < K:
        return
    if backend.can_rollback:
        start = time.perf_counter()
        for j, token_id in enumerate(draft):
            backend.fill(matcher, bitmask, j)
            backend.accept(matcher, token_id)
        backend.rollback(matcher, NUM_ROLLBACK)
        stats.spec_us.append((time.perf_counter() - start) * 1e6)
        backend.rollback(matcher, K - NUM_ROLLBACK)
    native = torch.zeros_like(bitmask)
    start = time.perf_counter()
    if backend.fill_draft_native(matcher, draft, native):
        stats.native_spec_us.append((time.perf_counter() - start) * 1e6)
        if backend.can_rollback:
            stats.num_native_mismatches += not torch.equal(native[:K], bitmask[:K])


# ---------------------------------------------------------------- the run


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def describe_error(error: BaseException) -> str:
    message = " ".join(str(error).split()).split("cannot be enforced: ")[-1]
    return f"{type(error).__name__}: {message[:110]}"


def run_backend(backend: Backend, vocab: Vocab, args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    backend.build_tokenizer(vocab)
    result: dict[str, Any] = {"tokenizer_s": time.perf_counter() - start, "schemas": {},
                              "probes": {}}
    bitmask = torch.zeros((K + 1, (vocab.vocab_size + 31) // 32), dtype=torch.int32)
    rng = random.Random(args.seed)
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        try:
            compiled = backend.compile(schema)
        except Exception as error:  # noqa: BLE001 - a refusal is a result here
            result["schemas"][name] = {"refused": describe_error(error)}
            continue
        compile_ms = (time.perf_counter() - start) * 1e3
        stats = WalkStats()
        for index in range(args.walks):
            is_timing = index < args.timing_walks
            soft_len = SOFT_LEN if is_timing else rng.randrange(0, SOFT_LEN)
            walk(backend, compiled, vocab, rng, soft_len, stats, validation_schema(schema),
                 bitmask, time_speculation=is_timing)
        result["schemas"][name] = {"compile_ms": compile_ms, "stats": stats}
        print(f"  {backend.name:13s} {name:22s} compile {compile_ms:8.1f} ms, "
              f"valid {stats.num_valid}/{stats.num_walks - stats.num_unfinished}", flush=True)
    for name, schema in FEATURE_PROBES.items():
        try:
            compiled = backend.compile(schema)
        except Exception as error:  # noqa: BLE001
            result["probes"][name] = {"refused": describe_error(error)}
            continue
        stats = WalkStats()
        for _ in range(args.probe_walks):
            walk(backend, compiled, vocab, rng, rng.randrange(0, 40), stats, schema, bitmask,
                 time_speculation=False)
        result["probes"][name] = {"stats": stats}
    return result


def print_report(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nCPU: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}")
    for name in results:
        package = BACKENDS[name]().package
        print(f"{name} {importlib.metadata.version(package)}: tokenizer info "
              f"{results[name]['tokenizer_s']:.2f} s")
    print(f"\nPer schema ({args.walks} walks each, {args.timing_walks} of them ~{SOFT_LEN} tokens "
          f"and timed for speculation; mask = one full-vocabulary bitmask, us)")
    # valid = of the walks that ended (unfin = did not end in HARD_LEN tokens), how many validated
    header = (f"{'schema':22s} {'library':13s} {'compile ms':>10s} {'mask p50':>9s} {'mask p99':>9s}"
              f" {'spec k=8':>9s} {'native':>8s} {'valid':>8s} {'unfin':>5s} {'leaks':>5s}")
    print(header)
    print("-" * len(header))
    for schema_name in SCHEMAS:
        for name, result in results.items():
            entry = result["schemas"][schema_name]
            if "refused" in entry:
                print(f"{schema_name:22s} {name:13s} REFUSED {entry['refused']}")
                continue
            stats: WalkStats = entry["stats"]
            spec = statistics.median(stats.spec_us) if stats.spec_us else math.nan
            native = statistics.median(stats.native_spec_us) if stats.native_spec_us else math.nan
            print(f"{schema_name:22s} {name:13s} {entry['compile_ms']:10.1f} "
                  f"{percentile(stats.mask_us, 0.5):9.1f} {percentile(stats.mask_us, 0.99):9.1f} "
                  f"{spec:9.0f} {native:8.0f} "
                  f"{stats.num_valid:>3d}/{stats.num_walks - stats.num_unfinished:<4d} "
                  f"{stats.num_unfinished:5d} {stats.num_special_leaks:5d}")
            if stats.num_native_mismatches:
                print(f"{'':37s}! native masks differ from token-by-token in "
                      f"{stats.num_native_mismatches}/{len(stats.native_spec_us)} blocks")
            for failure in stats.failures[:3]:
                print(f"{'':37s}! {failure}")
    print(f"\nSchema features ({args.probe_walks} short walks each when compiled): "
          "'ok n/N' = N finished walks, n valid; 'INVALID' = compiled, then produced invalid output "
          "(the feature is ignored or mis-implemented), with the first failure")
    for probe in FEATURE_PROBES:
        cells = []
        for name, result in results.items():
            entry = result["probes"][probe]
            if "refused" in entry:
                cells.append(f"{name}: refused ({entry['refused'][:70]})")
                continue
            stats = entry["stats"]
            num_finished = stats.num_walks - stats.num_unfinished
            verdict = "ok" if stats.num_valid == num_finished and not stats.failures else "INVALID"
            cells.append(f"{name}: {verdict} {stats.num_valid}/{num_finished}"
                         + (f" ({stats.failures[0][:60]})" if stats.failures else ""))
        print(f"{probe:28s} " + "\n{:28s} ".format("").join(cells))
    print("\nNotes")
    for name in results:
        for note in BACKENDS[name]().notes:
            print(f"- {name}: {note}")


def measure_batch(vocab: Vocab, batch: int = 32, repeats: int = 20) -> None:
    """Host cost of one verification step under grammars: the masks of `batch` requests with k = 8
    drafts each (fill_batch_masks), then those 9 * batch masks applied to float32 logits."""
    from engine.structured import (
        GrammarCompiler,
        allocate_token_bitmask,
        apply_token_bitmask_,
        fill_batch_masks,
        parse_response_format,
    )

    compiler = GrammarCompiler(vocab.tokenizer, vocab.eos_ids)
    rng = random.Random(1)
    backend = SpecserveBackend()
    backend.compiler, backend.parse = compiler, parse_response_format
    bitmask = allocate_token_bitmask(batch * (K + 1), vocab.vocab_size)
    states, drafts = [], []
    for index in range(batch):
        schema = list(SCHEMAS.values())[index % len(SCHEMAS)]
        state = backend.matcher(backend.compile(schema))
        for _ in range(rng.randrange(0, 30)):  # somewhere inside the output
            draft = backend.pick_draft(state, vocab, rng, bitmask)[:1]
            if not draft:
                break
            state.commit(draft)
        states.append(state)
        drafts.append(backend.pick_draft(state, vocab, rng, bitmask))
    starts = [i * (K + 1) for i in range(batch)]
    logits = torch.randn(batch * (K + 1), vocab.vocab_size)
    fill_s, apply_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fill_batch_masks(states, drafts, bitmask, starts)
        fill_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_token_bitmask_(logits, bitmask, vocab.vocab_size)
        apply_s.append(time.perf_counter() - start)
    print(f"\nOne step, batch {batch}, k = {K} (engine.structured, torch 1 thread): "
          f"fill_batch_masks {statistics.median(fill_s) * 1e3:.2f} ms, "
          f"apply_token_bitmask_ on [{batch * (K + 1)}, {vocab.vocab_size}] float32 "
          f"{statistics.median(apply_s) * 1e3:.2f} ms (medians of {repeats})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--walks", type=int, default=40, help="random walks per schema")
    parser.add_argument("--timing-walks", type=int, default=6,
                        help="of those, walks of ~200 tokens that also time speculation")
    parser.add_argument("--probe-walks", type=int, default=20, help="walks per feature probe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=",".join(BACKENDS), help="comma-separated libraries")
    args = parser.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    vocab = load_vocab()
    print(f"tokenizer loaded in {time.perf_counter() - start:.1f} s (vocabulary {vocab.vocab_size})")
    results = {}
    for name in args.only.split(","):
        package = {"xgrammar": "xgrammar", "outlines-core": "outlines_core"}.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            # NOTE: only llguidance is a dependency; the others are measured when installed
            print(f"{name}: not installed, skipped (pip install {name})")
            continue
        results[name] = run_backend(BACKENDS[name](), vocab, args)
    print_report(results, args)
    if "specserve" in results:
        measure_batch(vocab)


if __name__ == "__main__":
    main()
