"""``redis+sentinel://`` / ``rediss+sentinel://``: the Redis store on a Sentinel-managed primary.

The URL names the sentinels and the service; redis-py's :class:`redis.sentinel.Sentinel` asks
them for the primary's address whenever a connection is made, and nothing else: the connection
each thread keeps would stay on the old primary after a failover, which takes writes (and loses
them) until Sentinel turns it into a replica, ~10 s later. So each store has a thread that listens
for Sentinel's ``+switch-master`` on one sentinel (another when that one goes away) and marks the
pinned connections stale: each thread's next call connects again, to the primary the announcing
sentinel names, and a call in flight at that moment fails closed (``StoreUnavailableError``).
Everything else is :class:`~singleton_tasks.stores.redis.RedisStore`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

try:  # the driver, when installed (Store.check_drivers names the extra otherwise)
    import redis
    import redis.connection
    import redis.sentinel
except ImportError:  # pragma: no cover - the core-only install (tests/test_extras.py)
    pass

from ..errors import SingletonConfigError
from ._redis_options import check_timeouts
from .base import redact_url
from .redis import RedisStore

DEFAULT_SENTINEL_PORT = 26379
SWITCH_CHANNEL = "+switch-master"  # "<service> <old ip> <old port> <new ip> <new port>"
# A sentinel's subscription is pinged when quiet this long, and given up when quiet twice as long:
# a sentinel that vanished without closing the connection is noticed, and another one listened to.
_QUIET_PING_S = 5.0
_POLL_S = 1.0  # how often the listener looks at its stop flag between messages

logger = logging.getLogger("singleton_tasks")

# Taken to start a store's listener; a new lock in a forked child (a parent's thread may hold it).
_listener_start_lock = threading.Lock()


def _new_listener_start_lock() -> None:
    global _listener_start_lock
    _listener_start_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_listener_start_lock)


@dataclass(frozen=True)
class SentinelAddress:
    """What a Sentinel URL names: the sentinels, the service, and the data nodes' URL for redis-py."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    tls: bool
    node_url: str  # redis://[user:password@]sentinel-host/db?options: parsed by redis-py for its options


def parse_sentinel_url(url: str) -> SentinelAddress:
    """``redis+sentinel://[[user]:password@]host[:port][,host[:port]…]/service_name[/db][?options]``.

    The password (and user) are the data nodes' (the primary and its replicas); sentinels that
    need their own go in ``sentinel_kwargs``. SingletonConfigError names the URL, its password
    redacted, and what is wrong; no connection is made.
    """
    where = f"Sentinel store URL {redact_url(url)}"
    try:
        parts = urlsplit(url)
        username, password = parts.username, parts.password
    except ValueError as error:
        raise SingletonConfigError(f"malformed {where}: {error}") from None
    hosts = parts.netloc.rpartition("@")[2]
    sentinels = []
    for host_port in hosts.split(","):
        host, colon, port = host_port.strip().rpartition(":")
        if not colon:
            host, port = port, str(DEFAULT_SENTINEL_PORT)
        host = host.strip("[]")  # [::1]:26379
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise SingletonConfigError(f"malformed {where}: sentinel address {host_port!r} is not host:port")
        sentinels.append((host, int(port)))
    segments = [segment for segment in parts.path.split("/") if segment]
    if not segments:
        raise SingletonConfigError(
            f"malformed {where}: no service name (expected redis+sentinel://host:port[,host:port…]/service_name[/db])"
        )
    if len(segments) > 2 or (len(segments) == 2 and not segments[1].isdigit()):
        raise SingletonConfigError(
            f"malformed {where}: the path must be /service_name or /service_name/db, got {parts.path!r}"
        )
    # The userinfo as written (still percent-encoded): redis-py decodes it once.
    userinfo = parts.netloc.rpartition("@")[0] + "@" if (username or password) else ""
    db = segments[1] if len(segments) == 2 else "0"
    node_url = urlunsplit(("redis", f"{userinfo}{sentinels[0][0]}", f"/{db}", parts.query, ""))
    return SentinelAddress(tuple(sentinels), segments[0], parts.scheme.lower() == "rediss+sentinel", node_url)


