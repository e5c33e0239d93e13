"""`--speculative-config`: which proposer drafts tokens, and how many, parsed from vLLM-style JSON.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}
    {"method": "suffix", "num_speculative_tokens": 4, "suffix_max_depth": 24}
    {"method": "mlp_speculator", "model": "/path/to/speculator", "num_speculative_tokens": 3}
    {"method": "eagle", "model": "/path/to/eagle-head", "num_speculative_tokens": 3}
    {"method": "eagle3", "model": "/path/to/eagle3-head", "num_speculative_tokens": 3}
    {"method": "mtp", "num_speculative_tokens": 2}     (the MTP layers of --model's own checkpoint)
    {"method": "ngram", "num_speculative_tokens": 5, "adaptive": true}
    {"method": "suffix", "num_speculative_tokens": 12, "draft_tree": true}
    {"method": "eagle", "model": "/path/to/head", "num_speculative_tokens": 8, "draft_tree": true}
    {"method": "medusa", "model": "/path/to/medusa-heads", "num_speculative_tokens": 3}
    {"method": "medusa", "model": "/path/to/medusa-heads", "num_speculative_tokens": 10,
     "draft_tree": true, "medusa_choices": [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0]]}

With "adaptive", num_speculative_tokens is the most a request drafts: each step the engine picks
every request's k in 0..that from measured costs and recent acceptance (engine/adaptive/).

Unknown keys and bad values fail here, at start-up, with the name of what was wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MethodFacts:
    """What the engine knows of a proposal method before building its proposer
    (engine/proposers/__init__.py builds it): a new method is one entry of METHODS."""

    # what its "model" must be, or "" when it needs none
    needs_model: str = ""
    # it drafts trees (several guesses at once, verified in one pass) when told `draft_tree`
    drafts_trees: bool = False
    # it reads the target's embedding and LM head (under tensor parallelism the engine keeps them
    # whole for it; the draft model has its own)
    reads_target_vocab: bool = False
    # its weights are in the target's own checkpoint (MTP): a "model" is refused, not ignored
    reads_target_checkpoint: bool = False


_TRAINED_HEAD = "a folder written by `specserve train-speculator --method {method}`, or one " \
    "published for the target"
METHODS = {
    "ngram": MethodFacts(drafts_trees=True),
    "draft_model": MethodFacts(needs_model="a local folder or .gguf file of a smaller model with "
                                           "the same tokenizer"),
    "eagle": MethodFacts(needs_model=_TRAINED_HEAD, drafts_trees=True, reads_target_vocab=True),
    "eagle3": MethodFacts(needs_model="an EAGLE-3 head folder (the EAGLE authors' layout or vLLM "
                                      "speculators')", drafts_trees=True, reads_target_vocab=True),
    "mlp_speculator": MethodFacts(needs_model=_TRAINED_HEAD, reads_target_vocab=True),
    "suffix": MethodFacts(drafts_trees=True),
    "mtp": MethodFacts(drafts_trees=True, reads_target_vocab=True, reads_target_checkpoint=True),
    "medusa": MethodFacts(needs_model=_TRAINED_HEAD + " (FasterDecoding's or vLLM's layout)",
                          drafts_trees=True, reads_target_vocab=True),
}
# what `specserve serve` speculates with unless told otherwise ("none" turns it off): suffix drafts
# cost nothing and need no second model, and adaptive k backs off where drafts do not pay (a busy
# batch, text it cannot guess), so it is never much slower than plain decoding (docs/perf.md)
DEFAULT_SERVE_SPECULATIVE_CONFIG = '{"method": "suffix", "num_speculative_tokens": 8, "adaptive": true}'
MAX_SPECULATIVE_TOKENS = 16
# a draft tree's node budget may go further: its rows spread over branches, not depth
MAX_TREE_DRAFT_TOKENS = 32
TREE_METHODS = tuple(method for method, facts in METHODS.items() if facts.drafts_trees)
# suffix trees cost O(depth) per committed token in Python: deeper buys little and costs every step
MAX_SUFFIX_DEPTH = 64
# who drafts from whose finished outputs: requests of one tenant (same cache_salt), or everybody
SUFFIX_CACHE_SCOPES = ("tenant", "global")
# a Medusa tree node is one of its head's top MAX_MEDUSA_RANK guesses (FasterDecoding's go to 10)
MAX_MEDUSA_RANK = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # k: draft tokens proposed per step for one request (a request may get fewer, or none)
    num_speculative_tokens: int
    # choose each request's k per step (at most num_speculative_tokens) to maximise tokens per second
    adaptive: bool = False
    # draft a tree of guesses (n-gram: several matches; suffix: the most frequent continuations;
    # EAGLE: the head's top-k expanded by confidence), num_speculative_tokens its node budget,
    # verified in one pass under a tree attention mask
    draft_tree: bool = False
    # n-gram: the shortest and longest suffix of the context looked up earlier in it
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_model / eagle / mlp_speculator: a local folder with the proposer's weights
    model: str | None = None
    # suffix: the longest pattern the suffix trees index (tokens); a match plus its draft fit in it
    suffix_max_depth: int = 24
    # suffix: tokens of finished requests' outputs kept for later requests to draft from (0 = none)
    suffix_max_cached_tokens: int = 65536
    # suffix: a draft stops where the estimated probability of its path falls below this
    suffix_min_token_prob: float = 0.1
    # suffix: at most this many draft tokens per matched context token (the paper's MAX_SPEC = α·p)
    suffix_factor: float = 1.0
    # suffix: "tenant" = a request drafts only from outputs of requests with its cache_salt (API
    # key + salt: acceptance counts could otherwise reveal other clients' outputs); "global" = from
    # every request's outputs (one trusted client). suffix_max_cached_tokens bounds the total.
    suffix_cache_scope: str = "tenant"
    # ranks a model drafter runs on (vLLM's key): 1, unsharded on rank 0 beside a target split over
    # any number of ranks. A sharded drafter would pay an all-reduce per layer per draft token for
    # a model too small to need the memory (docs/perf.md measures it), so it is not offered.
    draft_tensor_parallel_size: int = 1
    # medusa with draft_tree: the tree's shape as FasterDecoding writes it, paths of top-k ranks in
    # priority order ([[0], [0, 0], [1], ...]: head 0's best, then head 1's best after it, then head
    # 0's second best...); num_speculative_tokens nodes are kept. None: the heads' likeliest paths
    medusa_choices: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        most = MAX_TREE_DRAFT_TOKENS if self.draft_tree else MAX_SPECULATIVE_TOKENS
        if not 1 <= self.num_speculative_tokens <= most:
            raise ValueError(f"num_speculative_tokens must be in [1, {most}]"
                             f"{' for a draft tree' if self.draft_tree else ''}, "
                             f"got {self.num_speculative_tokens}")
        if self.draft_tree and self.method not in TREE_METHODS:
            raise ValueError(f"draft_tree is built for {', '.join(TREE_METHODS)}; "
                             f"{self.method!r} drafts a chain")
        needs_model = self.facts.needs_model
        if needs_model and not self.model:
            raise ValueError(f'speculative method "{self.method}" needs "model": '
                             f'{needs_model.format(method=self.method)}')
        if self.facts.reads_target_checkpoint and self.model is not None:
            raise ValueError(f'speculative method "{self.method}" reads its layers from the '
                             f'target\'s own checkpoint (--model); drop "model" '
                             f'(got {self.model!r})')
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError(f"draft_tensor_parallel_size must be 1 (drafters run unsharded on "
                             f"rank 0), got {self.draft_tensor_parallel_size!r}")
        self._check_suffix_settings()
        self._check_medusa_choices()

    @property
    def facts(self) -> MethodFacts:
        return METHODS[self.method]

    def _check_suffix_settings(self) -> None:
        if not 2 <= self.suffix_max_depth <= MAX_SUFFIX_DEPTH:
            raise ValueError(f"suffix_max_depth must be in [2, {MAX_SUFFIX_DEPTH}], "
                             f"got {self.suffix_max_depth}")
        if self.method == "suffix" and not self.draft_tree \
                and self.suffix_max_depth <= self.num_speculative_tokens:
            raise ValueError(f"suffix_max_depth ({self.suffix_max_depth}) must exceed "
                             f"num_speculative_tokens ({self.num_speculative_tokens}): a match of "
                             f"at least one token and its draft fit in that depth")
        if self.suffix_max_cached_tokens < 0:
            raise ValueError(f"suffix_max_cached_tokens must be >= 0 (0 turns the cache of "
                             f"finished outputs off), got {self.suffix_max_cached_tokens}")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ValueError(f"suffix_min_token_prob must be in [0, 1], "
                             f"got {self.suffix_min_token_prob}")
        if not (self.suffix_factor > 0 and math.isfinite(self.suffix_factor)):
            raise ValueError(f"suffix_factor must be a finite number > 0, got {self.suffix_factor}")
        if self.suffix_cache_scope not in SUFFIX_CACHE_SCOPES:
            raise ValueError(f"suffix_cache_scope must be one of {', '.join(SUFFIX_CACHE_SCOPES)}, "
                             f"got {self.suffix_cache_scope!r}")

    def _check_medusa_choices(self) -> None:
        """A list of rank paths, each path's parent listed too; kept as tuples (hashable, frozen)."""
        choices = self.medusa_choices
        if choices is None:
            return
        if self.method != "medusa" or not self.draft_tree:
            raise ValueError('medusa_choices shapes a Medusa draft tree: it needs "method": "medusa" '
                             'and "draft_tree": true')
        if not isinstance(choices, (list, tuple)) or not choices or not all(
                isinstance(path, (list, tuple)) and path and all(
                    isinstance(rank, int) and not isinstance(rank, bool)
                    and 0 <= rank < MAX_MEDUSA_RANK for rank in path) for path in choices):
            raise ValueError(f"medusa_choices must be a non-empty list of non-empty lists of ranks "
                             f"in [0, {MAX_MEDUSA_RANK}), e.g. [[0], [0, 0], [1]]; got {choices!r}")
        paths = tuple(tuple(path) for path in choices)
        if len(set(paths)) != len(paths):
            raise ValueError(f"medusa_choices lists a path twice: {choices!r}")
        orphans = [path for path in paths if len(path) > 1 and path[:-1] not in set(paths)]
        if orphans:
            raise ValueError(f"medusa_choices {list(orphans[0])} has no parent "
                             f"{list(orphans[0][:-1])} among the choices: a tree lists every "
                             f"path's prefixes too")
        object.__setattr__(self, "medusa_choices", paths)

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """Parse a JSON string or a dict; `num_speculative_tokens` is required, as in vLLM."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(f"unknown speculative config keys {unknown}; known: {sorted(fields)}")
        for required in ("method", "num_speculative_tokens"):
            if required not in value:
                raise ValueError(f"speculative config needs {required!r}")
        for key, expected in (("method", str), ("num_speculative_tokens", int), ("model", str),
                              ("prompt_lookup_min", int), ("prompt_lookup_max", int),
                              ("suffix_max_depth", int), ("suffix_max_cached_tokens", int),
                              ("suffix_min_token_prob", numbers.Real),
                              ("suffix_factor", numbers.Real), ("suffix_cache_scope", str),
                              ("adaptive", bool), ("draft_tree", bool),
                              ("draft_tensor_parallel_size", int)):
            if key in value and (not isinstance(value[key], expected)
                                 or (isinstance(value[key], bool) and expected is not bool)):
                raise ValueError(f"speculative config {key!r} must be {expected.__name__}, "
                                 f"got {value[key]!r}")
        return cls(**value)
