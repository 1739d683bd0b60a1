"""What a Redis store checks of its server: the eviction policy, the replicas, the ACL behind a refusal.

:class:`ServerChecks` refuses a server that would evict the store's keys (``allkeys-*``) and
``wait_replicas`` above the replicas present, at the store's first use and again at each
:meth:`~singleton_tasks.stores.base.Store.check_health`; :func:`denied_command` tells which
command the ACL refused a script.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

try:  # the driver, when installed (Store.check_drivers names the extra otherwise)
    import redis
    import redis.exceptions
except ImportError:  # pragma: no cover - the core-only install (tests/test_extras.py)
    pass

from ..errors import SingletonConfigError, StoreUnavailableError
from ._driver_errors import TranslatedErrors, redis_script_denied

if TYPE_CHECKING:
    from ._redis_options import StoreOptions

logger = logging.getLogger("singleton_tasks")


def _as_str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def eviction_policy(client: redis.Redis) -> str | None:
    """``maxmemory-policy`` by CONFIG GET, or from INFO memory where CONFIG is refused or
    renamed (managed services); None if neither answers."""
    try:
        reply = client.config_get("maxmemory-policy")
        for name, value in reply.items():
            if _as_str(name) == "maxmemory-policy":
                return _as_str(value)
    except redis.exceptions.ResponseError:
        pass
    try:
        policy = client.info("memory").get("maxmemory_policy")
    except redis.exceptions.ResponseError:
        return None
    return None if policy is None else _as_str(policy)


class _Named:
    """Shows as the text it was given (``%r`` and ``!r`` of a store in messages)."""

    __slots__ = ("_text",)

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text


def _weak_callable(function: Callable[[], list[redis.Redis]]) -> Callable[[], list[redis.Redis]]:
    """``function``, holding its object weakly when it is a bound method (no servers once gone)."""
    if not inspect.ismethod(function):
        return function
    method = weakref.WeakMethod(function)

    def call() -> list[redis.Redis]:
        bound = method()
        return [] if bound is None else bound()

    return call


class ServerChecks:
    """A store's checks of its servers: once before its first operation, again at each health check.

    ``servers`` names the servers to check (a cluster: every primary); ``errors`` translates a
    driver error raised while checking (the store's own translation).
    """

    def __init__(
        self,
        store: object,
        options: StoreOptions,
        servers: Callable[[], list[redis.Redis]],
        errors: TranslatedErrors,
    ) -> None:
        #: How the messages name the store (its repr: the redacted URL); a name, not the store, and
        #: ``servers`` held weakly: the store keeps this object and stays out of a reference cycle
        #: (:class:`~singleton_tasks.stores._driver_errors.TranslatedErrors` says why).
        self._store = _Named(repr(store))
        self._options = options
        self._servers = _weak_callable(servers)
        self._errors = errors
        #: The server's eviction policy and replicas were checked (once per store).
        self._checked = False
        self._lock = threading.Lock()
        #: The refusal :meth:`check_health` found (an allkeys-* policy set at runtime):
        #: registrations and claims raise it until a check passes again.
        self.refusal: str | None = None

    def check_once(self) -> None:
        """Refuse an evicting server, and ``wait_replicas`` above the replicas present, at first use.

        Runs before the first operation of this store object (the adapters' first send, a worker's
        boot); a refusal is raised again at every use, a check that could not reach the server is
        made again at the next.
        """
        if self._checked:
            return
        with self._lock:
            if not self._checked:
                with self._errors:
                    for server in self._servers():
                        self._check_server(server)
                self._checked = True

    def _check_server(self, client: redis.Redis) -> None:
        """The checks of one server."""
        policy = eviction_policy(client)
        if policy is None:
            logger.warning(
                "%r: could not read the server's maxmemory-policy (CONFIG GET and INFO memory are "
                "refused to this user); if it is allkeys-*, Redis may evict the store's keys under "
                "memory pressure and two runs of one key can then hold it at once: use noeviction",
                self._store,
            )
        refusal = self._eviction_refusal(policy)
        if refusal is not None:
            raise SingletonConfigError(refusal)
        if self._options.wait_replicas is not None:
            wait_replicas = self._options.wait_replicas or 0
            replicas = int(client.info("replication").get("connected_slaves", 0))
            if wait_replicas > replicas:
                raise SingletonConfigError(
                    f"{self._store!r}: wait_replicas={wait_replicas} but the primary has {replicas} "
                    "connected replica(s): every write would fail. Nothing was written"
                )

    def _eviction_refusal(self, policy: str | None) -> str | None:
        """Why the store refuses a server evicting by ``policy``; None: it does not."""
        if policy is None or not policy.startswith("allkeys-") or self._options.allow_eviction:
            return None
        return (
            f"{self._store!r}: the server's maxmemory-policy is {policy}: under memory pressure Redis "
            "would evict the store's keys (a running holder's slot, the key's token) and admit a "
            "second run of a key while the first runs. Set maxmemory-policy noeviction, or give "
            "the store a dedicated Redis; allow_eviction=true accepts that risk. Nothing was written"
        )

    def check_health(self) -> None:
        """Read every server's eviction policy again (:meth:`Store.check_health`).

        An ``allkeys-*`` policy set while the store runs (``CONFIG SET``) is refused as at first
        use, by this call and by every registration and claim until a call finds it changed back.
        """
        with self._errors:
            policies = [eviction_policy(server) for server in self._servers()]
        refusal = next(filter(None, map(self._eviction_refusal, policies)), None)
        if refusal is None and self.refusal is not None:
            logger.warning(
                "%r: the server's maxmemory-policy is accepted again: runs are admitted", self._store
            )
        self.refusal = refusal
        if refusal is not None:
            raise SingletonConfigError(refusal)

    def check_acknowledged(self, acknowledged: int) -> None:
        """``wait_replicas`` not reached: the write is on the primary only, and may be lost by a failover."""
        options = self._options
        if options.wait_replicas is not None and acknowledged < options.wait_replicas:
            raise StoreUnavailableError(
                f"{self._store!r}: only {acknowledged} of wait_replicas={options.wait_replicas} replicas "
                f"acknowledged the write within {options.wait_timeout_ms} ms; it is applied on the "
                "primary but may not survive a failover"
            )


def denied_command(client: redis.Redis, error: BaseException) -> str:
    """Which command a script was refused: TIME (the clock every deadline is decided on) or another."""
    try:
        client.eval("return redis.call('TIME')", 0)
    except redis.exceptions.ResponseError as probe:
        if redis_script_denied(probe):
            return (
                "the server refuses TIME inside scripts to this user, and the store decides every "
                "deadline on the server's clock; allow TIME (ACL +time). Nothing was written"
            )
    except redis.exceptions.RedisError:
        pass
    return f"the user may not run a command the store's scripts need (nothing was written): {error}"


__all__ = ["ServerChecks", "denied_command", "eviction_policy"]
