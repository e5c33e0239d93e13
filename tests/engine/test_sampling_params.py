"""engine/sampling_params.py: bad values fail up front with a ValueError naming the field."""

from __future__ import annotations

import pytest

from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SEED_RANGE,
    SamplingParams,
    child_seed,
)


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"n": 0}, "n"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"top_k": -2}, "top_k"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
    ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"seed": -1}, "seed"),
])
def test_invalid_value_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("stop, expected", [
    ("###", ("###",)),
    (["a", "b"], ("a", "b")),
    ((), ()),
])
def test_stop_is_normalised_to_a_tuple(stop: str | list[str] | tuple[str, ...],
                                       expected: tuple[str, ...]) -> None:
    assert SamplingParams(stop=stop).stop == expected


def test_stop_token_ids_list_becomes_a_tuple() -> None:
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_defaults_are_valid() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.n) == (1.0, 1.0, 0, 1)
    assert (params.max_tokens, params.min_tokens, params.logprobs) == (16, 0, None)
    assert params.stop == () and params.stop_token_ids == ()
    assert not params.is_greedy and params.top_k_or_none is None


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0},
    {"top_p": 1.0, "top_k": -1},
    {"top_k": 5},
    {"max_tokens": None, "min_tokens": 100},
    {"min_tokens": 4, "max_tokens": 4},
    {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS},
    {"seed": 0},
])
def test_edge_values_are_accepted(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


@pytest.mark.parametrize("top_k, expected", [(0, None), (-1, None), (7, 7)])
def test_top_k_or_none(top_k: int, expected: int | None) -> None:
    assert SamplingParams(top_k=top_k).top_k_or_none == expected


def test_params_are_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize("seed, index, expected", [
    (None, 3, None),
    (7, 0, 7),
    (7, 2, 9),
    (SEED_RANGE - 1, 1, 0),  # wraps instead of overflowing what a generator and msgpack take
    (SEED_RANGE - 2, 127, 125),
])
def test_child_seeds_stay_in_range(seed: int | None, index: int, expected: int | None) -> None:
    assert child_seed(seed, index) == expected
    if expected is not None:
        SamplingParams(seed=expected)
