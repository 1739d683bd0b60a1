"""An unusable store is a typed error before anything is published, on both frameworks (issue 16).

A bad URL is refused when the adapter is constructed (no connection there); a store that cannot
be used at the first ``.send()`` / ``.delay()`` (a bad URL that arrived later, an unreachable or
silent server, a missing schema) makes that call raise a ``SingletonError`` within the store's
connect timeout, and the broker holds nothing. Dramatiq's errors are ``MiddlewareError`` too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from celery import Celery
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import MiddlewareError

from singleton_tasks import (
    SchemaVersionError,
    SingletonConfigError,
    SingletonError,
    StoreUnavailableError,
    store_from_url,
)
from singleton_tasks.celery import SingletonTask, install
from singleton_tasks.dramatiq import ConfigError, SingletonMiddleware
from singleton_tasks.stores import SCHEMA_VERSION
from singleton_tasks.stores.choice import STORE_ENV

KNOWN = str(
    sorted(
        [
            *("memory", "postgres", "postgresql", "redis", "redis+cluster", "redis+sentinel", "rediss"),
            *("rediss+cluster", "rediss+sentinel", "sqlite"),
        ]
    )
)

#: URLs refused by their scheme or syntax: (url, what the error must name).
BAD_URLS = {
    "unknown-scheme": ("mysql://app:s3cret@localhost/db", "unknown store scheme 'mysql'"),
    "typo-scheme": ("redsi://localhost:6379/0", "unknown store scheme 'redsi'"),
    "no-scheme": ("localhost:6379", "malformed store URL"),
    "sqlite-two-slashes": ("sqlite://x.db", "malformed SQLite store URL"),
    "bad-port": ("redis://app:s3cret@localhost:6379x/0", "malformed store URL"),
    "cluster-bad-port": ("redis+cluster://app:s3cret@h1:7101,h2:71o2", "port '71o2' is not a number"),
    "cluster-database": ("rediss+cluster://app:s3cret@h1:7101/2", "a Redis Cluster has only database 0"),
}


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A port that takes TCP connections and never answers (a server that hangs, or drops packets)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepted: the handshake completes, no byte ever comes back
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


@dataclass(frozen=True)
class Case:
    """How the unusable store reaches the adapter, and how long the send may take to refuse."""

    store: Callable[[int, Path], Any]  # (port of the silent server, a folder) -> URL or Store
    late_url: str | None  # a bad URL that arrives after construction (env / app.conf)
    error: type[SingletonError]
    bound: float


def _newer_schema(_port: int, folder: Path) -> str:
    # The store answers, but another library version wrote its schema.
    url = f"sqlite:///{folder / 'newer.db'}"
    store = store_from_url(url)
    store.migrate()
    store.set_schema_version_for_tests(SCHEMA_VERSION + 1)  # type: ignore[attr-defined]
    store.close()
    return url


CASES = {
    **{
        name: Case(lambda _p, _f: None, url, SingletonConfigError, 2.0)
        for name, (url, _what) in BAD_URLS.items()
    },
    "redis-refused": Case(lambda _p, _f: "redis://127.0.0.1:1/0", None, StoreUnavailableError, 2.0),
    "redis-cluster-refused": Case(
        lambda _p, _f: "redis+cluster://app:s3cret@127.0.0.1:1,127.0.0.1:2", None, StoreUnavailableError, 2.0
    ),
    "redis-silent": Case(
        lambda p, _f: f"redis://127.0.0.1:{p}/0?socket_connect_timeout=1&socket_timeout=1",
        None,
        StoreUnavailableError,
        3.0,
    ),
    "postgres-refused": Case(
        lambda _p, _f: "postgresql://127.0.0.1:1/test", None, StoreUnavailableError, 7.5
    ),
    "postgres-silent": Case(
        lambda p, _f: store_from_url(f"postgresql://127.0.0.1:{p}/test", timeout=1.0),
        None,
        StoreUnavailableError,
        3.5,
    ),
    "newer-schema": Case(_newer_schema, None, SchemaVersionError, 2.0),
}


def _namespace() -> str:
    return f"bad{uuid.uuid4().hex[:10]}"


# -- construction -------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(BAD_URLS))
@pytest.mark.parametrize("framework", ["dramatiq", "celery"])
def test_a_bad_store_url_is_refused_at_construction(framework: str, case: str) -> None:
    url, what = BAD_URLS[case]
    with pytest.raises(SingletonConfigError) as raised:
        if framework == "dramatiq":
            SingletonMiddleware(store=url)
        else:
            install(Celery("bad", set_as_current=False), store=url)
    message = str(raised.value)
    assert what in message
    assert "s3cret" not in message
    if "scheme" in what:
        assert KNOWN in message  # the known schemes are listed


@pytest.mark.parametrize("framework", ["dramatiq", "celery"])
def test_a_bad_store_url_in_the_environment_is_refused_at_construction(
    framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STORE_ENV, "mysql://app:s3cret@localhost/db")
    with pytest.raises(SingletonConfigError, match="unknown store scheme 'mysql'") as raised:
        if framework == "dramatiq":
            SingletonMiddleware()
        else:
            install(Celery("bad", set_as_current=False))
    assert "s3cret" not in str(raised.value)


def test_construction_never_connects() -> None:
    # Valid URLs of servers that are not there: a worker may start before its store.
    SingletonMiddleware(store="redis://127.0.0.1:1/0")
    SingletonMiddleware(store="postgresql://127.0.0.1:1/test")
    install(Celery("early", set_as_current=False), store="redis://127.0.0.1:1/0")
    with pytest.raises(SingletonConfigError, match="store must be a store URL or a Store"):
        SingletonMiddleware(store=6379)  # type: ignore[arg-type]


# -- the first send -----------------------------------------------------------------------------
def _dramatiq_send(store: Any, namespace: str) -> tuple[Callable[[], object], Callable[[], int]]:
    broker = StubBroker()
    broker.add_middleware(SingletonMiddleware(store, namespace=namespace))

    @dramatiq.actor(broker=broker, actor_name=f"bad_{namespace}", singleton={"key": "k:{x}"})
    def job(x: int) -> None: ...

    def held() -> int:
        return sum(queue.qsize() for queue in broker.queues.values())

    return lambda: job.send(1), held


def _celery_send(
    store: Any, namespace: str, late_url: str | None
) -> tuple[Callable[[], object], Callable[[], int]]:
    app = Celery(f"bad{namespace}", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.task_default_queue = f"q{namespace}"
    if late_url is not None:
        app.conf.singleton_store = late_url  # read at first use, as without install()
    else:
        install(app, store, namespace=namespace)

    @app.task(base=SingletonTask, singleton={"key": "k:{x}"}, name=f"bad.{namespace}", shared=False)
    def job(x: int) -> None: ...

    def held() -> int:
        with app.connection() as conn:
            return int(conn.default_channel.queue_declare(queue=app.conf.task_default_queue).message_count)

    return lambda: job.delay(1), held


#: The cases that wait out a connect or pool timeout on real time: kept out of the fast loop.
SLOW_CASES = {"redis-silent", "postgres-refused", "postgres-silent"}


@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=[pytest.mark.slow] * (name in SLOW_CASES)) for name in sorted(CASES)]
)
@pytest.mark.parametrize("framework", ["dramatiq", "celery"])
def test_the_first_send_to_an_unusable_store_raises_and_publishes_nothing(
    framework: str, case: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = CASES[case]
    namespace = _namespace()
    with silent_server() as port:
        store = spec.store(port, tmp_path)
        if framework == "dramatiq":
            send, held = _dramatiq_send(store, namespace)
            if spec.late_url is not None:  # constructed without a store; the URL comes later
                monkeypatch.setenv(STORE_ENV, spec.late_url)
        else:
            send, held = _celery_send(store, namespace, spec.late_url)
        for _attempt in range(2):  # the first send, and the next one: nothing is cached wrongly
            started = time.monotonic()
            with pytest.raises(spec.error) as raised:
                send()
            elapsed = time.monotonic() - started
            assert elapsed < spec.bound, f"took {elapsed:.1f}s"
            if framework == "dramatiq":
                assert isinstance(raised.value, MiddlewareError)  # what Dramatiq lets reach .send()
            assert held() == 0
        assert "s3cret" not in str(raised.value)
        if not isinstance(store, str) and store is not None:
            store.close()


# -- a Dramatiq worker's boot -------------------------------------------------------------------
def test_a_dramatiq_worker_whose_store_url_turned_invalid_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broker = StubBroker()
    broker.add_middleware(SingletonMiddleware())
    monkeypatch.setenv(STORE_ENV, "mysql://localhost/db")
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    try:
        with caplog.at_level(logging.CRITICAL, "singleton_tasks"), pytest.raises(ConfigError, match="mysql"):
            worker.start()
    finally:
        worker.stop()
        broker.close()
    assert any("cannot start" in r.getMessage() and "mysql" in r.getMessage() for r in caplog.records)


def test_a_dramatiq_worker_with_an_unreachable_store_starts_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = StubBroker()
    broker.add_middleware(SingletonMiddleware("redis://127.0.0.1:1/0"))
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    with caplog.at_level(logging.WARNING, "singleton_tasks"):
        worker.start()
    worker.stop()
    broker.close()
    assert any("unavailable at worker start" in r.getMessage() for r in caplog.records)


@pytest.mark.slow  # starts the dramatiq command
def test_the_dramatiq_command_exits_at_boot_on_an_invalid_store_url(tmp_path: Path) -> None:
    (tmp_path / "badstore_broker.py").write_text(
        textwrap.dedent(
            """
            import dramatiq
            from dramatiq.brokers.stub import StubBroker
            from singleton_tasks.dramatiq import SingletonMiddleware

            broker = StubBroker()
            broker.add_middleware(SingletonMiddleware())  # store from SINGLETON_TASKS_STORE
            dramatiq.set_broker(broker)
            """
        )
    )
    env = {**os.environ, STORE_ENV: "mysql://app:s3cret@localhost/db"}
    dramatiq_cli = str(Path(sys.executable).with_name("dramatiq"))
    result = subprocess.run(
        [dramatiq_cli, "badstore_broker", "--path", str(tmp_path), "--processes", "1", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "unknown store scheme 'mysql'" in output and KNOWN in output
    assert "s3cret" not in output
    assert "ready for action" not in output
