"""The Redis store on a 3-primary + 3-replica loopback Redis Cluster (``redis+cluster://``).

The contract suite and the model test run on it from test_contract.py / test_model.py; here is
what only a cluster has: keys on several primaries in one heartbeat, inspection and operator
release across every primary, a slot moved to a primary without the function library, and URLs
that name no reachable seed.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from conftest import REDIS_URL
from loopback_cluster import LoopbackCluster
from redis_servers import as_written_by_version_3
from services import require_server

from singleton_tasks import SingletonConfigError, StoreUnavailableError, store_from_url
from singleton_tasks.cli import cli
from singleton_tasks.outcomes import Decision, HolderRef, RunSpec
from singleton_tasks.stores import check_store_url
from singleton_tasks.stores._redis_scripts import hash_tag as _hash_tag
from singleton_tasks.stores.redis_cluster import RedisClusterStore

SCOPE = "cluster.task"


@pytest.fixture
def store(redis_cluster: LoopbackCluster) -> Iterator[RedisClusterStore]:
    made = store_from_url(redis_cluster.url, namespace=f"c{uuid.uuid4().hex[:12]}")
    assert isinstance(made, RedisClusterStore)
    made.migrate()
    yield made
    for key in list(made._client.scan_iter(match=f"{made.namespace}:*", count=1000)):
        made._client.delete(key)
    made.close()


def keys_on_distinct_primaries(
    store: RedisClusterStore, cluster: LoopbackCluster, count: int = 3
) -> dict[str, int]:
    return cluster.keys_on_distinct_primaries(lambda key: store._prefix(SCOPE, key), count)


cluster = pytest.mark.redis_cluster  # the bad-input tests below need no cluster: every env runs them


@cluster
def test_one_heartbeat_extends_holders_on_three_primaries(
    store: RedisClusterStore, redis_cluster: LoopbackCluster
) -> None:
    """A script may touch one slot only: the batch is split by slot, not sent whole (CROSSSLOT)."""
    keys = keys_on_distinct_primaries(store, redis_cluster)
    refs = []
    for key in keys:
        spec = RunSpec(SCOPE, key, f"run-{key}", lease=30.0)
        outcome = store.claim(spec, 0, None)
        assert outcome.decision is Decision.ADMITTED and outcome.token is not None
        refs.append(HolderRef(SCOPE, key, spec.run_id, outcome.token))
    before = {s.key: s.holders[0].lease_expires_at for s in store.snapshot()}
    time.sleep(0.05)
    stale = HolderRef(SCOPE, "k0", "nobody", 1)
    outcome = store.heartbeat([*refs, stale])
    assert outcome.lost == ("nobody",)
    after = {s.key: s.holders[0].lease_expires_at for s in store.snapshot()}
    assert sorted(after) == sorted(keys)
    assert all(after[key] > before[key] for key in keys), (before, after)


def count_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The port each write to a server goes to, from now on (every command a client sends is one)."""
    ports: list[int] = []
    send = redis.connection.AbstractConnection.send_packed_command

    def counted(self: redis.connection.AbstractConnection, command: Any, check_health: bool = True) -> None:
        ports.append(self.port)  # type: ignore[attr-defined]
        send(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)
    return ports


