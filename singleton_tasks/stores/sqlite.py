"""``sqlite:///path.db``: one host, many processes and threads; the embedded default (docs/deployment.md).

``sqlite:///relative.db`` is relative to the working directory, ``sqlite:////abs/path.db``
absolute. The database runs in WAL mode; every operation is one ``BEGIN IMMEDIATE``
transaction (the write lock is taken before reading, so competing claims are serialized),
and waits up to ``busy_timeout`` seconds for that lock. Each thread has its own connection.
``sqlite:///:memory:`` keeps the data in this process only (one shared connection).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

from ..config import Timings
from ..errors import SingletonConfigError, StoreUnavailableError
from ._driver_errors import sqlite_locked
from ._sql import SQLITE, SQLCursor, SQLStore
from .base import Clock, pop_query_option

# Connections inherited through a fork: never used or closed by the child (closing one there
# can disturb the parent's locks), only kept from being garbage-collected.
_FORK_ORPHANS: list[sqlite3.Connection] = []


def sqlite_path(url: str) -> str:
    """The database path of a ``sqlite://`` URL (one leading slash is the URL's)."""
    parts = urlsplit(pop_query_option(url, "retention")[0])  # the base class reads ?retention=
    if parts.netloc or parts.query or parts.fragment or not parts.path.startswith("/") or len(parts.path) < 2:
        raise SingletonConfigError(
            f"malformed SQLite store URL {url!r}: expected sqlite:///relative.db or sqlite:////absolute.db "
            "(?retention= is the only URL option; the others are keyword arguments, e.g. busy_timeout=30.0)"
        )
    return unquote(parts.path[1:])


class SQLiteStore(SQLStore):
    """The gate's rules over a SQLite database file."""

    schemes = ("sqlite",)
    migrates_on_first_use = True

    @classmethod
    def check_url(cls, url: str) -> None:
        super().check_url(url)
        sqlite_path(url)

    dialect = SQLITE

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "default",
        retention: float | None = None,
        timings: Timings | None = None,
        clock: Clock | None = None,
        busy_timeout: float = 30.0,
    ) -> None:
        super().__init__(url, namespace=namespace, retention=retention, timings=timings, clock=clock)
        if not isinstance(busy_timeout, (int, float)) or busy_timeout < 0:
            raise SingletonConfigError(f"busy_timeout must be a number of seconds >= 0, got {busy_timeout!r}")
        self.path = sqlite_path(url)
        self.busy_timeout = float(busy_timeout)
        self._memory = self.path == ":memory:"
        self._lock = threading.Lock()  # guards the bookkeeping; serializes all use when in memory
        self._local = threading.local()
        self._connections: list[tuple[weakref.ref[threading.Thread], int, sqlite3.Connection]] = []
        self._shared: sqlite3.Connection | None = None
        #: Connections inside a transaction now, and those of them that close() asked to close:
        #: closing a connection another thread is using can crash the interpreter, so the
        #: thread closes it itself when its transaction ends.
        self._in_use: set[sqlite3.Connection] = set()
        self._close_after_use: set[sqlite3.Connection] = set()

    def _now_arg(self) -> float:
        return self.time()  # the host's clock: SQLite serves one host

    def _connect(self) -> sqlite3.Connection:
        try:
            # isolation_level=None: the driver never opens transactions itself; we BEGIN/COMMIT.
            connection = sqlite3.connect(
                self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as error:
            raise StoreUnavailableError(f"{self.url}: cannot open {self.path!r}: {error}") from error
        try:
            if not self._memory:
                self._enable_wal(connection)
        except sqlite3.Error as error:
            connection.close()
            raise StoreUnavailableError(f"{self.url}: cannot enable WAL on {self.path!r}: {error}") from error
        return connection

    def _enable_wal(self, connection: sqlite3.Connection) -> None:
        """WAL is persistent in the file; readers never block the writer.

        synchronous stays FULL (the default): a committed admission survives a power loss.
        Switching a new file to WAL can answer "database is locked" at once, without SQLite's
        busy handler, while another process switches it too: try again within busy_timeout.
        """
        deadline = time.monotonic() + self.busy_timeout
        while True:
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as error:
                if not sqlite_locked(error) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def _connection(self) -> sqlite3.Connection:
        """This thread's connection (in memory: the one shared connection)."""
        if self._memory:
            if self._shared is None:
                self._shared = self._connect()
            return self._shared
        pid = os.getpid()
        connection: sqlite3.Connection | None = getattr(self._local, "connection", None)
        if connection is not None and self._local.pid == pid:
            return connection
        if connection is not None:
            _FORK_ORPHANS.append(connection)
        connection = self._connect()
        self._local.connection, self._local.pid = connection, pid
        with self._lock:
            kept = []
            for thread_ref, owner_pid, other in self._connections:
                thread = thread_ref()
                if owner_pid == pid and (thread is None or not thread.is_alive()):
                    other.close()  # its thread is gone: nobody else can be using it
                elif owner_pid == pid:
                    kept.append((thread_ref, owner_pid, other))
            kept.append((weakref.ref(threading.current_thread()), pid, connection))
            self._connections = kept
        return connection

    @contextlib.contextmanager
    def _begin(self, *, write: bool) -> Iterator[SQLCursor]:
        with self._lock if self._memory else contextlib.nullcontext():
            connection = self._connection()
            if not self._memory:  # in memory, self._lock already keeps close() out
                with self._lock:
                    self._in_use.add(connection)
            try:
                try:
                    connection.execute("BEGIN IMMEDIATE" if write else "BEGIN")
                except sqlite3.Error as error:
                    raise StoreUnavailableError(f"{self.url}: cannot begin a transaction: {error}") from error
                try:
                    yield SQLCursor(connection.cursor(), self.dialect, (sqlite3.Error,), self.url)
                    connection.execute("COMMIT")
                except BaseException as error:
                    if connection.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            connection.execute("ROLLBACK")
                    if isinstance(error, sqlite3.Error):
                        raise StoreUnavailableError(f"{self.url}: cannot commit: {error}") from error
                    raise
            finally:
                if not self._memory:
                    self._done_with(connection)

    def _done_with(self, connection: sqlite3.Connection) -> None:
        """End this thread's use of ``connection``; close it if close() came meanwhile."""
        with self._lock:
            self._in_use.discard(connection)
            closing = connection in self._close_after_use
            self._close_after_use.discard(connection)
        if closing:
            with contextlib.suppress(sqlite3.Error):
                connection.close()

    def close(self) -> None:
        with self._lock:
            connections = [c for _t, pid, c in self._connections if pid == os.getpid()]
            if self._shared is not None:
                connections.append(self._shared)
            self._connections, self._shared = [], None
            self._local = threading.local()
            busy = [c for c in connections if c in self._in_use]
            self._close_after_use.update(busy)  # their threads close them (_done_with)
            connections = [c for c in connections if c not in self._in_use]
        for connection in connections:
            with contextlib.suppress(sqlite3.Error):
                connection.close()
