"""``singleton-tasks drop-waiters``: the operator cancels every run waiting on a key; its holders stay."""

from __future__ import annotations

import sys

import click

from ..outcomes import KeySnapshot
from ..stores import Store
from ._format import waiter_state
from ._open import open_store, snapshots, store_options
from ._settling import (
    confirm_and_broker_options,
    drop_waiters_of,
    open_broker,
    publish_wakes,
    report_wakes,
    who,
)


def _one_key(store: Store, scope: str | None, key: str) -> KeySnapshot | None:
    """The key to act on; a usage error when several scopes use it and none was chosen."""
    snaps = snapshots(store, scope=scope, key=key)
    if len(snaps) > 1:
        scopes = ", ".join(repr(s.scope) for s in snaps)
        raise click.UsageError(f"key {key!r} is used by several scopes ({scopes}): choose one with --scope")
    return snaps[0] if snaps else None


@click.command("drop-waiters")
@store_options
@click.option("--key", required=True, help="The key whose waiters to drop.")
@click.option(
    "--scope", default=None, help="The key's scope (default: a task's name); needed if several use the key."
)
@confirm_and_broker_options
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
    with open_broker(broker_url) as broker, open_store(store_url, namespace) as store:
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
        click.echo(
            f"{what} {where}: waiters to drop {len(snap.waiters)}, holders left alone {len(snap.holders)}"
        )
        for w in snap.waiters:
            click.echo(f"{w.position:>6}  {w.run_id}  {waiter_state(w)}")
        if not yes and not click.confirm(f"Drop these {len(snap.waiters)} waiters?", default=False):
            click.echo("nothing dropped", err=True)
            sys.exit(1)
        done = drop_waiters_of(store, snap, who())
        dropped = {w.run_id for w in done.dropped}
        holding = {h.run_id for h in done.after.holders} if done.after else set()
        waiting = {w.run_id for w in done.after.waiters} if done.after else set()
        for w in snap.waiters:
            if w.run_id in dropped:
                click.echo(f"dropped {w.run_id} (position {w.position})")
            elif w.run_id in holding:
                click.echo(f"{w.run_id}: admitted meanwhile, left (it settles where it runs)")
            elif w.run_id in waiting:
                click.echo(f"{w.run_id}: still waiting, not dropped (try `release {w.run_id}`)")
            else:
                click.echo(f"{w.run_id}: settled meanwhile")
        report_wakes(done.wakes, done.evicted, published=publish_wakes(broker, broker_url, done.wakes))
        click.echo(
            f"dropped {len(dropped)} of {len(snap.waiters)} waiters of {what}; {len(waiting)} waiting now"
        )
        if len(dropped) < len(snap.waiters):
            sys.exit(1)
