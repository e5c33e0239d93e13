"""EngineCore: the engine step, and nothing that talks to the outside world."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from engine.adaptive import AdaptiveSpeculation
from engine.adaptive.calibration import calibrate_verify_cost
from engine.adaptive.calibration_cache import engine_fields
from engine.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from engine.drafting import DraftChoice, Drafting
from engine.models.loader import embedded_gguf_path
from engine.proposers import Proposer, build_proposer
from engine.request import Request
from engine.runner.worker import Worker
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.spec_config import SpeculativeConfig
from engine.step.isolation import sample_isolated
from engine.step.rejection import RejectionSampler
from engine.step.scheduler_output import SchedulerOutput
from engine.step.types import (
    RequestUpdate,
    SampledTokens,
    ScheduledRequest,
    StepResult,
    StepStats,
)
from engine.structured import CompiledGrammar, GrammarCompiler, GrammarState


@dataclass
class EngineTotals:
    """Counters since start; the metrics exporter reads differences."""

    num_steps: int = 0
    # seconds in target forward + verification, and in proposing drafts
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig,
                 speculative_config: SpeculativeConfig | None = None,
                 parallel_config: ParallelConfig | None = None) -> None:
        self.worker = Worker(model_config, cache_config, parallel_config,
                             drafters_read_vocab=speculative_config is not None
                             and speculative_config.facts.reads_target_vocab)
        self.scheduler = Scheduler(scheduler_config, self.worker.kv_spec, self.worker.device,
                                   self.worker.block_manager)
        self.sampler = RejectionSampler()
        self.speculative_config = speculative_config
        proposer = (None if speculative_config is None
                    else build_proposer(speculative_config, self.worker.target_handle()))
        if proposer is not None and proposer.target_feature_layers:
            self.worker.capture_aux_hidden(proposer.target_feature_layers)
        # NOTE: after the features are chosen (a graph records them), before calibration (which
        # then times the steps as they will run)
        self.worker.capture_step_graphs(scheduler_config.max_num_seqs,
                                        _chain_draft_len(speculative_config))
        self.adaptive: AdaptiveSpeculation | None = None
        if speculative_config is not None and speculative_config.adaptive:
            self.adaptive = AdaptiveSpeculation(has_soft_drafts=not proposer.drafts_for_free,
                                                drafts_first=proposer.drafts_for_free)
            calibrate_verify_cost(self.adaptive.cost, self.worker, self.scheduler.block_manager,
                                  self.sampler, min(scheduler_config.max_num_batched_tokens,
                                                    self.worker.kv_spec.max_model_len),
                                  cache_fields=engine_fields(
                                      model_config, cache_config, parallel_config,
                                      model_config.model or embedded_gguf_path(),
                                      self.worker.linear_backend,
                                      proposer.target_feature_layers, self.worker.device))
        self.drafting: Drafting | None = (
            None if proposer is None
            else Drafting(proposer, speculative_config.num_speculative_tokens, self.scheduler,
                          self.adaptive))
        self.eos_token_ids = frozenset(self.worker.arch.eos_token_ids)
        # response_format grammars for this tokenizer, built at the first request that has one
        self._grammar_compiler: GrammarCompiler | None = None
        self.totals = EngineTotals()

    @property
    def proposer(self) -> Proposer | None:
        """The drafting phase's proposer (tests and benchmarks may put another in its place)."""
        return None if self.drafting is None else self.drafting.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        self.drafting.proposer = proposer

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, grammar: CompiledGrammar | None = None) -> None:
        """`cache_salt` names the request's tenant: requests share cross-request state (suffix
        decoding's output cache) only with requests of the same salt; None shares with nobody.
        `grammar`: its response_format already compiled (off the engine loop, engine_process.py);
        None compiles it here."""
        vocab_size = self.worker.arch.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:  # NOTE: sorted by id
            raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids,
                          cache_salt=cache_salt)
        if params.response_format is not None:
            request.grammar = self._grammar_state(params.response_format, grammar)
        self.scheduler.add_request(request)

    def grammar_compiler(self) -> GrammarCompiler:
        """The response_format compiler of this model's tokenizer, built at first use (~1 s);
        thread-safe once built."""
        if self._grammar_compiler is None:
            if self.worker.tokenizer is None:
                raise ValueError("response_format needs the model's tokenizer, and this model "
                                 "was loaded without one")
            self._grammar_compiler = GrammarCompiler(self.worker.tokenizer, self.eos_token_ids)
        return self._grammar_compiler

    def _grammar_state(self, response_format_key: str,
                       compiled: CompiledGrammar | None = None) -> GrammarState:
        """A fresh grammar state for a request's format (compiled once per format, LRU-cached);
        an unenforceable schema raises UnsupportedSchemaError, a ValueError."""
        if compiled is None:
            compiled = self.grammar_compiler().compile_key(response_format_key)
        elif compiled.key != response_format_key:
            raise ValueError("the compiled grammar is not the request's response_format")
        return compiled.new_state(self.eos_token_ids)

    def abort(self, request_ids: list[str]) -> list[RequestUpdate]:
        updates = [u for u in map(self.scheduler.abort, request_ids) if u is not None]
        self._free_request_state(updates)
        return updates

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        self.worker.close()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> StepResult:
        """schedule -> one target forward (verifying drafts) -> rejection-sample -> commit -> propose."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return StepResult()
        num_prompt_tokens = _num_prompt_tokens(scheduled)
        pass_start = time.perf_counter()
        out = self.worker.execute(scheduled.forward, scheduled.layout.logits_indices)
        sampled = sample_isolated(self.sampler, out.logits, scheduled.layout)
        if scheduled.layout.draft_parents is not None:
            self.worker.keep_accepted_paths(scheduled, sampled)
        target_pass_seconds = time.perf_counter() - pass_start
        drafting = self.drafting
        failures = ({} if drafting is None
                    else drafting.record_target_hidden(scheduled, sampled, out.token_hidden))
        updates = self.scheduler.commit(scheduled, sampled)
        self._fail_after_commit(updates, failures)
        verified = time.perf_counter()
        choices, failures = (([], {}) if drafting is None
                             else drafting.propose(scheduled.layout, sampled, out.hidden))
        self._fail_after_commit(updates, failures)
        self._account(scheduled, sampled, choices, start, verified, updates, target_pass_seconds)
        return StepResult(updates, self._step_stats(scheduled.sampling, sampled, choices, updates,
                                                    num_prompt_tokens, start, verified))

    def _fail_after_commit(self, updates: list[RequestUpdate], failures: dict[str, str]) -> None:
        """End the requests that failed after their tokens were committed: each keeps the tokens
        it emitted this step, and its update now ends it with the error."""
        if not failures:  # NOTE: every step passes here; nothing to build on the usual path
            return
        updates_by_id = {update.request_id: update for update in updates}
        for request_id, error in failures.items():
            ended = self.scheduler.fail(request_id, error)
            if ended is None:
                continue  # it finished in this step's commit anyway
            update = updates_by_id.get(request_id)
            if update is None:  # mid-prefill: nothing emitted this step
                updates.append(ended)
            else:
                update.finish_reason, update.stop_reason = ended.finish_reason, None
                update.error, update.report = error, ended.report

    def _account(self, scheduled: SchedulerOutput, sampled: list[SampledTokens],
                 choices: list[DraftChoice], start: float, verified: float,
                 updates: list[RequestUpdate], target_pass_seconds: float) -> None:
        """Totals, per-request timings, what adaptive speculation learns from this step; then the
        finished requests' proposer and adaptive state is dropped."""
        now = time.perf_counter()
        self.totals.num_steps += 1
        self.totals.verify_seconds += verified - start
        self.totals.draft_seconds += now - verified
        for item in scheduled.sampling:
            item.request.spec_stats.verify_seconds += verified - start
        for choice in choices:
            if choice.k > 0:
                choice.request.spec_stats.draft_seconds += now - verified
        if self.adaptive is not None:
            self.adaptive.observe_step(scheduled, sampled, [c.k for c in choices],
                                       target_pass_seconds, verified - start, now - verified)
        self._free_request_state(updates)

    def gauge_snapshot(self) -> StepStats:
        """Running, waiting and KV-cache usage now, outside a step (StepStats.is_step False)."""
        scheduler, pool = self.scheduler, self.scheduler.block_manager
        return StepStats(is_step=False, num_running=len(scheduler.running),
                         num_waiting=len(scheduler.waiting),
                         kv_cache_usage=1.0 - pool.num_free_blocks / pool.num_blocks,
                         num_preemptions=scheduler.num_preemptions,
                         prefix_cache_queries=pool.prefix_cache_queries,
                         prefix_cache_hits=pool.prefix_cache_hits)

    def _step_stats(self, items: list[ScheduledRequest], sampled: list[SampledTokens],
                    choices: list[DraftChoice], updates: list[RequestUpdate],
                    num_prompt_tokens: int, start: float, verified: float) -> StepStats:
        stats = dataclasses.replace(
            self.gauge_snapshot(), is_step=True, num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=sum(len(u.new_token_ids) for u in updates),
            verify_seconds=verified - start, draft_seconds=time.perf_counter() - verified,
            num_k_choices=len(choices), num_speculating_choices=sum(c.k > 0 for c in choices),
            sum_chosen_k=sum(c.k for c in choices))
        for item, kept in zip(items, sampled):
            if not item.num_draft_tokens or kept.error is not None:
                continue
            num_accepted = len(kept.token_ids) - 1
            stats.num_drafts += 1
            stats.num_draft_tokens += item.num_draft_tokens
            stats.num_accepted_tokens += num_accepted
            stats.accepted_lengths.append(num_accepted)
            if len(stats.accepted_per_position) < item.num_draft_tokens:
                stats.accepted_per_position += [0] * (item.num_draft_tokens
                                                      - len(stats.accepted_per_position))
            for position in range(num_accepted):
                stats.accepted_per_position[position] += 1
        return stats

    def _free_request_state(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            if update.finish_reason is not None and self.drafting is not None:
                self.drafting.free(update.request_id)


def _chain_draft_len(speculative_config: SpeculativeConfig | None) -> int:
    """The most drafts a chain verification holds (0: no speculation, or trees, never captured)."""
    if speculative_config is None or speculative_config.draft_tree:
        return 0
    return speculative_config.num_speculative_tokens


def _num_prompt_tokens(scheduled: SchedulerOutput) -> int:
    """Prompt tokens computed this step (recomputed output tokens after a preemption are not)."""
    return sum(max(0, min(item.num_known_tokens,
                          item.request.num_prompt_tokens - item.request.num_computed_tokens))
               for item in scheduled.scheduled)
