"""`--speculative-config` parsing: good JSON builds a config, anything else fails naming the problem."""

from __future__ import annotations

import pytest

from engine.spec_config import SpeculativeConfig


def test_vllm_style_json_parses():
    config = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}')
    assert (config.method, config.num_speculative_tokens) == ("ngram", 5)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 4)
    assert SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 1}) == \
        SpeculativeConfig("ngram", 1)
    assert SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": true}').adaptive


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"method": "ngram"}', "needs 'num_speculative_tokens'"),
    ('{"num_speculative_tokens": 3}', "needs 'method'"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}', "unknown .*lookahead"),
    ('{"method": "magic", "num_speculative_tokens": 3}', "method must be one of"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "train-speculator --method eagle"),
    ('{"method": "draft_model", "num_speculative_tokens": 3}', "needs \"model\""),
    ('{"method": "ngram", "num_speculative_tokens": 0}', r"num_speculative_tokens must be in"),
    ('{"method": "ngram", "num_speculative_tokens": "5"}', "must be int"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "must be int"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "adaptive": "yes"}', "'adaptive' must be bool"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "adaptive": 1}', "'adaptive' must be bool"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, '
     '"prompt_lookup_max": 2}', "prompt_lookup_min"),
])
def test_bad_configs_fail_clearly(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(value)


def test_none_turns_speculation_off():
    from engine.engine_args import EngineArgs

    assert EngineArgs(speculative_config="none").configs()[3] is None
    assert EngineArgs(speculative_config=None).configs()[3] is None
