"""Stores, chosen by URL scheme (SPEC §8)."""

from __future__ import annotations

import importlib
import inspect
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
    "postgresql": "singleton_tasks.stores.postgres:PostgresStore",
    "postgres": "singleton_tasks.stores.postgres:PostgresStore",
}


def store_from_url(url: str, *, namespace: str = "default", **options: Any) -> Store:
    """A store for ``url`` (``memory://``, ``sqlite:///path``, ``redis://…``, ``postgresql://…``)."""
    if not isinstance(url, str) or "://" not in url:
        raise SingletonConfigError(
            f"malformed store URL {redact_url(url) if isinstance(url, str) else url!r}: "
            f"expected scheme://…, one of {sorted(STORE_CLASSES)}"
        )
    try:
        scheme = urlsplit(url).scheme.lower()
    except ValueError as error:
        raise SingletonConfigError(f"malformed store URL {redact_url(url)}: {error}") from None
    target = STORE_CLASSES.get(scheme)
    if target is None:
        raise SingletonConfigError(
            f"unknown store scheme {scheme!r} in {redact_url(url)}; known: {sorted(STORE_CLASSES)}"
        )
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        extra = {"redis": "redis", "rediss": "redis", "postgresql": "postgres", "postgres": "postgres"}
        raise SingletonConfigError(
            f"the {scheme}:// store needs its driver: "
            f"pip install 'singleton-tasks[{extra.get(scheme, scheme)}]' ({error})"
        ) from error
    store_class: type[Store] = getattr(module, class_name)
    try:
        inspect.signature(store_class).bind(url, namespace=namespace, **options)
    except TypeError as error:
        raise SingletonConfigError(f"unsupported option for the store {redact_url(url)}: {error}") from None
    return store_class(url, namespace=namespace, **options)


__all__ = ["SCHEMA_VERSION", "STORE_CLASSES", "RuleStore", "Store", "redact_url", "store_from_url"]
