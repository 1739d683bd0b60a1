"""``singleton-tasks release``: the operator frees one run's slot (or place in line) and names who is next."""

from __future__ import annotations

import sys

import click

from ..outcomes import KeySnapshot, ReleaseOutcome
from ..stores import Store
from ._open import open_store, snapshots, store_options
from ._settling import (
    confirm_and_broker_options,
    describe_run,
    find_run,
    open_broker,
    publish_wakes,
    release_run,
    report_wakes,
    who,
)


def _report_next(store: Store, snap: KeySnapshot, outcome: ReleaseOutcome, published: set[str]) -> None:
    report_wakes(outcome.wakes, outcome.evicted, published)
    if not outcome.wakes:
        after = store.snapshot(scope=snap.scope, key=snap.key)
        waiters = after[0].waiters if after else ()
        if waiters:
            head = waiters[0]
            click.echo(f"next in line: {head.run_id} ({head.state.value}); admitted when it is delivered")
        else:
            click.echo(f"no waiters left on key {snap.key!r}")


@click.command()
@store_options
@click.argument("run_id")
@confirm_and_broker_options
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
    with open_broker(broker_url) as broker, open_store(store_url, namespace) as store:
        found = find_run(snapshots(store), run_id)
        if found is None:
            click.echo(
                f"run {run_id} is not registered in {store.url} (namespace {store.namespace})", err=True
            )
            sys.exit(1)
        snap, run = found
        what = describe_run(snap, run)
        if not yes and not click.confirm(f"Release {what}?", default=False):
            click.echo("not released", err=True)
            sys.exit(1)
        outcome = release_run(store, snap, run, who())
        if outcome is None:
            click.echo(f"run {run_id} settled meanwhile: nothing released", err=True)
            sys.exit(1)
        click.echo(f"released {what}")
        _report_next(store, snap, outcome, published=publish_wakes(broker, broker_url, outcome.wakes))