class RedisSentinelStore(RedisStore):
    """The Redis store on the primary a set of sentinels names, following it through failovers.

    ``sentinel_kwargs`` go to the connections to the sentinels (a sentinel password, TLS
    settings); by default they get the store's socket timeouts. Other options are the Redis
    store's (``wait_replicas``, ``allow_eviction``, redis-py connection options).
    """

    schemes = ("redis+sentinel", "rediss+sentinel")

    @staticmethod
    def _node_url(url: str) -> str:
        return parse_sentinel_url(url).node_url

    def __init__(self, url: str, *, sentinel_kwargs: dict[str, Any] | None = None, **options: Any) -> None:
        self.address = parse_sentinel_url(url)
        if sentinel_kwargs is not None and not isinstance(sentinel_kwargs, dict):
            raise SingletonConfigError(
                f"Sentinel store {redact_url(url)}: sentinel_kwargs must be a dict, got {sentinel_kwargs!r}"
            )
        self._sentinel_kwargs = dict(sentinel_kwargs or {})
        check_timeouts(self._sentinel_kwargs, f"Sentinel store {redact_url(url)}: sentinel_kwargs")
        self._listener: threading.Thread | None = None
        self._listener_pid: int | None = None
        self._listener_stop = threading.Event()
        self._listener_pubsub: Any = None  # the subscription being read, disconnected by close()
        super().__init__(url, **options)

    def _make_client(self, url: str, redis_options: dict[str, Any]) -> redis.Redis:
        # The query's options parsed as redis-py parses a redis:// URL's; the host is the sentinels'.
        address = parse_sentinel_url(url)  # the URL without the store's own options
        node_options: dict[str, Any] = redis.connection.parse_url(address.node_url)  # type: ignore[no-untyped-call]
        node_options.pop("host", None)
        node_options.pop("port", None)
        node_options.update(redis_options)
        sentinel_kwargs = {k: v for k, v in node_options.items() if k.startswith("socket_")}
        if self.address.tls:
            node_options["ssl"] = True
            sentinel_kwargs["ssl"] = True
        sentinel_kwargs.update(self._sentinel_kwargs)
        self._sentinel = redis.sentinel.Sentinel(
            list(address.sentinels), sentinel_kwargs=sentinel_kwargs, **node_options
        )
        client: redis.Redis = self._sentinel.master_for(address.service_name, redis_class=redis.Redis)
        return client

    # -- following a failover -----------------------------------------------------------------

    def _pin_connection(self, client: redis.Redis | None) -> redis.Redis:
        if self._listener_pid != os.getpid():
            self._start_listener()  # before the first connection: a failover after it is heard
        return super()._pin_connection(client)

    def _start_listener(self) -> None:
        """The thread that hears failovers, once per process (a forked child starts its own)."""
        with _listener_start_lock:
            if self._listener_pid == os.getpid() or self._listener_stop.is_set():  # closed: none
                return
            self._listener = threading.Thread(
                target=self._listen, args=(self._listener_stop,), name="singleton-sentinel", daemon=True
            )
            self._listener.start()
            self._listener_pid = os.getpid()

    def _listen(self, stop: threading.Event) -> None:
        """Listen on one sentinel after another until the store is closed."""
        # The primary the store's connections were made to: a switch missed before the first
        # subscription, or while changing sentinels, shows as a different address when subscribed.
        known: tuple[str, int] | None = self._client.connection_pool.master_address  # type: ignore[attr-defined]
        failures = 0
        while not stop.is_set():
            for sentinel in list(self._sentinel.sentinels):
                if stop.is_set():
                    return
                started = time.monotonic()
                try:
                    known = self._listen_to(sentinel, known, stop)
                except (redis.exceptions.RedisError, OSError, ValueError) as error:
                    # A subscription that lasted is not a failure: its sentinel went away later.
                    failures = 0 if time.monotonic() - started > _QUIET_PING_S else failures + 1
                    logger.debug("%r: listening to sentinel %r: %s", self, sentinel, error)
            # Every sentinel failed: try again soon, then less often.
            stop.wait(min(0.1 * failures, 2.0))

    def _listen_to(
        self, sentinel: redis.Redis, known: tuple[str, int] | None, stop: threading.Event
    ) -> tuple[str, int] | None:
        """Read ``+switch-master`` from one sentinel until it goes away or the store is closed;
        returns the primary's address as last heard."""
        pubsub = sentinel.pubsub()
        self._listener_pubsub = pubsub
        try:
            pubsub.subscribe(SWITCH_CHANNEL)
            # Asked once subscribed: a switch in between is in the address or among the messages.
            reply: Any = sentinel.sentinel_get_master_addr_by_name(self.address.service_name)
            if reply:
                current = (_as_text(reply[0]), int(reply[1]))
                if known is not None and current != known:
                    # Not asked first: this sentinel may be the one that has not heard yet.
                    self._primary_changed(known, current, None)
                known = current
            heard = time.monotonic()
            pinged = False
            while not stop.is_set():
                message = pubsub.get_message(timeout=_POLL_S)
                if message is None:
                    quiet = time.monotonic() - heard
                    if quiet > 2 * _QUIET_PING_S:
                        raise redis.exceptions.ConnectionError(f"no answer to a PING in {quiet:.0f} s")
                    if quiet > _QUIET_PING_S and not pinged:
                        pubsub.ping()
                        pinged = True
                    continue
                heard, pinged = time.monotonic(), False
                if message["type"] != "message":
                    continue
                name, _old_host, _old_port, new_host, new_port = _as_text(message["data"]).split()
                if name != self.address.service_name:
                    continue
                new = (new_host, int(new_port))
                if new != known:
                    self._primary_changed(known, new, sentinel)
                known = new
        finally:
            self._listener_pubsub = None
            pubsub.close()
        return known

    def _primary_changed(
        self, old: tuple[str, int] | None, new: tuple[str, int], announcer: redis.Redis | None
    ) -> None:
        """Every connection of the store connects again; the sentinel that announced the switch,
        if any, is asked first from now on (it names the new primary; another may not have heard
        yet: sentinels pass a new configuration on every 2 s)."""
        sentinels = self._sentinel.sentinels
        if announcer is not None and announcer in sentinels:  # discover_master's own swap
            at = sentinels.index(announcer)
            sentinels[0], sentinels[at] = sentinels[at], sentinels[0]
        self._primary_generation += 1  # the pinned connections: at their thread's next call
        self._client.connection_pool.disconnect(inuse_connections=False)  # the idle pooled ones
        logger.info(
            "%r: the sentinels announced a new primary for %s at %s:%d (was %s); moving its "
            "connections to the new primary",
            self,
            self.address.service_name,
            *new,
            "unknown" if old is None else f"{old[0]}:{old[1]}",
        )

    def close(self) -> None:
        self._listener_stop.set()
        pubsub = self._listener_pubsub
        if pubsub is not None and self._listener_pid == os.getpid():
            try:
                pubsub.connection.disconnect()  # wakes the listener from its read
            except (redis.exceptions.RedisError, OSError, AttributeError):
                pass
        listener = self._listener
        try:
            super().close()
        finally:
            for client in self._sentinel.sentinels:
                client.close()
            if listener is not None and self._listener_pid == os.getpid():
                listener.join(timeout=2 * _POLL_S)


def _as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
