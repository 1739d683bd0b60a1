"""``singleton-tasks demo``: the sync-inventory story on the embedded default, no servers.

Three stores A, B and C, one slot each. A burst on A queues only A's lane while B and C run
at once; a fourth start on A, past ``max_queue_depth=2``, is rejected. Runs in-process against
a SQLite store in a temporary directory, on whichever framework is installed: Dramatiq's
``StubBroker`` and an embedded worker, or Celery's in-memory transport and an embedded
threads worker.
"""

from __future__ import annotations

import importlib.util
import itertools
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from .. import current_admission
from ..errors import SingletonQueueFullError
from ._open import StoreProblem

BODY_SECONDS = 0.5
LANE_WIDTH = 40  # with the key and the runs' tokens, whole, the table fits 80 columns
FRAMEWORKS = ("dramatiq", "celery")
SENDS = [("A", "A1"), ("A", "A2"), ("A", "A3"), ("B", "B1"), ("C", "C1")]


class DemoUnavailable(Exception):
    """No framework the demo can run on is installed; the message names the extra."""


@dataclass(frozen=True)
class Run:
    store: str
    label: str
    token: int
    start: float
    end: float


def pick_framework(wanted: str | None = None) -> str:
    """``wanted`` if it is installed, else the first installed of Dramatiq and Celery."""
    for name in (wanted,) if wanted else FRAMEWORKS:
        if importlib.util.find_spec(name) is not None:
            return name
    if wanted:
        raise DemoUnavailable(
            f"the demo on {wanted.capitalize()} needs it installed: pip install 'singleton-tasks[{wanted}]'"
        )
    raise DemoUnavailable(
        "the demo runs on Dramatiq or Celery, and neither is installed: "
        "pip install 'singleton-tasks[dramatiq]' (or 'singleton-tasks[celery]')"
    )


def run_demo(
    console: Console, *, body_seconds: float = BODY_SECONDS, framework: str | None = None
) -> list[Run]:
    """Play the story and print its lane timeline and summary; returns the runs for tests."""
    chosen = pick_framework(framework)
    runs: list[Run] = []
    lock = threading.Lock()

    def body(store_id: str, label: str) -> None:
        start = time.monotonic()
        time.sleep(body_seconds)
        admission = current_admission()
        with lock:
            runs.append(Run(store_id, label, admission.token if admission else 0, start, time.monotonic()))

    with tempfile.TemporaryDirectory(prefix="singleton-demo-") as tmp:
        store_url = f"sqlite:///{Path(tmp) / 'demo.db'}"
        play = _on_dramatiq if chosen == "dramatiq" else _on_celery
        with play(store_url, body) as (send, wait):
            on = chosen.capitalize()
            console.print(f"[bold]singleton-tasks demo[/] on {on} — store {store_url} (embedded SQLite)")
            console.print("sync_inventory: key 'store:{store_id}', limit 1, max_queue_depth 2\n")
            origin = time.monotonic()
            for store_id, label in SENDS:
                send(store_id, label)
                console.print(f"  send {label:<3} → accepted")
            try:
                send("A", "A4")
                console.print("  send A4  → accepted (unexpected)")
            except SingletonQueueFullError as error:
                console.print(
                    f"  send A4  → [red]SingletonQueueFullError[/]: key {error.key!r} "
                    f"limit={error.limit} max_queue_depth={error.max_queue_depth}"
                )
            wait()
            # Until the last run ended (not the worker's shutdown, slow on Celery's memory transport).
            total = max((r.end for r in runs), default=time.monotonic()) - origin
    _print_lanes(console, runs, origin, total)
    return runs


Send = Callable[[str, str], object]


