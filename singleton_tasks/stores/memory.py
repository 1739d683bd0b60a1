"""``memory://[name]``: one process, real per-key locking, the gate's rules unchanged.

Stores created with the same ``name`` share their data (like clients of one server);
``namespace`` partitions it as on every other store.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from .. import gate
from ..gate import KeyMeta, KeyTransaction, RunRecord, Timings
from ..outcomes import HolderRef, KeySnapshot, RunState
from .base import SCHEMA_VERSION, RuleStore, snapshot_of


@dataclass
class _KeyData:
    meta: KeyMeta | None = None
    runs: dict[str, RunRecord] = field(default_factory=dict)
    order: list[tuple[int, str]] = field(default_factory=list)  # waiters by seq
    settled: dict[str, tuple[int, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Server:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[tuple[str, str, str], _KeyData] = {}
        self.schema: int | None = SCHEMA_VERSION

    def key(self, namespace: str, scope: str, key: str) -> _KeyData:
        ident = (namespace, scope, key)
        data = self.keys.get(ident)  # entries are never removed: a hit needs no lock
        if data is None:
            with self.lock:
                data = self.keys.setdefault(ident, _KeyData())
        return data


_SERVERS: dict[str, _Server] = {}
_SERVERS_LOCK = threading.Lock()


def _server(name: str) -> _Server:
    with _SERVERS_LOCK:
        return _SERVERS.setdefault(name, _Server())


class _MemoryTransaction(KeyTransaction):
    """Reads hand out copies; every write is journaled so an error rolls the key back."""

    def __init__(self, data: _KeyData) -> None:
        self._data = data
        self._undo: list[Callable[[], None]] = []

    def rollback(self) -> None:
        for undo in reversed(self._undo):
            undo()

    def meta(self) -> KeyMeta | None:
        return replace(self._data.meta) if self._data.meta else None

    def save_meta(self, meta: KeyMeta) -> None:
        previous = self._data.meta
        self._undo.append(lambda: setattr(self._data, "meta", previous))
        self._data.meta = replace(meta)

    def get_run(self, run_id: str) -> RunRecord | None:
        run = self._data.runs.get(run_id)
        return run.copy() if run else None

    def _put(self, run_id: str, run: RunRecord | None) -> None:
        runs, order = self._data.runs, self._data.order
        old = runs.pop(run_id, None)
        if old is not None and old.state is not RunState.HOLDING:
            del order[bisect.bisect_left(order, (old.seq, run_id))]
        if run is not None:
            runs[run_id] = run
            if run.state is not RunState.HOLDING:
                bisect.insort(order, (run.seq, run_id))

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

    def waiters_before(self, seq: int) -> int:
        return bisect.bisect_left(self._data.order, (seq, ""))

    def unconfirmed_before(self, created_before: float) -> list[str]:
        return [
            r.run_id
            for r in self._data.runs.values()
            if r.state is RunState.PENDING and not r.confirmed and r.created_at < created_before
        ]

    def settled_generation(self, run_id: str, now: float) -> int | None:
        marker = self._data.settled.get(run_id)
        return marker[0] if marker and marker[1] > now else None

    def mark_settled(self, run_id: str, generation: int, expires_at: float, now: float) -> None:
        settled = self._data.settled
        # Markers are inserted in expiry order (one TTL per store): drop expired ones from the front.
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

    def __init__(
        self, url: str = "memory://", *, namespace: str = "default", timings: Timings | None = None
    ) -> None:
        super().__init__(url, namespace=namespace, timings=timings)
        self._server = _server(urlsplit(url).netloc + urlsplit(url).path)

    @contextlib.contextmanager
    def transaction(self, scope: str, key: str) -> Iterator[KeyTransaction]:
        data = self._server.key(self.namespace, scope, key)
        with data.lock:
            tx = _MemoryTransaction(data)
            try:
                yield tx
            except BaseException:
                tx.rollback()
                raise

    def _heartbeat_batch(self, holders: Sequence[HolderRef], now: float) -> list[bool]:
        alive = []
        for ref in holders:
            with self.transaction(ref.scope, ref.key) as tx:
                alive.append(gate.heartbeat(tx, ref.run_id, ref.token, now=now))
        return alive

    def snapshot(self, *, now: float, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
        with self._server.lock:
            items = [(k, d) for k, d in self._server.keys.items() if k[0] == self.namespace]
        snaps = []
        for (_ns, s, k), data in sorted(items, key=lambda item: item[0]):
            if (scope is not None and s != scope) or (key is not None and k != key):
                continue
            with data.lock:
                if not data.runs or data.meta is None:
                    continue
                snaps.append(snapshot_of(s, k, data.meta, list(data.runs.values())))
        return snaps

    def schema_version(self) -> int | None:
        return self._server.schema

    def migrate(self) -> None:
        self._server.schema = SCHEMA_VERSION

    def set_schema_version_for_tests(self, version: int | None) -> None:
        """Pretend another library version wrote this server (the contract suite's mismatch test)."""
        self._server.schema = version
