"""Stores, chosen by URL scheme (docs/deployment.md#choosing-a-store)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from ..errors import SingletonConfigError
from .base import SCHEMA_VERSION, RuleStore, Store, redact_url

# scheme -> "module:Class", imported only when used so drivers stay optional.
STORE_CLASSES: dict[str, str] = {
    "memory": "singleton_tasks.stores.memory:MemoryStore",
    "sqlite": "singleton_tasks.stores.sqlite:SQLiteStore",
    "redis": "singleton_tasks.stores.redis:RedisStore",
    "rediss": "singleton_tasks.stores.redis:RedisStore",
    "redis+cluster": "singleton_tasks.stores.redis_cluster:RedisClusterStore",
    "rediss+cluster": "singleton_tasks.stores.redis_cluster:RedisClusterStore",
    "redis+sentinel": "singleton_tasks.stores.redis_sentinel:RedisSentinelStore",
    "rediss+sentinel": "singleton_tasks.stores.redis_sentinel:RedisSentinelStore",
    "postgresql": "singleton_tasks.stores.postgres:PostgresStore",
    "postgres": "singleton_tasks.stores.postgres:PostgresStore",
}


def _scheme(url: object) -> str:
    """The URL's known scheme, or a SingletonConfigError naming it and the known ones."""
    if not isinstance(url, str) or "://" not in url:
        raise SingletonConfigError(
            f"malformed store URL {redact_url(url) if isinstance(url, str) else url!r}: "
            f"expected scheme://…, one of {sorted(STORE_CLASSES)}"
        )
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as error:
        raise SingletonConfigError(f"malformed store URL {redact_url(url)}: {error}") from None
    if scheme not in STORE_CLASSES:
        raise SingletonConfigError(
            f"unknown store scheme {scheme!r} in {redact_url(url)}; known: {sorted(STORE_CLASSES)}"
        )
    return scheme


def _store_module(scheme: str) -> ModuleType:
    """The store's module: importing it imports its driver, or names the extra that installs it."""
    module_name = STORE_CLASSES[scheme].split(":")[0]
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        extra = "postgres" if scheme.startswith("postgres") else "redis" if "redis" in scheme else scheme
        raise SingletonConfigError(
            f"the {scheme}:// store needs its driver: pip install 'singleton-tasks[{extra}]' ({error})"
        ) from error


def _check_sqlite(url: str) -> None:
    from .sqlite import sqlite_path

    sqlite_path(url)


def _check_redis(url: str) -> None:
    import redis.connection

    from .redis import split_store_options, store_options

    store_options(url, {})  # the store's own options (allow_eviction, wait_replicas, ...)
    redis.connection.parse_url(split_store_options(url)[0])  # type: ignore[no-untyped-call]  # ValueError: a bad port or option


def _check_redis_sentinel(url: str) -> None:
    import redis.connection

    from .redis import split_store_options, store_options
    from .redis_sentinel import parse_sentinel_url

    store_options(url, {})
    redis.connection.parse_url(parse_sentinel_url(split_store_options(url)[0]).node_url)  # type: ignore[no-untyped-call]


def _check_redis_cluster(url: str) -> None:
    from .redis_cluster import cluster_seeds

    cluster_seeds(url)  # ValueError: no host, a bad port, a database other than 0, a bad option


def _check_postgres(url: str) -> None:
    import psycopg.conninfo

    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error as error:
        raise ValueError(str(error)) from None


# Schemes without one port (memory://, several hosts): their own check reads the addresses.
_MULTI_HOST_SCHEMES = ("memory", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")

# Syntax checks that need no connection; schemes without one get the generic checks only.
_URL_CHECKS: dict[str, Callable[[str], None]] = {
    "sqlite": _check_sqlite,
    "redis": _check_redis,
    "rediss": _check_redis,
    "redis+cluster": _check_redis_cluster,
    "rediss+cluster": _check_redis_cluster,
    "redis+sentinel": _check_redis_sentinel,
    "rediss+sentinel": _check_redis_sentinel,
    "postgresql": _check_postgres,
    "postgres": _check_postgres,
}


def check_store_url(url: str) -> str:
    """Check a store URL's scheme, syntax and driver without connecting; returns its scheme.

    Raises :class:`SingletonConfigError` (the URL redacted in its message) for an unknown
    scheme, a malformed URL or a driver that is not installed. Adapters call it when they are
    constructed, so a typo fails at setup rather than at the first run.
    """
    scheme = _scheme(url)
    _store_module(scheme)
    try:
        if scheme not in _MULTI_HOST_SCHEMES:
            urlsplit(url).port  # noqa: B018 - raises ValueError on a port that is not a number
        check = _URL_CHECKS.get(scheme)
        if check is not None:
            check(url)
    except ValueError as error:  # SingletonConfigError is one: its own message is kept
        if isinstance(error, SingletonConfigError):
            raise
        detail = str(error)
        try:
            password = urlsplit(url).password
        except ValueError:
            password = None
        if password and password in detail:  # a driver's message may quote the URL
            detail = detail.replace(password, "***")
        raise SingletonConfigError(f"malformed store URL {redact_url(url)}: {detail}") from None
    return scheme


def store_from_url(url: str, *, namespace: str = "default", **options: Any) -> Store:
    """A store for ``url`` (``memory://``, ``sqlite:///path``, ``redis://…``, ``redis+sentinel://…``,
    ``postgresql://…``)."""
    scheme = _scheme(url)
    module = _store_module(scheme)
    store_class: type[Store] = getattr(module, STORE_CLASSES[scheme].split(":")[1])
    try:
        inspect.signature(store_class).bind(url, namespace=namespace, **options)
    except TypeError as error:
        raise SingletonConfigError(f"unsupported option for the store {redact_url(url)}: {error}") from None
    return store_class(url, namespace=namespace, **options)


__all__ = [
    "SCHEMA_VERSION",
    "STORE_CLASSES",
    "RuleStore",
    "Store",
    "check_store_url",
    "redact_url",
    "store_from_url",
]
