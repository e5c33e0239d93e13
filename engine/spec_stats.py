"""Speculation statistics as plain numbers: per request, and summed per step for the metrics exporter.

Names follow the vocabulary of kernels/rejection_reference.py: k drafts proposed, of which the
accepted ones form a prefix; each verification emits accepted + 1 tokens (the +1 is the recovered or
bonus token). α = accepted / proposed; τ (mean acceptance length) = 1 + accepted / verification
steps, vLLM's definition: what a step that verified drafts emitted on average, the bonus token
included. One definition everywhere: the HTTP response, the offline LLM, the CLI, the load tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    # target passes that verified at least one draft token
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # target passes that emitted tokens for this request (with or without drafts)
    num_target_passes: int = 0
    # tokens emitted by those passes
    num_emitted_tokens: int = 0
    # accepted_per_position[i]: steps in which draft position i + 1 was accepted
    accepted_per_position: list[int] = field(default_factory=list)
    # acceptance_histogram[a]: spec steps that accepted exactly a drafts
    acceptance_histogram: list[int] = field(default_factory=list)
    # wall-clock seconds of the steps this request took part in: target pass + verification, and
    # drafting for it (batched work counts in full for every request it served)
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0

    def observe(self, num_draft_tokens: int, num_accepted: int, num_emitted: int) -> None:
        """Record one target pass: `num_draft_tokens` verified, a prefix of `num_accepted` kept."""
        self.num_target_passes += 1
        self.num_emitted_tokens += num_emitted
        if num_draft_tokens == 0:
            return
        self.num_spec_steps += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_draft_tokens += num_accepted
        _grow(self.accepted_per_position, num_draft_tokens)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        _grow(self.acceptance_histogram, num_accepted + 1)
        self.acceptance_histogram[num_accepted] += 1

    @property
    def draft_acceptance_rate(self) -> float | None:
        """α; None before any draft was proposed."""
        if not self.num_draft_tokens:
            return None
        return self.num_accepted_draft_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """τ = 1 + accepted / verification steps (1.0 before any step verified a draft)."""
        if not self.num_spec_steps:
            return 1.0
        return 1.0 + self.num_accepted_draft_tokens / self.num_spec_steps

    @classmethod
    def merged(cls, parts: list[SpecStats]) -> SpecStats:
        """One request's n completions are separate engine requests; their stats add up."""
        total = cls()
        for part in parts:
            for name in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens",
                         "num_target_passes", "num_emitted_tokens", "verify_seconds",
                         "draft_seconds"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            for mine, theirs in ((total.accepted_per_position, part.accepted_per_position),
                                 (total.acceptance_histogram, part.acceptance_histogram)):
                _grow(mine, len(theirs))
                for i, count in enumerate(theirs):
                    mine[i] += count
        return total

    def as_dict(self) -> dict:
        """vLLM's per-request names, as the HTTP response's `metrics.speculative_decoding` carries them."""
        return {
            "num_spec_steps": self.num_spec_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_draft_tokens": self.num_accepted_draft_tokens,
            "num_target_passes": self.num_target_passes,
            "num_emitted_tokens": self.num_emitted_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_histogram": list(self.acceptance_histogram),
            "accepted_per_position": list(self.accepted_per_position),
            "verify_seconds": self.verify_seconds,
            "draft_seconds": self.draft_seconds,
        }


def _grow(counts: list[int], size: int) -> None:
    if len(counts) < size:
        counts.extend([0] * (size - len(counts)))
