"""--override-generation-config: the server's defaults fill only the sampling fields a request
leaves out, and a bad flag fails at start-up with a message naming the problem."""

from __future__ import annotations

import pytest

from server.api_requests import ChatCompletionRequest
from server.sampling_defaults import parse_generation_config, with_defaults

ASK = [{"role": "user", "content": "hi"}]


def test_defaults_fill_only_what_the_request_left_out() -> None:
    defaults = parse_generation_config('{"temperature": 0, "top_k": 5}')
    silent = with_defaults(ChatCompletionRequest(messages=ASK), defaults)
    assert silent.to_sampling_params(16).is_greedy and silent.top_k == 5
    explicit = with_defaults(ChatCompletionRequest(messages=ASK, temperature=0.7), defaults)
    params = explicit.to_sampling_params(16)
    assert params.temperature == 0.7 and params.top_k == 5
    untouched = ChatCompletionRequest(messages=ASK)
    assert with_defaults(untouched, {}) is untouched


@pytest.mark.parametrize("text, message", [
    ("{temperature: 0}", "not valid JSON"),
    ("[0]", "must be a JSON object"),
    ('{"max_tokens": 5}', "unknown field"),
    ('{"temperature": -1}', "temperature must be in"),
    ('{"top_p": 0}', "top_p must be in"),
])
def test_a_bad_flag_is_refused_with_the_reason(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_generation_config(text)


def test_no_flag_means_no_defaults() -> None:
    assert parse_generation_config(None) == {} == parse_generation_config("")
