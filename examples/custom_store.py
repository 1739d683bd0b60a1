"""A custom store: the library's rules over plain dicts, proven by the contract suite.

A backend that can lock one key and read and write that key's records under the lock gets
every rule from the library: subclass ``RuleStore``, give it a ``KeyTransaction`` (a handful of
reads and writes of one key's records), and add heartbeats, snapshots and the schema version.
This one keeps its data in process memory, like ``memory://``; a real backend (a SQL database,
a document store) replaces ``_Server`` and ``_Transaction`` with its own tables or documents.

Use it by passing the object where a store URL would go::

    SingletonMiddleware(store=DictStore("dict://app"))
    install(app, store=DictStore("dict://app"))

and prove it keeps the rules with the contract suite (see ``tests/test_custom_store_example.py``).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from singleton_tasks import gate
from singleton_tasks.config import Timings
from singleton_tasks.outcomes import HolderRef, KeySnapshot, RunState
from singleton_tasks.records import KeyMeta, KeyTransaction, RunRecord
from singleton_tasks.stores.base import SCHEMA_VERSION, Clock, RuleStore, snapshot_of


@dataclass
class _Key:
    """Everything stored for one scope+key, guarded by its own lock."""

    meta: KeyMeta | None = None
    runs: dict[str, RunRecord] = field(default_factory=dict)
    settled: dict[str, tuple[int, float]] = field(default_factory=dict)  # run id → (generation, expiry)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class _Server:
    """What a database server would hold: every namespace's keys, and the schema version."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: dict[tuple[str, str, str], _Key] = {}  # (namespace, scope, key) → data
        # In memory there is nothing to create; a database store starts at None and creates its
        # tables in migrate() (run at deploy time, as `singleton-tasks migrate` does for SQL).
        self.schema: int | None = SCHEMA_VERSION


_SERVERS: dict[str, _Server] = {}
_SERVERS_LOCK = threading.Lock()


class _Transaction(KeyTransaction):
    """One key's records, read and written while the store holds that key's lock."""

    def __init__(self, data: _Key, now: float) -> None:
        self.data = data
        self._now = now

    def now(self) -> float:
        # Every deadline is decided on the store's clock: a server-backed store reads its
        # server's clock here (once the key is locked); this one serves one process.
        return self._now

    def meta(self) -> KeyMeta | None:
        return replace(self.data.meta) if self.data.meta else None

    def save_meta(self, meta: KeyMeta) -> None:
        # meta.idle_until set: the key has no runs, and may be deleted with its settled markers
        # after that time (the rules treat it as forgotten either way). A real store deletes
        # such keys in sweep(); this example keeps them.
        self.data.meta = replace(meta)

    def get_run(self, run_id: str) -> RunRecord | None:
        run = self.data.runs.get(run_id)
        return run.copy() if run else None

    def save_run(self, run: RunRecord) -> None:
        self.data.runs[run.run_id] = run.copy()

    def delete_run(self, run_id: str) -> None:
        self.data.runs.pop(run_id, None)

    def holders(self) -> list[RunRecord]:
        return [run.copy() for run in self.data.runs.values() if run.state is RunState.HOLDING]

    def count_runs(self) -> int:
        return len(self.data.runs)

    def _waiters(self) -> list[RunRecord]:
        # Sorting on every call is fine for an example; a real store keeps an index on seq.
        waiting = (run for run in self.data.runs.values() if run.state is not RunState.HOLDING)
        return sorted(waiting, key=lambda run: run.seq)

    def waiters_from(self, after_seq: int, count: int) -> list[RunRecord]:
        return [run.copy() for run in self._waiters() if run.seq > after_seq][:count]

    def newest_waiter(self) -> RunRecord | None:
        waiting = self._waiters()
        return waiting[-1].copy() if waiting else None

    def waiters_before(self, seq: int) -> int:
        return sum(1 for run in self._waiters() if run.seq < seq)

    def unconfirmed_before(self, before: float) -> list[str]:
        # A real store keeps an index of unconfirmed waiters on created_at.
        waiting = (run for run in self.data.runs.values() if run.state is not RunState.HOLDING)
        ordered = sorted(waiting, key=lambda run: (run.created_at, run.run_id))
        return [run.run_id for run in ordered if not run.confirmed and run.created_at < before]

    def settled_generation(self, run_id: str, now: float) -> int | None:
        marker = self.data.settled.get(run_id)
        return marker[0] if marker and marker[1] > now else None

    def mark_settled(self, run_id: str, generation: int, expires_at: float, now: float) -> None:
        for other, (_generation, expires) in list(self.data.settled.items()):
            if expires <= now:
                del self.data.settled[other]
        self.data.settled[run_id] = (generation, expires_at)

    def clear_settled(self, run_id: str) -> None:
        self.data.settled.pop(run_id, None)


