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

from ._redis_call import call_script
from .redis import _text

_SCRIPT_COMMANDS = frozenset({"FCALL", "EVALSHA"})

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

    The store's FCALL/EVALSHA go straight to the primary of their keys' slot, on a connection
    pinned to the calling thread (RedisStore's single-connection call): the routed path costs
    about twice the client CPU per call, and a worker of many threads is bound by that CPU.
    A redirect or a failed connection sends the call down the routed path, which follows
    ``MOVED``/``ASK``, retries ``TRYAGAIN``/cluster-down and refreshes the slot map.

    ``RedisClusterException`` (no node reachable, a slot not covered, ...) does not derive from
    ``RedisError``; every command passes through ``execute_command``, so translating there lets
    the store treat it as any other failed call (StoreUnavailableError: fail closed).
    """

    connection = None  # RedisStore's calls take execute_command: routed here, by slot

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._threads = threading.local()

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if args[0] in _SCRIPT_COMMANDS and not kwargs and int(args[2]) > 0:
            try:
                return self._direct(*args)
            except _REROUTE:
                pass  # the routed path below follows the cluster's new layout
        try:
            return super().execute_command(*args, **kwargs)  # type: ignore[no-untyped-call]
        except redis.exceptions.RedisClusterException as error:
            raise redis.exceptions.ConnectionError(f"{type(error).__name__}: {error}") from error

    def _direct(self, command: str, name: str, numkeys: int, *keys_and_args: Any) -> Any:
        """The call on this thread's connection to the primary of the first key's slot."""
        node = self.nodes_manager.get_node_from_slot(redis.crc.key_slot(keys_and_args[0]))
        pool = node.redis_connection.connection_pool
        threads = self._threads
        if getattr(threads, "pid", None) != os.getpid():
            threads.clients, threads.pid = {}, os.getpid()  # a forked child makes its own
        pinned = threads.clients.get(node.name)
        if pinned is None or pinned.connection_pool is not pool:
            pinned = redis.Redis(connection_pool=pool, single_connection_client=True)
            threads.clients[node.name] = pinned
        return call_script(pinned, command.encode(), _text(name), int(numkeys), keys_and_args)


__all__ = ["ClusterClient"]
