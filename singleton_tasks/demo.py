"""``singleton-tasks demo``: the sync-inventory story on the embedded default, no servers.

Three stores A, B and C, one slot each. A burst on A queues only A's lane while B and C run
at once; a fourth start on A, past ``max_queue_depth=2``, is rejected. Runs in-process on
Dramatiq's ``StubBroker`` against a SQLite store in a temporary directory.
"""

from __future__ import annotations

import itertools
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from . import current_admission
from .errors import SingletonQueueFullError

BODY_SECONDS = 0.5
LANE_WIDTH = 48


@dataclass(frozen=True)
class Run:
    store: str
    label: str
    token: int
    start: float
    end: float


def run_demo(console: Console, *, body_seconds: float = BODY_SECONDS) -> list[Run]:
    """Play the story and print its lane timeline and summary; returns the runs for tests."""
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from .dramatiq import SingletonMiddleware

    runs: list[Run] = []
    lock = threading.Lock()
    with tempfile.TemporaryDirectory(prefix="singleton-demo-") as tmp:
        store_url = f"sqlite:///{Path(tmp) / 'demo.db'}"
        broker = StubBroker()
        broker.add_middleware(SingletonMiddleware(store=store_url, retry_delay=1.0, retry_jitter=0.1))
        broker.emit_after("process_boot")

        @dramatiq.actor(
            broker=broker,
            actor_name="sync_inventory",
            max_retries=0,
            singleton={"key": "store:{store_id}", "max_queue_depth": 2},
        )
        def sync_inventory(store_id: str, label: str) -> None:
            start = time.monotonic()
            time.sleep(body_seconds)
            admission = current_admission()
            with lock:
                runs.append(
                    Run(store_id, label, admission.token if admission else 0, start, time.monotonic())
                )

        console.print(f"[bold]singleton-tasks demo[/] — store {store_url} (embedded SQLite)")
        console.print("sync_inventory: key 'store:{store_id}', limit 1, max_queue_depth 2\n")
        origin = time.monotonic()
        for store_id, label in [("A", "A1"), ("A", "A2"), ("A", "A3"), ("B", "B1"), ("C", "C1")]:
            sync_inventory.send(store_id, label)
            console.print(f"  send {label:<3} → accepted")
        try:
            sync_inventory.send("A", "A4")
            console.print("  send A4  → accepted (unexpected)")
        except SingletonQueueFullError as error:
            console.print(
                f"  send A4  → [red]SingletonQueueFullError[/]: key {error.key!r} "
                f"limit={error.limit} max_queue_depth={error.max_queue_depth}"
            )
        worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=50)
        worker.start()
        try:
            broker.join(sync_inventory.queue_name, fail_fast=True)
            worker.join()
        finally:
            worker.stop()
            broker.close()
        total = time.monotonic() - origin
    _print_lanes(console, runs, origin, total)
    return runs


def _print_lanes(console: Console, runs: list[Run], origin: float, total: float) -> None:
    scale = LANE_WIDTH / max(total, 1e-9)
    table = Table(title="lanes (one slot each; time →)", show_lines=False)
    table.add_column("key")
    table.add_column(f"0 … {total:.1f} s", no_wrap=True)
    table.add_column("runs (token)")
    for store in sorted({r.store for r in runs}):
        lane = [" "] * LANE_WIDTH
        mine = sorted((r for r in runs if r.store == store), key=lambda r: r.start)
        for run in mine:
            first = int((run.start - origin) * scale)
            last = max(first, min(LANE_WIDTH - 1, int((run.end - origin) * scale) - 1))
            for i in range(first, last + 1):
                lane[i] = run.label[-1]
        table.add_row(f"store:{store}", "".join(lane), ", ".join(f"{r.label} ({r.token})" for r in mine))
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
