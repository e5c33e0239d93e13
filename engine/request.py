"""One request's state inside the engine: its tokens, how many have K/V in the cache, and why it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams
from engine.spec_stats import SpecStats

if TYPE_CHECKING:
    from engine.structured import GrammarState

# the prefix-cache tenant of requests without a cache_salt (a server without API keys, no salt)
ANONYMOUS_PREFIX_TENANT = "anonymous"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    # EOS, a stop token id or (in the front end) a stop string
    STOP = "stop"
    # max_tokens or max_model_len reached
    LENGTH = "length"
    # the client went away or the front end cancelled it
    ABORT = "abort"
    # the step failed for this request alone (its grammar, its drafts, non-finite logits); the
    # request ends with an error and the engine goes on (RequestUpdate.error says why)
    ERROR = "error"


@dataclass
class TokenLogprobs:
    """The target's log-probability of an emitted token, and the top-N alternatives at its position."""

    token_id: int
    logprob: float
    # rank of the emitted token among all tokens (1 = most likely)
    rank: int
    top: list[tuple[int, float]]


# NOTE: eq=False: a request is itself, not its fields; the scheduler's list removals then compare
# identities instead of every token list (seconds when thousands of requests finish in one step)
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # token ids that count as end-of-sequence for this model
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # tokens whose K/V sit in the cache; the last sampled token is never computed yet
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # the stop token id that ended the request, if one did
    stop_reason: int | None = None
    num_preemptions: int = 0
    # a private random stream for seeded requests, so batch neighbours cannot change their tokens
    generator: torch.Generator | None = None
    spec_stats: SpecStats = field(default_factory=SpecStats)
    # tenant isolation key: state that outlives the request and that another request could observe
    # (suffix decoding's output cache) is shared only between requests with the same salt; None
    # belongs to no tenant and shares with nobody (but see prefix_cache_tenant)
    cache_salt: str | None = None
    # prompt tokens whose K/V came from the prefix cache at the latest admission
    num_cached_tokens: int = 0
    # structured output: where the committed output stands in its grammar (None = free text)
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def prefix_cache_tenant(self) -> str:
        """Whose cached prefix blocks the request may read and fill. Without a salt it is the shared
        anonymous tenant, as in vLLM: a prefix hit only tells a client that the same prefix was sent
        before, while suffix decoding's cache would tell it what other clients' outputs said."""
        return ANONYMOUS_PREFIX_TENANT if self.cache_salt is None else self.cache_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the concatenation."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
