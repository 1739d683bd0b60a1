"""Shared fixtures: every store by URL, on the real servers; skip by hand, fail in CI."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from loopback_cluster import LoopbackCluster
from marks import (  # noqa: F401  (hooks: pytest finds them in this module)
    needs,
    pytest_itemcollected,
    pytest_runtest_protocol,
    pytest_terminal_summary,
    require_marked,
)
from prometheus_client import CollectorRegistry
from services import require_server

from singleton_tasks import Store, metrics, store_from_url
from singleton_tasks.confirms import flush_all_confirms
from singleton_tasks.outcomes import PAYLOAD_ON_REQUEST, Decision, RunSpec
from singleton_tasks.runtime import Gatekeeper

REDIS_URL = os.environ.get("SINGLETON_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
POSTGRES_URL = os.environ.get("SINGLETON_TEST_POSTGRES_URL", "postgresql://127.0.0.1:5432/test")
RABBITMQ_URL = os.environ.get("SINGLETON_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
BROKER_REDIS_URL = os.environ.get("SINGLETON_TEST_BROKER_REDIS_URL", "redis://127.0.0.1:6379/14")

#: The Redis Cluster leg starts its own 6-node cluster: selected with ``-m redis_cluster`` (tox
#: env ``redis-cluster``), left out elsewhere.
BACKENDS = ["memory", "sqlite", "redis", "postgres", "redis-cluster"]


@pytest.fixture(scope="session")
@needs("redis_cluster")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackCluster]:
    """A 3-primary + 3-replica cluster on 127.0.0.1:7101-7106, stopped by PID when the session ends."""
    require_marked("redis_cluster", "the loopback Redis Cluster")  # also when reached by getfixturevalue
    cluster = LoopbackCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def backend_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest | None = None) -> str:
    if backend == "memory":
        return f"memory://test-{uuid.uuid4().hex}"
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'singleton.db'}"
    if backend == "redis":
        require_server(REDIS_URL, "Redis")
        return REDIS_URL
    if backend == "postgres":
        require_server(POSTGRES_URL, "PostgreSQL")
        return POSTGRES_URL
    if backend == "redis-cluster" and request is not None:
        cluster: LoopbackCluster = request.getfixturevalue("redis_cluster")
        return cluster.url
    raise ValueError(backend)


StoreFactory = Callable[..., Store]


def backend_params(backends: list[str]) -> list[Any]:
    """Each backend as a parameter carrying its mark, so ``-m redis`` selects the Redis legs."""
    return [
        pytest.param(name, marks=getattr(pytest.mark, name.replace("-", "_")), id=name) for name in backends
    ]


@pytest.fixture(params=backend_params(BACKENDS))
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class OpenGatekeepers:
    """The gatekeepers a test made, and the background threads of those it closed."""

    def __init__(self) -> None:
        self.made: list[Gatekeeper] = []
        self.threads: list[threading.Thread] = []

    def close(self) -> None:
        while self.made:
            gatekeeper = self.made.pop()
            for worker in (gatekeeper._heartbeater, gatekeeper._confirmer):
                thread = getattr(worker, "_thread", None)
                if thread is not None:
                    self.threads.append(thread)
            gatekeeper.close()


@pytest.fixture(autouse=True)
def gatekeepers(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenGatekeepers]:
    """Every :class:`Gatekeeper` a test makes (a Celery app's, a middleware's), closed after it;
    the test fails if one's heartbeat or confirm thread is still running then.

    A gatekeeper left open keeps its heartbeat ticking against a store the test closed, logging a
    traceback every interval for the rest of the session. Python 3.11 parses source with ``ast``
    to format each traceback, and ``ast`` is not thread-safe there (CPython gh-106905): the model
    test's Hypothesis failed with "AST constructor recursion depth mismatch" beside such a thread.
    (A gatekeeper made by a module- or session-wide fixture is that fixture's to close.)
    """
    opened = OpenGatekeepers()
    init = Gatekeeper.__init__

    def tracked_init(self: Gatekeeper, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        opened.made.append(self)

    monkeypatch.setattr(Gatekeeper, "__init__", tracked_init)
    yield opened
    opened.close()
    for thread in opened.threads:
        thread.join(timeout=5.0)
        if thread.is_alive():
            pytest.fail(f"the test left {thread.name} running", pytrace=False)


@pytest.fixture
def store_factory(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, gatekeepers: OpenGatekeepers
) -> Iterator[StoreFactory]:
    """Make stores on one server; each test gets its own namespace unless it names one."""
    url = backend_url(backend, tmp_path, request)
    default_namespace = f"t{uuid.uuid4().hex[:12]}"
    made: list[Store] = []

    def make(namespace: str | None = None, **options: object) -> Store:
        store = store_from_url(url, namespace=namespace or default_namespace, **options)
        store.migrate()
        made.append(store)
        return store

    yield make
    gatekeepers.close()  # no heartbeat or confirm thread may use a store being closed
    flush_all_confirms()
    for store in made:
        store.close()
    purge_namespaces(backend, url, {store.namespace for store in made})


def purge_namespaces(backend: str, url: str, namespaces: set[str]) -> None:
    """Leave the shared test servers as found: drop what the test's namespaces wrote."""
    if backend == "redis":
        import redis

        client = redis.Redis.from_url(url)
        try:
            for namespace in namespaces:
                batch = list(client.scan_iter(match=f"{namespace}:*", count=1000))
                for start in range(0, len(batch), 500):
                    client.delete(*batch[start : start + 500])
        finally:
            client.close()
    elif backend == "redis-cluster":
        from redis.cluster import RedisCluster

        cluster = RedisCluster.from_url(url.replace("redis+cluster://", "redis://").split(",")[0])
        try:
            for namespace in namespaces:
                for key in list(cluster.scan_iter(match=f"{namespace}:*", count=1000)):
                    cluster.delete(key)  # keys of many slots: one at a time
        finally:
            cluster.close()
    elif backend == "postgres":
        import psycopg

        with psycopg.connect(url, autocommit=True) as connection:
            for table in ("singleton_runs", "singleton_settled", "singleton_keys"):
                connection.execute(
                    f"DELETE FROM {table} WHERE namespace = ANY(%s)",  # type: ignore[arg-type]
                    [sorted(namespaces)],
                )


@pytest.fixture
def store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """The URL of ``store_factory``'s server, for child processes that make their own stores.

    (For memory:// every call names a new server: memory stores cannot cross processes.)
    """
    return backend_url(backend, tmp_path, request)


@pytest.fixture
def store(store_factory: StoreFactory) -> Store:
    return store_factory()


@pytest.fixture
def metrics_registry() -> Iterator[CollectorRegistry]:
    """The library's metrics sent to a registry of the test's own; the hooks as they were after."""
    saved = (metrics._active, metrics._disabled)
    registry = CollectorRegistry()
    metrics.install(registry)
    yield registry
    metrics._active, metrics._disabled = saved


def look_at_runs_never_seen(store: Store) -> None:
    """Calls about runs ``store`` never saw, each on a key of its own (k1..k5): none writes anything."""
    asked = store.claim(RunSpec("s", "k1", "r1"), 0, PAYLOAD_ON_REQUEST)
    assert asked.decision is Decision.PAYLOAD_NEEDED
    assert not store.confirm("s", "k2", "r2")
    assert store.park("s", "k3", "r3") == ()
    assert not store.suspend("s", "k4", "r4", 1, delay=1.0)
    assert not store.unregister("s", "k5", "r5")
