"""Chat prompts for self-distillation, built from Python's standard library (no download): questions
about modules, summaries of their documentation, small coding tasks, and everyday questions.

json and textwrap are left out on purpose: the speculative benchmark's workloads are built from them
(loadtest/workloads.py), and a speculator must not be measured on its own training text.
"""

from __future__ import annotations

import importlib
import inspect
import random

MODULES = ("collections", "itertools", "functools", "pathlib", "re", "datetime", "statistics",
           "heapq", "bisect", "string", "difflib", "fractions", "decimal", "random", "shutil",
           "csv", "argparse", "logging", "math", "os", "sys", "time", "enum", "dataclasses",
           "typing", "copy", "pprint", "operator", "zipfile", "gzip", "hashlib", "base64",
           "urllib.parse", "html", "sqlite3", "threading", "queue", "subprocess", "tempfile",
           "glob", "fnmatch", "uuid", "secrets", "calendar", "locale", "unicodedata", "struct",
           "array", "weakref", "contextlib", "abc", "io", "pickle", "shelve", "configparser")
EVERYDAY = (
    "What is the capital of Japan, and what is it known for?",
    "Give me three tips for staying focused while studying.",
    "How do plants make their food?",
    "Explain what a black hole is to a ten-year-old.",
    "Write a short poem about autumn leaves.",
    "What are the health benefits of drinking water?",
    "Suggest a simple recipe for a vegetable soup.",
    "Why is the sky blue?",
    "How can I improve my handwriting?",
    "What is the difference between weather and climate?",
    "Write a friendly email inviting a colleague to lunch.",
    "List five animals that live in the ocean and one fact about each.",
    "How does a bicycle stay upright while moving?",
    "Explain the rules of chess in a few sentences.",
    "What should I consider when adopting a dog?",
    "Describe the water cycle step by step.",
    "Give me a short motivational message for a Monday morning.",
    "What is photosynthesis?",
    "How do I make a good first impression at a job interview?",
    "Write a haiku about the city at night.",
)
TEMPLATES = (
    "Explain in simple words what the Python module `{name}` is for.",
    "Summarize this documentation in two or three sentences:\n\n{doc}",
    "Write a short Python example that uses `{name}.{function}` and explain it.",
    "What are common mistakes people make when using Python's `{name}` module?",
)


def build_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """`num_prompts` distinct user messages, in a repeatable shuffled order."""
    prompts = list(EVERYDAY)
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        doc = " ".join((inspect.getdoc(module) or "").split())[:600]
        functions = [n for n, obj in vars(module).items()
                     if not n.startswith("_") and inspect.isfunction(obj)]
        for template in TEMPLATES:
            if "{doc}" in template and len(doc) < 80:
                continue
            if "{function}" in template and not functions:
                continue
            prompts.append(template.format(name=name, doc=doc,
                                           function=functions[0] if functions else ""))
    random.Random(seed).shuffle(prompts)
    if num_prompts > len(prompts):
        raise ValueError(f"at most {len(prompts)} prompts are available, asked for {num_prompts}")
    return prompts[:num_prompts]


def build_documents(max_chars: int = 8000) -> list[tuple[str, str]]:
    """(user message, assistant text) pairs from module documentation, for teacher-forced
    self-distillation: the target reads the text as its own answer, and the positions where it
    would have written exactly that text become training examples (train_speculator.py)."""
    documents = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(module) or ""]
        docs += [inspect.getdoc(obj) or "" for n, obj in sorted(vars(module).items())
                 if not n.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                 and getattr(obj, "__module__", None) == module.__name__]
        text = "\n\n".join(d for d in docs if len(d) > 40)[:max_chars]
        if len(text) > 200:
            documents.append((f"Explain the Python module `{name}`.", text))
    return documents
