"""The custom store of the docs (examples/custom_store.py) keeps the contract and gates real runs."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from singleton_tasks import Store, current_admission
from singleton_tasks.dramatiq import SingletonMiddleware
from singleton_tasks.testing import StoreContract, StoreFactory

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_store.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("custom_store_example", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


custom_store = load_example()


class TestDictStoreContract(StoreContract):
    """The exported contract suite, run on the example as the docs tell a store author to."""

    @pytest.fixture
    def store_factory(self) -> Iterator[StoreFactory]:
        url = f"dict://{uuid.uuid4().hex}"
        default = f"t{uuid.uuid4().hex[:12]}"
        made: list[Store] = []

        def make(namespace: str | None = None, **options: object) -> Store:
            store = custom_store.DictStore(url, namespace=namespace or default, **options)
            store.migrate()
            made.append(store)
            return store

        yield make
        for store in made:
            store.close()


def test_the_custom_store_gates_a_dramatiq_burst() -> None:
    """Passed as an object to the middleware, it serializes same-key runs in send order."""
    broker = StubBroker()
    broker.add_middleware(
        SingletonMiddleware(store=custom_store.DictStore(f"dict://{uuid.uuid4().hex}"), retry_delay=0.05)
    )
    broker.emit_after("process_boot")
    lock = threading.Lock()
    events: list[tuple[str, int, int]] = []  # (kind, n, token)

    @dramatiq.actor(broker=broker, singleton={"key": "k"})
    def body(n: int) -> None:
        admission = current_admission()
        assert admission is not None
        with lock:
            events.append(("start", n, admission.token))
        time.sleep(0.02)
        with lock:
            events.append(("end", n, admission.token))

    for n in range(5):
        body.send(n)
    worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=20)
    worker.start()
    try:
        broker.join(body.queue_name, timeout=15_000)
        worker.join()
    finally:
        worker.stop()
    starts = [(n, token) for kind, n, token in events if kind == "start"]
    assert [n for n, _token in starts] == [0, 1, 2, 3, 4]
    assert [token for _n, token in starts] == sorted({token for _n, token in starts})
    # Never two bodies at once: every start follows the previous body's end.
    assert [kind for kind, _n, _token in events] == ["start", "end"] * 5
