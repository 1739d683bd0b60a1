"""The ``singleton-tasks`` command group and its entry point (:func:`main`); each command is its own module.

The command sees keys, holders and waiters; frees a stuck slot; drops a key's waiters; migrates.

Every command takes ``--store URL`` (or ``SINGLETON_TASKS_STORE``; default: the embedded
SQLite store of this host) and ``--namespace`` (or ``SINGLETON_TASKS_NAMESPACE``; default
``default``). Store URLs are only ever shown with their password redacted.

Exit codes: 0 success; 1 the command's answer is "no" (``release`` of an unknown run,
``drop-waiters`` of an unknown key or with a waiter it did not drop, ``migrate --check`` with an
upgrade due, a refused confirmation); 2 usage, configuration or store error (unreachable store,
wrong schema version).

``inspect --json`` prints one JSON document; its format is in ``singleton-tasks inspect --help``
(:data:`singleton_tasks.cli.inspect.JSON_HELP`).

The commands are the modules ``inspect``, ``release``, ``drop_waiters``, ``top``, ``migrate``,
``demo`` and ``web``; they share ``_open`` (the store), ``_format`` (times and text) and ``_settling``
(``--yes``, ``--broker``). This module adds them to the group, so none of them imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import click

from . import demo, drop_waiters, inspect, migrate, release, top, web


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="singleton-tasks")
def cli() -> None:
    """Operate singleton-tasks: see keys, holders and waiters; free a stuck slot; drop a key's
    waiters; migrate a store."""


for _command in (
    inspect.inspect,
    release.release,
    drop_waiters.drop_waiters,
    top.top,
    migrate.migrate,
    demo.demo,
    web.web,
):
    cli.add_command(_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cli.main(args=list(argv) if argv is not None else None, prog_name="singleton-tasks")
