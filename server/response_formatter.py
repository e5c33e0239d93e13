"""What the completions and chat formatters share: the response id and creation time that every
chunk of one stream repeats, usage, the speculation metrics extra, and tokens as text."""

from __future__ import annotations

import time
from typing import Any

from server.api_responses import ResponseMetrics, Usage, random_id
from server.generation import Generation


class ResponseFormatter:
    def __init__(self, tokenizer: Any, model_name: str, id_prefix: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.response_id = random_id(id_prefix)
        self.created = int(time.time())

    @staticmethod
    def usage(generation: Generation) -> Usage:
        return Usage.count(generation.num_prompt_tokens, generation.num_completion_tokens,
                           generation.num_cached_tokens)

    @staticmethod
    def metrics(generation: Generation) -> ResponseMetrics:
        return ResponseMetrics.of(generation.reports(), generation.num_spec_tokens)

    def token_text(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode([token_id])
