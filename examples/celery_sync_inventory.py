"""Sync inventory, one run per store at a time — Celery.

Run it as it is (in-process worker, memory broker, embedded SQLite store, no server)::

    python examples/celery_sync_inventory.py

Against real servers, shared by every worker host (``pip install "singleton-tasks[celery-redis]"``
for Celery's Redis transport), from the repository's root::

    export SINGLETON_TASKS_STORE=redis://localhost:6379/1 CELERY_BROKER_URL=redis://localhost:6379/0
    celery -A examples.celery_sync_inventory worker --pool threads -c 4     # the workers
    python examples/celery_sync_inventory.py --producer-only                 # the producer

The tasks are named explicitly (``shop.…``): run as a script, this module is ``__main__``, and
Celery would name its tasks after that, not after the module the worker imports.
``SINGLETON_TASKS_NAMESPACE`` (the variable ``singleton-tasks inspect`` reads too) picks the
store namespace.
"""

from __future__ import annotations

import os
import sys
import time

from celery import Celery

from singleton_tasks import SingletonQueueFullError, current_admission, singleton
from singleton_tasks.celery import SingletonTask, install

app = Celery(
    "shop",
    broker=os.environ.get("CELERY_BROKER_URL", "memory://"),
    backend=os.environ.get("CELERY_RESULT_BACKEND", "cache+memory://"),
)
app.conf.broker_transport_options = {"polling_interval": 0.05}
app.conf.broker_connection_retry_on_startup = True
# The store comes from SINGLETON_TASKS_STORE (or the embedded SQLite default, with a warning).
install(
    app,
    namespace=os.environ.get("SINGLETON_TASKS_NAMESPACE", "default"),
    retry_delay=float(os.environ.get("SINGLETON_RETRY_DELAY", "1.0")),
)


@app.task(
    name="shop.sync_inventory",
    base=SingletonTask,
    singleton={"key": "store:{store_id}", "max_queue_depth": 2},
)
def sync_inventory(store_id: str, seconds: float = 0.3) -> str:
    admission = current_admission()
    print(f"  syncing store {store_id} (fencing token {admission.token if admission else '?'})", flush=True)
    time.sleep(seconds)
    return store_id


@singleton(key="acct:{account}", limit=2)
@app.task(name="shop.generate_statement")
def generate_statement(account: str) -> str:
    return f"statement for {account}"


def produce() -> tuple[list[object], int]:
    """A burst for store A and one run for B; the 4th A run is refused."""
    results, rejected = [], 0
    for store_id in ["A", "A", "A", "B", "A"]:
        try:
            results.append(sync_inventory.delay(store_id))
        except SingletonQueueFullError as error:
            rejected += 1
            print(f"refused: {error}", flush=True)
    results.append(generate_statement.delay("42"))
    print(f"sent: {len(results)} runs, {rejected} refused", flush=True)
    return results, rejected


def main() -> int:
    if "--producer-only" in sys.argv:
        return produce()[1]
    from celery.contrib.testing.worker import start_worker  # an embedded worker for the example

    with start_worker(app, pool="threads", concurrency=4, perform_ping_check=False):
        results, rejected = produce()
        values = [result.get(timeout=30) for result in results]  # type: ignore[attr-defined]
    print(f"done: {values}, {rejected} refused", flush=True)
    return rejected


if __name__ == "__main__":
    main()
