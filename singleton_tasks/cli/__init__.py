"""The ``singleton-tasks`` command: see keys, holders and waiters; free a stuck slot; drop a
key's waiters; migrate.

Every command takes ``--store URL`` (or ``SINGLETON_TASKS_STORE``; default: the embedded
SQLite store of this host) and ``--namespace`` (or ``SINGLETON_TASKS_NAMESPACE``; default
``default``). Store URLs are only ever shown with their password redacted.

Exit codes: 0 success; 1 the command's answer is "no" (``release`` of an unknown run,
``drop-waiters`` of an unknown key or with a waiter it did not drop, ``migrate --check`` with an
upgrade due, a refused confirmation); 2 usage, configuration or store error (unreachable store,
wrong schema version).

``inspect --json`` prints one JSON document; its format is in ``singleton-tasks inspect --help``
(:data:`JSON_HELP`).
"""

from __future__ import annotations

import getpass
import io
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import click
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ..errors import SingletonError
from ..outcomes import HolderView, KeySnapshot, ReleaseOutcome, RunState, WaiterView, Wake
from ..stores import SCHEMA_VERSION, Store, check_store_url, redact_url, store_from_url
from ..stores.base import check_namespace
from ..stores.choice import STORE_ENV

logger = logging.getLogger("singleton_tasks")

NAMESPACE_ENV = "SINGLETON_TASKS_NAMESPACE"
JSON_FORMAT = 1

F = TypeVar("F", bound=Callable[..., Any])

JSON_HELP = """\
--json prints one JSON document (format 1; times are epoch seconds of the
store's clock, durations are seconds; the store's password is redacted):

\b
{
  "format": 1,
  "store": "redis://user:***@host:6379/0",     # redacted
  "namespace": "default",
  "schema_version": 4,                           # null: the store was never migrated
  "now": 1767225600.0,
  "totals": {"keys": 1, "holders": 1, "waiters": 2},
  "keys": [                                      # sorted by scope, key
    {
      "scope": "tasks.sync_inventory", "key": "store:A", "limit": 1,
      "token": 42,                               # last fencing token handed out
      "holders": [                               # by token
        {"run_id": "…", "token": 42, "admitted_at": …, "heartbeat_at": …,
         "lease_expires_at": …, "lease_age": 3.2,    # seconds since the last heartbeat
         "lease_expired": false,
         "status": "executing"}                  # or "waiting_for_retry"; "phantom": its
      ],                                         # data is lost, release it
      "waiters": [                               # in admission order
        {"run_id": "…", "position": 1, "created_at": …, "waiting": 12.5,
         "state": "gated",                       # "pending" | "gated" | "woken" | "phantom"
         "confirmed": true,                      # false: enqueue not yet confirmed
         "seen_at": …,                           # a live copy of it last reached the store
         "reissue_at": …,                        # owning a slot and unseen by then, the store
                                                 # issues it again (null: never)
         "passed_over": false}                   # always false: no waiter is passed over since
                                                 # schema 4 (kept for readers of this format)
      ]
    }
  ]
}

New fields may be added to this format; existing ones keep their name and meaning."""


class StoreProblem(click.ClickException):
    """A configuration or store error: shown without a traceback, exit code 2."""

    exit_code = 2


def _default_store_url() -> str:
    from ..stores.choice import default_store_url

    return default_store_url()


def _scrub(text: str, url: str) -> str:
    """Belt and braces: no message we print may carry the URL's password, whoever wrote it."""
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        text = text.replace(url, redact_url(url)).replace(password, "***")
    return text


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

    def __init__(self, url: str, namespace: str) -> None:
        self.url = redact_url(url)
        self.namespace = check_namespace(namespace)

    def schema_version(self) -> int | None:
        return None

    def time(self) -> float:
        return time.time()  # a SQLite store's clock is the host's

    def close(self) -> None:
        pass


def _sqlite_file_missing(url: str) -> bool:
    try:
        if check_store_url(url) != "sqlite":
            return False
    except SingletonError:
        return False  # store_from_url reports it
    from ..stores.sqlite import sqlite_path

    path = sqlite_path(url)
    return path != ":memory:" and not os.path.exists(path)


