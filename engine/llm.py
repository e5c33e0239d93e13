"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))` over an in-process EngineCore."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from engine.core import EngineCore
from engine.engine_args import EngineArgs
from engine.output_processor import CompletionTracker
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig
from engine.spec_stats import SpecStats
from engine.step.types import RequestUpdate

# a prompt: text, token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}; a dict may add
# "cache_salt": the request's tenant (cross-request state such as suffix decoding's output cache is
# shared only between prompts with the same salt)
PromptType = str | list[int] | dict[str, Any]
# the tenant of prompts without a salt: an LLM serves one user, who shares with themself
DEFAULT_CACHE_SALT = "offline"


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """Keywords are EngineArgs' (engine/engine_args.py): dtype, quantization, device,
        max_model_len (allow_long_max_model_len: above the trained length), max_num_seqs,
        max_num_batched_tokens, block_size, kv_cache_memory_gib, num_kv_blocks, num_threads,
        gpu_kernels, enforce_eager (no CUDA graphs), cuda_graph_max_seqs, batch_invariant (rows
        independent of their batch), speculative_config, tensor_parallel_size (and for several
        machines nnodes, node_rank, master_addr, master_port)."""
        speculative_config = engine_args.pop("speculative_config", None)
        if isinstance(speculative_config, SpeculativeConfig):
            args = EngineArgs(model=model, **engine_args)
            configs = (*args.configs()[:3], speculative_config)
        else:
            args = EngineArgs(model=model, speculative_config=speculative_config, **engine_args)
            configs = args.configs()
        self.engine = EngineCore(*configs, parallel_config=args.parallel_config())
        self.tokenizer = self.engine.worker.tokenizer
        self._request_counter = itertools.count()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks now (they also stop when this process exits)."""
        self.engine.close()

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
        trackers: dict[str, tuple[CompletionOutput, CompletionTracker]] = {}
        try:
            for prompt, token_ids, params in zip(prompts, token_lists, params_list):
                result = RequestOutput(str(next(self._request_counter)),
                                       prompt if isinstance(prompt, str) else None, token_ids)
                results.append(result)
                for index in range(params.n):
                    child_id = f"{result.request_id}-{index}"
                    child_params = params.for_completion(index)
                    self.engine.add_request(child_id, token_ids, child_params,
                                            _cache_salt(prompt))
                    completion = CompletionOutput(index, "", [],
                                                  logprobs=[] if params.logprobs is not None else None)
                    result.outputs.append(completion)
                    trackers[child_id] = (completion,
                                          CompletionTracker(self.tokenizer, token_ids, child_params))
        except Exception:
            self.engine.abort(list(trackers))
            raise
        progress = tqdm(total=len(trackers), desc="generating", disable=not use_tqdm)
        while self.engine.has_unfinished:
            for update in self.engine.step().updates:
                if self._apply(update, trackers):
                    progress.update(1)
        progress.close()
        for result in results:
            result.finished = True
            result.spec_stats = SpecStats.merged([c.spec_stats for c in result.outputs
                                                  if c.spec_stats is not None])
            result.num_cached_tokens = max(c.report.num_cached_tokens if c.report else 0
                                           for c in result.outputs)
        return results

    def _apply(self, update: RequestUpdate,
               trackers: dict[str, tuple[CompletionOutput, CompletionTracker]]) -> bool:
        """Fold one engine update into its completion; True when that completion just finished."""
        completion, tracker = trackers[update.request_id]
        finished = tracker.apply(update)
        if tracker.take_abort():
            self.engine.abort([update.request_id])
        completion.token_ids = tracker.token_ids
        completion.logprobs = tracker.logprobs
        completion.text = tracker.text
        completion.finish_reason, completion.stop_reason = tracker.finish_reason, tracker.stop_reason
        completion.report = tracker.report
        completion.error = completion.error or update.error
        return finished

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
            _cache_salt(prompt)  # validated with the rest, before any prompt is added
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


def _cache_salt(prompt: PromptType) -> str | None:
    salt = prompt.get("cache_salt", DEFAULT_CACHE_SALT) if isinstance(prompt, dict) \
        else DEFAULT_CACHE_SALT
    if not isinstance(salt, str):
        raise TypeError(f'a prompt\'s "cache_salt" must be a string, got {type(salt).__name__}')
    return salt
