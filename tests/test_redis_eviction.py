"""An evicting Redis is refused (issue 18): with ``maxmemory-policy allkeys-*`` Redis may drop any
of the store's keys under memory pressure (a running holder's slot, the key's token) and the gate
would admit a second run of a key. The store reads the policy at first use, so the first
``.send()`` / ``.delay()`` and a worker's boot refuse it, and nothing is published or written.

Each server here is a private ``redis-server --maxmemory 64mb --maxmemory-policy …`` on a loopback
port of its own, started and stopped by PID.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import MiddlewareError
from redis_servers import RedisProcess, redis_server
from test_bad_stores import _celery_send, _dramatiq_send
from test_celery import make_app, unique, worker
from test_celery import wait_for as celery_wait_for

from singleton_tasks import SingletonConfigError, store_from_url
from singleton_tasks.celery import SingletonTask
from singleton_tasks.confirms import flush_all_confirms
from singleton_tasks.dramatiq import ConfigError, SingletonMiddleware
from singleton_tasks.outcomes import Decision, HolderRef, Registered, RunSpec
from singleton_tasks.runtime import Gatekeeper

pytestmark = pytest.mark.redis

PORTS = {"allkeys-lru": 7201, "noeviction": 7202, "volatile-lru": 7203}
SWITCHING_PORT = 7204


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RedisProcess]]:
    """One 64 MB server per policy."""
    started: dict[str, RedisProcess] = {}
    try:
        for policy, port in PORTS.items():
            folder = tmp_path_factory.mktemp(f"redis-{policy}")
            started[policy] = RedisProcess(
                port, folder, ["--maxmemory", "64mb", "--maxmemory-policy", policy]
            )
        yield started
    finally:
        for server in started.values():
            server.stop()


def _namespace() -> str:
    return f"ev{uuid.uuid4().hex[:10]}"


def _keys(server: RedisProcess, namespace: str) -> list[bytes]:
    return list(server.client.scan_iter(match=f"{namespace}:*"))


def assert_names_the_fix(message: str, policy: str = "allkeys-lru") -> None:
    assert "maxmemory-policy" in message and policy in message, message
    assert "noeviction" in message and "dedicated Redis" in message, message
    assert "allow_eviction" in message, message


def _sender(framework: str, store: Any, namespace: str) -> tuple[Callable[[], object], Callable[[], int]]:
    """A task's send and the count of messages it published, on either framework."""
    if framework == "dramatiq":
        return _dramatiq_send(store, namespace)
    return _celery_send(store, namespace, None)


def assert_send_refused(send: Callable[[], object], framework: str) -> None:
    """The send raises the refusal naming the fix (Dramatiq's as a MiddlewareError)."""
    with pytest.raises(SingletonConfigError) as raised:
        send()
    assert_names_the_fix(str(raised.value))
    if framework == "dramatiq":
        assert isinstance(raised.value, MiddlewareError)


def test_an_allkeys_server_is_refused_at_first_use_and_again_at_every_use(
    servers: dict[str, RedisProcess],
) -> None:
    namespace = _namespace()
    store = store_from_url(servers["allkeys-lru"].url, namespace=namespace)
    try:
        for operation in (store.migrate, lambda: store.register(RunSpec("s", "k", "r1")), store.time):
            with pytest.raises(SingletonConfigError) as raised:
                operation()
            assert_names_the_fix(str(raised.value))
    finally:
        store.close()
    assert _keys(servers["allkeys-lru"], namespace) == []


def test_the_policy_is_read_from_info_where_config_is_refused(servers: dict[str, RedisProcess]) -> None:
    """Managed services disable or rename CONFIG: INFO memory tells the policy too."""
    server = servers["allkeys-lru"]
    user = f"noconfig{uuid.uuid4().hex[:6]}"
    server.client.acl_setuser(
        user, enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all", "-config"]
    )
    store = store_from_url(f"redis://{user}:s3cret@127.0.0.1:{server.port}/0", namespace=_namespace())
    try:
        with pytest.raises(SingletonConfigError) as raised:
            store.migrate()
        assert_names_the_fix(str(raised.value))
        assert "s3cret" not in str(raised.value)
    finally:
        store.close()
        server.client.acl_deluser(user)


def test_an_unreadable_policy_is_a_warning_once(
    servers: dict[str, RedisProcess], caplog: pytest.LogCaptureFixture
) -> None:
    server = servers["noeviction"]
    user = f"blind{uuid.uuid4().hex[:6]}"
    server.client.acl_setuser(
        user, enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all", "-config", "-info"]
    )
    store = store_from_url(f"redis://{user}:s3cret@127.0.0.1:{server.port}/0", namespace=_namespace())
    try:
        with caplog.at_level(logging.WARNING, "singleton_tasks"):
            store.migrate()
            spec = RunSpec("s", "k", "r1")
            store.register(spec)
            assert store.claim(spec, 0, None).decision is Decision.ADMITTED
        warnings = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert "noeviction" in warnings[0] and "s3cret" not in warnings[0]
    finally:
        store.close()
        server.client.acl_deluser(user)


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru"])
def test_noeviction_and_volatile_policies_are_accepted(servers: dict[str, RedisProcess], policy: str) -> None:
    namespace = _namespace()
    store = store_from_url(servers[policy].url, namespace=namespace)
    try:
        store.migrate()
        spec = RunSpec("s", "k", "r1")
        store.register(spec)
        assert store.claim(spec, 0, None).decision is Decision.ADMITTED
        assert _keys(servers[policy], namespace)
    finally:
        store.close()


