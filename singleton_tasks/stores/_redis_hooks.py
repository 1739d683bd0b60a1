"""The Redis store's extension points: the hooks the Cluster and Sentinel stores override, and their contract.

:class:`~singleton_tasks.stores.redis_cluster.RedisClusterStore` and
:class:`~singleton_tasks.stores.redis_sentinel.RedisSentinelStore` subclass
:class:`~singleton_tasks.stores.redis.RedisStore` and override these methods, and no other
underscored one (the public ``heartbeat``, ``confirm_many`` and ``close`` are the protocol's).
Each hook's docstring in the store starts with *Hook.*; mypy checks below that the store still
has every hook with this signature. A new extension point is added here first.

============================  ===================
hook                          overridden by
============================  ===================
``_node_url``                 Cluster, Sentinel
``_connect``                  Cluster
``_make_client``              Sentinel
``_servers``                  Cluster
``_index_key``                Cluster
``_due_index_key``            Cluster
``_busy_tags``                Cluster
``_due_tags``                 Cluster
``_thread_client``            Cluster
``_pin_connection``           Sentinel
``_call``                     Cluster
``_load_script``              Cluster
``_load_library``             Cluster
============================  ===================

Besides, the Sentinel store raises ``_primary_generation`` when it hears of a failover: every
thread's pinned connection then connects again before its next call, and a call that was in
flight fails closed (:class:`~singleton_tasks.errors.StoreUnavailableError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script


class RedisStoreHooks(Protocol):
    """What a subclass of the Redis store may change, one method per hook."""

    @staticmethod
    def _node_url(url: str) -> str:
        """The one-node URL redis-py parses for its options (the store's own options removed);
        ValueError names what is wrong with ``url``."""

    def _connect(self, url: str, redis_options: dict[str, Any]) -> redis.Redis:
        """The client of every operation, made without connecting (a bad option fails here)."""

    def _make_client(self, url: str, redis_options: dict[str, Any]) -> redis.Redis:
        """The client :meth:`_connect` checks: where the server is found (the sentinels)."""

    def _servers(self) -> list[redis.Redis]:
        """The servers whose eviction policy and replicas are checked (a cluster: every primary)."""

    def _index_key(self, tag: bytes) -> bytes:
        """The busy-key index that lists the key of hash tag ``tag``; in the key's slot, since
        the scripts write it in the same call."""

    def _due_index_key(self, tag: bytes) -> bytes:
        """The due-key index that lists the key of hash tag ``tag`` (as :meth:`_index_key`)."""

    def _busy_tags(self) -> list[bytes]:
        """Every hash tag the busy-key indexes list, sorted; driver errors translated."""

    def _due_tags(self, now: float, count: int) -> list[bytes]:
        """Up to ``count`` hash tags due before ``now``, earliest first; driver errors translated."""

    def _thread_client(self) -> redis.Redis:
        """The client the calling thread makes its calls on."""

    def _pin_connection(self, client: redis.Redis | None) -> redis.Redis:
        """This thread's client made, or its connection made again after a failover; the
        server checks run before a thread's first connection."""

    def _call(
        self, name: str, numkeys: int, keys_and_args: Sequence[bytes | str], wait: Sequence[bytes] | None
    ) -> Any:
        """One script call (and its WAIT when ``wait`` is given); driver errors translated."""

    def _load_script(self, client: redis.Redis, script: Script) -> str:
        """Load ``script`` where an EVALSHA found it missing; its SHA."""

    def _load_library(self, client: redis.Redis) -> bool:
        """Load the function library where an FCALL found it missing; False: no functions for us."""


__all__ = ["RedisStoreHooks"]