@contextmanager
def open_store(store_url: str | None, namespace: str, *, create: bool = False) -> Iterator[Store]:
    """The store, with every library error turned into a clean, redacted CLI error.

    Unless ``create``, a SQLite file that does not exist is not created: it is shown empty.
    """
    url = store_url or _default_store_url()
    store: Store | None = None
    try:
        if not create and _sqlite_file_missing(url):
            yield cast(Store, _NoFileYet(url, namespace))
            return
        store = store_from_url(url, namespace=namespace)
        yield store
    except SingletonError as error:
        raise StoreProblem(_scrub(str(error), url)) from None
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


def _snapshots(store: Store, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
    if not _has_schema(store):
        return []
    snaps = store.snapshot(scope=scope, key=key)
    return sorted(snaps, key=lambda s: (s.scope, s.key))


# -- inspect ------------------------------------------------------------------------------------


def _holder_status(holder: HolderView) -> str:
    if holder.phantom:
        return "phantom"
    return "executing" if holder.executing else "waiting_for_retry"


def _waiter_state(waiter: WaiterView, now: float) -> str:
    if waiter.phantom:
        return "phantom"
    return waiter.state.value


def inspect_document(store: Store, snaps: Sequence[KeySnapshot], now: float) -> dict[str, Any]:
    """The ``inspect --json`` document (format described in the module docstring)."""
    keys = []
    for snap in snaps:
        keys.append(
            {
                "scope": snap.scope,
                "key": snap.key,
                "limit": snap.limit,
                "token": snap.token,
                "holders": [
                    {
                        "run_id": h.run_id,
                        "token": h.token,
                        "admitted_at": h.admitted_at,
                        "heartbeat_at": h.heartbeat_at,
                        "lease_expires_at": h.lease_expires_at,
                        "lease_age": round(max(0.0, now - h.heartbeat_at), 3),
                        "lease_expired": h.lease_expires_at <= now,
                        "status": _holder_status(h),
                    }
                    for h in snap.holders
                ],
                "waiters": [
                    {
                        "run_id": w.run_id,
                        "position": w.position,
                        "created_at": w.created_at,
                        "waiting": round(max(0.0, now - w.created_at), 3),
                        "state": "phantom" if w.phantom else w.state.value,
                        "confirmed": w.confirmed,
                        "seen_at": w.seen_at,
                        "reissue_at": w.reissue_at,
                        "passed_over": False,
                    }
                    for w in snap.waiters
                ],
            }
        )
    return {
        "format": JSON_FORMAT,
        "store": store.url,
        "namespace": store.namespace,
        "schema_version": store.schema_version(),
        "now": now,
        "totals": {
            "keys": len(snaps),
            "holders": sum(len(s.holders) for s in snaps),
            "waiters": sum(len(s.waiters) for s in snaps),
        },
        "keys": keys,
    }


def _clock_time(ts: float, now: float | None = None) -> str:
    """Local wall time; the date only when it is not the same day as ``now``."""
    moment = datetime.fromtimestamp(ts)
    if now is not None and moment.date() == datetime.fromtimestamp(now).date():
        return moment.strftime("%H:%M:%S")
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _seconds(value: float) -> str:
    value = max(0.0, value)
    if value < 60:
        return f"{value:.1f}s"
    if value < 3600:
        return f"{int(value // 60)}m{int(value % 60):02d}s"
    return f"{int(value // 3600)}h{int(value % 3600 // 60):02d}m"


def _title(snap: KeySnapshot) -> str:
    return (
        f"{snap.scope} · {snap.key}   slots {len(snap.holders)}/{snap.limit}   "
        f"waiters {len(snap.waiters)}   token {snap.token}"
    )


def _rows(snap: KeySnapshot, now: float) -> list[tuple[str, str, str, str, str, str]]:
    """(position, run id, token, since, age, state) of the key's holders, then its waiters."""
    rows = []
    for h in snap.holders:
        state = "executing" if h.executing else "waiting for retry"
        if h.phantom:
            state = "phantom: its data is lost, release it"
        elif h.lease_expires_at <= now:
            state += " (lease lapsed)"
        since = _clock_time(h.admitted_at, now)
        rows.append(
            ("holder", h.run_id, str(h.token), since, f"lease {_seconds(now - h.heartbeat_at)}", state)
        )
    for w in snap.waiters:
        state = _waiter_state(w, now) + ("" if w.confirmed or w.phantom else ", unconfirmed")
        rows.append(
            (
                str(w.position),
                w.run_id,
                "",
                _clock_time(w.created_at, now),
                _seconds(now - w.created_at),
                state,
            )
        )
    return rows


def _key_table(snap: KeySnapshot, now: float, *, since: bool = True) -> Table:
    """One key's holders and waiters as a table; columns are never cut to an ellipsis."""
    table = Table(title=_title(snap), title_justify="left", box=None, padding=(0, 1), pad_edge=False)
    table.add_column("#", justify="right", no_wrap=True, header_style="bold")
    table.add_column("run id", no_wrap=True, header_style="bold")
    table.add_column("token", justify="right", no_wrap=True, header_style="bold")
    if since:
        table.add_column("since", no_wrap=True, header_style="bold")
    table.add_column("age", justify="right", no_wrap=True, header_style="bold")
    table.add_column("state", min_width=9, header_style="bold")  # wraps between words
    for position, run_id, token, since_at, age, state in _rows(snap, now):
        table.add_row(position, run_id, token, *([since_at] if since else []), age, state)
    return table


def _key_lines(snap: KeySnapshot, now: float) -> RenderableType:
    """One key for a terminal too narrow for its table: each run's id on a line of its own."""
    lines: list[RenderableType] = [Text(_title(snap), style="italic")]
    for position, run_id, token, _since, age, state in _rows(snap, now):
        lines.append(Text(f"{position:>6} {run_id}"))
        details = ([f"token {token}"] if token else []) + [age, state]
        lines.append(Text("       " + " · ".join(details), style="dim"))
    return Group(*lines)


def _widths(renderable: RenderableType) -> Measurement:
    """The narrowest width a renderable can take (its wrappable cells wrapped) and its natural one."""
    console = Console(width=10_000)
    return Measurement.get(console, console.options, renderable)


def inspect_renderable(
    store: Store, snaps: Sequence[KeySnapshot], now: float, width: int | None = None
) -> RenderableType:
    """The ``inspect`` view. Narrower than a key's table (``width``), the table drops its "since"
    column (the age says as much) and wraps its states; narrower still, the key is listed one run
    per line. Run ids are never cut."""
    parts: list[RenderableType] = [Text(f"store {store.url}  namespace {store.namespace}", style="dim")]
    for snap in snaps:
        view: RenderableType = _key_table(snap, now)
        if width is not None and _widths(view).maximum > width:
            view = _key_table(snap, now, since=False)
            if _widths(view).minimum + 2 > width:  # a margin: rich measures wrapped cells tightly
                view = _key_lines(snap, now)
        parts.append(view)
    holders = sum(len(s.holders) for s in snaps)
    waiters = sum(len(s.waiters) for s in snaps)
    parts.append(Text(f"{len(snaps)} keys, {holders} holders, {waiters} waiters"))
    if store.schema_version() is None:
        parts.append(Text("(this store has no schema yet: nothing has used it)", style="dim"))
    return Group(*parts)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="singleton-tasks")
