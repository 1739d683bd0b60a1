"""How the commands render times, durations, run states and rich views as text."""

from __future__ import annotations

import io
from datetime import datetime

from rich.console import Console, RenderableType

from ..outcomes import WaiterView


def clock_time(ts: float, now: float | None = None) -> str:
    """Local wall time; the date only when it is not the same day as ``now``."""
    moment = datetime.fromtimestamp(ts)
    if now is not None and moment.date() == datetime.fromtimestamp(now).date():
        return moment.strftime("%H:%M:%S")
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def seconds(value: float) -> str:
    """A duration, short: ``4.2s``, ``3m07s``, ``2h05m`` (negative as zero)."""
    value = max(0.0, value)
    if value < 60:
        return f"{value:.1f}s"
    if value < 3600:
        return f"{int(value // 60)}m{int(value % 60):02d}s"
    return f"{int(value // 3600)}h{int(value % 3600 // 60):02d}m"


#: ``top`` shows a token by this many last digits: the tokens of one key differ there unless
#: handed out a whole number of seconds apart, to the microsecond.
TOKEN_DIGITS = 6


def short_token(token: int) -> str:
    """A token as ``top`` shows it: its last TOKEN_DIGITS digits after an ellipsis (``…583123``)."""
    digits = str(token)
    return digits if len(digits) <= TOKEN_DIGITS else "…" + digits[-TOKEN_DIGITS:]


def waiter_state(waiter: WaiterView) -> str:
    """``pending``, ``gated``, ``woken``, or ``phantom`` (its data is lost)."""
    if waiter.phantom:
        return "phantom"
    return waiter.state.value


def render_text(renderable: RenderableType, width: int = 160) -> str:
    """A renderable as plain text (no colours): for tests and for ``--once`` without a terminal."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False, soft_wrap=False).print(
        renderable
    )
    return buffer.getvalue()
