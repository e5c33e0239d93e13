"""The three benchmark workloads: code editing, extraction from a given text, and open chat.

Prompts are built from Python's own standard-library sources and docstrings, so they are real text
that ships with every Python and needs no download.
"""

from __future__ import annotations

import inspect
import json
import textwrap


def _code_editing() -> str:
    source = textwrap.dedent(inspect.getsource(json.dumps))
    return ("Rewrite the following Python function so that every parameter has a type hint. "
            "Keep the body and the docstring exactly as they are.\n\n```python\n" + source + "```")


def _extraction() -> str:
    doc = inspect.getdoc(textwrap)
    doc += "\n\n" + inspect.getdoc(textwrap.TextWrapper)
    return ("Read the documentation below and list every option of TextWrapper with a one-line "
            "description of each.\n\n" + doc)


def _open_chat() -> str:
    return "I'm planning a weekend trip to the mountains in autumn. What should I pack, and why?"


WORKLOADS: dict[str, str] = {
    "code_editing": _code_editing(),
    "extraction": _extraction(),
    "open_chat": _open_chat(),
}


def chat_prompts(tokenizer) -> dict[str, list[int]]:
    """Token ids of each workload after the tokenizer's chat template."""
    return {name: user_prompt_ids(tokenizer, message) for name, message in WORKLOADS.items()}


def user_prompt_ids(tokenizer, message: str) -> list[int]:
    """One user message as the model's prompt: through its chat template, or, for a model with
    none (a base model), the message as plain text after the tokenizer's own special tokens."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(message)
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)
