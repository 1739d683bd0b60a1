"""redis-py's cluster client with a direct path for the store's scripts (the Redis Cluster store's).

Its own module because it subclasses the driver's class: ``redis_cluster`` imports it when it
connects, so that module (and the store's scheme) can be read without redis-py installed.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import redis
import redis.crc
import redis.exceptions
from redis.cluster import RedisCluster

#: Replies after which the routed path is taken: it follows the redirect or waits out the
#: cluster's change, and refreshes the slot map the direct path reads.
_REROUTE = (
    redis.exceptions.AskError,  # MovedError too
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.RedisClusterException,  # SlotNotCoveredError: the slot map is stale
)


class ClusterClient(RedisCluster):
    """redis-py's cluster client, with a direct path for the store's scripts.

    :meth:`node_client` is the store's direct path: a client pinned to one connection (per
    calling thread) to the primary of a key's slot, on which the store makes its FCALL/EVALSHA
    as on a single server (RedisStore's single-connection call, a batch of confirms in one
    write). redis-py's routed path costs more client CPU per call
    (benchmarks/README.md#where-the-client-cpu-goes), and a worker of many threads is bound by
    that CPU. A reply or error in :attr:`reroute` sends the call down
    the routed path (this client's own ``execute_command``), which follows ``MOVED``/``ASK``,
    retries ``TRYAGAIN``/cluster-down and refreshes the slot map the direct path reads.

    ``RedisClusterException`` (no node reachable, a slot not covered, ...) does not derive from
    ``RedisError``; every routed command passes through ``execute_command``, so translating
    there lets the store treat it as any other failed call (StoreUnavailableError: fail closed).
    """

    connection = None  # RedisStore's calls on this client take execute_command: routed, by slot
    #: What the direct path answers when the cluster changed under it: take the routed path.
    reroute = _REROUTE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._threads = threading.local()

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]
        except redis.exceptions.RedisClusterException as error:
            raise redis.exceptions.ConnectionError(f"{type(error).__name__}: {error}") from error

    def node_client(self, key: bytes) -> redis.Redis:
        """This thread's client pinned to one connection to the primary of ``key``'s slot.

        Raises one of :attr:`reroute` when the slot map has no primary for it.
        """
        node = self.nodes_manager.get_node_from_slot(redis.crc.key_slot(key))
        pool = node.redis_connection.connection_pool
        threads = self._threads
        if getattr(threads, "pid", None) != os.getpid():
            threads.clients, threads.pid = {}, os.getpid()  # a forked child makes its own
        pinned: redis.Redis | None = threads.clients.get(node.name)
        if pinned is None or pinned.connection_pool is not pool:
            pinned = redis.Redis(connection_pool=pool, single_connection_client=True)
            threads.clients[node.name] = pinned
        return pinned


__all__ = ["ClusterClient"]
