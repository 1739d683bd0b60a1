"""What the commands that settle runs (``release``, ``drop-waiters``) share: ``--yes``, ``--broker``, wakes.

``--broker`` publishes the woken waiters' messages at once; the report says who was woken and
how each will be admitted; the log names the operator (:func:`who`). Dramatiq is imported only
when ``--broker`` is given: the command runs without it installed.
"""

from __future__ import annotations

import getpass
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import click

from ..outcomes import HolderView, KeySnapshot, ReleaseOutcome, WaiterView, Wake
from ..stores import Store, redact_url
from ..stores.base import scrub_secrets
from ._open import StoreProblem, snapshots

logger = logging.getLogger("singleton_tasks")


def who() -> str:
    """The operator, as the log names them: ``user@host``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (containers without a passwd entry)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def find_run(snaps: Sequence[KeySnapshot], run_id: str) -> tuple[KeySnapshot, HolderView | WaiterView] | None:
    """The key and the holder or waiter ``run_id`` is, in ``snaps``; None if it is in none."""
    for snap in snaps:
        runs: tuple[HolderView | WaiterView, ...] = (*snap.holders, *snap.waiters)
        for run in runs:
            if run.run_id == run_id:
                return snap, run
    return None


def describe_run(snap: KeySnapshot, run: HolderView | WaiterView) -> str:
    """``run`` as an operator reads it: what it is in its key's lane, and the key."""
    if isinstance(run, HolderView):
        role = f"holder (token {run.token}, {'executing' if run.executing else 'waiting for retry'})"
    else:
        role = f"waiter (position {run.position}, {run.state.value})"
    return f"run {run.run_id}: {role} of key {snap.key!r} (scope {snap.scope!r})"


def release_run(
    store: Store, snap: KeySnapshot, run: HolderView | WaiterView, operator: str
) -> ReleaseOutcome | None:
    """Free ``run``'s slot or place in line (``Store.operator_release``) and log it, naming
    ``operator``; None, logging nothing, when it settled meanwhile."""
    outcome = store.operator_release(run.run_id)
    if outcome is None or not outcome.released:
        return None
    logger.warning(
        "operator release by %s: %s in %s namespace %r; woke %s",
        operator,
        describe_run(snap, run),
        store.url,
        store.namespace,
        [w.run_id for w in outcome.wakes] or "nobody",
    )
    return outcome


@dataclass(frozen=True)
class WaitersDropped:
    """What :func:`drop_waiters_of` did to a key's listed waiters."""

    dropped: tuple[WaiterView, ...]  # settled by this call, in line order
    left: tuple[WaiterView, ...]  # not dropped: admitted or settled meanwhile, or still waiting
    wakes: tuple[Wake, ...]  # runs that own a slot because of the drops (none of the dropped)
    evicted: tuple[str, ...]  # orphaned holders evicted on the way
    after: KeySnapshot | None  # the key once done (None: no holders or waiters left)


def drop_waiters_of(store: Store, snap: KeySnapshot, operator: str) -> WaitersDropped:
    """Settle each waiter listed in ``snap`` in the store, as ``release`` would; a waiter admitted
    meanwhile by a copy of it is left alone (it settles where it runs). Logs one warning per
    dropped run, naming ``operator``."""
    what = f"key {snap.key!r} (scope {snap.scope!r})"
    dropped: set[str] = set()
    wakes: dict[str, Wake] = {}
    evicted: list[str] = []
    # Back to front: dropping a waiter never makes one behind it own a slot, so no listed
    # waiter is woken (and admitted by its wake) by these drops.
    for waiter in reversed(snap.waiters):
        outcome = store.release(snap.scope, snap.key, waiter.run_id, token=None, waiting_only=True)
        wakes.update((wake.run_id, wake) for wake in outcome.wakes)
        evicted.extend(outcome.evicted)
        if outcome.released:
            dropped.add(waiter.run_id)
            logger.warning(
                "operator drop of a waiter by %s: run %s (position %d) of %s in %s namespace %r",
                operator,
                waiter.run_id,
                waiter.position,
                what,
                store.url,
                store.namespace,
            )
    after = snapshots(store, scope=snap.scope, key=snap.key)
    return WaitersDropped(
        dropped=tuple(w for w in snap.waiters if w.run_id in dropped),
        left=tuple(w for w in snap.waiters if w.run_id not in dropped),
        wakes=tuple(wake for run_id, wake in wakes.items() if run_id not in dropped),
        evicted=tuple(evicted),
        after=after[0] if after else None,
    )


def confirm_and_broker_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--yes`` and ``--broker`` of the commands that settle runs (``release``, ``drop-waiters``)."""
    command = click.option(
        "--broker",
        "broker_url",
        default=None,
        metavar="URL",
        help="Dramatiq broker (redis://… or amqp://…) to publish the woken waiters' messages on at once.",
    )(command)
    return click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")(command)


def report_wakes(wakes: Sequence[Wake], evicted: Sequence[str], published: set[str]) -> None:
    """One line per woken waiter (how it will be admitted) and per evicted orphaned holder."""
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
def open_broker(url: str | None) -> Iterator[Any]:
    """The ``--broker`` of a command, made before the store is touched (a wrong URL changes
    nothing) and closed however the command ends; None without ``--broker``."""
    if url is None:
        yield None
        return
    made = _dramatiq_broker(url)
    try:
        yield made
    finally:
        made.close()


def publish_wakes(broker: Any, broker_url: str | None, wakes: Sequence[Wake]) -> set[str]:
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
        detail = scrub_secrets(f"{type(error).__name__}: {error}", broker_url)
        click.echo(f"publishing wakes on {redact_url(broker_url)} failed ({detail})", err=True)
    return published
