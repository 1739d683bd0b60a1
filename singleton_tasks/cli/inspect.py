"""``singleton-tasks inspect``: keys with their holders and waiters, as tables or one JSON document."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import click
from rich.console import Console, Group, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from ..outcomes import HolderView, KeySnapshot
from ..stores import Store
from ._format import clock_time, seconds, waiter_state
from ._open import open_store, snapshots, store_options

JSON_FORMAT = 1

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
      "token": 1767279283512300,                 # last fencing token handed out
      "holders": [                               # by token
        {"run_id": "…", "token": 1767279283512300, "admitted_at": …, "heartbeat_at": …,
         "lease_expires_at": …, "lease_age": 3.2,    # seconds since the last heartbeat
         "lease_expired": false,
         "status": "executing",                  # or "waiting_for_retry"; "phantom": its
                                                 # data is lost, release it
         "payload_bytes": null,                  # a holder keeps no message to issue again
         "live_generations": [0]}                # its copies whose delivery may act
      ],
      "waiters": [                               # in admission order
        {"run_id": "…", "position": 1, "created_at": …, "waiting": 12.5,
         "state": "gated",                       # "pending" | "gated" | "woken" | "phantom"
         "confirmed": true,                      # false: enqueue not yet confirmed
         "seen_at": …,                           # a live copy of it last reached the store
         "reissue_at": …,                        # owning a slot and unseen by then, the store
                                                 # issues it again (null: never)
         "passed_over": false,                   # always false: no waiter is passed over since
                                                 # schema 4 (kept for readers of this format)
         "payload_bytes": 512,                   # the message the store keeps to issue it
                                                 # again, in bytes (null: none kept)
         "live_generations": [0, 1767279290000000]}
                                                 # the generations of its copies the store counts
                                                 # as live (0: the producer's copy); a delivery
                                                 # of any other copy is stale
      ]
    }
  ]
}

New fields may be added to this format; existing ones keep their name and meaning."""


def _holder_status(holder: HolderView) -> str:
    if holder.phantom:
        return "phantom"
    return "executing" if holder.executing else "waiting_for_retry"


def inspect_document(
    store: Store,
    snaps: Sequence[KeySnapshot],
    now: float,
    *,
    schema_version: Callable[[], int | None] | None = None,
) -> dict[str, Any]:
    """The ``inspect --json`` document (format described in :data:`JSON_HELP`).

    ``schema_version`` reads the schema's version (the store's own by default).
    """
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
                        "payload_bytes": h.payload_bytes,
                        "live_generations": list(h.live_generations),
                    }
                    for h in snap.holders
                ],
                "waiters": [
                    {
                        "run_id": w.run_id,
                        "position": w.position,
                        "created_at": w.created_at,
                        "waiting": round(max(0.0, now - w.created_at), 3),
                        "state": waiter_state(w),
                        "confirmed": w.confirmed,
                        "seen_at": w.seen_at,
                        "reissue_at": w.reissue_at,
                        "passed_over": False,
                        "payload_bytes": w.payload_bytes,
                        "live_generations": list(w.live_generations),
                    }
                    for w in snap.waiters
                ],
            }
        )
    return {
        "format": JSON_FORMAT,
        "store": store.url,
        "namespace": store.namespace,
        "schema_version": (schema_version or store.schema_version)(),
        "now": now,
        "totals": {
            "keys": len(snaps),
            "holders": sum(len(s.holders) for s in snaps),
            "waiters": sum(len(s.waiters) for s in snaps),
        },
        "keys": keys,
    }


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
        since = clock_time(h.admitted_at, now)
        rows.append(
            ("holder", h.run_id, str(h.token), since, f"lease {seconds(now - h.heartbeat_at)}", state)
        )
    for w in snap.waiters:
        state = waiter_state(w) + ("" if w.confirmed or w.phantom else ", unconfirmed")
        rows.append(
            (
                str(w.position),
                w.run_id,
                "",
                clock_time(w.created_at, now),
                seconds(now - w.created_at),
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


@click.command(epilog=JSON_HELP)
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
        snaps = snapshots(store, scope=scope, key=key)
        now = store.time()  # ages and leases are the store's: its clock decides them
        if as_json:
            click.echo(json.dumps(inspect_document(store, snaps, now), indent=2))
        else:
            console = Console(soft_wrap=False)
            console.print(inspect_renderable(store, snaps, now, width=console.width))
