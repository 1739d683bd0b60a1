"""The library's one clock: every store operation is handed ``now()`` (SPEC §8)."""

from __future__ import annotations

import time


def now() -> float:
    """Seconds since the epoch; freezegun freezes and moves it in tests."""
    return time.time()
