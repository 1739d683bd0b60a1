"""Stores, chosen by URL scheme (docs/deployment.md#choosing-a-store)."""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import Any
from urllib.parse import urlsplit

from ..errors import SingletonConfigError
from .base import SCHEMA_VERSION, RuleStore, Store, redact_url, scrub_secrets, url_retention

# The store classes, in the order a scheme is looked for: each class declares its own schemes,
# drivers and extra (Store.schemes / .drivers / .extra). A store's module imports its driver only
# if it is installed, so a lookup imports the modules up to the one serving the scheme (memory://
# imports no driver) and an unknown scheme imports them all to name the known ones.
_STORES = (
    "memory:MemoryStore",
    "sqlite:SQLiteStore",
    "postgres:PostgresStore",
    "redis:RedisStore",
    "redis_sentinel:RedisSentinelStore",
    "redis_cluster:RedisClusterStore",
)
_found: dict[str, type[Store]] = {}
_imported = 0  # how many of _STORES have been imported into _found
_lock = threading.Lock()


def _store_class(scheme: str | None) -> type[Store] | None:
    """The class serving ``scheme`` (None: not known); with None, import every store class."""
    global _imported
    with _lock:
        while scheme not in _found and _imported < len(_STORES):
            module_name, class_name = _STORES[_imported].split(":")
            module = importlib.import_module(f"{__name__}.{module_name}")
            store_class: type[Store] = getattr(module, class_name)
            for served in store_class.schemes:
                _found.setdefault(served, store_class)
            _imported += 1
    return _found.get(scheme) if scheme is not None else None


def store_classes() -> dict[str, type[Store]]:
    """Every known scheme and the store class serving it (imports every store module)."""
    _store_class(None)
    return dict(_found)


def _class_for(url: object) -> type[Store]:
    """The class serving the URL's scheme, or a SingletonConfigError naming it and the known ones."""
    if not isinstance(url, str) or "://" not in url:
        raise SingletonConfigError(
            f"malformed store URL {redact_url(url) if isinstance(url, str) else url!r}: "
            f"expected scheme://…, one of {sorted(store_classes())}"
        )
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as error:
        raise SingletonConfigError(f"malformed store URL {redact_url(url)}: {error}") from None
    store_class = _store_class(scheme)
    if store_class is None:
        raise SingletonConfigError(
            f"unknown store scheme {scheme!r} in {redact_url(url)}; known: {sorted(store_classes())}"
        )
    store_class.check_drivers(scheme)
    return store_class


def check_store_url(url: str) -> str:
    """Check a store URL's scheme, syntax and driver without connecting; returns its scheme.

    Raises :class:`SingletonConfigError` (the URL redacted in its message) for an unknown
    scheme, a malformed URL, a bad ``?retention=`` or a driver that is not installed. Adapters
    call it when they are constructed, so a typo fails at setup rather than at the first run.
    """
    store_class = _class_for(url)
    url_retention(url)  # ?retention= is every scheme's, checked whatever the class
    try:
        store_class.check_url(url)
    except ValueError as error:  # SingletonConfigError is one: its own message is kept
        if isinstance(error, SingletonConfigError):
            raise
        detail = scrub_secrets(str(error), url)  # a driver's message may quote the URL
        raise SingletonConfigError(f"malformed store URL {redact_url(url)}: {detail}") from None
    return urlsplit(url).scheme.lower()


def store_from_url(url: str, *, namespace: str = "default", **options: Any) -> Store:
    """A store for ``url`` (``memory://``, ``sqlite:///path``, ``redis://…``, ``redis+sentinel://…``,
    ``postgresql://…``)."""
    store_class = _class_for(url)
    try:
        inspect.signature(store_class).bind(url, namespace=namespace, **options)
    except TypeError as error:
        raise SingletonConfigError(f"unsupported option for the store {redact_url(url)}: {error}") from None
    return store_class(url, namespace=namespace, **options)


__all__ = [
    "SCHEMA_VERSION",
    "RuleStore",
    "Store",
    "check_store_url",
    "redact_url",
    "store_classes",
    "store_from_url",
]
