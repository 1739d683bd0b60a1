"""How a Redis store makes its calls: pinned connections, FCALL or EVALSHA, WAIT, the failover check.

:class:`RedisPlumbing` is :class:`~singleton_tasks.stores.redis.RedisStore`'s base: every
operation is one script call made here, on the calling thread's own connection, by ``FCALL``
(the function library, Redis 7 and later) or by ``EVALSHA`` where the server or the user has no
functions, loading the library or the script again where the server lost it. With
``wait_replicas`` a writing call carries its ``WAIT`` in the same round trip. A call that
overlapped a failover the Sentinel store heard of fails closed. Driver errors become the
library's here (:meth:`RedisPlumbing._fail`, through ``with self._errors``).

The methods whose docstring starts with *Hook.* are overridden by the Cluster and Sentinel
stores; their contract is :class:`~singleton_tasks.stores._redis_hooks.RedisStoreHooks`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

try:  # the driver, when installed (Store.check_drivers names the extra otherwise)
    import redis
    import redis.exceptions
    from redis.commands.core import Script

    from ._redis_call import call_script as _call_script  # imports the driver too
except ImportError:  # pragma: no cover - the core-only install (tests/test_extras.py)
    pass

from ..errors import SingletonConfigError, StoreUnavailableError
from . import _redis_scripts as lua
from ._driver_errors import (
    TranslatedErrors,
    redis_function_missing,
    redis_library_exists,
    redis_no_functions,
    redis_script_denied,
    unavailable,
)
from ._redis_server import denied_command
from .base import Store

if TYPE_CHECKING:
    from ._redis_server import ServerChecks


class RedisPlumbing(Store):
    """The call plumbing of the Redis stores (the state it keeps is set by :meth:`_init_calls`)."""

    #: The client of every operation (a cluster client in the cluster store).
    _client: redis.Redis
    #: The checks of the servers, made before this thread's first call.
    _server_checks: ServerChecks
    #: WAIT's arguments, sent behind every writing operation (None: writes do not wait).
    _wait: tuple[bytes, bytes] | None

    def _init_calls(self, functions: bool) -> None:
        """Set up the calls' state once ``_client`` is made."""
        #: Cleared at the first call that finds the server or the user without functions.
        self._functions = functions
        self._function_names = lua.function_library()[1]
        #: Each operation's script, for EVALSHA (its ``sha`` updated when loaded again).
        self._scripts: dict[str, Script] = {
            name: self._client.register_script(text) for name, text in lua.load_scripts().items()
        }
        self._threads = threading.local()
        #: Raised when the pinned connections must connect again (the Sentinel store: a
        #: failover); each thread compares it with its connection's before every call.
        self._primary_generation = 0

    @property
    def _errors(self) -> TranslatedErrors:
        """``with self._errors:`` turns a driver error into the library's (:meth:`_fail`).

        Made per use: kept as an attribute, it would hold the store's own method and put the
        store in a reference cycle. The collector would then free its client at an arbitrary
        point or at interpreter exit, where redis-py's ``Redis.__del__`` can block for ever on
        its pool's lock (a producer process that never exits).
        """
        return TranslatedErrors((redis.exceptions.RedisError,), self._fail)

    def _servers(self) -> list[redis.Redis]:
        """*Hook.* The servers whose eviction policy and replicas are checked (a cluster: every primary)."""
        return [self._client]

    def _check_servers(self) -> None:
        """The server checks, before this store's first operation (:meth:`ServerChecks.check_once`)."""
        if not self._server_checks.checked:
            self._server_checks.check_once(self._servers, self._errors)

    def _fail(self, error: BaseException) -> NoReturn:
        if redis_script_denied(error):
            # The ACL keeps this user from a command the scripts call: a setup error, not an outage.
            raise SingletonConfigError(f"{self!r}: {denied_command(self._thread_client(), error)}") from error
        raise unavailable(repr(self), error) from error

    def _eval(self, name: str, numkeys: int, *keys_and_args: bytes | str) -> Any:
        """One FCALL, or one EVALSHA where the server has no functions for us; with
        ``wait_replicas``, a writing operation's WAIT rides in the same round trip."""
        generation = self._primary_generation  # read before the call picks its connection
        wait = None if name == "snapshot" else self._wait
        answer = self._call(name, numkeys, keys_and_args, wait)
        if self._primary_generation != generation:
            self._primary_changed_during_call()
        if wait is None:
            return answer
        reply, acknowledged = answer
        self._server_checks.check_acknowledged(int(acknowledged))
        return reply

    def _primary_changed_during_call(self) -> NoReturn:
        """A call answered after the store heard of a failover may have been answered by the old
        primary, which loses what it took: it fails closed rather than report that success."""
        raise StoreUnavailableError(
            f"{self!r}: the sentinels announced a new primary while this call was made; it may "
            "have been applied on the old primary only, and lost with it"
        )

    def _call(
        self, name: str, numkeys: int, keys_and_args: Sequence[bytes | str], wait: Sequence[bytes] | None
    ) -> Any:
        """*Hook.* The call, by FCALL or EVALSHA (and WAIT behind it when ``wait`` is given).

        The library (or the script) is loaded once more when the server does not know it (a
        new, restarted or flushed server, a replica just promoted), and the call is made again:
        nothing ran the first time.
        """
        with self._errors:
            return self._call_on(self._thread_client(), name, numkeys, keys_and_args, wait)

    def _call_on(
        self,
        client: redis.Redis,
        name: str,
        numkeys: int,
        keys_and_args: Sequence[bytes | str],
        wait: Sequence[bytes] | None,
    ) -> Any:
        """:meth:`_call` on ``client`` (the cluster store picks the primary of the keys' slot);
        raises RedisError."""
        if self._functions:
            function = self._function_names[name]
            try:
                return _call_script(client, b"FCALL", function, numkeys, keys_and_args, wait)
            except redis.exceptions.ResponseError as error:
                if redis_function_missing(error):
                    if self._load_library(client):
                        return _call_script(client, b"FCALL", function, numkeys, keys_and_args, wait)
                elif not redis_no_functions(error):
                    raise
                self._functions = False
        script = self._scripts[name]
        try:
            return _call_script(client, b"EVALSHA", script.sha.encode(), numkeys, keys_and_args, wait)
        except redis.exceptions.NoScriptError:
            script.sha = self._load_script(client, script)
            return _call_script(client, b"EVALSHA", script.sha.encode(), numkeys, keys_and_args, wait)

    def _load_script(self, client: redis.Redis, script: Script) -> str:
        """*Hook.* Load ``script`` for EVALSHA; its SHA."""
        return client.script_load(script.script)

    def _load_library(self, client: redis.Redis) -> bool:
        """*Hook.* Load the function library; False if this server or user cannot have functions."""
        try:
            client.function_load(lua.function_library()[0])
        except redis.exceptions.ResponseError as error:
            if redis_no_functions(error):
                return False
            if not redis_library_exists(error):  # another process loaded it first
                raise
        return True

    def _thread_client(self) -> redis.Redis:
        """*Hook.* This thread's client, pinned to one connection of the shared pool.

        A pooled call checks a connection out and back in and polls its socket for stale data,
        one more system call per operation; in a worker of many threads each is a GIL hand-off
        (benchmarks/README.md#where-the-client-cpu-goes). The connection goes back to the pool
        when the thread's client is collected, and a forked child makes its own. When
        ``_primary_generation`` has moved on (the Sentinel store heard of a failover), the
        thread connects again before its call: one integer compare per call.
        """
        threads = self._threads
        client: redis.Redis | None = getattr(threads, "client", None)
        if client is None or threads.pid != os.getpid() or threads.generation != self._primary_generation:
            client = self._pin_connection(client)
        return client

    def _pin_connection(self, client: redis.Redis | None) -> redis.Redis:
        """*Hook.* This thread's client made (its first call, or the first in a forked child), or
        its connection made again after a failover: this thread's own, idle between its calls."""
        threads = self._threads
        generation = self._primary_generation  # before connecting: a later failover is seen next call
        if client is not None and threads.pid == os.getpid():
            connection = client.connection
            assert connection is not None  # a single-connection client
            with self._errors:
                connection.disconnect()  # type: ignore[no-untyped-call]
                # connect() asks the sentinels; a command's own reconnect would go back to the old host.
                connection.connect()  # type: ignore[no-untyped-call]
        else:
            self._check_servers()
            client = redis.Redis(connection_pool=self._client.connection_pool, single_connection_client=True)
            threads.client, threads.pid = client, os.getpid()
        threads.generation = generation
        return client


__all__ = ["RedisPlumbing"]
