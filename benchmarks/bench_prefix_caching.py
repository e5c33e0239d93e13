"""Time to first token with prefix caching on and off, on the embedded model (issue 18's aim: a
second turn's TTFT at most 30% of the uncached one).

Two workloads, each run with caching on and off, interleaved, medians over --repeats:
- a 4-turn chat: each turn resends the whole conversation (system prompt, earlier questions and the
  model's own answers), as chat clients do; TTFT of turns 2-4;
- 8 requests that share a ~1000-token system prompt, one after another, each with its own question.
TTFT is measured offline as the time of a request with max_tokens=1 (prefill + the first token), in
a fresh engine per run, so every run starts with an empty cache.

Run: python -m benchmarks.bench_prefix_caching [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine import LLM, SamplingParams

SYSTEM = ("You are a meticulous assistant for a logistics company. " * 4 + "Rules: " + " ".join(
    f"Rule {i}: shipments of class {i % 7} leave from dock {i % 5} before {6 + i % 12} o'clock, "
    f"unless the manifest lists hazardous goods, in which case dock {(i + 2) % 5} is used."
    for i in range(30)))
QUESTIONS = ["Which dock does class 3 leave from?", "And if the goods are hazardous?",
             "What time does it leave?", "Summarise the rules for class 5 in one sentence.",
             "Which classes leave from dock 0?", "Is there any rule for class 9?",
             "What is the latest departure time?", "Which dock is used least?"]
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)
ANSWER = SamplingParams(temperature=0.0, max_tokens=48)


def ttft(llm: LLM, messages: list[dict]) -> float:
    start = time.perf_counter()
    llm.chat([messages], FIRST_TOKEN)
    return time.perf_counter() - start


def chat_turns(caching: bool) -> list[float]:
    """TTFT of turns 1-4 of one conversation, in a fresh engine."""
    llm = LLM(None, dtype="float32", max_model_len=2048, enable_prefix_caching=caching)
    messages = [{"role": "system", "content": SYSTEM}]
    times = []
    for question in QUESTIONS[:4]:
        messages.append({"role": "user", "content": question})
        times.append(ttft(llm, messages))
        answer = llm.chat([messages], ANSWER)[0].outputs[0].text
        messages.append({"role": "assistant", "content": answer})
    return times


def shared_system_prompt(caching: bool) -> list[float]:
    """TTFT of 8 requests, one after another, sharing the system prompt, in a fresh engine."""
    llm = LLM(None, dtype="float32", max_model_len=2048, enable_prefix_caching=caching)
    return [ttft(llm, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    probe = LLM(None, dtype="float32", max_model_len=2048)
    num_system = len(probe.tokenizer.encode(SYSTEM))
    del probe
    shared_system_prompt(False)  # NOTE: warm-up, not timed: kernels built, caches filled
    chats = {True: [], False: []}
    shared = {True: [], False: []}
    for _ in range(args.repeats):
        for caching in (False, True):
            chats[caching].append(chat_turns(caching))
            shared[caching].append(shared_system_prompt(caching))
    print(f"system prompt: {num_system} tokens; medians of {args.repeats} runs, caching off / on")
    print(f"{'':>24} {'off ms':>8} {'on ms':>8} {'on / off':>9}")
    for turn in range(4):
        off = statistics.median(run[turn] for run in chats[False])
        on = statistics.median(run[turn] for run in chats[True])
        print(f"{'chat turn ' + str(turn + 1):>24} {off * 1e3:>8.0f} {on * 1e3:>8.0f} "
              f"{on / off:>9.2f}")
    for label, index in (("shared prompt, request 1", slice(0, 1)),
                         ("shared prompt, 2-8", slice(1, None))):
        off = statistics.median(t for run in shared[False] for t in run[index])
        on = statistics.median(t for run in shared[True] for t in run[index])
        print(f"{label:>24} {off * 1e3:>8.0f} {on * 1e3:>8.0f} {on / off:>9.2f}")


if __name__ == "__main__":
    main()
