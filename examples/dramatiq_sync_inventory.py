"""Sync inventory, one run per store at a time — Dramatiq.

Run it as it is (in-process worker, embedded SQLite store, no server)::

    python examples/dramatiq_sync_inventory.py

Against real servers, shared by every worker host, from the repository's root::

    export SINGLETON_TASKS_STORE=redis://localhost:6379/1 DRAMATIQ_BROKER_URL=redis://localhost:6379/0
    python examples/dramatiq_sync_inventory.py                   # producer + in-process worker
    # or real worker processes, and the producer alone:
    dramatiq examples.dramatiq_sync_inventory
    python examples/dramatiq_sync_inventory.py --producer-only

``SINGLETON_TASKS_NAMESPACE`` (the variable ``singleton-tasks inspect`` reads too) picks the
store namespace.
"""

from __future__ import annotations

import os
import sys
import time

import dramatiq
from dramatiq.brokers.stub import StubBroker

from singleton_tasks import SingletonQueueFullError, current_admission, singleton
from singleton_tasks.dramatiq import SingletonMiddleware


def make_broker() -> dramatiq.Broker:
    url = os.environ.get("DRAMATIQ_BROKER_URL")
    if url is None:
        return StubBroker()
    if url.startswith("amqp"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url)
    from dramatiq.brokers.redis import RedisBroker

    return RedisBroker(url=url)


broker = make_broker()
# The middleware goes on the broker before any actor is declared. Its store comes from
# SINGLETON_TASKS_STORE, or the embedded SQLite default (with a warning) when unset.
broker.add_middleware(
    SingletonMiddleware(
        namespace=os.environ.get("SINGLETON_TASKS_NAMESPACE", "default"),
        retry_delay=float(os.environ.get("SINGLETON_RETRY_DELAY", "1.0")),
    )
)
dramatiq.set_broker(broker)
# No broker.emit_after("process_boot") here: the `dramatiq` command emits it in each worker
# process (a second one fails TimeLimit's thread); main() emits it for its in-process worker.


@dramatiq.actor(singleton={"key": "store:{store_id}", "max_queue_depth": 2})
def sync_inventory(store_id: str, seconds: float = 0.3) -> None:
    admission = current_admission()
    print(f"  syncing store {store_id} (fencing token {admission.token if admission else '?'})", flush=True)
    time.sleep(seconds)


@singleton(key=lambda account: f"acct:{account}", limit=2)
@dramatiq.actor
def generate_statement(account: str) -> None:
    time.sleep(0.1)


def produce() -> int:
    """Send a burst for store A and one run for B; the 4th A run is refused."""
    sent = rejected = 0
    for store_id in ["A", "A", "A", "B", "A"]:
        try:
            sync_inventory.send(store_id)
            sent += 1
        except SingletonQueueFullError as error:
            rejected += 1
            print(f"refused: {error}", flush=True)
    generate_statement.send("42")
    print(f"sent: {sent + 1} runs, {rejected} refused", flush=True)
    return rejected


def main() -> int:
    if "--producer-only" in sys.argv:
        return produce()
    broker.emit_after("process_boot")
    rejected = produce()
    worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=50)
    worker.start()
    try:
        broker.join(sync_inventory.queue_name)  # every run done, deferred copies included
        worker.join()
    finally:
        worker.stop()
        broker.close()
    print(f"done: {rejected} refused", flush=True)
    return rejected


if __name__ == "__main__":
    main()
