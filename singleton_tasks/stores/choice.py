"""Which store a process uses: ``store=`` → ``SINGLETON_TASKS_STORE`` → the embedded default.

Also what a process checks of the store it chose before its first operation: the schema, created
there and then only by a store class that declares it may be (:attr:`Store.migrates_on_first_use`).
"""

from __future__ import annotations

import os
import tempfile
import warnings

from ..errors import SingletonConfigError
from . import check_store_url
from .base import Store

#: The environment variable naming the store when no ``store=`` is given (adapters and CLI).
STORE_ENV = "SINGLETON_TASKS_STORE"
_default_warned = False


def default_store_url() -> str:
    """The embedded default: a SQLite file shared by every process of this host."""
    return f"sqlite:///{os.path.join(tempfile.gettempdir(), 'singleton-tasks.db')}"


def resolve_store_url(store: str | None) -> str:
    """``store`` → ``SINGLETON_TASKS_STORE`` → the embedded default, with a one-time warning."""
    global _default_warned
    if store:
        return store
    from_env = os.environ.get(STORE_ENV)
    if from_env:
        return from_env
    if not _default_warned:
        _default_warned = True
        warnings.warn(
            "singleton-tasks: no store configured; using the embedded SQLite default "
            f"({default_store_url()}), which serializes runs only on this host. "
            f"Pass store=... or set {STORE_ENV} (redis://… or postgresql://…) for several hosts.",
            stacklevel=3,
        )
    return default_store_url()


def check_store_argument(store: object) -> None:
    """Check an adapter's ``store`` argument at construction, without connecting (docs/deployment.md).

    A URL's scheme, syntax and driver are checked; without a store, the URL in
    ``SINGLETON_TASKS_STORE`` if it is set. Anything else is a :class:`SingletonConfigError`.
    """
    if isinstance(store, Store):
        return
    if store is None:
        from_env = os.environ.get(STORE_ENV)
        if from_env:
            check_store_url(from_env)
        return
    if not isinstance(store, str):
        raise SingletonConfigError(f"store must be a store URL or a Store, got {type(store).__name__}")
    check_store_url(store)


def ensure_schema(store: Store) -> None:
    """Create a missing schema where the store's class allows it at first use; then check it.

    Embedded and self-contained stores (:attr:`Store.migrates_on_first_use`) create theirs on
    first use; the others must be migrated by an operator (``singleton-tasks migrate``).
    """
    if store.schema_version() is None and store.migrates_on_first_use:
        store.migrate()
    store.check_schema()
