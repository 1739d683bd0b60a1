"""The lanes' data: one store snapshot per interval, shared by every open page, and the handoffs seen.

A frame is ``inspect --json``'s document (:func:`singleton_tasks.cli.inspect.inspect_document`)
without the store's URL, and each page asks for its slice of it (:func:`page_of`): a filter on
the task (the key's scope) and on the key, then one page of lanes. The store is read once per
interval however many pages are open, and only while one is (:class:`LaneWatch`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cli._open import snapshots
from ..cli.inspect import inspect_document
from ..outcomes import KeySnapshot
from ..stores import Store

#: Lanes per page: a page of this many keys renders in a few milliseconds in a browser.
PAGE_SIZE = 50
#: The handoffs kept for the side panel (the newest first).
HANDOFFS_KEPT = 100
#: A holder seen leaving is paired with the next admission on its key within this many seconds
#: of the store's clock; a key that stays idle longer starts afresh.
DEPARTURE_MEMORY = 120.0

Frame = dict[str, Any]


@dataclass
class _Departure:
    run_id: str
    last_seen: float  # the store time of the last frame that showed it holding
    gone_at: float  # the store time of the first frame that did not


@dataclass
class HandoffTracker:
    """Handoffs (a holder leaves, a waiter is admitted) as the view observes them between frames.

    A holder's release is not in the store's data: it happened between the last frame that
    showed the holder and the first that did not. So the gap from release to admission is known
    within one interval and is given as a range, ``gap_min``..``gap_max`` seconds (the admission
    time is the store's ``admitted_at``). An admission on a key where no holder left (a free slot)
    is no handoff; a run admitted and released between two frames is not seen.
    """

    handoffs: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HANDOFFS_KEPT))
    _holding: dict[tuple[str, str], dict[str, tuple[int, float]]] = field(default_factory=dict)
    _departed: dict[tuple[str, str], list[_Departure]] = field(default_factory=dict)
    _at: float | None = None

    def observe(self, document: Frame) -> None:
        now = float(document["now"])
        current: dict[tuple[str, str], dict[str, tuple[int, float]]] = {}
        for lane in document["keys"]:
            current[(lane["scope"], lane["key"])] = {
                h["run_id"]: (int(h["token"]), float(h["admitted_at"])) for h in lane["holders"]
            }
        previous_at = self._at
        if previous_at is not None:
            for lane_id, before in self._holding.items():
                after = current.get(lane_id, {})
                for run_id in before:
                    if run_id not in after:
                        departure = _Departure(run_id, last_seen=previous_at, gone_at=now)
                        self._departed.setdefault(lane_id, []).append(departure)
            for lane_id, after in current.items():
                before = self._holding.get(lane_id, {})
                admitted = sorted(
                    (token, admitted_at, run_id) for run_id, (token, admitted_at) in after.items()
                )
                for token, admitted_at, run_id in admitted:
                    if run_id in before or not self._departed.get(lane_id):
                        continue
                    departure = self._departed[lane_id].pop(0)
                    self.handoffs.appendleft(
                        {
                            "scope": lane_id[0],
                            "key": lane_id[1],
                            "released": departure.run_id,
                            "admitted": run_id,
                            "token": token,
                            "admitted_at": admitted_at,
                            "gap_min": round(max(0.0, admitted_at - departure.gone_at), 3),
                            "gap_max": round(max(0.0, admitted_at - departure.last_seen), 3),
                        }
                    )
        for lane_id in list(self._departed):
            kept = [d for d in self._departed[lane_id] if now - d.gone_at <= DEPARTURE_MEMORY]
            if kept:
                self._departed[lane_id] = kept
            else:
                del self._departed[lane_id]
        self._holding, self._at = current, now


def read_frame(store: Store) -> Frame:
    """One snapshot of the store as the page's data."""
    return _page_document(store, snapshots(store), store.time())


def _page_document(store: Store, snaps: Sequence[KeySnapshot], now: float, **options: Any) -> Frame:
    """``inspect --json``'s document, less the URL: the page never shows where the store is (nor
    its password)."""
    document = inspect_document(store, snaps, now, **options)
    del document["store"]
    return document


def _matches(lane: dict[str, Any], task: str, key: str) -> bool:
    return task in lane["scope"] and key in lane["key"]


def page_of(
    frame: Frame, *, task: str = "", key: str = "", page: int = 1, page_size: int = PAGE_SIZE
) -> Frame:
    """The slice of ``frame`` one page shows: lanes whose task and key contain ``task`` and
    ``key`` (substrings, case-sensitive), page ``page`` (from 1; past the last, the last)."""
    lanes = frame["keys"]
    if task or key:
        lanes = [lane for lane in lanes if _matches(lane, task, key)]
    pages = max(1, math.ceil(len(lanes) / page_size))
    page = min(max(1, page), pages)
    start = (page - 1) * page_size
    return {
        **{name: value for name, value in frame.items() if name != "keys"},
        "matched": len(lanes),
        "page": page,
        "pages": pages,
        "page_size": page_size,
        "keys": lanes[start : start + page_size],
    }


class LaneWatch:
    """The shared snapshot: read from the store at most once per ``interval``, by one thread,
    while a page is subscribed (:meth:`subscribe`); every page gets the same frame.

    ``read`` is called on the watch's own thread (the store's drivers block). ``on_frame`` is
    called there after each new frame (the web app wakes its streams with it).
    """

    def __init__(
        self,
        store: Store,
        interval: float,
        *,
        read: Callable[[Store], Frame] = read_frame,
        on_frame: Callable[[], None] | None = None,
        scrub: Callable[[str], str] = str,
    ) -> None:
        self.store = store
        self.interval = interval
        self.handoffs = HandoffTracker()
        self.reads = 0  # store snapshots taken: the store's load from the view
        self._read = read
        self._scrub = scrub  # a store error's text may carry the URL's password
        self._on_frame = on_frame
        self._frame: Frame | None = None
        self._read_at = -math.inf  # time.monotonic() of the last read
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._wanted = threading.Condition(self._lock)
        self._subscribers = 0
        self._closed = False
        self._error: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="singleton-tasks-web-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wanted.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def subscribe(self) -> None:
        with self._lock:
            self._subscribers += 1
            self._wanted.notify_all()

    def unsubscribe(self) -> None:
        with self._lock:
            self._subscribers -= 1

    @property
    def subscribers(self) -> int:
        return self._subscribers

    def frame(self) -> Frame:
        """The newest frame; read now if none is fresher than the interval (a page's first load)."""
        with self._lock:
            fresh = self._frame is not None and time.monotonic() - self._read_at < self.interval
            if fresh:
                assert self._frame is not None
                return self._frame
        self._refresh()
        assert self._frame is not None
        return self._frame

    def latest(self) -> Frame:
        """The newest frame, without reading (after :meth:`frame` has made one)."""
        assert self._frame is not None
        return self._frame

    @property
    def error(self) -> str | None:
        """The last read's error (the store unreachable), None when it read."""
        return self._error

    def _refresh(self) -> None:
        # One reader at a time: a page's first load and the watch thread never read twice over.
        with self._read_lock:
            if self._frame is not None and time.monotonic() - self._read_at < self.interval:
                return
            started = time.monotonic()
            try:
                frame = self._read(self.store)
            except Exception as error:  # the store down: the pages say so and the watch retries
                self._error = self._scrub(f"{type(error).__name__}: {error}")
                with self._lock:
                    # Down from the start: an empty frame, so pages show the error (and the
                    # store is asked again only an interval later, not by every request).
                    self._frame = self._frame or self._empty_frame()
                    self._read_at = started
                return
            self._error = None
            self.handoffs.observe(frame)
            frame["handoffs"] = list(self.handoffs.handoffs)
            frame["interval"] = self.interval
            with self._lock:
                self._frame, self._read_at = frame, started
                self.reads += 1
        if self._on_frame is not None:
            self._on_frame()

    def _empty_frame(self) -> Frame:
        """A frame of no keys, as the store's document would be with none busy."""
        frame = _page_document(self.store, [], time.time(), schema_version=lambda: None)
        return {**frame, "handoffs": [], "interval": self.interval}

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and self._subscribers == 0:
                    self._wanted.wait()
                if self._closed:
                    return
                due = self._read_at + self.interval - time.monotonic()
                if due > 0:
                    self._wanted.wait(due)
                    continue
            try:
                self._refresh()
            except Exception:
                with self._lock:
                    self._wanted.wait(self.interval)