@cluster
def test_a_batch_of_confirms_is_one_write_per_primary(
    store: RedisClusterStore, redis_cluster: LoopbackCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer's confirm thread sends its batch in one write per primary, not one round trip per run."""
    runs = [(SCOPE, f"key-{i}", f"run-{i}") for i in range(30)]  # keys of every primary
    for scope, key, run_id in runs:
        store.register(RunSpec(scope, key, run_id), confirmed=False)
    writes = count_writes(monkeypatch)
    assert store.confirm_many(runs) == [True] * len(runs)
    monkeypatch.undo()
    assert sorted(writes) == redis_cluster.primary_ports(), writes
    assert all(w.confirmed for snap in store.snapshot(scope=SCOPE) for w in snap.waiters)
    assert store.confirm_many([*runs[:2], (SCOPE, "key-0", "nobody")]) == [True, True, False]


@cluster
def test_each_operation_is_one_write_to_its_keys_primary(
    store: RedisClusterStore, redis_cluster: LoopbackCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The uncontended run's register, claim and release: one round trip each, to the primary of
    the key's slot (no routing or schema read in between)."""
    [key] = keys_on_distinct_primaries(store, redis_cluster, 1)
    primary = redis_cluster.primary_port_of(store._prefix(SCOPE, key))
    spec = RunSpec(SCOPE, key, "run")
    store.register(RunSpec(SCOPE, key, "warm"))  # the thread's first call connects
    assert store.unregister(SCOPE, key, "warm")
    writes = count_writes(monkeypatch)
    store.register(spec)
    claimed = store.claim(spec, 0, None)
    assert store.release(SCOPE, key, "run", token=claimed.token).released
    assert claimed.decision is Decision.ADMITTED
    assert writes == [primary] * 3


@cluster
def test_inspect_and_operator_release_reach_every_primary(
    store: RedisClusterStore, redis_cluster: LoopbackCluster
) -> None:
    keys = keys_on_distinct_primaries(store, redis_cluster)
    for key in keys:
        store.claim(RunSpec(SCOPE, key, f"holder-{key}"), 0, None)
        assert store.claim(RunSpec(SCOPE, key, f"waiter-{key}"), 0, b"w").decision is Decision.GATED
    runner = CliRunner()
    shown = runner.invoke(
        cli, ["inspect", "--json", "--store", redis_cluster.url, "--namespace", store.namespace]
    )
    assert shown.exit_code == 0, shown.output
    document = json.loads(shown.output)
    assert sorted(k["key"] for k in document["keys"]) == sorted(keys)
    # Release each holder by run id alone: the store finds it on whichever primary serves its key.
    for key in keys:
        released = runner.invoke(
            cli,
            [
                "release",
                f"holder-{key}",
                "--yes",
                "--store",
                redis_cluster.url,
                "--namespace",
                store.namespace,
            ],
        )
        assert released.exit_code == 0, released.output
    assert {s.key: [h.run_id for h in s.holders] for s in store.snapshot()} == {k: [] for k in keys}
    assert {s.key: [w.run_id for w in s.waiters] for s in store.snapshot()} == {
        k: [f"waiter-{k}"] for k in keys
    }


@cluster
def test_each_slot_indexes_its_own_busy_keys_and_inspect_never_scans(
    store: RedisClusterStore, redis_cluster: LoopbackCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The busy-key index of a key lives in the key's own slot (the script updates both at once,
    else CROSSSLOT), lists it exactly while it has runs, and `inspect` reads the indexes, never SCAN."""
    busy = keys_on_distinct_primaries(store, redis_cluster)
    for key in busy:
        assert store.claim(RunSpec(SCOPE, key, f"holder-{key}"), 0, None).decision is Decision.ADMITTED
    for number in range(30):  # idle keys, spread over the slots
        spec = RunSpec(SCOPE, f"idle{number}", f"r{number}")
        outcome = store.claim(spec, 0, None)
        assert store.release(SCOPE, spec.key, spec.run_id, token=outcome.token).released
    client = store._client
    for key in busy:
        prefix = store._prefix(SCOPE, key)
        index = store._index_key(prefix[len(store.namespace) + 1 : -1])
        assert client.keyslot(index) == client.keyslot(prefix + b"meta")
        assert prefix[len(store.namespace) + 1 : -1] in client.smembers(index)
    indexes = list(client.scan_iter(match=f"{store.namespace}:{{*}}:busy", count=1000))
    assert sum(client.scard(index) for index in indexes) == len(busy)

    def no_scan(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("inspect scanned the database")

    monkeypatch.setattr(client, "scan_iter", no_scan)
    assert sorted(s.key for s in store.snapshot()) == sorted(busy)
    for key in busy:
        released = store.operator_release(f"holder-{key}")
        assert released is not None and released.released
    assert store.snapshot() == []
    monkeypatch.undo()
    # Idle again: no index is left behind.
    assert list(client.scan_iter(match=f"{store.namespace}:{{*}}:busy", count=1000)) == []


@cluster
def test_migrate_from_version_2_indexes_the_busy_keys_of_every_primary(
    store: RedisClusterStore, redis_cluster: LoopbackCluster
) -> None:
    """A namespace written before the busy index: `migrate` scans every primary and lists each
    busy key in its own slot's index."""
    busy = keys_on_distinct_primaries(store, redis_cluster)
    for key in busy:
        assert store.claim(RunSpec(SCOPE, key, f"holder-{key}"), 0, None).decision is Decision.ADMITTED
    client = store._client
    indexes = list(client.scan_iter(match=f"{store.namespace}:{{*}}:busy", count=1000))
    assert len(indexes) == len(busy)
    for index in indexes:  # what version 2 left: the keys, no index
        client.delete(index)
    store.set_schema_version_for_tests(2)
    assert store.snapshot() == []
    store.migrate()
    store.check_schema()
    assert sorted(s.key for s in store.snapshot()) == sorted(busy)


@cluster
def test_tick_due_finds_the_due_keys_of_every_primary(
    store: RedisClusterStore, redis_cluster: LoopbackCluster
) -> None:
    """Each key is listed as due in its own slot's due index; tick_due reads every slot's and
    ticks each due key on its own primary."""
    keys = keys_on_distinct_primaries(store, redis_cluster)
    for key in keys:
        store.claim(RunSpec(SCOPE, key, f"h-{key}", lease=0.1, orphan_timeout=0.1), 0, None)
        waiter = RunSpec(SCOPE, key, f"w-{key}", orphan_timeout=0.1, recheck=0.0)
        store.register(waiter, payload=b"w")  # due when unseen for its orphan timeout
        tag = _hash_tag(SCOPE, key)
        assert store._client.zscore(store._due_index_key(tag), tag) is not None
    time.sleep(0.3)
    done = store.tick_due()
    assert sorted((d.key, d.evicted, [(w.run_id, w.payload) for w in d.wakes]) for d in done) == sorted(
        (key, (f"h-{key}",), [(f"w-{key}", b"w")]) for key in keys
    )
    assert store.tick_due() == []  # issued again only after its orphan timeout
    for key in keys:
        assert store.release(SCOPE, key, f"w-{key}", token=None).released
    assert list(store._client.scan_iter(match=f"{store.namespace}:{{*}}:due", count=1000)) == []


@cluster
def test_migrate_from_version_3_on_every_primary(
    store: RedisClusterStore, redis_cluster: LoopbackCluster
) -> None:
    """`migrate` brings the busy keys of every primary to version 4, each in its own slot."""
    busy = keys_on_distinct_primaries(store, redis_cluster)
    for key in busy:
        assert store.claim(RunSpec(SCOPE, key, f"holder-{key}"), 0, None).decision is Decision.ADMITTED
        store.register(RunSpec(SCOPE, key, f"queued-{key}"), payload=b"q", confirmed=False)
    as_written_by_version_3(store)
    store.set_schema_version_for_tests(3)
    store.migrate()
    store.check_schema()
    client = store._client
    for key in busy:
        tag, prefix = _hash_tag(SCOPE, key), store._prefix(SCOPE, key)
        assert client.zscore(store._due_index_key(tag), tag) == 0.0
        assert client.zrange(prefix + b"unconfirmed", 0, -1) == [f"queued-{key}".encode()]
        assert not client.exists(prefix + b"overdue")
        run = prefix + b"run:" + f"queued-{key}".encode()
        assert client.hexists(run, "reissue_at") and not client.hexists(run, "passed_over_at")
    assert store.tick_due() == []  # every key ticked: its due_at recomputed, nothing to do yet
    assert all(client.zscore(store._due_index_key(_hash_tag(SCOPE, k)), _hash_tag(SCOPE, k)) for k in busy)


@cluster
def test_a_phantom_holder_is_shown_evicted_and_released_on_the_cluster(
    store: RedisClusterStore, redis_cluster: LoopbackCluster
) -> None:
    """A holder whose run hash is gone (lost by a failover) never sticks its key or crashes the CLI."""
    [key] = keys_on_distinct_primaries(store, redis_cluster, 1)
    store.claim(RunSpec(SCOPE, key, "ghost", lease=30.0), 0, None)
    gated = store.claim(RunSpec(SCOPE, key, "waiter"), 0, b"w")
    store._client.delete(store._prefix(SCOPE, key) + b"run:ghost")
    shown = CliRunner().invoke(
        cli, ["inspect", "--json", "--store", redis_cluster.url, "--namespace", store.namespace]
    )
    assert shown.exit_code == 0, shown.output
    [entry] = json.loads(shown.output)["keys"]
    assert [(h["run_id"], h["status"]) for h in entry["holders"]] == [("ghost", "phantom")]
    outcome = store.claim(RunSpec(SCOPE, key, "waiter"), gated.generation or 0, b"w")
    assert outcome.decision is Decision.ADMITTED and outcome.evicted == ("ghost",)
    store.register(RunSpec(SCOPE, key, "lost"))
    store._client.delete(store._prefix(SCOPE, key) + b"run:lost")
    released = store.operator_release("lost")
    assert released is not None and released.released
    assert [w.run_id for w in store.snapshot()[0].waiters] == []


def _move_slot(cluster: LoopbackCluster, slot: int, source: int, target: int) -> None:
    """Reshard one slot from one primary to another, keys and all (what redis-cli --cluster does)."""
    src, dst = redis.Redis(port=source), redis.Redis(port=target)
    src_id, dst_id = src.execute_command("CLUSTER MYID"), dst.execute_command("CLUSTER MYID")
    dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", "127.0.0.1", target, "", 0, 5000, "KEYS", *keys)
    for port in cluster.primary_ports():
        redis.Redis(port=port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)
    cluster.wait_ok()


@cluster
def test_a_slot_moved_to_a_primary_without_the_library_keeps_serving(
    store: RedisClusterStore, redis_cluster: LoopbackCluster
) -> None:
    """MOVED is followed, and a primary that lacks the function library gets it and the call is made again."""
    [key] = keys_on_distinct_primaries(store, redis_cluster, 1)
    prefix = store._prefix(SCOPE, key)
    holder = store.claim(RunSpec(SCOPE, key, "holder"), 0, None)
    gated = store.claim(RunSpec(SCOPE, key, "waiter"), 0, b"w")
    source = redis_cluster.primary_port_of(prefix)
    target = next(port for port in redis_cluster.primary_ports() if port != source)
    redis.Redis(port=target).function_flush()  # a primary as a resharding adds it: no library
    _move_slot(redis_cluster, redis.Redis(port=source).cluster("keyslot", prefix), source, target)
    assert redis_cluster.primary_port_of(prefix) == target
    released = store.release(SCOPE, key, "holder", token=holder.token)
    assert released.released and [w.run_id for w in released.wakes] == ["waiter"]
    assert (
        store.claim(RunSpec(SCOPE, key, "waiter"), gated.generation or 0, b"w").decision is Decision.ADMITTED
    )
    assert redis.Redis(port=target).exists(prefix + b"meta") == 1
    assert redis.Redis(port=target).function_list() != []


@cluster
def test_scripts_are_loaded_again_where_a_primary_lost_them(redis_cluster: LoopbackCluster) -> None:
    """Without functions (EVALSHA): NOSCRIPT on a primary loads the script on every primary and retries."""
    store = store_from_url(redis_cluster.url, namespace=f"c{uuid.uuid4().hex[:12]}", functions=False)
    try:
        store.migrate()
        for port in redis_cluster.primary_ports():
            redis.Redis(port=port).script_flush()
        assert store.claim(RunSpec(SCOPE, "k", "r"), 0, None).decision is Decision.ADMITTED
        assert store.release(SCOPE, "k", "r", token=None).released
    finally:
        store.close()


@cluster
def test_retention_in_the_cluster_url(redis_cluster: LoopbackCluster) -> None:
    """The URL's other options still reach the client (tests/test_config.py checks the parse)."""
    made = store_from_url(
        redis_cluster.url + "?retention=7&client_name=kept", namespace=f"c{uuid.uuid4().hex[:12]}"
    )
    try:
        assert made.retention == 7.0
        made.migrate()
        made.register(RunSpec(SCOPE, "k", "r1"))
        assert [snap.key for snap in made.snapshot()] == ["k"]
        primary = made._servers()[0]  # type: ignore[attr-defined]
        assert primary.client_getname() in ("kept", b"kept")
    finally:
        made.release(SCOPE, "k", "r1", token=None)
        for key in list(made._client.scan_iter(match=f"{made.namespace}:*", count=1000)):  # type: ignore[attr-defined]
            made._client.delete(key)  # type: ignore[attr-defined]
        made.close()


# -- bad input (no cluster needed) ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "what"),
    [
        ("redis+cluster://app:s3cret@127.0.0.1:7101,:7102", "has no host"),
        ("redis+cluster://app:s3cret@127.0.0.1:7101,127.0.0.1:71x2", "'71x2' is not a number"),
        ("rediss+cluster://app:s3cret@127.0.0.1:7101/3", "only database 0"),
        ("redis+cluster://app:s3cret@127.0.0.1:7101?socket_timeout=soon", "socket_timeout"),
    ],
)
def test_a_malformed_cluster_url_is_refused_naming_the_value(url: str, what: str) -> None:
    for check in (check_store_url, store_from_url):
        with pytest.raises(SingletonConfigError, match=r"malformed store URL|invalid") as raised:
            check(url)
        assert what in str(raised.value)
        assert "s3cret" not in str(raised.value) and "***" in str(raised.value)


def test_a_cluster_url_without_a_reachable_seed_is_unavailable_and_redacted() -> None:
    url = "redis+cluster://app:s3cret@127.0.0.1:1,127.0.0.1:2"
    assert check_store_url(url) == "redis+cluster"  # the syntax is fine: no connection here
    started = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="no seed node answered") as raised:
        store_from_url(url)
    assert time.monotonic() - started < 5
    message = str(raised.value)
    assert "127.0.0.1:1,127.0.0.1:2" in message and "s3cret" not in message


@pytest.mark.redis
def test_a_cluster_url_naming_a_standalone_server_is_a_config_error() -> None:
    require_server(REDIS_URL, "Redis")
    host = REDIS_URL.split("://", 1)[1].split("/", 1)[0]
    with pytest.raises(SingletonConfigError, match="not a Redis Cluster node") as raised:
        store_from_url(f"redis+cluster://{host}", namespace="never")
    assert f"redis+cluster://{host}" in str(raised.value) and "redis://" in str(raised.value)