def cli() -> None:
    """Operate singleton-tasks: see keys, holders and waiters; free a stuck slot; drop a key's
    waiters; migrate a store."""


@cli.command(epilog=JSON_HELP)
@store_options
@click.option("--scope", default=None, help="Only keys of this scope (default: a task's name).")
@click.option("--key", default=None, help="Only this key.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print a JSON document (format 1, described below).",
)
def inspect(store_url: str | None, namespace: str, scope: str | None, key: str | None, as_json: bool) -> None:
    """Keys with their holders (token, lease age) and waiters in admission order.

    The table fits the terminal: narrow, it drops the "since" column, then lists one run per line.
    """
    with open_store(store_url, namespace) as store:
        snaps = _snapshots(store, scope=scope, key=key)
        now = store.time()  # ages and leases are the store's: its clock decides them
        if as_json:
            click.echo(json.dumps(inspect_document(store, snaps, now), indent=2))
        else:
            console = Console(soft_wrap=False)
            console.print(inspect_renderable(store, snaps, now, width=console.width))


# -- release ------------------------------------------------------------------------------------


def _find_run(
    snaps: Sequence[KeySnapshot], run_id: str
) -> tuple[KeySnapshot, HolderView | WaiterView] | None:
    for snap in snaps:
        runs: tuple[HolderView | WaiterView, ...] = (*snap.holders, *snap.waiters)
        for run in runs:
            if run.run_id == run_id:
                return snap, run
    return None


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (containers without a passwd entry)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _describe(run: HolderView | WaiterView) -> str:
    if isinstance(run, HolderView):
        return f"holder (token {run.token}, {'executing' if run.executing else 'waiting for retry'})"
    return f"waiter (position {run.position}, {run.state.value})"


