"""``postgresql://…`` (or ``postgres://…``): psycopg 3 and a connection pool (docs/deployment.md).

Every operation on a key first locks that key's row (created on first use), so admissions
for different keys never wait on each other. The schema is created and upgraded by
``singleton-tasks migrate`` (:meth:`PostgresStore.migrate`), never implicitly.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

try:  # the driver, when installed (Store.check_drivers names the extra otherwise)
    import psycopg
    import psycopg.conninfo
    from psycopg_pool import ConnectionPool
except ImportError:  # pragma: no cover - the core-only install (tests/test_extras.py)
    pass

from ..config import Timings
from ..errors import SingletonConfigError
from ._driver_errors import unavailable
from ._sql import POSTGRES, SQLCursor, SQLStore
from .base import Clock, pop_query_option, redact_url

# Pools inherited through a fork: their connections belong to the parent (closing them here
# would end the parent's sessions), so the child only keeps them from being garbage-collected.
_FORK_ORPHANS: list[ConnectionPool[Any]] = []


def _check_connect_timeout(params: dict[str, Any], where: str) -> None:
    """SingletonConfigError naming a ``connect_timeout`` psycopg cannot read: every connection
    would fail with it (0 or less is psycopg's own default, not an error)."""
    value = params.get("connect_timeout")
    if value is not None:
        try:
            int(float(value))  # as psycopg reads it
        except (TypeError, ValueError, OverflowError):
            raise SingletonConfigError(
                f"{where}: connect_timeout must be a number of seconds, got {value!r}"
            ) from None


class PostgresStore(SQLStore):
    """The gate's rules over PostgreSQL rows, one row lock per key.

    Options: ``min_size`` / ``max_size`` of the pool (opened at first use), ``timeout``: how long
    an operation may wait for a connection or for a key's lock before it fails with
    :class:`~singleton_tasks.errors.StoreUnavailableError`.
    """

    schemes = ("postgresql", "postgres")
    drivers = ("psycopg", "psycopg_pool")
    extra = "postgres"

    @classmethod
    def check_url(cls, url: str) -> None:
        super().check_url(url)
        try:
            params = psycopg.conninfo.conninfo_to_dict(pop_query_option(url, "retention")[0])
        except psycopg.Error as error:
            raise ValueError(str(error)) from None
        _check_connect_timeout(params, f"PostgreSQL store {redact_url(url)}")

    clock_source = "server"
    dialect = POSTGRES

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "default",
        retention: float | None = None,
        timings: Timings | None = None,
        clock: Clock | None = None,
        min_size: int = 1,
        max_size: int = 10,
        timeout: float = 5.0,
    ) -> None:
        super().__init__(url, namespace=namespace, retention=retention, timings=timings, clock=clock)
        if not (
            isinstance(min_size, int)
            and isinstance(max_size, int)
            and 0 <= min_size <= max_size
            and max_size >= 1
        ):
            raise SingletonConfigError(
                f"pool sizes need 0 <= min_size <= max_size and max_size >= 1, got {min_size}, {max_size}"
            )
        # Not finite: every connection fails setting its lock_timeout (the pool waits forever).
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise SingletonConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        # ?retention= is the base class's: libpq refuses a parameter it does not know.
        conninfo = pop_query_option(url, "retention")[0]
        try:
            params = psycopg.conninfo.conninfo_to_dict(conninfo)
        except psycopg.Error as error:
            raise SingletonConfigError(f"malformed PostgreSQL store URL {self.url}: {error}") from None
        _check_connect_timeout(params, f"PostgreSQL store {self.url}")
        self._conninfo = conninfo  # never shown: self.url is the redacted one
        # Each connection attempt gives up within `timeout` too (libpq waits for the OS otherwise:
        # minutes for a host that drops packets), unless the URL sets its own connect_timeout.
        self._connect_kwargs: dict[str, Any] = (
            {} if "connect_timeout" in params else {"connect_timeout": max(1, math.ceil(timeout))}
        )
        self.min_size, self.max_size, self.timeout = min_size, max_size, float(timeout)
        self._lock = threading.Lock()
        self._pool: ConnectionPool[Any] | None = None
        self._pool_pid = 0

    def _now_arg(self) -> float | None:
        return None if self.clock is None else self.clock()

    def time(self) -> float:
        """The server's clock (``clock_timestamp()``), or the test clock."""
        with self._begin(write=False) as cursor:
            row = cursor.one("server_time", {"now": self._now_arg()})
        assert row is not None
        return float(row[0])

    def _configure(self, connection: psycopg.Connection[Any]) -> None:
        # A key row locked by a stuck session fails the operation (deferred, retried) after
        # `timeout` instead of blocking a worker forever.
        connection.execute("SELECT set_config('lock_timeout', %s, false)", [f"{int(self.timeout * 1000)}ms"])
        connection.commit()

    def _get_pool(self) -> ConnectionPool[Any]:
        with self._lock:
            if self._pool is not None and self._pool_pid != os.getpid():
                _FORK_ORPHANS.append(self._pool)
                self._pool = None
            if self._pool is None:
                pool: ConnectionPool[Any] = ConnectionPool(
                    self._conninfo,
                    kwargs=self._connect_kwargs,
                    min_size=self.min_size,
                    max_size=self.max_size,
                    timeout=self.timeout,
                    configure=self._configure,
                    name=f"singleton-tasks {self.url}",
                    open=False,
                )
                pool.open(wait=False)
                self._pool, self._pool_pid = pool, os.getpid()
            return self._pool

    @contextlib.contextmanager
    def _begin(self, *, write: bool) -> Iterator[SQLCursor]:
        # The pool's connection context commits on exit and rolls back on an error; a broken
        # connection is discarded by the pool.
        try:
            with self._get_pool().connection() as connection, connection.cursor() as raw:
                yield SQLCursor(raw, self.dialect, (psycopg.Error,), self.url)
        except psycopg.Error as error:  # pool timeouts included (PoolTimeout is one)
            raise unavailable(self.url, error) from error

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None and self._pool_pid == os.getpid():
            pool.close()
