"""``wait_replicas=N[&wait_timeout_ms=M]`` (issue 18): every writing operation waits for N replicas
(``WAIT``, sent behind the script call in the same round trip) before the gate answers; fewer
acknowledgements fail the operation closed. A private primary and its replica on loopback,
started and stopped by PID.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Iterator

import pytest
from redis_servers import RedisProcess, replica_in_sync, wait_for
from test_roundtrips import commands_sent, verbs

from singleton_tasks import SingletonConfigError, StoreUnavailableError, store_from_url
from singleton_tasks.outcomes import Decision, Registered, RunSpec

pytestmark = pytest.mark.redis

PRIMARY_PORT, REPLICA_PORT = 7210, 7211


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisProcess, RedisProcess]]:
    primary = RedisProcess(PRIMARY_PORT, tmp_path_factory.mktemp("primary"), [])
    try:
        replica = RedisProcess(
            REPLICA_PORT, tmp_path_factory.mktemp("replica"), ["--replicaof", "127.0.0.1", str(PRIMARY_PORT)]
        )
        try:
            wait_for(lambda: replica_in_sync(primary), "the replica to sync")
            yield primary, replica
        finally:
            replica.stop()
    finally:
        primary.stop()


def _namespace() -> str:
    return f"wr{uuid.uuid4().hex[:10]}"


def test_each_write_waits_for_the_replica(
    servers: tuple[RedisProcess, RedisProcess],
) -> None:
    primary, replica = servers
    store = store_from_url(f"{primary.url}?wait_replicas=1&wait_timeout_ms=2000", namespace=_namespace())
    try:
        store.migrate()
        spec = RunSpec("s", "k", "r1")
        store.register(spec)  # warm: the first use checks the server and loads the library
        outcome, sent, _ = commands_sent(primary.url, lambda: store.claim(spec, 0, b"payload"))
        assert outcome.decision is Decision.ADMITTED
        assert verbs(sent) == ["FCALL", "WAIT"], sent
        assert sent[1] == "WAIT 1 2000", sent
        # Acknowledged: the replica has the admission the moment the gate answered.
        assert replica.client.exists(*(k for k in primary.client.scan_iter(match=f"{store.namespace}:*")))
        _, sent, _ = commands_sent(primary.url, lambda: store.snapshot(scope="s", key="k"))
        assert verbs(sent) == ["FCALL"], sent  # a read does not wait
        released = store.release("s", "k", "r1", token=outcome.token)
        assert released.released
    finally:
        store.close()


def test_fewer_acknowledgements_fail_the_operation_closed(servers: tuple[RedisProcess, RedisProcess]) -> None:
    """A replica that does not answer (paused): the write is on the primary, the gate says unavailable."""
    primary, replica = servers
    store = store_from_url(primary.url, namespace=_namespace(), wait_replicas=1, wait_timeout_ms=300)
    try:
        store.migrate()
        replica.process.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailableError) as raised:
                store.register(RunSpec("s", "k", "r1"))
            elapsed = time.monotonic() - started
        finally:
            replica.process.send_signal(signal.SIGCONT)
        message = str(raised.value)
        assert "0 of wait_replicas=1" in message and "300 ms" in message, message
        assert 0.25 < elapsed < 3.0, elapsed
        # Applied on the primary all the same (WAIT cannot take a write back): a retry finds it.
        wait_for(lambda: replica_in_sync(primary), "the replica to resume")
        assert store.register(RunSpec("s", "k", "r1")).status is Registered.EXISTS
    finally:
        store.close()


def test_more_replicas_than_present_is_refused_before_anything_is_written(
    servers: tuple[RedisProcess, RedisProcess],
) -> None:
    primary, _ = servers
    namespace = _namespace()
    store = store_from_url(f"redis://:s3cret@127.0.0.1:{PRIMARY_PORT}/0?wait_replicas=2", namespace=namespace)
    try:
        for _attempt in range(2):
            with pytest.raises(SingletonConfigError) as raised:
                store.register(RunSpec("s", "k", "r1"))
            message = str(raised.value)
            assert "wait_replicas=2" in message and "1 connected replica" in message, message
            assert "s3cret" not in message
    finally:
        store.close()
    assert list(primary.client.scan_iter(match=f"{namespace}:*")) == []


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"wait_replicas": 0}, "wait_replicas must be an integer >= 1, got 0"),
        ({"wait_replicas": -1}, "wait_replicas must be an integer >= 1, got -1"),
        ({"wait_replicas": True}, "wait_replicas must be an integer >= 1, got True"),
        ({"wait_replicas": "two"}, "wait_replicas must be an integer >= 1, got 'two'"),
        ({"wait_replicas": 1, "wait_timeout_ms": 0}, "wait_timeout_ms must be an integer >= 1, got 0"),
        ({"wait_timeout_ms": 100}, "wait_timeout_ms needs wait_replicas"),
        ({"wait_replicas": 1, "wait_timeout_ms": 5000}, "must be shorter than the socket_timeout"),
    ],
)
def test_bad_wait_options_are_refused_by_name(options: dict[str, object], what: str) -> None:
    with pytest.raises(SingletonConfigError) as raised:
        store_from_url("redis://:s3cret@127.0.0.1:1/0", **options)
    assert what in str(raised.value) and "s3cret" not in str(raised.value)


@pytest.mark.parametrize(
    ("query", "what"),
    [
        ("wait_replicas=0", "wait_replicas must be an integer >= 1, got '0'"),
        ("wait_replicas=1&wait_timeout_ms=soon", "wait_timeout_ms must be an integer >= 1, got 'soon'"),
    ],
)
def test_bad_wait_options_in_the_url_are_refused_by_name(query: str, what: str) -> None:
    from singleton_tasks.stores import check_store_url

    url = f"redis://:s3cret@127.0.0.1:1/0?{query}"
    for refuse in (check_store_url, store_from_url):
        with pytest.raises(SingletonConfigError) as raised:
            refuse(url)
        assert what in str(raised.value) and "s3cret" not in str(raised.value)


def test_an_option_given_twice_must_agree() -> None:
    with pytest.raises(SingletonConfigError, match="wait_replicas is given twice"):
        store_from_url("redis://127.0.0.1:1/0?wait_replicas=1", wait_replicas=2)
    store = store_from_url("redis://127.0.0.1:1/0?wait_replicas=1", wait_replicas=1)
    assert store.options.wait_replicas == 1  # type: ignore[attr-defined]
    store.close()
