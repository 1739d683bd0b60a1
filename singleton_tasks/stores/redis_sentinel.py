"""``redis+sentinel://`` / ``rediss+sentinel://``: the Redis store on a Sentinel-managed primary.

The URL names the sentinels and the service; redis-py's :class:`redis.sentinel.Sentinel` asks
them for the primary's address whenever a connection is made. After a failover the connections
to the old primary fail (it is gone, or it answers ``READONLY`` as a replica and redis-py drops
the connection): that operation fails closed with ``StoreUnavailableError``, and the next one
connects to the new primary. Everything else is :class:`~singleton_tasks.stores.redis.RedisStore`.
"""

from __future__ import annotations

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
from .base import redact_url
from .redis import RedisStore

DEFAULT_SENTINEL_PORT = 26379


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

    def close(self) -> None:
        try:
            super().close()
        finally:
            for client in self._sentinel.sentinels:
                client.close()
