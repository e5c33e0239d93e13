"""How one request's failure inside the step is caught and told (engine/step/isolation.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def describe(error: BaseException) -> str:
    """What a client is told: the exception's type and message, never a traceback."""
    return f"{type(error).__name__}: {error}"


def run_isolated(work: Callable[[], None], request_id: str, what: str) -> str | None:
    """`work()` for one request; None when it ran, else why it failed (logged here)."""
    try:
        work()
    except Exception as error:  # NOTE: any bug of one request's state; the caller ends it alone
        logger.exception("request %s failed in %s", request_id, what)
        return f"{what} failed: {describe(error)}"
    return None
