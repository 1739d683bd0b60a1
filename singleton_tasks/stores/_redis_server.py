"""What a Redis store checks of its server: the eviction policy, the replicas, the ACL behind a refusal.

:class:`ServerChecks` refuses a server that would evict the store's keys (``allkeys-*``) and
``wait_replicas`` above the replicas present, at the store's first use and again at each
:meth:`~singleton_tasks.stores.base.Store.check_health`; :func:`denied_command` tells which
command the ACL refused a script.
"""

from __future__ import annotations

import logging
import threading
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


class ServerChecks:
    """A store's checks of its servers: once before its first operation, again at each health check.

    ``servers`` names the servers to check (a cluster: every primary); ``errors`` translates a
    driver error raised while checking (the store's own translation).
    """

    def __init__(self, where: str, options: StoreOptions) -> None:
        #: How the messages name the store (its repr: the redacted URL). The store keeps this
        #: object, so it holds nothing of the store's: the servers and the error translation
        #: come with each call (a store stays out of reference cycles: ``TranslatedErrors``).
        self._where = where
        self._options = options
        #: The server's eviction policy and replicas were checked (once per store).
        self.checked = False
        self._lock = threading.Lock()
        #: The refusal :meth:`check_health` found (an allkeys-* policy set at runtime):
        #: registrations and claims raise it until a check passes again.
        self.refusal: str | None = None

    def check_once(self, servers: Callable[[], list[redis.Redis]], errors: TranslatedErrors) -> None:
        """Refuse an evicting server, and ``wait_replicas`` above the replicas present, at first use.

        Runs before the first operation of this store object (the adapters' first send, a worker's
        boot); a refusal is raised again at every use, a check that could not reach the server is
        made again at the next.
        """
        if self.checked:
            return
        with self._lock:
            if not self.checked:
                with errors:
                    for server in servers():
                        self._check_server(server)
                self.checked = True

    def _check_server(self, client: redis.Redis) -> None:
        """The checks of one server."""
        policy = eviction_policy(client)
        if policy is None:
            logger.warning(
                "%s: could not read the server's maxmemory-policy (CONFIG GET and INFO memory are "
                "refused to this user); if it is allkeys-*, Redis may evict the store's keys under "
                "memory pressure and two runs of one key can then hold it at once: use noeviction",
                self._where,
            )
        refusal = self._eviction_refusal(policy)
        if refusal is not None:
            raise SingletonConfigError(refusal)
        if self._options.wait_replicas is not None:
            wait_replicas = self._options.wait_replicas or 0
            replicas = int(client.info("replication").get("connected_slaves", 0))
            if wait_replicas > replicas:
                raise SingletonConfigError(
                    f"{self._where}: wait_replicas={wait_replicas} but the primary has {replicas} "
                    "connected replica(s): every write would fail. Nothing was written"
                )

    def _eviction_refusal(self, policy: str | None) -> str | None:
        """Why the store refuses a server evicting by ``policy``; None: it does not."""
        if policy is None or not policy.startswith("allkeys-") or self._options.allow_eviction:
            return None
        return (
            f"{self._where}: the server's maxmemory-policy is {policy}: under memory pressure Redis "
            "would evict the store's keys (a running holder's slot, the key's token) and admit a "
            "second run of a key while the first runs. Set maxmemory-policy noeviction, or give "
            "the store a dedicated Redis; allow_eviction=true accepts that risk. Nothing was written"
        )

    def check_health(self, servers: Callable[[], list[redis.Redis]], errors: TranslatedErrors) -> None:
        """Read every server's eviction policy again (:meth:`Store.check_health`).

        An ``allkeys-*`` policy set while the store runs (``CONFIG SET``) is refused as at first
        use, by this call and by every registration and claim until a call finds it changed back.
        """
        with errors:
            policies = [eviction_policy(server) for server in servers()]
        refusal = next(filter(None, map(self._eviction_refusal, policies)), None)
        if refusal is None and self.refusal is not None:
            logger.warning(
                "%s: the server's maxmemory-policy is accepted again: runs are admitted", self._where
            )
        self.refusal = refusal
        if refusal is not None:
            raise SingletonConfigError(refusal)

    def check_acknowledged(self, acknowledged: int) -> None:
        """``wait_replicas`` not reached: the write is on the primary only, and may be lost by a failover."""
        options = self._options
        if options.wait_replicas is not None and acknowledged < options.wait_replicas:
            raise StoreUnavailableError(
                f"{self._where}: only {acknowledged} of wait_replicas={options.wait_replicas} replicas "
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
