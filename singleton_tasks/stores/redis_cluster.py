"""``redis+cluster://`` / ``rediss+cluster://``: the Redis store on a Redis Cluster.

The rules, scripts and data layout are :class:`~singleton_tasks.stores.redis.RedisStore`'s: all
data of one scope+key lives under one hash tag, so every per-key call touches one slot and runs
on the primary that serves it. What the cluster changes is handled here:

* redis-py's :class:`redis.cluster.RedisCluster` routes each call to its slot's primary and
  follows ``MOVED``/``ASK``; after a failover or a resharding it refreshes its slot map.
* The namespace's schema record is one key; the cluster client reads it from whichever primary
  serves its slot (a worker reads it once, when it opens the store).
* Each script call goes straight to the primary of its keys' slot, on a connection pinned to
  the calling thread (as on one server); a reply that the cluster changed sends it through the
  cluster client's routed path (:class:`~singleton_tasks.stores._cluster_client.ClusterClient`).
* The heartbeat of many holders is one call per hash slot (a script may only touch one slot).
  A producer's batch of confirms is one write per primary.
* The function library is loaded on every primary (a replica gets it by replication, so a
  promoted replica has it); a primary that lacks it (a node added by a resharding) makes the
  call load it on every primary and retry once.
* Errors of the cluster client that are not ``RedisError`` (no reachable node, a slot not
  covered) are reported as :class:`~singleton_tasks.errors.StoreUnavailableError`, as an
  unreachable server is: nothing is admitted while the cluster cannot answer.
* The busy-key index (see :mod:`~singleton_tasks.stores.redis`) is one set per hash slot: a
  script may only touch the slot of its key, so the set that lists a key must live in that
  key's slot. The set of slot ``s`` is ``<namespace>:{<t>}:busy``, where ``t`` is the smallest
  decimal number whose CRC16 falls in slot ``s`` (:func:`slot_tags`: fixed by the hash alone,
  so every process names the same set). ``inspect``/``top`` and operator release read the set
  of every slot, one pipeline per primary (16,384 ``SMEMBERS`` of sets that are mostly absent),
  then the keys they list: their cost grows with the busy keys and the primaries, never with
  the idle keys. A read answered by a redirect (a slot moving) is made again on the routed path.
* The due-key index is one sorted set per hash slot too, ``<namespace>:{<t>}:due``;
  :meth:`RedisClusterStore.tick_due` reads the keys due by now from every slot's, one pipeline
  per primary, and calls each due key on its own primary.
"""

from __future__ import annotations

import binascii
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit, urlunsplit

try:  # the driver, when installed (Store.check_drivers names the extra otherwise)
    import redis
    import redis.connection
    import redis.crc
    import redis.exceptions
    from redis.cluster import ClusterNode
    from redis.commands.core import Script
except ImportError:  # pragma: no cover - the core-only install (tests/test_extras.py)
    pass

from ..errors import SingletonConfigError, StoreUnavailableError
from ..outcomes import HeartbeatOutcome, HolderRef
from ._driver_errors import (
    redis_cluster_mode_disabled,
    redis_cluster_unreachable,
    redis_no_functions,
)
from ._redis_scripts import function_library
from .base import scrub_secrets
from .redis import RedisStore

if TYPE_CHECKING:
    from ._cluster_client import ClusterClient

#: Hash slots of a Redis Cluster (redis.crc.REDIS_CLUSTER_HASH_SLOTS; here without the driver).
_SLOTS = 16384


def cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """A cluster URL as a one-node URL redis-py reads (its options, TLS, credentials) and the seed nodes.

    Raises ValueError naming what is wrong (the caller redacts the URL): no host, a port that is
    not a number, a database other than 0 (a cluster has only database 0).
    """
    parts = urlsplit(url)
    if parts.scheme.lower() not in RedisClusterStore.schemes:
        raise ValueError(f"expected one of {sorted(RedisClusterStore.schemes)}, got {parts.scheme!r}")
    scheme = parts.scheme.lower().partition("+")[0]  # the one-node URL's: redis or rediss
    userinfo, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for host_port in hosts.split(","):
        host, _, port = host_port.strip().rpartition(":") if ":" in host_port else (host_port, "", "6379")
        host = host.strip("[]")
        if not host:
            raise ValueError(f"seed node {host_port!r} has no host (expected host:port[,host:port…])")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"seed node {host_port!r}: port {port!r} is not a number in 1-65535")
        seeds.append((host, int(port)))
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"database {parts.path.strip('/')!r}: a Redis Cluster has only database 0")
    first_host, first_port = seeds[0]
    netloc = (
        (userinfo + "@" if userinfo else "")
        + (f"[{first_host}]" if ":" in first_host else first_host)
        + f":{first_port}"
    )
    single = urlunsplit((scheme, netloc, "", parts.query, ""))
    redis.connection.parse_url(single)  # type: ignore[no-untyped-call]  # ValueError: a bad option
    return single, seeds


