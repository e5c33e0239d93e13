"""What rank 0 tells the other tensor-parallel ranks (engine/runner/collectives.py carries them),
each a dataclass, as the engine queue's messages are (engine/messages.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.step.types import ForwardInput


@dataclass
class KeptRows:
    """A tree's accepted path: the K/V of rows `rows` moves to positions start, start + 1, ..."""

    seq_id: str
    start: int
    rows: list[int]
    block_table: list[int]


@dataclass
class ExecutePass:
    """Run the step's target pass; the collectives inside meet rank 0's."""

    forward: ForwardInput


@dataclass
class KeepRows:
    """Move each tree's accepted path's K/V into place, as rank 0 does."""

    moves: list[KeptRows]


@dataclass
class StopRank:
    """Leave."""
