"""``memory://[name]``: one process, real per-key locking, the gate's rules unchanged.

Stores created with the same ``name`` share their data (like clients of one server);
``namespace`` partitions it as on every other store.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from .. import gate
from ..config import Timings
from ..outcomes import HolderRef, KeySnapshot, RunState
from ..records import KeyMeta, KeyTransaction, RunRecord
from .base import SCHEMA_VERSION, Clock, RuleStore, snapshot_of


@dataclass
class _KeyData:
    meta: KeyMeta | None = None
    runs: dict[str, RunRecord] = field(default_factory=dict)
    order: list[tuple[int, str]] = field(default_factory=list)  # waiters by seq
    unconfirmed: list[tuple[float, str]] = field(default_factory=list)  # unconfirmed waiters by created_at
    settled: dict[str, tuple[int, float]] = field(default_factory=dict)
    removed: bool = False  # forgotten: a caller that waited for its lock looks the key up again
    lock: threading.Lock = field(default_factory=threading.Lock)


Ident = tuple[str, str, str]


class _Server:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[Ident, _KeyData] = {}
        self.active: set[Ident] = set()  # keys with runs (a snapshot reads only these)
        self.idle: list[tuple[float, Ident]] = []  # heap of (idle_until, key) to forget
        self.schema: int | None = SCHEMA_VERSION

    def key(self, ident: Ident) -> _KeyData:
        data = self.keys.get(ident)  # a dict read needs no lock
        if data is None:
            with self.lock:
                data = self.keys.setdefault(ident, _KeyData())
        return data

    def lock_key(self, ident: Ident) -> _KeyData:
        """The key's data, locked (looked up again if it was forgotten while we waited)."""
        while True:
            data = self.key(ident)
            data.lock.acquire()
            if not data.removed:
                return data
            data.lock.release()

    def drop_if_unwritten(self, ident: Ident, data: _KeyData) -> None:
        """Forget a key made by a lookup that wrote nothing to it (``data`` locked): it would never
        be idle, so never forgotten."""
        if data.meta is None and not data.runs and not data.settled:
            with self.lock:
                if self.keys.get(ident) is data:
                    data.removed = True
                    del self.keys[ident]

    def forget_idle(self, now: float) -> None:
        """Drop keys idle past their ``idle_until`` (any namespace): nothing of them is left."""
        while self.idle and self.idle[0][0] < now:
            with self.lock:
                if not self.idle or self.idle[0][0] >= now:
                    return
                _until, ident = heapq.heappop(self.idle)
                data = self.keys.get(ident)
                if data is None or not data.lock.acquire(blocking=False):
                    continue  # gone already, or in use (it will be idle again later)
                try:
                    idle_until = None if data.meta is None else data.meta.idle_until
                    if idle_until is None or data.runs:
                        continue  # in use again
                    if idle_until >= now:
                        heapq.heappush(self.idle, (idle_until, ident))  # used while idle
                        continue
                    data.removed = True
                    del self.keys[ident]
                finally:
                    data.lock.release()


_SERVERS: dict[str, _Server] = {}
_SERVERS_LOCK = threading.Lock()


def _server(name: str) -> _Server:
    with _SERVERS_LOCK:
        return _SERVERS.setdefault(name, _Server())


