"""Opening the store a command names (``--store``, ``--namespace``), its errors shown clean and redacted.

A SQLite file that does not exist is shown empty (with a note on stderr) rather than created,
unless the command creates (``migrate``); a SQLite path whose directory does not exist is an
error; a store never migrated reads as having no keys.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import click

from ..errors import SingletonError
from ..outcomes import KeySnapshot
from ..stores import Store, check_store_url, redact_url, store_from_url
from ..stores.base import check_namespace, scrub_secrets
from ..stores.choice import STORE_ENV, default_store_url
from ..stores.sqlite import SQLiteStore, sqlite_path

NAMESPACE_ENV = "SINGLETON_TASKS_NAMESPACE"

F = TypeVar("F", bound=Callable[..., Any])


class StoreProblem(click.ClickException):
    """A configuration or store error: shown without a traceback, exit code 2."""

    exit_code = 2


def store_options(func: F) -> F:
    """``--store`` and ``--namespace``, shared by every command."""
    func = click.option(
        "--namespace",
        envvar=NAMESPACE_ENV,
        default="default",
        show_default=True,
        help=f"Store namespace of the application [env {NAMESPACE_ENV}].",
    )(func)
    func = click.option(
        "--store",
        "store_url",
        envvar=STORE_ENV,
        default=None,
        metavar="URL",
        help=(
            f"Store URL: sqlite:///path.db, redis://…, postgresql://…, memory://name [env {STORE_ENV}; "
            "default: the embedded SQLite store of this host]."
        ),
    )(func)
    return func


class _NoFileYet:
    """A SQLite store whose file does not exist, as the commands that only read see it: empty.

    Opening it would create the file (and its WAL): ``inspect``, ``top``, ``release`` and
    ``migrate --check`` leave the host as they found it.
    """

    migrates_on_first_use = SQLiteStore.migrates_on_first_use  # as the store that would open it

    def __init__(self, url: str, namespace: str) -> None:
        self.url = redact_url(url)
        self.namespace = check_namespace(namespace)

    def schema_version(self) -> int | None:
        return None

    def time(self) -> float:
        return time.time()  # a SQLite store's clock is the host's

    def close(self) -> None:
        pass


def _sqlite_path(url: str) -> str | None:
    """The database path of a SQLite URL; None for another store, an in-memory one or a bad URL."""
    try:
        if check_store_url(url) != "sqlite":
            return None
    except SingletonError:
        return None  # store_from_url reports it
    path = sqlite_path(url)
    return None if path == ":memory:" else path


@contextmanager
def open_store(store_url: str | None, namespace: str, *, create: bool = False) -> Iterator[Store]:
    """The store, with every library error turned into a clean, redacted CLI error.

    A SQLite path whose directory does not exist is an error (a mistyped path). Unless
    ``create``, a SQLite file that does not exist is not created: it is shown empty, with a note.
    """
    url = store_url or default_store_url()
    path = _sqlite_path(url)
    absolute = None if path is None else os.path.abspath(path)
    if path is not None and absolute is not None:
        directory = os.path.dirname(absolute)
        if not os.path.isdir(directory):
            raise StoreProblem(
                f"{redact_url(url)}: no SQLite database at {path!r}: the directory {directory!r} "
                "does not exist (a mistyped path?)"
            )
    store: Store | None = None
    try:
        if not create and absolute is not None and not os.path.exists(absolute):
            click.echo(
                f"note: no SQLite file at {absolute!r} yet (nothing has used this store): shown empty",
                err=True,
            )
            yield cast(Store, _NoFileYet(url, namespace))
            return
        store = store_from_url(url, namespace=namespace)
        yield store
    except SingletonError as error:
        raise StoreProblem(scrub_secrets(str(error), url)) from None
    finally:
        if store is not None:
            try:
                store.close()
            except SingletonError:
                pass


def _has_schema(store: Store) -> bool:
    """False on a store never migrated (nothing can be registered there yet); error on a mismatch."""
    if store.schema_version() is None:
        return False
    store.check_schema()
    return True


def snapshots(store: Store, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
    """The store's keys with holders or waiters, sorted by scope and key (none before a migration)."""
    if not _has_schema(store):
        return []
    snaps = store.snapshot(scope=scope, key=key)
    return sorted(snaps, key=lambda s: (s.scope, s.key))
