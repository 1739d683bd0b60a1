"""Sync inventory, one run per store at a time — Dramatiq.

Run it as it is (in-process worker, embedded SQLite store, no server)::

    python examples/dramatiq_sync_inventory.py

Against real servers, shared by every worker host::

    SINGLETON_TASKS_STORE=redis://localhost:6379/1 DRAMATIQ_BROKER_URL=redis://localhost:6379/0 \
        python examples/dramatiq_sync_inventory.py            # producer + in-process worker
    dramatiq examples.dramatiq_sync_inventory                 # or real worker processes
"""

from __future__ import annotations

import os
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
broker.add_middleware(SingletonMiddleware(retry_delay=float(os.environ.get("SINGLETON_RETRY_DELAY", "1.0"))))
dramatiq.set_broker(broker)
broker.emit_after("process_boot")


@dramatiq.actor(singleton={"key": "store:{store_id}", "max_queue_depth": 2})
def sync_inventory(store_id: str, seconds: float = 0.3) -> None:
    admission = current_admission()
    print(f"  syncing store {store_id} (fencing token {admission.token if admission else '?'})")
    time.sleep(seconds)


@singleton(key=lambda account: f"acct:{account}", limit=2)
@dramatiq.actor
def generate_statement(account: str) -> None:
    time.sleep(0.1)


def main() -> int:
    """Send a burst for store A and one run for B; the 4th A run is refused."""
    rejected = 0
    for store_id in ["A", "A", "A", "B", "A"]:
        try:
            sync_inventory.send(store_id)
        except SingletonQueueFullError as error:
            rejected += 1
            print(f"refused: {error}")
    generate_statement.send("42")
    worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=50)
    worker.start()
    try:
        if isinstance(broker, StubBroker):
            broker.join(sync_inventory.queue_name)
            worker.join()
        else:
            time.sleep(3)
    finally:
        worker.stop()
    print(f"done: {rejected} refused")
    return rejected


if __name__ == "__main__":
    main()