class _MemoryTransaction(KeyTransaction):
    """Reads hand out copies; every write is journaled so an error rolls the key back."""

    def __init__(self, server: _Server, ident: Ident, data: _KeyData, now: float) -> None:
        self._server = server
        self._ident = ident
        self._data = data
        self._now = now
        self._undo: list[Callable[[], None]] = []

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()

    def now(self) -> float:
        return self._now

    def meta(self) -> KeyMeta | None:
        return replace(self._data.meta) if self._data.meta else None

    def save_meta(self, meta: KeyMeta) -> None:
        previous = self._data.meta
        self._undo.append(lambda: self._put_meta(previous))
        self._put_meta(replace(meta))

    def _put_meta(self, meta: KeyMeta | None) -> None:
        data, server = self._data, self._server
        old = data.meta
        data.meta = meta
        idle_until = None if meta is None else meta.idle_until
        if old is not None and meta is not None and (old.idle_until is None) == (idle_until is None):
            return  # still idle or still active: the server's indexes stay (a later idle_until
            # is found by forget_idle, which puts the key back in the heap)
        with server.lock:
            if meta is not None and idle_until is None:
                server.active.add(self._ident)
            else:
                server.active.discard(self._ident)
                if idle_until is not None:
                    heapq.heappush(server.idle, (idle_until, self._ident))

    def get_run(self, run_id: str) -> RunRecord | None:
        run = self._data.runs.get(run_id)
        return run.copy() if run else None

    def _put(self, run_id: str, run: RunRecord | None) -> None:
        runs, order, unconfirmed = self._data.runs, self._data.order, self._data.unconfirmed
        old = runs.pop(run_id, None)
        if old is not None and old.state is not RunState.HOLDING:
            del order[bisect.bisect_left(order, (old.seq, run_id))]
            if not old.confirmed:
                del unconfirmed[bisect.bisect_left(unconfirmed, (old.created_at, run_id))]
        if run is not None:
            runs[run_id] = run
            if run.state is not RunState.HOLDING:
                bisect.insort(order, (run.seq, run_id))
                if not run.confirmed:
                    bisect.insort(unconfirmed, (run.created_at, run_id))

    def save_run(self, run: RunRecord) -> None:
        previous = self._data.runs.get(run.run_id)
        self._undo.append(lambda: self._put(run.run_id, previous))
        self._put(run.run_id, run.copy())

    def delete_run(self, run_id: str) -> None:
        previous = self._data.runs.get(run_id)
        self._undo.append(lambda: self._put(run_id, previous))
        self._put(run_id, None)

    def holders(self) -> list[RunRecord]:
        return [r.copy() for r in self._data.runs.values() if r.state is RunState.HOLDING]

    def count_runs(self) -> int:
        return len(self._data.runs)

    def waiters_from(self, after_seq: int, count: int) -> list[RunRecord]:
        order = self._data.order
        start = bisect.bisect_right(order, (after_seq, "\U0010ffff"))
        return [self._data.runs[run_id].copy() for _seq, run_id in order[start : start + count]]

    def newest_waiter(self) -> RunRecord | None:
        order = self._data.order
        return self._data.runs[order[-1][1]].copy() if order else None

    def waiters_before(self, seq: int) -> int:
        return bisect.bisect_left(self._data.order, (seq, ""))

    def unconfirmed_before(self, before: float) -> list[str]:
        unconfirmed = self._data.unconfirmed
        return [run_id for _at, run_id in unconfirmed[: bisect.bisect_left(unconfirmed, (before, ""))]]

    def settled_generation(self, run_id: str, now: float) -> int | None:
        marker = self._data.settled.get(run_id)
        return marker[0] if marker and marker[1] > now else None

    def mark_settled(self, run_id: str, generation: int, expires_at: float, now: float) -> None:
        settled = self._data.settled
        # Markers are inserted in expiry order (one retention per store): drop expired ones from the front.
        for other, (_gen, expires) in list(settled.items()):
            if expires > now:
                break
            self.clear_settled(other)
        previous = settled.pop(run_id, None)
        self._undo.append(lambda: self._restore_settled(run_id, previous))
        settled[run_id] = (generation, expires_at)

    def clear_settled(self, run_id: str) -> None:
        previous = self._data.settled.pop(run_id, None)
        if previous is not None:
            self._undo.append(lambda: self._restore_settled(run_id, previous))

    def _restore_settled(self, run_id: str, marker: tuple[int, float] | None) -> None:
        if marker is None:
            self._data.settled.pop(run_id, None)
        else:
            self._data.settled[run_id] = marker


class MemoryStore(RuleStore):
    """The gate's rules over in-process dicts: for tests and single-process apps."""

    schemes = ("memory",)
    migrates_on_first_use = True

    @classmethod
    def check_url(cls, url: str) -> None:
        """Any ``memory://NAME`` will do (NAME is no host: it has no port)."""

    def __init__(
        self,
        url: str = "memory://",
        *,
        namespace: str = "default",
        retention: float | None = None,
        timings: Timings | None = None,
        clock: Clock | None = None,
    ) -> None:
        super().__init__(url, namespace=namespace, retention=retention, timings=timings, clock=clock)
        self._server = _server(urlsplit(url).netloc + urlsplit(url).path)

    @contextlib.contextmanager
    def transaction(self, scope: str, key: str) -> Iterator[KeyTransaction]:
        server, ident = self._server, (self.namespace, scope, key)
        data = server.lock_key(ident)
        now = self.time()
        try:
            tx = _MemoryTransaction(server, ident, data, now)
            try:
                yield tx
            except BaseException:
                tx.rollback()
                raise
        finally:
            server.drop_if_unwritten(ident, data)
            data.lock.release()
        server.forget_idle(now)

    def _heartbeat_batch(self, holders: Sequence[HolderRef]) -> tuple[list[bool], float]:
        alive = []
        for ref in holders:
            with self.transaction(ref.scope, ref.key) as tx:
                alive.append(gate.heartbeat(tx, ref.run_id, ref.token))
        return alive, self.time()

    def due_keys(self, now: float, count: int) -> list[tuple[str, str]]:
        """A scan of the busy keys: the in-process store serves one process's keys."""
        server = self._server
        with server.lock:
            idents = [i for i in server.active if i[0] == self.namespace]
        due = []
        for ident in idents:
            data = server.keys.get(ident)
            meta = None if data is None else data.meta  # a reference read: no lock needed
            if meta is not None and meta.due_at is not None and meta.due_at < now:
                due.append((meta.due_at, ident[1], ident[2]))
        return [(scope, key) for _at, scope, key in sorted(due)[:count]]

    def snapshot(self, *, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
        server = self._server
        with server.lock:
            idents = sorted(
                i
                for i in server.active
                if i[0] == self.namespace
                and (scope is None or i[1] == scope)
                and (key is None or i[2] == key)
            )
        snaps = []
        for ident in idents:
            data = server.keys.get(ident)
            if data is None:
                continue
            with data.lock:
                if not data.runs or data.meta is None:
                    continue
                snaps.append(snapshot_of(ident[1], ident[2], data.meta, list(data.runs.values())))
        return snaps

    def schema_version(self) -> int | None:
        return self._server.schema

    def migrate(self) -> None:
        self._server.schema = SCHEMA_VERSION

    def set_schema_version_for_tests(self, version: int | None) -> None:
        """Pretend another library version wrote this server (the contract suite's mismatch test)."""
        self._server.schema = version
