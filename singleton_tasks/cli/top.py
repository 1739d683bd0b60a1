"""``singleton-tasks top``: a live view, one lane per key, holders as slots and waiters queued behind."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import click
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.text import Text

from ..outcomes import KeySnapshot, RunState
from ..stores import Store
from ._format import clock_time, render_text, seconds, short_token
from ._open import open_store, snapshots, store_options


@dataclass
class TopState:
    """What one frame remembers for the next: the admissions seen, to count handoffs between frames."""

    admissions: set[tuple[str, str, int]] = field(default_factory=set)
    at: float | None = None
    rate: float | None = None

    def advance(self, snaps: Sequence[KeySnapshot], now: float) -> float | None:
        """Handoffs per second since the previous frame (admissions = holders with a new token).

        Tokens come from the store clock, so their values do not count admissions: a holder
        with a token not seen in the previous frame does. A run admitted and settled between
        two frames, or a key first seen, is not counted.
        """
        admissions = {(s.scope, s.key, h.token) for s in snaps for h in s.holders}
        if self.at is not None and now > self.at:
            seen_keys = {(scope, key) for scope, key, _token in self.admissions}
            new = [a for a in admissions - self.admissions if (a[0], a[1]) in seen_keys]
            self.rate = len(new) / (now - self.at)
        self.admissions, self.at = admissions, now
        return self.rate


_WAITER_GLYPH = {RunState.PENDING: "○", RunState.GATED: "●", RunState.WOKEN: "◉"}
MAX_GLYPHS = 40


def _lane_name(snap: KeySnapshot) -> str:
    return f"{snap.scope} · {snap.key}"


@dataclass
class _Lane:
    """One key's line. Too wide for the terminal, its counts are cut first, so that its token
    stays readable; then the whole line is (one key, one line, however narrow the terminal)."""

    head: Text  # the key's name, its slots and its waiters' glyphs
    counts: Text  # held, waiting, oldest
    token: Text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        counts = self.counts.copy()
        room = options.max_width - self.head.cell_len - self.token.cell_len
        if counts.cell_len > room:
            counts.truncate(max(room, 1), overflow="ellipsis")
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append_text(self.head)
        line.append_text(counts)
        line.append_text(self.token)
        yield line


def _lane(snap: KeySnapshot, now: float, name_width: int = 36) -> _Lane:
    head = Text()
    head.append(_lane_name(snap)[:name_width].ljust(name_width) + " ", style="bold")
    head.append("[")
    for i in range(max(snap.limit, len(snap.holders))):
        if i < len(snap.holders):
            holder = snap.holders[i]
            head.append(
                "■" if holder.executing else "□", style="green" if holder.lease_expires_at > now else "red"
            )
        else:
            head.append("·", style="dim")
    head.append("] ")
    for waiter in snap.waiters[:MAX_GLYPHS]:
        head.append(_WAITER_GLYPH.get(waiter.state, "?"), style="yellow")
    if len(snap.waiters) > MAX_GLYPHS:
        head.append(f" +{len(snap.waiters) - MAX_GLYPHS}", style="yellow")
    counts = Text(f"  {len(snap.holders)}/{snap.limit} held, {len(snap.waiters)} waiting")
    if snap.waiters:
        oldest = max(now - w.created_at for w in snap.waiters)
        counts.append(f", oldest {seconds(oldest)}", style="yellow" if oldest < 60 else "red")
    # Its last digits (docs/operations.md#top); `inspect` shows it whole.
    token = Text(f"  token {short_token(snap.token)}", style="dim")
    return _Lane(head, counts, token)


def top_renderable(
    store: Store, snaps: Sequence[KeySnapshot], now: float, rate: float | None
) -> RenderableType:
    """One frame: header, legend, a lane per key, and the totals with the handoff rate."""
    holders = sum(len(s.holders) for s in snaps)
    waiters = sum(len(s.waiters) for s in snaps)
    summary = Text(
        f"keys {len(snaps)}  holders {holders}  waiters {waiters}  handoffs/s "
        + ("–" if rate is None else f"{rate:.1f}"),
        style="bold",
    )
    header = Text(
        f"singleton-tasks top · {store.url} · namespace {store.namespace} · {clock_time(now)}",
        style="dim",
        no_wrap=True,
        overflow="ellipsis",
    )
    legend = Text("■ executing  □ waiting for retry  · free slot   ○ pending  ● gated  ◉ woken", style="dim")
    name_width = min(60, max((len(_lane_name(s)) for s in snaps), default=0))
    lanes: list[RenderableType] = [_lane(s, now, name_width) for s in snaps]
    if not lanes:
        lanes.append(Text("no keys with holders or waiters"))
    return Group(header, legend, *lanes, summary)


def top_frame(store: Store, state: TopState | None = None, *, now: float | None = None) -> RenderableType:
    """One frame of ``top`` for ``store``; pass the same ``state`` to rate handoffs across frames."""
    state = state or TopState()
    snaps = snapshots(store)
    now = store.time() if now is None else now
    rate = state.advance(snaps, now)
    return top_renderable(store, snaps, now, rate)


def render_top_frame(
    store: Store, state: TopState | None = None, *, now: float | None = None, width: int = 160
) -> str:
    """One ``top`` frame as plain text."""
    return render_text(top_frame(store, state, now=now), width=width)


@click.command()
@store_options
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between refreshes.",
)
@click.option("--once", is_flag=True, help="Render one frame and exit (same as --frames 1).")
@click.option(
    "--frames",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Exit after N frames [default: run until interrupted].",
)
def top(store_url: str | None, namespace: str, interval: float, once: bool, frames: int | None) -> None:
    """A live view: one lane per key, holders as slots, waiters queued behind them.

    On a terminal the view is redrawn in place. When the output is not a terminal (a pipe, a
    file), each refresh prints a whole frame as plain text, followed by a blank line.
    """
    if once:
        frames = 1
    console = Console(soft_wrap=False)
    with open_store(store_url, namespace) as store:
        state = TopState()
        try:
            if frames == 1:
                console.print(top_frame(store, state))
            elif console.is_terminal:
                _live(console, store, state, interval, frames)
            else:
                _print_frames(console, store, state, interval, frames)
        except KeyboardInterrupt:
            pass


def _refresh(
    store: Store, state: TopState, interval: float, frames: int | None, show: Callable[[RenderableType], None]
) -> None:
    """Show a frame every ``interval`` seconds, ``frames`` times (or until interrupted)."""
    shown = 0
    while True:  # a reader that goes away (`top | head`) ends it: rich exits quietly, status 1
        show(top_frame(store, state))
        shown += 1
        if frames is not None and shown >= frames:
            return
        time.sleep(interval)  # the refresh cadence of a view, not a wait for a store event


def _live(console: Console, store: Store, state: TopState, interval: float, frames: int | None) -> None:
    """Redraw the frame in place (a terminal)."""
    from rich.live import Live

    with Live(console=console, auto_refresh=False, screen=False) as live:
        _refresh(store, state, interval, frames, lambda frame: live.update(frame, refresh=True))


def _print_frames(
    console: Console, store: Store, state: TopState, interval: float, frames: int | None
) -> None:
    """Print a whole frame per refresh, a blank line after each (``top -b``, for pipes and files)."""

    def show(frame: RenderableType) -> None:
        console.print(frame)
        console.print()

    _refresh(store, state, interval, frames, show)