@pytest.mark.parametrize("how", ["keyword", "url"])
def test_allow_eviction_opts_out(servers: dict[str, RedisProcess], how: str) -> None:
    url = servers["allkeys-lru"].url
    namespace = _namespace()
    if how == "keyword":
        store = store_from_url(url, namespace=namespace, allow_eviction=True)
    else:
        store = store_from_url(url + "?allow_eviction=true", namespace=namespace)
    try:
        store.migrate()
        spec = RunSpec("s", "k", "r1")
        store.register(spec)
        assert store.claim(spec, 0, None).decision is Decision.ADMITTED
    finally:
        store.close()


@pytest.mark.parametrize("value", ["maybe", "2", ""])
def test_allow_eviction_must_be_true_or_false(value: str) -> None:
    with pytest.raises(SingletonConfigError, match="allow_eviction must be true or false") as raised:
        store_from_url(f"redis://:s3cret@127.0.0.1:1/0?allow_eviction={value}")
    assert repr(value) in str(raised.value) and "s3cret" not in str(raised.value)


# -- a policy changed while the store runs --------------------------------------------------------
@pytest.fixture
def switching(tmp_path: Path) -> Iterator[RedisProcess]:
    """A noeviction server of this test's own, whose policy the test changes."""
    with redis_server(
        SWITCHING_PORT, tmp_path, "--maxmemory", "64mb", "--maxmemory-policy", "noeviction"
    ) as server:
        yield server


def _set_policy(server: RedisProcess, policy: str) -> None:
    server.client.config_set("maxmemory-policy", policy)


def test_a_policy_set_at_runtime_stops_admissions_until_it_is_set_back(switching: RedisProcess) -> None:
    store = store_from_url(switching.url, namespace=_namespace())
    try:
        store.migrate()
        running = RunSpec("s", "running", "r0")
        store.register(running)
        token = store.claim(running, 0, None).token
        assert token is not None
        store.check_health()  # noeviction: nothing to refuse
        _set_policy(switching, "allkeys-lru")
        with pytest.raises(SingletonConfigError) as raised:
            store.check_health()
        assert_names_the_fix(str(raised.value))
        new = RunSpec("s", "new", "r1")
        for _attempt in range(2):
            for operation in (lambda: store.register(new), lambda: store.claim(new, 0, None)):
                with pytest.raises(SingletonConfigError) as refused:
                    operation()
                assert str(refused.value) == str(raised.value)
        assert store.snapshot(scope="s", key="new") == []  # nothing written
        # The run already admitted keeps its slot and settles.
        assert store.heartbeat([HolderRef("s", "running", "r0", token)]).lost == ()
        assert store.release("s", "running", "r0", token=token).released
        _set_policy(switching, "noeviction")
        store.check_health()
        assert store.register(new).status is Registered.REGISTERED
        assert store.claim(new, 0, None).decision is Decision.ADMITTED
    finally:
        store.close()


def test_allow_eviction_accepts_a_policy_set_at_runtime(switching: RedisProcess) -> None:
    store = store_from_url(switching.url, namespace=_namespace(), allow_eviction=True)
    try:
        store.migrate()
        _set_policy(switching, "allkeys-lru")
        store.check_health()
        assert store.register(RunSpec("s", "k", "r1")).status is Registered.REGISTERED
    finally:
        store.close()