def _confirm_and_broker_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--yes`` and ``--broker`` of the commands that settle runs (``release``, ``drop-waiters``)."""
    command = click.option(
        "--broker",
        "broker_url",
        default=None,
        metavar="URL",
        help="Dramatiq broker (redis://… or amqp://…) to publish the woken waiters' messages on at once.",
    )(command)
    return click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")(command)


@cli.command()
@store_options
@click.argument("run_id")
@_confirm_and_broker_options
def release(store_url: str | None, namespace: str, run_id: str, yes: bool, broker_url: str | None) -> None:
    """Operator override: free RUN_ID's slot (or place in line) and name who is next.

    Use it for a holder stuck with orphan_timeout=None or a worker known dead. If the run is
    still executing somewhere, its body keeps running without a slot: its fencing token is
    what lets downstream systems reject its writes.

    Waking: the store names the gated waiters that now own the slot. Without --broker their
    wake messages are not published (only the framework can), and a woken waiter is admitted
    when its deferred copy comes due: about a second later at the head of the line. With a
    Dramatiq --broker, the wakes are published at once.
    """
    with _broker(broker_url) as broker, open_store(store_url, namespace) as store:
        found = _find_run(_snapshots(store), run_id)
        if found is None:
            click.echo(
                f"run {run_id} is not registered in {store.url} (namespace {store.namespace})", err=True
            )
            sys.exit(1)
        snap, run = found
        what = f"run {run_id}: {_describe(run)} of key {snap.key!r} (scope {snap.scope!r})"
        if not yes and not click.confirm(f"Release {what}?", default=False):
            click.echo("not released", err=True)
            sys.exit(1)
        outcome = store.operator_release(run_id)
        if outcome is None or not outcome.released:
            click.echo(f"run {run_id} settled meanwhile: nothing released", err=True)
            sys.exit(1)
        logger.warning(
            "operator release by %s: %s in %s namespace %r; woke %s",
            _who(),
            what,
            store.url,
            store.namespace,
            [w.run_id for w in outcome.wakes] or "nobody",
        )
        click.echo(f"released {what}")
        _report_next(store, snap, outcome, published=_publish_wakes(broker, broker_url, outcome.wakes))


def _report_wakes(wakes: Sequence[Wake], evicted: Sequence[str], published: set[str]) -> None:
    for wake in wakes:
        how = (
            "its wake message was published"
            if wake.run_id in published
            else "its deferred copy admits it when due (about a second at the head of the line)"
        )
        click.echo(
            f"woke {wake.run_id} (generation {wake.generation}): "
            f"it owns a free slot of key {wake.key!r}; {how}"
        )
    for run_id in evicted:
        click.echo(f"evicted orphaned holder {run_id}")


def _report_next(store: Store, snap: KeySnapshot, outcome: ReleaseOutcome, published: set[str]) -> None:
    _report_wakes(outcome.wakes, outcome.evicted, published)
    if not outcome.wakes:
        after = store.snapshot(scope=snap.scope, key=snap.key)
        waiters = after[0].waiters if after else ()
        if waiters:
            head = waiters[0]
            click.echo(f"next in line: {head.run_id} ({head.state.value}); admitted when it is delivered")
        else:
            click.echo(f"no waiters left on key {snap.key!r}")


def _dramatiq_broker(url: str) -> Any:
    """A bare Dramatiq broker (no middleware: the wake is published as the adapter would)."""
    scheme = url.split("://", 1)[0].lower()
    try:
        if scheme in ("redis", "rediss"):
            from dramatiq.brokers.redis import RedisBroker

            return RedisBroker(url=url, middleware=[])  # type: ignore[no-untyped-call]
        if scheme in ("amqp", "amqps"):
            from dramatiq.brokers.rabbitmq import RabbitmqBroker

            return RabbitmqBroker(url=url, middleware=[])
    except ImportError as error:
        raise StoreProblem(f"--broker needs dramatiq and its broker's driver installed ({error})") from None
    raise StoreProblem(f"--broker {redact_url(url)}: expected a redis://… or amqp://… Dramatiq broker URL")


@contextmanager
def _broker(url: str | None) -> Iterator[Any]:
    """The ``--broker`` of a command, made before the store is touched (a wrong URL changes
    nothing) and closed however the command ends; None without ``--broker``."""
    if url is None:
        yield None
        return
    broker = _dramatiq_broker(url)
    try:
        yield broker
    finally:
        broker.close()


def _publish_wakes(broker: Any, broker_url: str | None, wakes: Sequence[Wake]) -> set[str]:
    """Publish the wakes on a Dramatiq broker; a failure leaves them to their deferred copies."""
    published: set[str] = set()
    if broker is None or broker_url is None:
        return published
    from ..dramatiq import wake_message

    try:
        for wake in wakes:
            if wake.payload is None:
                continue
            try:
                message = wake_message(broker, wake)
            except Exception:  # a Celery payload, or another format: not ours to publish
                click.echo(f"cannot publish the wake of {wake.run_id}: not a Dramatiq message", err=True)
                continue
            broker.enqueue(message)
            published.add(wake.run_id)
    except Exception as error:
        detail = _scrub(f"{type(error).__name__}: {error}", broker_url)
        click.echo(f"publishing wakes on {redact_url(broker_url)} failed ({detail})", err=True)
    return published


# -- drop-waiters ---------------------------------------------------------------------------------


def _one_key(store: Store, scope: str | None, key: str) -> KeySnapshot | None:
    """The key to act on; a usage error when several scopes use it and none was chosen."""
    snaps = _snapshots(store, scope=scope, key=key)
    if len(snaps) > 1:
        scopes = ", ".join(repr(s.scope) for s in snaps)
        raise click.UsageError(f"key {key!r} is used by several scopes ({scopes}): choose one with --scope")
    return snaps[0] if snaps else None


@cli.command("drop-waiters")
@store_options
@click.option("--key", required=True, help="The key whose waiters to drop.")
@click.option(
    "--scope", default=None, help="The key's scope (default: a task's name); needed if several use the key."
)
@_confirm_and_broker_options
def drop_waiters(
    store_url: str | None, namespace: str, key: str, scope: str | None, yes: bool, broker_url: str | None
) -> None:
    """Cancel every run waiting on KEY; its holders keep their slots.

    Purging a broker queue does not cancel singleton runs: the store keeps them in line and
    re-issues their copies. This settles each listed waiter in the store, as `release` would;
    a waiter admitted meanwhile by a copy of it is left alone (it settles where it runs).

    Exit code 0 when every listed waiter was dropped (or the key had none), 1 when one was
    not (admitted or settled meanwhile), the key is unknown or the confirmation is refused.
    """
    with _broker(broker_url) as broker, open_store(store_url, namespace) as store:
        snap = _one_key(store, scope, key)
        where = f"in {store.url} (namespace {store.namespace})"
        if snap is None:
            scoped = f" of scope {scope!r}" if scope is not None else ""
            click.echo(f"key {key!r}{scoped} has no holders or waiters {where}", err=True)
            sys.exit(1)
        what = f"key {snap.key!r} (scope {snap.scope!r})"
        if not snap.waiters:
            click.echo(f"{what} has no waiters: nothing to drop")
            return
        now = store.time()
        click.echo(
            f"{what} {where}: waiters to drop {len(snap.waiters)}, holders left alone {len(snap.holders)}"
        )
        for w in snap.waiters:
            click.echo(f"{w.position:>6}  {w.run_id}  {_waiter_state(w, now)}")
        if not yes and not click.confirm(f"Drop these {len(snap.waiters)} waiters?", default=False):
            click.echo("nothing dropped", err=True)
            sys.exit(1)
        who = _who()
        dropped: set[str] = set()
        wakes: dict[str, Wake] = {}
        evicted: list[str] = []
        # Back to front: dropping a waiter never makes one behind it own a slot, so no listed
        # waiter is woken (and admitted by its wake) by this command's own drops.
        for w in reversed(snap.waiters):
            outcome = store.release(snap.scope, snap.key, w.run_id, token=None, waiting_only=True)
            wakes.update((wake.run_id, wake) for wake in outcome.wakes)
            evicted.extend(outcome.evicted)
            if outcome.released:
                dropped.add(w.run_id)
                logger.warning(
                    "operator drop of a waiter by %s: run %s (position %d) of %s in %s namespace %r",
                    who,
                    w.run_id,
                    w.position,
                    what,
                    store.url,
                    store.namespace,
                )
        after = _one_key(store, snap.scope, snap.key)
        holding = {h.run_id for h in after.holders} if after else set()
        waiting = {w.run_id for w in after.waiters} if after else set()
        for w in snap.waiters:
            if w.run_id in dropped:
                click.echo(f"dropped {w.run_id} (position {w.position})")
            elif w.run_id in holding:
                click.echo(f"{w.run_id}: admitted meanwhile, left (it settles where it runs)")
            elif w.run_id in waiting:
                click.echo(f"{w.run_id}: still waiting, not dropped (try `release {w.run_id}`)")
            else:
                click.echo(f"{w.run_id}: settled meanwhile")
        woken = [wake for run_id, wake in wakes.items() if run_id not in dropped]
        _report_wakes(woken, evicted, published=_publish_wakes(broker, broker_url, woken))
        click.echo(
            f"dropped {len(dropped)} of {len(snap.waiters)} waiters of {what}; {len(waiting)} waiting now"
        )
        if len(dropped) < len(snap.waiters):
            sys.exit(1)


# -- top ------------------------------------------------------------------------------------------


@dataclass
class TopState:
    """What one frame remembers for the next: the admissions seen, to count handoffs between frames."""

    admissions: set[tuple[str, str, int]] = field(default_factory=set)
    at: float | None = None
    rate: float | None = None

    def advance(self, snaps: Sequence[KeySnapshot], now: float) -> float | None:
        """Handoffs per second since the previous frame (admissions = holders with a new token).

        Tokens come from the store clock, so their values do not count admissions: a holder
        with a token not seen in the previous frame does. A run admitted and settled between
        two frames, or a key first seen, is not counted.
        """
        admissions = {(s.scope, s.key, h.token) for s in snaps for h in s.holders}
        if self.at is not None and now > self.at:
            seen_keys = {(scope, key) for scope, key, _token in self.admissions}
            new = [a for a in admissions - self.admissions if (a[0], a[1]) in seen_keys]
            self.rate = len(new) / (now - self.at)
        self.admissions, self.at = admissions, now
        return self.rate


_WAITER_GLYPH = {RunState.PENDING: "○", RunState.GATED: "●", RunState.WOKEN: "◉"}
MAX_GLYPHS = 40


def _lane_name(snap: KeySnapshot) -> str:
    return f"{snap.scope} · {snap.key}"


def _lane(snap: KeySnapshot, now: float, name_width: int = 36) -> Text:
    lane = Text(no_wrap=True, overflow="ellipsis")  # one key, one line, however narrow the terminal
    lane.append(_lane_name(snap)[:name_width].ljust(name_width) + " ", style="bold")
    lane.append("[")
    for i in range(max(snap.limit, len(snap.holders))):
        if i < len(snap.holders):
            holder = snap.holders[i]
            lane.append(
                "■" if holder.executing else "□", style="green" if holder.lease_expires_at > now else "red"
            )
        else:
            lane.append("·", style="dim")
    lane.append("] ")
    for waiter in snap.waiters[:MAX_GLYPHS]:
        lane.append(_WAITER_GLYPH.get(waiter.state, "?"), style="yellow")
    if len(snap.waiters) > MAX_GLYPHS:
        lane.append(f" +{len(snap.waiters) - MAX_GLYPHS}", style="yellow")
    lane.append(f"  {len(snap.holders)}/{snap.limit} held, {len(snap.waiters)} waiting")
    if snap.waiters:
        oldest = max(now - w.created_at for w in snap.waiters)
        lane.append(f", oldest {_seconds(oldest)}", style="yellow" if oldest < 60 else "red")
    lane.append(f"  token {snap.token}", style="dim")
    return lane


def top_renderable(
    store: Store, snaps: Sequence[KeySnapshot], now: float, rate: float | None
) -> RenderableType:
    holders = sum(len(s.holders) for s in snaps)
    waiters = sum(len(s.waiters) for s in snaps)
    summary = Text(
        f"keys {len(snaps)}  holders {holders}  waiters {waiters}  handoffs/s "
        + ("–" if rate is None else f"{rate:.1f}"),
        style="bold",
    )
    header = Text(
        f"singleton-tasks top · {store.url} · namespace {store.namespace} · {_clock_time(now)}",
        style="dim",
        no_wrap=True,
        overflow="ellipsis",
    )
    legend = Text("■ executing  □ waiting for retry  · free slot   ○ pending  ● gated  ◉ woken", style="dim")
    name_width = min(60, max((len(_lane_name(s)) for s in snaps), default=0))
    lanes: list[RenderableType] = [_lane(s, now, name_width) for s in snaps]
    if not lanes:
        lanes.append(Text("no keys with holders or waiters"))
    return Group(header, legend, *lanes, summary)


def top_frame(store: Store, state: TopState | None = None, *, now: float | None = None) -> RenderableType:
    """One frame of ``top`` for ``store``; pass the same ``state`` to rate handoffs across frames."""
    state = state or TopState()
    snaps = _snapshots(store)
    now = store.time() if now is None else now
    rate = state.advance(snaps, now)
    return top_renderable(store, snaps, now, rate)


def render_text(renderable: RenderableType, width: int = 160) -> str:
    """A renderable as plain text (no colours): for tests and for ``--once`` without a terminal."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False, soft_wrap=False).print(
        renderable
    )
    return buffer.getvalue()


