"""The worker host's clock, for what the broker needs (deferral ETAs, wake times) and metrics.

Every decision of the gate is taken on the store's clock instead (docs/deployment.md#clocks-and-skew).
"""

from __future__ import annotations

import time


def now() -> float:
    """Seconds since the epoch; freezegun freezes and moves it in tests."""
    return time.time()
