"""``singleton-tasks migrate``: create or upgrade a store's schema, or only check whether one is due."""

from __future__ import annotations

import sys

import click

from ..stores import SCHEMA_VERSION
from ._open import open_store, store_options


@click.command()
@store_options
@click.option(
    "--check",
    is_flag=True,
    help=(
        "Only check: exit 1 when an upgrade is due, 0 when current or when the store has no schema "
        "yet and creates it at first use (SQLite, Redis)."
    ),
)
def migrate(store_url: str | None, namespace: str, check: bool) -> None:
    """Create or upgrade the store's schema (stop singleton starts and drain runs first).

    With --check nothing is created or changed (not even a new SQLite file).
    """
    with open_store(store_url, namespace, create=not check) as store:
        found = store.schema_version()
        if found is not None and found > SCHEMA_VERSION:
            click.echo(
                f"{store.url}: schema version {found} is newer than this library's ({SCHEMA_VERSION}); "
                "upgrade singleton-tasks instead",
                err=True,
            )
            sys.exit(1)
        if check:
            if found == SCHEMA_VERSION:
                click.echo(f"{store.url}: schema version {found} is current")
                return
            if found is None and store.migrates_on_first_use:
                click.echo(
                    f"{store.url}: no schema yet; nothing to migrate: "
                    f"the first worker or producer creates version {SCHEMA_VERSION}"
                )
                return
            if found is None:
                click.echo(
                    f"{store.url}: upgrade due: no schema yet; workers refuse this store until "
                    f"`singleton-tasks migrate` creates version {SCHEMA_VERSION}"
                )
            else:
                click.echo(f"{store.url}: upgrade due: schema version {found} → {SCHEMA_VERSION}")
            sys.exit(1)
        if found == SCHEMA_VERSION:
            click.echo(f"{store.url}: schema version {found} is current; nothing to do")
            return
        store.migrate()
        click.echo(f"{store.url}: schema migrated from version {found} to {store.schema_version()}")