def render_top_frame(
    store: Store, state: TopState | None = None, *, now: float | None = None, width: int = 160
) -> str:
    """One ``top`` frame as plain text."""
    return render_text(top_frame(store, state, now=now), width=width)


@cli.command()
@store_options
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between refreshes.",
)
@click.option("--once", is_flag=True, help="Render one frame and exit.")
def top(store_url: str | None, namespace: str, interval: float, once: bool) -> None:
    """A live view: one lane per key, holders as slots, waiters queued behind them."""
    from rich.live import Live

    with open_store(store_url, namespace) as store:
        state = TopState()
        if once:
            Console(soft_wrap=False).print(top_frame(store, state))
            return
        try:
            with Live(top_frame(store, state), auto_refresh=False, screen=False) as live:
                while True:
                    # The refresh cadence of an interactive view, not a wait for a store event.
                    time.sleep(interval)
                    live.update(top_frame(store, state), refresh=True)
        except KeyboardInterrupt:
            pass


# -- migrate ------------------------------------------------------------------------------------


@cli.command()
@store_options
@click.option("--check", is_flag=True, help="Only check: exit 1 when an upgrade is due, 0 when current.")
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
            click.echo(f"{store.url}: upgrade due: schema version {found} → {SCHEMA_VERSION}")
            sys.exit(1)
        if found == SCHEMA_VERSION:
            click.echo(f"{store.url}: schema version {found} is current; nothing to do")
            return
        store.migrate()
        click.echo(f"{store.url}: schema migrated from version {found} to {store.schema_version()}")


@cli.command()
@click.option(
    "--framework",
    type=click.Choice(["dramatiq", "celery"]),
    default=None,
    help="Run it on this framework (default: Dramatiq if it is installed, else Celery).",
)
def demo(framework: str | None) -> None:
    """The sync-inventory story on the embedded SQLite store: no server needed (~3 s)."""
    from .demo import DemoUnavailable, run_demo

    try:
        run_demo(Console(), framework=framework)
    except DemoUnavailable as error:
        raise StoreProblem(str(error)) from None


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cli.main(args=list(argv) if argv is not None else None, prog_name="singleton-tasks")
