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


@pytest.mark.slow  # runs pytest in a child interpreter
def test_the_test_kits_own_example_runs_as_written(tmp_path: Path) -> None:
    """``singleton_tasks.testing``'s docstring example, copied verbatim into a test module, passes.

    Its ``my_package.MyStore`` is the example store of the docs, on the URL the docstring gives.
    """
    import subprocess
    import textwrap

    import singleton_tasks.testing

    doc = singleton_tasks.testing.__doc__ or ""
    block = doc.split("::\n\n", 1)[1]
    example = textwrap.dedent(block.split("\nThe suite is deterministic", 1)[0])
    assert "class TestMyStore(StoreContract):" in example
    (tmp_path / "test_my_store_contract.py").write_text(example)
    (tmp_path / "my_package.py").write_text(
        "import importlib.util, sys, uuid\n"
        f"spec = importlib.util.spec_from_file_location('custom_store_example', {str(EXAMPLE)!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "SERVER = f'dict://{uuid.uuid4().hex}'\n\n"
        "class MyStore(module.DictStore):\n"
        "    def __init__(self, url, **options):\n"
        "        assert url == 'mystore://127.0.0.1:7000', url\n"
        "        super().__init__(SERVER, **options)\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    passed = int(summary.split(" passed")[0].split()[-1])
    assert passed >= 50, summary
