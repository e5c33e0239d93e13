"""specserve's engine: continuous batching over a paged KV cache, and the offline `LLM` API."""

from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