class DictStore(RuleStore):
    """``dict://NAME``: stores of one NAME share their data, as clients of one server would."""

    schemes = ("dict",)

    def __init__(
        self,
        url: str = "dict://",
        *,
        namespace: str = "default",
        retention: float | None = None,
        timings: Timings | None = None,
        clock: Clock | None = None,
    ):
        super().__init__(url, namespace=namespace, retention=retention, timings=timings, clock=clock)
        with _SERVERS_LOCK:
            self._server = _SERVERS.setdefault(urlsplit(url).netloc, _Server())

    def _key(self, scope: str, key: str) -> _Key:
        with self._server.lock:
            return self._server.keys.setdefault((self.namespace, scope, key), _Key())

    @contextlib.contextmanager
    def transaction(self, scope: str, key: str) -> Iterator[KeyTransaction]:
        """Lock the key; if the rules raise, put its records back as they were (a rollback)."""
        data = self._key(scope, key)
        with data.lock:
            before = copy.deepcopy((data.meta, data.runs, data.settled))
            try:
                yield _Transaction(data, self.time())
            except BaseException:
                data.meta, data.runs, data.settled = before
                raise

    def _heartbeat_batch(self, holders: Sequence[HolderRef]) -> tuple[list[bool], float]:
        # A server-backed store sends all of these in one call (one round trip per interval)
        # and answers with its clock, which workers compare with theirs.
        alive = []
        for ref in holders:
            with self.transaction(ref.scope, ref.key) as tx:
                alive.append(gate.heartbeat(tx, ref.run_id, ref.token))
        return alive, self.time()

    def due_keys(self, now: float, count: int) -> list[tuple[str, str]]:
        # A real store keeps an index of its keys on due_at: workers ask every heartbeat.
        with self._server.lock:
            due = [
                (data.meta.due_at, scope, key)
                for (namespace, scope, key), data in self._server.keys.items()
                if namespace == self.namespace and data.meta is not None and data.meta.due_at is not None
            ]
        return [(scope, key) for due_at, scope, key in sorted(due) if due_at < now][:count]

    def snapshot(self, *, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
        with self._server.lock:
            mine = sorted(
                ((ident, data) for ident, data in self._server.keys.items() if ident[0] == self.namespace),
                key=lambda item: item[0],
            )
        snapshots = []
        for (_namespace, key_scope, key_name), data in mine:
            if scope not in (None, key_scope) or key not in (None, key_name):
                continue
            with data.lock:
                if data.runs and data.meta is not None:
                    snapshots.append(snapshot_of(key_scope, key_name, data.meta, list(data.runs.values())))
        return snapshots

    def schema_version(self) -> int | None:
        return self._server.schema

    def migrate(self) -> None:
        self._server.schema = SCHEMA_VERSION

    def set_schema_version_for_tests(self, version: int | None) -> None:
        """Lets the contract suite pretend another library version wrote the schema."""
        self._server.schema = version
