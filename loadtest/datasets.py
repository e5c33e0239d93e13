"""What to send: the built-in synthetic prompts, a JSONL file of prompts or conversations, or the
three workloads of the speculative benchmark (loadtest/workloads.py).

JSONL, one JSON object per line (blank lines are skipped), with one of:
  {"prompt": "text"}                                        a single user turn
  {"messages": [{"role": "user", "content": "..."}, ...]}   an OpenAI chat conversation
  {"conversations": [{"from": "human", "value": "..."}, ...]}  ShareGPT; trailing answers dropped
and optionally "max_tokens": N to override the run's cap for that request.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.workloads import WORKLOADS

DATASET_NAMES = ("synthetic", "workloads", "jsonl")
CHAT_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "chatgpt": "assistant", "assistant": "assistant"}

# NOTE: the vocabulary repeats inside each synthetic prompt on purpose, so prompt-lookup proposers
# find something to draft from; the words themselves only need to be common English tokens.
_SYNTHETIC_WORDS = (
    "river stone light garden window paper music quiet morning market bridge winter coffee "
    "letter forest engine yellow simple number travel moment pocket silver animal corner "
    "history summer button planet doctor circle energy island mirror orange pencil rocket"
).split()


class DatasetError(ValueError):
    """A dataset that cannot be used, naming the file and line at fault."""


@dataclass(frozen=True)
class LoadRequest:
    """One request to send: a chat conversation or a plain prompt, and its own token cap."""

    messages: tuple[dict[str, str], ...] | None  # OpenAI chat messages, or None for a prompt
    prompt: str | None                           # plain text, or None for a conversation
    max_tokens: int | None                       # None: the run's --max-tokens
    source: str                                  # where it came from, for error messages

    def chat_messages(self) -> list[dict[str, str]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def completion_prompt(self) -> str:
        if self.prompt is None:
            raise DatasetError(f"{self.source}: a conversation cannot go to /v1/completions; "
                               "use --endpoint chat or give {\"prompt\": ...} lines")
        return self.prompt


def synthetic_requests(num_requests: int, num_words: int = 64, seed: int = 0) -> list[LoadRequest]:
    """Seeded word lists to repeat and continue: cheap to make, fixed in length."""
    if num_words < 1:
        raise DatasetError(f"synthetic prompts need at least 1 word, got {num_words}")
    rng = np.random.default_rng(seed)
    requests = []
    for index in range(num_requests):
        words = rng.choice(_SYNTHETIC_WORDS, size=num_words).tolist()
        prompt = ("Repeat the following words in the same order, then continue the list:\n"
                  + " ".join(words))
        requests.append(LoadRequest(None, prompt, None, f"synthetic:{index}"))
    return requests


def workload_requests() -> list[LoadRequest]:
    """Code editing, extraction and open chat, as the speculative benchmark sends them."""
    return [LoadRequest(None, text, None, f"workload:{name}") for name, text in WORKLOADS.items()]


def read_jsonl(path: str | Path) -> list[LoadRequest]:
    """Every line of a JSONL dataset, validated; the first bad line raises DatasetError."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"cannot read {path}: {error}") from error
    requests = []
    for line_number, line in enumerate(lines, start=1):
        if line.strip():
            requests.append(_parse_line(line, f"{path}:{line_number}"))
    if not requests:
        raise DatasetError(f"{path}: no requests in the file")
    return requests


def _parse_line(line: str, source: str) -> LoadRequest:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{source}: not valid JSON ({error.msg})") from error
    if not isinstance(item, dict):
        raise DatasetError(f"{source}: expected a JSON object, got {type(item).__name__}")
    max_tokens = item.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise DatasetError(f"{source}: max_tokens must be a positive integer, got {max_tokens!r}")
    keys = [key for key in ("prompt", "messages", "conversations") if key in item]
    if len(keys) != 1:
        raise DatasetError(f"{source}: needs exactly one of \"prompt\", \"messages\" or "
                           f"\"conversations\", found {keys or 'none'}")
    if keys[0] == "prompt":
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise DatasetError(f"{source}: \"prompt\" must be a non-empty string")
        return LoadRequest(None, item["prompt"], max_tokens, source)
    if keys[0] == "messages":
        messages = _chat_messages(item["messages"], source)
    else:
        messages = _sharegpt_messages(item["conversations"], source)
    return LoadRequest(tuple(messages), None, max_tokens, source)


def _chat_messages(raw: Any, source: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise DatasetError(f"{source}: \"messages\" must be a non-empty list")
    messages = []
    for turn in raw:
        if not isinstance(turn, dict) or turn.get("role") not in CHAT_ROLES \
                or not isinstance(turn.get("content"), str):
            raise DatasetError(f"{source}: each message needs a role in {CHAT_ROLES} and a string "
                               f"content, got {turn!r}"[:300])
        messages.append({"role": turn["role"], "content": turn["content"]})
    return messages


def _sharegpt_messages(raw: Any, source: str) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise DatasetError(f"{source}: \"conversations\" must be a non-empty list")
    messages = []
    for turn in raw:
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES \
                or not isinstance(turn.get("value"), str):
            raise DatasetError(f"{source}: each turn needs \"from\" in {tuple(SHAREGPT_ROLES)} and "
                               f"a string \"value\", got {turn!r}"[:300])
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    # the recorded answers are what the server is asked to produce, so they are not sent
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not any(m["role"] == "user" for m in messages):
        raise DatasetError(f"{source}: the conversation has no user turn to answer")
    return messages


def load_requests(dataset: str, num_requests: int, *, path: str | None = None,
                  num_words: int = 64, seed: int = 0) -> list[LoadRequest]:
    """`num_requests` requests from a dataset, cycling through it in order when it is shorter."""
    if dataset == "synthetic":
        pool = synthetic_requests(num_requests, num_words, seed)
    elif dataset == "workloads":
        pool = workload_requests()
    elif dataset == "jsonl":
        if path is None:
            raise DatasetError("--dataset jsonl needs --dataset-path FILE")
        pool = read_jsonl(path)
    else:
        raise DatasetError(f"unknown dataset {dataset!r}; choose from {DATASET_NAMES}")
    return list(itertools.islice(itertools.cycle(pool), num_requests))
