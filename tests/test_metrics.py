"""The Prometheus hooks: counters and histograms per task, in the registry the user chose."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from singleton_tasks import SingletonQueueFullError, metrics
from singleton_tasks.outcomes import ClaimOutcome, Decision, Registered, ReleaseOutcome, RunSpec
from singleton_tasks.stores.memory import MemoryStore
from singleton_tasks.testing import ManualClock, at


@pytest.fixture(autouse=True)
def restore_hooks() -> Iterator[None]:
    saved = (metrics._active, metrics._disabled)
    yield
    metrics._active, metrics._disabled = saved


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    metrics.install(registry)
    return registry


def value(registry: CollectorRegistry, name: str, task: str = "inv.sync") -> float:
    return registry.get_sample_value(name, {"task": task}) or 0.0


def test_counters_follow_real_store_outcomes(registry: CollectorRegistry) -> None:
    """Outcomes of a real (memory) store fed to the hooks as an adapter would."""
    store = MemoryStore(f"memory://metrics-{uuid.uuid4().hex}", clock=ManualClock(100.0))
    task = "inv.sync"
    first = RunSpec("inv", "store:A", "r1")
    second = RunSpec("inv", "store:A", "r2", max_queue_depth=1)
    third = RunSpec("inv", "store:A", "r3", max_queue_depth=1)
    assert at(store, 100.0).register(first).status is Registered.REGISTERED
    assert at(store, 101.0).register(second).status is Registered.REGISTERED
    if at(store, 101.5).register(third).status is Registered.FULL:
        metrics.observe_rejected(task)

    admitted = at(store, 102.0).claim(first, 0, None)
    metrics.observe_claim(task, admitted, now=102.0, registered_at=100.0)
    gated = at(store, 103.0).claim(second, 0, b"r2")
    metrics.observe_claim(task, gated, now=103.0)
    assert gated.decision is Decision.GATED

    released = at(store, 104.0).release("inv", "store:A", "r1", token=admitted.token)
    metrics.observe_release(task, released)
    metrics.observe_woken(task, len(released.wakes))
    assert [w.run_id for w in released.wakes] == ["r2"]
    woken = at(store, 104.25).claim(second, released.wakes[0].generation, None)
    metrics.observe_claim(task, woken, now=104.25, registered_at=101.0, woken_at=104.0)

    assert value(registry, "singleton_tasks_admitted_total") == 2
    assert value(registry, "singleton_tasks_gated_total") == 1
    assert value(registry, "singleton_tasks_woken_total") == 1
    assert value(registry, "singleton_tasks_released_total") == 1
    assert value(registry, "singleton_tasks_rejected_total") == 1
    assert value(registry, "singleton_tasks_taken_over_total") == 0
    assert value(registry, "singleton_tasks_wait_seconds_count") == 2
    assert value(registry, "singleton_tasks_wait_seconds_sum") == pytest.approx(2.0 + 3.25)
    assert value(registry, "singleton_tasks_handoff_seconds_count") == 1
    assert value(registry, "singleton_tasks_handoff_seconds_sum") == pytest.approx(0.25)
    assert (
        registry.get_sample_value("singleton_tasks_handoff_seconds_bucket", {"task": task, "le": "0.25"}) == 1
    )


def test_takeover_and_evictions_are_counted(registry: CollectorRegistry) -> None:
    metrics.observe_claim(
        "t", ClaimOutcome(Decision.ADMITTED, token=3, takeover=True, evicted=("old1", "old2")), now=5.0
    )
    metrics.observe_release("t", ReleaseOutcome(released=False, lost=True, evicted=("old3",)))
    metrics.observe_claim("t", ClaimOutcome(Decision.STALE))
    assert value(registry, "singleton_tasks_taken_over_total", "t") == 1
    assert value(registry, "singleton_tasks_evicted_total", "t") == 3
    assert value(registry, "singleton_tasks_admitted_total", "t") == 1
    assert value(registry, "singleton_tasks_released_total", "t") == 0
    assert value(registry, "singleton_tasks_wait_seconds_count", "t") == 0  # no registration time given


def test_tasks_are_labelled_apart(registry: CollectorRegistry) -> None:
    metrics.observe_gated("a")
    metrics.observe_gated("a")
    metrics.observe_gated("b")
    assert value(registry, "singleton_tasks_gated_total", "a") == 2
    assert value(registry, "singleton_tasks_gated_total", "b") == 1


def test_install_twice_reuses_the_registry_and_disable_silences(registry: CollectorRegistry) -> None:
    again = metrics.install(registry)  # a second registration would raise "Duplicated timeseries"
    assert again is metrics.active()
    metrics.observe_released("t")
    metrics.disable()
    metrics.observe_released("t")
    assert metrics.active() is None
    assert value(registry, "singleton_tasks_released_total", "t") == 1
    metrics.install(registry)
    metrics.observe_released("t")
    assert value(registry, "singleton_tasks_released_total", "t") == 2


def test_prefix_and_separate_registries() -> None:
    one, two = CollectorRegistry(), CollectorRegistry()
    metrics.install(one, prefix="app_singleton")
    metrics.observe_admitted("t")
    metrics.install(two)
    metrics.observe_admitted("t")
    assert one.get_sample_value("app_singleton_admitted_total", {"task": "t"}) == 1
    assert two.get_sample_value("singleton_tasks_admitted_total", {"task": "t"}) == 1


def test_hooks_are_no_ops_without_prometheus_client(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics._active, metrics._disabled = None, False
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now raises ImportError
    metrics.observe_admitted("t", now=2.0, registered_at=1.0)
    metrics.observe_claim("t", ClaimOutcome(Decision.GATED))
    metrics.observe_release("t", ReleaseOutcome(released=True))
    assert metrics.active() is None
    assert metrics._disabled is True
    with pytest.raises(ImportError):
        metrics.install(CollectorRegistry())


def test_metrics_join_the_multiprocess_exposition_of_dramatiqs_prometheus(tmp_path: Path) -> None:
    """Dramatiq's Prometheus middleware exposes what worker processes write to its directory.

    The hooks create their metrics on the first event, after the middleware set
    PROMETHEUS_MULTIPROC_DIR at boot, so a worker's events show up in that exposition.
    """
    worker = textwrap.dedent(
        """
        import os, sys
        from singleton_tasks import SingletonQueueFullError, metrics
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]  # what after_process_boot does
        metrics.observe_admitted("inv.sync", now=5.0, registered_at=2.0)
        metrics.observe_gated("inv.sync")
        """
    )
    subprocess.run([sys.executable, "-c", worker, str(tmp_path)], check=True)
    exposition = textwrap.dedent(
        """
        import os, sys
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
        import prometheus_client as prom
        from prometheus_client import multiprocess
        registry = prom.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # as dramatiq's exposition server does
        sys.stdout.write(prom.generate_latest(registry).decode())
        """
    )
    text = subprocess.run(
        [sys.executable, "-c", exposition, str(tmp_path)], check=True, capture_output=True, text=True
    ).stdout
    assert 'singleton_tasks_admitted_total{task="inv.sync"} 1.0' in text
    assert 'singleton_tasks_gated_total{task="inv.sync"} 1.0' in text
    assert 'singleton_tasks_wait_seconds_sum{task="inv.sync"} 3.0' in text


def test_dramatiq_adapter_reports_through_the_hooks(registry: CollectorRegistry, tmp_path: Path) -> None:
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from singleton_tasks.dramatiq import SingletonMiddleware

    broker = StubBroker()
    broker.add_middleware(SingletonMiddleware(store=f"sqlite:///{tmp_path / 'm.db'}", retry_delay=30.0))
    broker.emit_after("process_boot")
    started = threading.Event()
    gate = threading.Event()
    second_done = threading.Event()

    @dramatiq.actor(broker=broker, actor_name="metrics_sync", singleton={"key": "k", "max_queue_depth": 1})
    def metrics_sync(first: bool) -> None:
        if first:
            started.set()
            gate.wait(10)
        else:
            second_done.set()

    metrics_sync.send(True)
    metrics_sync.send(False)
    with pytest.raises(SingletonQueueFullError):
        metrics_sync.send(False)
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=20)
    worker.start()
    try:
        assert started.wait(10)
        # The second run is gated behind the first.
        deadline = time.monotonic() + 10
        while value(registry, "singleton_tasks_gated_total", "metrics_sync") < 1:
            assert time.monotonic() < deadline, "the second run was never gated"
            time.sleep(0.01)
        gate.set()
        # The deferred copy's 30 s timer is still pending: only the wake can finish in time.
        assert second_done.wait(10)
        deadline = time.monotonic() + 10
        while value(registry, "singleton_tasks_released_total", "metrics_sync") < 2:
            assert time.monotonic() < deadline, "the second run never settled"
            time.sleep(0.01)
    finally:
        worker.stop()
    assert value(registry, "singleton_tasks_admitted_total", "metrics_sync") == 2
    assert value(registry, "singleton_tasks_rejected_total", "metrics_sync") == 1
    assert value(registry, "singleton_tasks_woken_total", "metrics_sync") == 1
    assert value(registry, "singleton_tasks_released_total", "metrics_sync") == 2
    assert value(registry, "singleton_tasks_handoff_seconds_count", "metrics_sync") == 1
    assert value(registry, "singleton_tasks_wait_seconds_count", "metrics_sync") == 2