@functools.cache
def slot_tags() -> tuple[bytes, ...]:
    """For each hash slot, the smallest decimal number (as text) whose CRC16 falls in it.

    ``{<tag>}`` then names a key of that slot: the slot's busy-key index. About 170,000 CRCs,
    computed once per process, when a cluster store first names an index.
    """
    tags: list[bytes] = [b""] * _SLOTS
    missing, number = _SLOTS, 0
    while missing:
        text = b"%d" % number
        slot = binascii.crc_hqx(text, 0) % _SLOTS
        if not tags[slot]:
            tags[slot] = text
            missing -= 1
        number += 1
    return tuple(tags)


class RedisClusterStore(RedisStore):
    """The gate's rules in Lua on a Redis Cluster (``redis+cluster://host:port[,host:port…]``).

    The seed nodes are where the client first learns the cluster's layout; any reachable one
    is enough. ``redis_options`` go to :class:`redis.cluster.RedisCluster` (timeouts, TLS
    settings, ``retry``, ...). Each key's deadlines are decided on the clock of the primary that
    serves its slot, so the nodes' clocks should agree (NTP), as the workers' already must.
    """

    schemes = ("redis+cluster", "rediss+cluster")

    @staticmethod
    def _node_url(url: str) -> str:
        return cluster_seeds(url)[0]  # ValueError: no host, a bad port, a database other than 0

    def _connect(self, url: str, redis_options: dict[str, Any]) -> redis.Redis:
        from ._cluster_client import ClusterClient

        if self._wait is not None:
            # Each call goes to its slot's primary on a pinned connection, without the WAIT.
            raise SingletonConfigError(f"{self!r}: wait_replicas is not supported on a Redis Cluster store")
        single, seeds = cluster_seeds(url)
        try:
            client = ClusterClient(
                url=single,
                startup_nodes=[ClusterNode(host, port) for host, port in seeds[1:]],  # type: ignore[no-untyped-call]
                **redis_options,
            )
        except (redis.exceptions.RedisClusterException, redis.exceptions.RedisError) as error:
            detail = scrub_secrets(str(error), url)
            if redis_cluster_mode_disabled(detail):
                raise SingletonConfigError(
                    f"{self!r}: the seed node is not a Redis Cluster node (cluster mode is not enabled); "
                    "a single server takes redis:// or rediss://"
                ) from None
            if isinstance(error, redis.exceptions.RedisError) or redis_cluster_unreachable(detail):
                raise StoreUnavailableError(f"{self!r}: no seed node answered ({detail})") from None
            raise SingletonConfigError(f"invalid Redis Cluster store {self.url}: {detail}") from None
        # RedisCluster serves every command the store sends (the same command methods as Redis).
        return cast(redis.Redis, client)

    def _index_key(self, tag: bytes) -> bytes:
        """The busy-key index of the hash slot that holds the key of hash tag ``tag``."""
        return self._slot_index_key(redis.crc.key_slot(self._ns_colon + tag + b":"))

    def _slot_index_key(self, slot: int) -> bytes:
        return self._ns_colon + b"{" + slot_tags()[slot] + b"}:busy"

    def _due_index_key(self, tag: bytes) -> bytes:
        """The due-key index of the hash slot that holds the key of hash tag ``tag``."""
        return self._slot_due_key(redis.crc.key_slot(self._ns_colon + tag + b":"))

    def _slot_due_key(self, slot: int) -> bytes:
        return self._ns_colon + b"{" + slot_tags()[slot] + b"}:due"

    def _read_every_slot(
        self, key_of: Callable[[int], bytes], read: Callable[[Any, bytes], Any]
    ) -> list[Any]:
        """``read(client, key)`` of the index ``key_of(slot)`` of every hash slot, one pipeline
        per primary; a read answered by a redirect (the slot moving) is made again routed."""
        self._check_servers()
        cluster = cast("ClusterClient", self._client)
        # A namespace holding a hash tag of its own puts all its keys (and indexes) in one slot.
        index_keys = sorted({key_of(slot) for slot in range(_SLOTS)})
        by_node: dict[str, tuple[Any, list[bytes]]] = {}
        replies: list[Any] = []
        try:
            for key in index_keys:
                node = cluster.nodes_manager.get_node_from_slot(redis.crc.key_slot(key))
                by_node.setdefault(node.name, (node, []))[1].append(key)
            for node, keys in by_node.values():
                pipe = cluster.get_redis_connection(node).pipeline(transaction=False)
                for key in keys:
                    read(pipe, key)
                for key, reply in zip(keys, pipe.execute(raise_on_error=False), strict=True):
                    if isinstance(reply, Exception):  # MOVED/ASK: the slot is moving
                        reply = read(cluster, key)
                    replies.append(reply)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as error:
            if not isinstance(error, redis.exceptions.RedisError):
                error = redis.exceptions.ConnectionError(f"{type(error).__name__}: {error}")
            self._fail(error)
        return replies

    def _busy_tags(self) -> list[bytes]:
        """The hash tags the busy-key index of every slot lists: one pipeline per primary."""
        tags: set[bytes] = set()
        for members in self._read_every_slot(self._slot_index_key, lambda client, key: client.smembers(key)):
            tags.update(cast(set[bytes], members))
        return sorted(tags)

    def _due_tags(self, now: float, count: int) -> list[bytes]:
        """The ``count`` earliest due keys of every slot's due index, one pipeline per primary."""
        until = f"({float(now)!r}"

        def read(client: Any, key: bytes) -> Any:
            return client.zrangebyscore(key, "-inf", until, start=0, num=count, withscores=True)

        due = [
            (score, tag)
            for entries in self._read_every_slot(self._slot_due_key, read)
            for tag, score in entries
        ]
        return [tag for _score, tag in sorted(due)[:count]]

    def _servers(self) -> list[redis.Redis]:
        cluster = cast("ClusterClient", self._client)
        return [cluster.get_redis_connection(node) for node in cluster.get_primaries()]  # type: ignore[no-untyped-call]

    def _thread_client(self) -> redis.Redis:
        # The cluster client keeps a connection pool per node and is safe to share by threads.
        return self._client

    def _call(
        self, name: str, numkeys: int, keys_and_args: Sequence[bytes | str], wait: Sequence[bytes] | None
    ) -> Any:
        """The call on this thread's connection to the primary of its keys' slot (all of a
        script's keys share one slot); the cluster client's routed path where that primary
        answers that the cluster changed (``MOVED``, ``TRYAGAIN``, a lost connection, ...)."""
        cluster = cast("ClusterClient", self._client)
        with self._errors:
            if numkeys:
                try:
                    client = cluster.node_client(cast(bytes, keys_and_args[0]))
                    return self._call_on(client, name, numkeys, keys_and_args, wait)
                except cluster.reroute:
                    pass  # the routed path follows the cluster's new layout
            return self._call_on(self._client, name, numkeys, keys_and_args, wait)

    def confirm_many(self, runs: Sequence[tuple[str, str, str]]) -> list[bool]:
        """One write per primary on this thread's connection to it: the confirms of the keys
        it serves, the replies read in order. A primary whose batch fails with a reply of the
        cluster changing (or any error reply) gets its confirms again one at a time, routed."""
        cluster = cast("ClusterClient", self._client)
        groups: dict[int, tuple[redis.Redis, list[int]]] = {}
        try:
            for index, (scope, key, _run_id) in enumerate(runs):
                client = cluster.node_client(self._prefix(scope, key))
                groups.setdefault(id(client), (client, []))[1].append(index)
        except cluster.reroute:
            groups = {}  # no usable slot map: every confirm on the routed path
        confirmed: list[bool | None] = [None] * len(runs)
        for client, indexes in groups.values():
            batch = [runs[index] for index in indexes]
            with self._errors:
                try:
                    replies = self._confirm_batch(client, batch) if len(batch) > 1 else None
                except cluster.reroute:
                    replies = None
            if replies is None:
                continue  # sent again one at a time below
            for index, reply in zip(indexes, replies, strict=True):
                confirmed[index] = reply
        return [
            self.confirm(*runs[index]) if reply is None else reply for index, reply in enumerate(confirmed)
        ]

    def _load_script(self, client: redis.Redis, script: Script) -> str:
        """Load ``script`` on every primary (the routed SCRIPT LOAD), not only the one that lacked it."""
        return super()._load_script(self._client, script)

    def _load_library(self, client: redis.Redis) -> bool:
        """Load the function library on every primary; False if they cannot have functions.

        REPLACE: a primary that has the library already must not stop the others loading it.
        ``client`` may be one primary's (the direct path): the library goes to all of them.
        """
        try:
            self._client.function_load(function_library()[0], replace=True)
        except redis.exceptions.ResponseError as error:
            if redis_no_functions(error):
                return False
            raise
        return True

    def heartbeat(self, holders: Sequence[HolderRef]) -> HeartbeatOutcome:
        """One heartbeat call per hash slot (a script's keys must share one slot)."""
        by_slot: dict[int, list[HolderRef]] = {}
        for ref in holders:
            by_slot.setdefault(redis.crc.key_slot(self._prefix(ref.scope, ref.key)), []).append(ref)
        if len(by_slot) <= 1:
            return super().heartbeat(holders)
        outcomes = []
        for group in by_slot.values():
            outcomes.append(super().heartbeat(group))
        # The earliest time any lease was extended from: the leases last at least that long.
        return HeartbeatOutcome(
            tuple(run_id for outcome in outcomes for run_id in outcome.lost),
            min(outcome.store_time for outcome in outcomes),
        )


__all__ = ["RedisClusterStore", "cluster_seeds", "slot_tags"]
