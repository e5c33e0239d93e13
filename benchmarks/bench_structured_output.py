"""What `response_format` costs, and what speculation still gives under it, on the embedded model:
greedy chat requests that ask for JSON, decoded with and without a JSON schema, with and without
the server's default speculation (adaptive suffix decoding). Configurations are interleaved, run by
run, and medians printed, since this machine's memory bandwidth drifts minute to minute.

Run: python -m benchmarks.bench_structured_output [--repeats 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine import LLM, SamplingParams
from engine.spec_config import DEFAULT_SERVE_SPECULATIVE_CONFIG

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "maxLength": 40},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
    "email": {"type": "string", "maxLength": 60}},
    "required": ["name", "age", "city", "hobbies", "email"], "additionalProperties": False}
ASKS = [
    "Ann Lee is 31, lives in Oslo, likes chess and running, and her email is ann@example.com. "
    "Give her record as JSON with name, age, city, hobbies and email.",
    "Bob Stone is 45, lives in Lyon, likes cooking, cycling and jazz; email bob.stone@example.org. "
    "Give his record as JSON with name, age, city, hobbies and email.",
    "Chen Wu is 27, lives in Taipei, likes go and hiking; email chen@wu.example. Give the record "
    "as JSON with name, age, city, hobbies and email.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    engines = {"none": LLM(None, dtype="float32", max_model_len=1024),
               "default": LLM(None, dtype="float32", max_model_len=1024,
                              speculative_config=DEFAULT_SERVE_SPECULATIVE_CONFIG)}
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
    formats = {"free text": None, "json_schema": fmt}
    conversations = [[{"role": "user", "content": ask}] for ask in ASKS]
    rates: dict[tuple[str, str], list[float]] = {}
    texts: dict[tuple[str, str], list[str]] = {}
    for name, llm in engines.items():  # warm-up: compile the grammar, fill the caches
        llm.chat(conversations[:1], SamplingParams(temperature=0, max_tokens=8, response_format=fmt))
    for _ in range(args.repeats):
        for spec, llm in engines.items():
            for label, response_format in formats.items():
                params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                        response_format=response_format)
                tokens, seconds, outs = 0, 0.0, []
                for conversation in conversations:  # one stream at a time
                    start = time.perf_counter()
                    out = llm.chat([conversation], params)[0].outputs[0]
                    seconds += time.perf_counter() - start
                    tokens += len(out.token_ids)
                    outs.append(out.text)
                rates.setdefault((spec, label), []).append(tokens / seconds)
                texts[(spec, label)] = outs
    valid = sum(_parses(t) for t in texts[("default", "json_schema")])
    print(f"greedy, one stream, {len(ASKS)} prompts x {args.repeats} runs, median output tok/s")
    print(f"{'speculation':>12} {'free text':>10} {'json_schema':>12} {'schema / free':>14}")
    for spec in engines:
        free = statistics.median(rates[(spec, "free text")])
        constrained = statistics.median(rates[(spec, "json_schema")])
        print(f"{spec:>12} {free:>10.1f} {constrained:>12.1f} {constrained / free:>14.2f}")
    for label in formats:
        ratio = (statistics.median(rates[("default", label)])
                 / statistics.median(rates[("none", label)]))
        print(f"default speculation vs none, {label}: {ratio:.2f}x")
    same = texts[("default", "json_schema")] == texts[("none", "json_schema")]
    print(f"json_schema outputs parse: {valid}/{len(ASKS)}; identical with and without "
          f"speculation: {same}")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
