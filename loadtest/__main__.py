"""`python -m loadtest`: the same entry point as the `specserve-loadtest` console script."""

from __future__ import annotations

from loadtest.cli import main

raise SystemExit(main())
