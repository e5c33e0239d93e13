"""engine/sampling_params.py: bad values fail up front with a ValueError naming the field."""

from __future__ import annotations

import pytest

from engine.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
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
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 101.0}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"logit_bias": {True: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": {5: "1"}}, "logit_bias"),
    ({"logit_bias": [(5, 1.0), (5, 2.0)]}, "logit_bias"),
    ({"logit_bias": [(5, 1.0, 2.0)]}, "logit_bias"),
    ({"logit_bias": 5}, "logit_bias"),
    ({"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)}, "logit_bias"),
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
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 0.01},
    {"repetition_penalty": 100.0},
    {"min_p": 1.0},
])
def test_edge_values_are_accepted(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


@pytest.mark.parametrize("top_k, expected", [(0, None), (-1, None), (7, 7)])
def test_top_k_or_none(top_k: int, expected: int | None) -> None:
    assert SamplingParams(top_k=top_k).top_k_or_none == expected


@pytest.mark.parametrize("logit_bias", [
    {7: -100, 3: 2.5},
    [(3, 2.5), (7, -100.0)],
    [[7, -100], [3, 2.5]],  # as msgpack brings the tuple back
])
def test_logit_bias_is_normalised_to_sorted_pairs(logit_bias) -> None:
    assert SamplingParams(logit_bias=logit_bias).logit_bias == ((3, 2.5), (7, -100.0))


def test_params_cross_the_process_boundary_unchanged() -> None:
    """The server sends dataclasses.asdict(params) through msgpack; the engine rebuilds them."""
    import dataclasses

    import msgpack

    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.2,
                            logit_bias={50: -100, 2: 0.5}, min_p=0.1, stop=["x"], seed=3)
    fields = msgpack.unpackb(msgpack.packb(dataclasses.asdict(params)), raw=False)
    assert SamplingParams(**fields) == params
    assert dataclasses.replace(params, n=1) == params


def test_has_penalties() -> None:
    assert not SamplingParams(logit_bias={1: 1.0}, min_p=0.5).has_penalties
    for name, value in (("presence_penalty", 0.1), ("frequency_penalty", -0.1),
                        ("repetition_penalty", 1.1)):
        assert SamplingParams(**{name: value}).has_penalties


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
