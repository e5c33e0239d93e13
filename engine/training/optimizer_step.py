"""One optimizer step as every speculator trainer takes it, so they log and schedule alike."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def take_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
              schedule: torch.optim.lr_scheduler.LRScheduler, progress,
              clip: Iterable[torch.nn.Parameter] | None = None, **shown: object) -> None:
    """Back-propagate `loss` and step (gradients over `clip` cut to norm 1 first, where given),
    advance the learning-rate schedule, and show the loss (and `shown`) on the progress bar."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(clip, 1.0)
    optimizer.step()
    schedule.step()
    progress.update(1)
    progress.set_postfix(loss=f"{loss.item():.3f}", **shown)
