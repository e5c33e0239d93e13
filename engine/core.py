"""EngineCore: the engine step, and nothing that talks to the outside world."""

from __future__ import annotations

from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.request import Request
from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestUpdate, Scheduler
from engine.worker import Worker


class EngineCore:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig) -> None:
        self.worker = Worker(model_config, cache_config)
        self.scheduler = Scheduler(scheduler_config, self.worker.kv_spec)
        self.sampler = Sampler()
        self.eos_token_ids = frozenset(self.worker.arch.eos_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        vocab_size = self.worker.arch.vocab_size
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        self.scheduler.add_request(
            Request(request_id, list(prompt_token_ids), params, self.eos_token_ids))

    def abort(self, request_ids: list[str]) -> list[RequestUpdate]:
        updates = (self.scheduler.abort(request_id) for request_id in request_ids)
        return [u for u in updates if u is not None]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestUpdate]:
        """schedule -> one target forward -> sample -> commit."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return []
        out = self.worker.execute(scheduled, self.scheduler.block_manager)
        sampled = self.sampler(out.logits, scheduled.sampling_requests)
        return self.scheduler.commit(scheduled, sampled)
