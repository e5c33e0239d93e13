"""How one request wants its tokens chosen and when it stops; validated once, up front, with clear errors."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# top-N logprobs returned per token at most (OpenAI's own cap is 20)
MAX_LOGPROBS = 20
# stop strings per request, and characters per stop string, at most: every new token is matched
# against each stop string over the last (longest stop) characters, so these bound that work
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# logit_bias entries per request at most (each costs work on every row of the request, every step)
MAX_LOGIT_BIAS_ENTRIES = 300
# bias added to a logit, at most this far from 0 either way (OpenAI's range; -100 bans in practice)
MAX_LOGIT_BIAS = 100.0
# frequency and presence penalties lie in [-2, 2] (OpenAI's range)
MAX_PENALTY = 2.0
# repetition_penalty lies in [1/100, 100]: far past any useful value, and a logit scaled by it stays
# finite, so no row of probabilities can turn into NaN
MAX_REPETITION_PENALTY = 100.0
# a temperature below this samples greedily (vLLM's rule): dividing logits by it would overflow
# float32 (1e-50 becomes 0.0), leaving no probability to sample from
GREEDY_TEMPERATURE = 1e-5
# seeds are in [0, SEED_RANGE): a torch generator takes 64-bit seeds, msgpack signed 64-bit ints
SEED_RANGE = 2**63


# integers a request may give are bounded, so that none overflows where it crosses to the engine
MAX_INT32 = 2**31 - 1
# the dataclass-field metadata key of a knob's declaration
_KNOB = "knob"


@dataclass(frozen=True)
class Interval:
    """The values a knob takes: low .. high, the low end open or closed."""

    low: float
    high: float
    low_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        return above and value <= self.high  # NOTE: NaN is in no interval

    def __str__(self) -> str:
        def number(value: float) -> str:
            return str(value) if isinstance(value, int) else f"{value:g}"

        return f"{'(' if self.low_open else '['}{number(self.low)}, {number(self.high)}]"


@dataclass(frozen=True)
class Knob:
    # what SamplingParams accepts (the offline LLM's range)
    valid: Interval
    # what the HTTP APIs accept (OpenAI's range where it is narrower)
    api: Interval
    # what the values mean, for the error message, where the interval alone does not say
    hint: str = ""


def knob(default: float, valid: Interval, api: Interval | None = None, hint: str = "") -> Any:
    """A per-request sampling knob, declared once: SamplingParams checks it against `valid`, and
    the HTTP APIs take it as an optional field of the same name bounded by `api`
    (server/api_requests.py), which --override-generation-config may default
    (server/sampling_defaults.py)."""
    return dataclasses.field(default=default,
                             metadata={_KNOB: Knob(valid, valid if api is None else api, hint)})


@functools.cache
def sampling_knobs() -> dict[str, tuple[type, Knob]]:
    """SamplingParams' knobs in declaration order: name -> (int or float, declaration)."""
    return {f.name: (type(f.default), f.metadata[_KNOB]) for f in dataclasses.fields(SamplingParams)
            if _KNOB in f.metadata}


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion `index` of n: seed + index, wrapped so it never leaves the range."""
    return None if seed is None else (seed + index) % SEED_RANGE


@dataclass(frozen=True)
class SamplingParams:
    # ---- knobs (knob(...)): each one's HTTP field and check come from its declaration; the
    # ones that reshape a row's distribution also have a law in engine/sample/row_laws.py ----
    # below GREEDY_TEMPERATURE (0 included) = greedy (argmax); otherwise logits are divided by it
    # before softmax (HTTP: OpenAI's range)
    temperature: float = knob(1.0, Interval(0.0, 100.0), api=Interval(0.0, 2.0))
    # nucleus sampling: keep the smallest set of tokens whose probability mass reaches top_p
    top_p: float = knob(1.0, Interval(0.0, 1.0, low_open=True))
    # keep only the top_k most likely tokens; 0 or -1 = all
    top_k: int = knob(0, Interval(-1, MAX_INT32), hint="-1 and 0 keep every token")
    # a seeded request's random numbers are keyed by (seed, output position): the same seed gives
    # the same tokens run to run, and with one-hot drafts (or none) whatever the speculation
    seed: int | None = None
    # generated tokens at most; None = until EOS, a stop condition or max_model_len
    max_tokens: int | None = 16
    # strings that end the output; the matched stop string is not included in the text
    stop: tuple[str, ...] = ()
    # token ids that end the output (the id itself is kept in token_ids, not in the text)
    stop_token_ids: tuple[int, ...] = ()
    # keep generating past EOS (benchmarks)
    ignore_eos: bool = False
    # completions to return per prompt
    n: int = 1
    # also return this many top logprobs per generated token (None = no logprobs)
    logprobs: int | None = None
    # do not start generation until at least this many tokens are produced
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # per-request speculation cap: None = the engine's k, 0 = no speculation for this request
    num_speculative_tokens: int | None = None
    # ---- logits processing, applied at every position as if decoding one token at a time ----
    # subtracted from a token's logit once if it occurs in the output so far (not the prompt)
    presence_penalty: float = knob(0.0, Interval(-MAX_PENALTY, MAX_PENALTY))
    # subtracted from a token's logit once per occurrence in the output so far (not the prompt)
    frequency_penalty: float = knob(0.0, Interval(-MAX_PENALTY, MAX_PENALTY))
    # tokens in the prompt or the output so far: a positive logit is divided by it, a negative one
    # multiplied (vLLM / transformers); 1 = off
    repetition_penalty: float = knob(1.0, Interval(1.0 / MAX_REPETITION_PENALTY,
                                                   MAX_REPETITION_PENALTY))
    # added to the logits of these token ids: ((token id, bias), ...) sorted by id; a mapping
    # {token id: bias} or a list of pairs is accepted and normalised
    logit_bias: tuple[tuple[int, float], ...] = ()
    # after temperature, drop tokens less likely than min_p times the most likely one; 0 = off
    min_p: float = knob(0.0, Interval(0.0, 1.0))
    # structured output: the canonical key of a ResponseFormat (engine/structured/), None = free
    # text; an OpenAI `response_format` dict (or a ResponseFormat) is accepted and normalised
    response_format: str | None = None

    def __post_init__(self) -> None:
        # NOTE: accept lists and a lone string from callers; normalised once here, never changed later
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        object.__setattr__(self, "response_format", _response_format_key(self.response_format))
        if self.response_format is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with response_format: the grammar may "
                             "end the output before min_tokens, where only EOS is allowed")
        for name, (_, declaration) in sampling_knobs().items():
            value = getattr(self, name)
            if value not in declaration.valid:
                hint = f" ({declaration.hint})" if declaration.hint else ""
                raise ValueError(f"{name} must be in {declaration.valid}{hint}, got {value}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.seed is not None and not 0 <= self.seed < SEED_RANGE:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")

    def for_completion(self, index: int) -> SamplingParams:
        """Completion `index` of n: each is its own engine request (n = 1), a seeded one with a
        seed of its own (the server's and the offline LLM's fan-out)."""
        return dataclasses.replace(self, n=1, seed=child_seed(self.seed, index))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def top_k_or_none(self) -> int | None:
        return self.top_k if self.top_k > 0 else None

    @property
    def has_penalties(self) -> bool:
        """Whether the logits depend on the tokens so far (presence, frequency or repetition)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _logit_bias_pairs(bias: Mapping[int, float] | Iterable) -> tuple[tuple[int, float], ...]:
    """logit_bias as ((token id, bias), ...) sorted by id, from a mapping or from pairs (msgpack
    brings the tuple back as lists); bad ids, values or sizes are a ValueError naming logit_bias."""
    try:
        pairs = list(bias.items()) if isinstance(bias, Mapping) else [tuple(p) for p in bias]
    except TypeError:
        raise ValueError("logit_bias must map token ids to biases") from None
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} "
                         "are allowed")
    normalised = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError("logit_bias must map token ids to biases")
        token_id, value = pair
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {token_id!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}], got {value!r} for token {token_id}")
        if token_id in normalised:
            raise ValueError(f"logit_bias gives token {token_id} twice")
        normalised[token_id] = float(value)
    return tuple(sorted(normalised.items()))


def _response_format_key(value: Any) -> str | None:
    """A response format as the key the engine compiles (engine/structured/), from an OpenAI
    `response_format` dict, a ResponseFormat, or a key already (what crosses the process queue)."""
    from engine.structured.response_format import ResponseFormat, parse_response_format

    if value is None or isinstance(value, str):
        return value
    fmt = value if isinstance(value, ResponseFormat) else parse_response_format(value)
    return None if fmt is None else fmt.key