@contextmanager
def _on_dramatiq(
    store_url: str, body: Callable[[str, str], None]
) -> Iterator[tuple[Send, Callable[[], None]]]:
    """Dramatiq's StubBroker; the worker starts once everything is sent."""
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from ..dramatiq import SingletonMiddleware

    broker = StubBroker()
    broker.add_middleware(SingletonMiddleware(store=store_url, retry_delay=1.0, retry_jitter=0.1))
    broker.emit_after("process_boot")
    sync_inventory: Any = dramatiq.actor(
        broker=broker,
        actor_name="sync_inventory",
        max_retries=0,
        singleton={"key": "store:{store_id}", "max_queue_depth": 2},
    )(body)

    def wait() -> None:
        worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=50)
        worker.start()
        try:
            broker.join(sync_inventory.queue_name, fail_fast=True)
            worker.join()
        finally:
            worker.stop()

    try:
        yield sync_inventory.send, wait
    finally:
        broker.close()


@contextmanager
def _on_celery(store_url: str, body: Callable[[str, str], None]) -> Iterator[tuple[Send, Callable[[], None]]]:
    """Celery's in-memory transport and result cache; an embedded threads worker once all is sent."""
    from celery import Celery
    from celery.contrib.testing.worker import start_worker

    from ..celery import SingletonTask, install

    app = Celery("demo", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.broker_transport_options = {"polling_interval": 0.01}
    app.conf.task_default_queue = f"singleton-demo-{uuid.uuid4().hex[:8]}"
    app.conf.worker_hijack_root_logger = False
    install(app, store=store_url, retry_delay=1.0, retry_jitter=0.1)
    sync_inventory: Any = app.task(
        body,
        base=SingletonTask,
        name="sync_inventory",
        shared=False,
        singleton={"key": "store:{store_id}", "max_queue_depth": 2},
    )
    results: list[Any] = []

    def send(store_id: str, label: str) -> object:
        result = sync_inventory.delay(store_id, label)
        results.append(result)
        return result

    def wait() -> None:
        with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False, loglevel="WARNING"):
            for result in results:
                result.get(interval=0.01, timeout=60)

    yield send, wait


def _print_lanes(console: Console, runs: list[Run], origin: float, total: float) -> None:
    scale = LANE_WIDTH / max(total, 1e-9)
    table = Table(title="lanes (one slot each; time →)", show_lines=False)
    table.add_column("key")
    table.add_column(f"0 … {total:.1f} s", no_wrap=True)
    table.add_column("run token", no_wrap=True)  # tokens whole: they are what the logs print
    for store in sorted({r.store for r in runs}):
        lane = [" "] * LANE_WIDTH
        mine = sorted((r for r in runs if r.store == store), key=lambda r: r.start)
        for run in mine:
            first = int((run.start - origin) * scale)
            last = max(first, min(LANE_WIDTH - 1, int((run.end - origin) * scale) - 1))
            for i in range(first, last + 1):
                lane[i] = run.label[-1]
        table.add_row(f"store:{store}", "".join(lane), "\n".join(f"{r.label:<3} {r.token}" for r in mine))
    console.print()
    console.print(table)
    overlaps = sum(
        1 for a in runs for b in runs if a is not b and a.store == b.store and a.start < b.start < a.end
    )
    handoffs = []
    for store in {r.store for r in runs}:
        lane_runs = sorted((r for r in runs if r.store == store), key=lambda r: r.start)
        handoffs += [later.start - earlier.end for earlier, later in itertools.pairwise(lane_runs)]
    worst = max(handoffs) * 1000 if handoffs else 0.0
    console.print(
        f"{len(runs)} runs, 1 rejected, {overlaps} same-key overlaps, "
        f"A ran in order: {[r.label for r in sorted(runs, key=lambda r: r.start) if r.store == 'A']}, "
        f"slowest handoff {worst:.0f} ms (fallback timer: 1000 ms), total {total:.1f} s"
    )


@click.command()
@click.option(
    "--framework",
    type=click.Choice(FRAMEWORKS),
    default=None,
    help="Run it on this framework (default: Dramatiq if it is installed, else Celery).",
)
def demo(framework: str | None) -> None:
    """The sync-inventory story on the embedded SQLite store: no server needed (~3 s)."""
    try:
        run_demo(Console(), framework=framework)
    except DemoUnavailable as error:
        raise StoreProblem(str(error)) from None
