"""The drivers' errors, read in one place: the checks of their text and their translation.

The drivers (redis-py, sqlite3, psycopg) say some things only in an error's message. Every
store decision taken on such a text is one function here, and each is pinned by a test that
provokes the real error on a real server (``tests/test_driver_errors.py``): a driver or server
upgrade that rewords one fails that test, not a store in production.

:class:`TranslatedErrors` is how a store family turns its driver's errors into the library's
(``with self._errors: ...``), written once per family instead of at every call.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import NoReturn

from ..errors import StoreUnavailableError

# -- Redis (redis-py's exceptions carry the server's reply text) ------------------------------


def redis_no_functions(error: BaseException) -> bool:
    """The server cannot serve functions to us: older than Redis 7 (``unknown command 'FCALL'``),
    or the ACL keeps FCALL / FUNCTION from this user (``NOPERM``)."""
    import redis.exceptions  # only ever called with a redis-py error: the driver is there

    text = str(error).lower()
    if isinstance(error, redis.exceptions.NoPermissionError):
        return "'fcall'" in text or "'function" in text  # not a key the ACL keeps from us
    return isinstance(error, redis.exceptions.ResponseError) and text.startswith("unknown command")


def redis_function_missing(error: BaseException) -> bool:
    """FCALL of a function the server does not have (a new, restarted or flushed server)."""
    return str(error).startswith("Function not found")


def redis_library_exists(error: BaseException) -> bool:
    """FUNCTION LOAD of a library the server has already (another process loaded it first)."""
    return "already exists" in str(error)


def redis_script_denied(error: BaseException) -> bool:
    """A script called a command the ACL keeps from this user (a setup error, not an outage)."""
    import redis.exceptions

    return isinstance(error, redis.exceptions.ResponseError) and "can't run this command" in str(error)


def redis_cluster_mode_disabled(detail: str) -> bool:
    """The seed node of a cluster store answers, but is no Redis Cluster node."""
    return "Cluster mode is not enabled" in detail


def redis_cluster_unreachable(detail: str) -> bool:
    """redis-py's cluster client reached none of the seed nodes (a ``RedisClusterException``)."""
    return "cannot be connected" in detail


# -- SQLite (sqlite3 reports most failures as OperationalError with a text) -------------------


def sqlite_locked(error: BaseException) -> bool:
    """``database is locked``: another connection holds the lock this one needs."""
    return "locked" in str(error)


def sqlite_duplicate_column(error: BaseException) -> bool:
    """``ALTER TABLE ... ADD COLUMN`` of a column the table has."""
    return "duplicate column name" in str(error)


def sqlite_no_such_column(error: BaseException) -> bool:
    """``ALTER TABLE ... DROP COLUMN`` of a column the table does not have."""
    return "no such column" in str(error)


# -- translation and scrubbing ----------------------------------------------------------------


def unavailable(where: str, error: BaseException) -> StoreUnavailableError:
    """The store error of a failed driver call: the store, the driver's error type and message."""
    return StoreUnavailableError(f"{where}: {type(error).__name__}: {error}")


class TranslatedErrors:
    """A context manager: an error of ``errors`` raised inside goes to ``fail``, which raises the
    library's error (an unreachable server: :class:`~singleton_tasks.errors.StoreUnavailableError`).

    It keeps no state beyond its two arguments; a class rather than a generator-based context
    manager because it sits on every operation's path. ``fail`` is held strongly: an object
    that keeps one as an attribute with its own method as ``fail`` is in a reference cycle, and
    a store must not be (``tests/test_store_lifetime.py``): make it per use, or give ``fail``
    the values it needs rather than the store.
    """

    __slots__ = ("_errors", "_fail")

    def __init__(
        self, errors: tuple[type[BaseException], ...], fail: Callable[[BaseException], NoReturn]
    ) -> None:
        self._errors = errors
        self._fail = fail

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is not None and isinstance(error, self._errors):
            self._fail(error)


__all__ = [
    "TranslatedErrors",
    "redis_cluster_mode_disabled",
    "redis_cluster_unreachable",
    "redis_function_missing",
    "redis_library_exists",
    "redis_no_functions",
    "redis_script_denied",
    "sqlite_duplicate_column",
    "sqlite_locked",
    "sqlite_no_such_column",
    "unavailable",
]
