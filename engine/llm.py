"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))` over an in-process EngineCore."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.config import CacheConfig, ModelConfig, SchedulerConfig
from engine.core import EngineCore
from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import FinishReason
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestUpdate
from engine.spec_config import SpeculativeConfig
from engine.spec_stats import SpecStats

# a prompt: text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}
PromptType = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, block_size: int = 16,
                 kv_cache_memory_gib: float = 1.0, num_kv_blocks: int | None = None,
                 num_threads: int | None = None,
                 speculative_config: str | dict[str, Any] | SpeculativeConfig | None = None,
                 ) -> None:
        if speculative_config is not None and not isinstance(speculative_config,
                                                             SpeculativeConfig):
            speculative_config = SpeculativeConfig.from_json(speculative_config)
        self.engine = EngineCore(
            ModelConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                        num_threads=num_threads),
            CacheConfig(block_size=block_size, kv_cache_memory_gib=kv_cache_memory_gib,
                        num_blocks=num_kv_blocks),
            SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens),
            speculative_config,
        )
        self.tokenizer = self.engine.worker.tokenizer
        self._request_counter = itertools.count()

    # ------------------------------------------------------------------ public API
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order."""
        if isinstance(prompts, str | dict) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        token_lists = [self._tokenize(p) for p in prompts]  # all validated before any is added
        return self._run(prompts, token_lists, params_list, use_tqdm)

    def chat(self, conversations: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        texts = [self.apply_chat_template(c) for c in conversations]
        token_lists = [self._require_tokenizer().encode(t, add_special_tokens=False) for t in texts]
        params_list = self._params_per_prompt(sampling_params, len(texts))
        return self._run(texts, token_lists, params_list, use_tqdm)

    def apply_chat_template(self, conversation: list[dict[str, str]]) -> str:
        tokenizer = self._require_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        return tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)

    # ------------------------------------------------------------------ internals
    def _run(self, prompts: Sequence[PromptType], token_lists: list[list[int]],
             params_list: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        trackers: dict[str, tuple[CompletionOutput, IncrementalDetokenizer | None]] = {}
        try:
            for prompt, token_ids, params in zip(prompts, token_lists, params_list):
                result = RequestOutput(str(next(self._request_counter)),
                                       prompt if isinstance(prompt, str) else None, token_ids)
                results.append(result)
                for index in range(params.n):
                    child_id = f"{result.request_id}-{index}"
                    child_params = self._child_params(params, index)
                    self.engine.add_request(child_id, token_ids, child_params)
                    completion = CompletionOutput(index, "", [],
                                                  logprobs=[] if params.logprobs is not None else None)
                    result.outputs.append(completion)
                    trackers[child_id] = (completion, self._detokenizer(token_ids, child_params))
        except Exception:
            self.engine.abort(list(trackers))
            raise
        progress = tqdm(total=len(trackers), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished:
            for update in self.engine.step():
                if self._apply(update, trackers):
                    progress.update(1)
        progress.close()
        for result in results:
            result.finished = True
            result.spec_stats = SpecStats.merged([c.spec_stats for c in result.outputs
                                                  if c.spec_stats is not None])
        return results

    def _apply(self, update: RequestUpdate,
               trackers: dict[str, tuple[CompletionOutput, IncrementalDetokenizer | None]]) -> bool:
        """Fold one engine update into its completion; True when that completion just finished."""
        completion, detok = trackers[update.request_id]
        if update.spec_stats is not None:
            completion.spec_stats = update.spec_stats
        if completion.finish_reason is not None:
            return False  # already ended here by a stop string; this is the engine's abort echo
        completion.token_ids += update.new_token_ids
        if completion.logprobs is not None and update.new_logprobs:
            completion.logprobs += update.new_logprobs
        if detok is not None:
            detok.update(update.new_token_ids)
            completion.text = detok.text
            if detok.matched_stop is not None and update.finish_reason is None:
                self.engine.abort([update.request_id])
                completion.finish_reason, completion.stop_reason = "stop", detok.matched_stop
                return True
        if update.finish_reason is not None:
            completion.finish_reason = update.finish_reason.value
            completion.stop_reason = update.stop_reason
            if detok is not None and detok.matched_stop is not None:
                completion.finish_reason = FinishReason.STOP.value
                completion.stop_reason = detok.matched_stop
            return True
        return False

    def _detokenizer(self, prompt_ids: list[int], params: SamplingParams
                     ) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            if params.stop:
                raise ValueError("stop strings need a tokenizer; this model folder has none")
            return None
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                      params.stop)

    @staticmethod
    def _child_params(params: SamplingParams, index: int) -> SamplingParams:
        """Each of n completions is its own request; seeded ones get seed + index to differ."""
        seed = None if params.seed is None else params.seed + index
        return dataclasses.replace(params, n=1, seed=seed)

    @staticmethod
    def _params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None,
                           num_prompts: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} SamplingParams for {num_prompts} prompts")
        return list(params)

    def _tokenize(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError('a prompt dict needs "prompt" (text) or "prompt_token_ids"')
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        raise TypeError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt)}")

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompt token ids instead")
        return self.tokenizer