def test_the_heartbeat_thread_checks_the_policy_each_interval(
    switching: RedisProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = store_from_url(switching.url, namespace=_namespace())
    gatekeeper = Gatekeeper(store, heartbeat_interval=0.05)
    checked = threading.Semaphore(0)
    check = store.check_health

    def observed() -> None:
        try:
            check()
        finally:
            checked.release()

    monkeypatch.setattr(store, "check_health", observed)
    try:
        store.migrate()
        _set_policy(switching, "allkeys-lru")
        caplog.set_level(logging.ERROR, "singleton_tasks")
        gatekeeper.heartbeats.start()
        assert checked.acquire(timeout=10)  # a check that began after the change
        with pytest.raises(SingletonConfigError) as raised:
            store.register(RunSpec("s", "k", "r1"))
        assert_names_the_fix(str(raised.value))
        _set_policy(switching, "noeviction")
        for _check in range(2):  # the second began after the change (and the first was logged)
            assert checked.acquire(timeout=10)
        assert store.register(RunSpec("s", "k", "r1")).status is Registered.REGISTERED
        assert any("admits no new runs" in r.getMessage() for r in caplog.records)
    finally:
        gatekeeper.close()
        store.close()


def test_a_health_check_the_server_does_not_answer_is_not_logged_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outage is reported by the heartbeats and the operations: the check adds no traceback."""
    store = store_from_url("redis://127.0.0.1:1/0", namespace=_namespace())
    gatekeeper = Gatekeeper(store)
    try:
        with caplog.at_level(logging.DEBUG, "singleton_tasks"):
            gatekeeper.heartbeats.check_health()
        assert all(r.levelno < logging.WARNING for r in caplog.records), caplog.records
        assert any("health check failed" in r.getMessage() for r in caplog.records)
    finally:
        gatekeeper.close()
        store.close()


@pytest.mark.parametrize("framework", ["dramatiq", "celery"])
def test_sends_are_refused_while_a_runtime_policy_evicts(switching: RedisProcess, framework: str) -> None:
    store = store_from_url(switching.url, namespace=_namespace())
    try:
        send, held = _sender(framework, store, store.namespace)
        send()
        _set_policy(switching, "allkeys-lru")
        with pytest.raises(SingletonConfigError):
            store.check_health()  # as a worker's heartbeat thread does
        assert_send_refused(send, framework)
        assert held() == 1
        _set_policy(switching, "noeviction")
        store.check_health()
        send()
        assert held() == 2
    finally:
        flush_all_confirms()
        store.close()


def test_a_celery_delivery_refused_at_runtime_is_deferred_and_runs_once_set_back(
    switching: RedisProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused, a claim defers its delivery (as an outage does) instead of failing the task."""
    store = store_from_url(switching.url, namespace=_namespace())
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k:{x}"}, name=unique(), shared=False)
    def job(x: int) -> int:
        return x

    try:
        result = job.delay(7)  # registered while the policy is accepted
        _set_policy(switching, "allkeys-lru")
        with pytest.raises(SingletonConfigError):
            store.check_health()  # as a worker's heartbeat thread does
        caplog.set_level(logging.ERROR, "singleton_tasks")
        with worker(app):
            celery_wait_for(
                lambda: result.ready() or any("deferred" in r.getMessage() for r in caplog.records),
                what="a refused claim",
            )
            assert result.state == "PENDING"  # not FAILURE: the run is still on its way
            _set_policy(switching, "noeviction")
            store.check_health()
            assert result.get(interval=0.01, timeout=10) == 7
    finally:
        flush_all_confirms()
        store.close()


# -- through the adapters -----------------------------------------------------------------------
@pytest.mark.parametrize("framework", ["dramatiq", "celery"])
def test_the_first_send_to_an_evicting_server_raises_and_publishes_nothing(
    servers: dict[str, RedisProcess], framework: str
) -> None:
    server, namespace = servers["allkeys-lru"], _namespace()
    send, held = _sender(framework, server.url, namespace)
    for _attempt in range(2):  # refused again: the refusal is not cached as a success
        assert_send_refused(send, framework)
        assert held() == 0
    assert _keys(server, namespace) == []


@pytest.mark.parametrize("framework", ["dramatiq", "celery"])
def test_the_first_send_to_a_noeviction_server_goes_through(
    servers: dict[str, RedisProcess], framework: str
) -> None:
    server, namespace = servers["noeviction"], _namespace()
    send, held = _sender(framework, server.url, namespace)
    send()
    assert held() == 1
    assert _keys(server, namespace)


def test_a_dramatiq_worker_refuses_to_start_on_an_evicting_server(
    servers: dict[str, RedisProcess], caplog: pytest.LogCaptureFixture
) -> None:
    broker = StubBroker()
    broker.add_middleware(SingletonMiddleware(servers["allkeys-lru"].url, namespace=_namespace()))
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    try:
        with caplog.at_level(logging.CRITICAL, "singleton_tasks"), pytest.raises(ConfigError) as raised:
            worker.start()
    finally:
        worker.stop()
        broker.close()
    assert_names_the_fix(str(raised.value))
    assert any("cannot start" in r.getMessage() for r in caplog.records)


def test_the_celery_worker_command_exits_at_boot_on_an_evicting_server(
    servers: dict[str, RedisProcess], tmp_path: Path
) -> None:
    (tmp_path / "evicting_app.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            from singleton_tasks.celery import SingletonTask, install

            app = Celery("evicting", broker="memory://", backend="cache+memory://")
            install(app, {servers["allkeys-lru"].url!r}, namespace={_namespace()!r})

            @app.task(base=SingletonTask, singleton={{"key": "k:{{x}}"}})
            def job(x):
                return x
            """
        )
    )
    celery_cli = str(Path(sys.executable).with_name("celery"))
    result = subprocess.run(
        [celery_cli, "-A", "evicting_app", "--workdir", str(tmp_path), "worker", "--pool", "solo"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert_names_the_fix(output)
    assert "ready." not in output
