"""What an operation costs on Redis: one FCALL each (one EVALSHA without functions), nothing else
(docs/deployment.md#choosing-a-store).

The test starts its own redis-server so that no other client's traffic is counted. What
the store sends is read with MONITOR, where commands that a Lua script runs inside the server
show as ``lua`` and are not round trips; ``INFO commandstats`` deltas cross-check the count
(they include commands run inside scripts, so alone they cannot tell a round trip apart).
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from services import free_port, require_executable

redis = pytest.importorskip("redis")

from singleton_tasks import Store, store_from_url  # noqa: E402
from singleton_tasks.outcomes import Decision, HolderRef, Registered, RunSpec  # noqa: E402

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on a free loopback port, stopped after the module."""
    executable = require_executable("redis-server")
    port = free_port()
    directory: Path = tmp_path_factory.mktemp("redis")
    server = subprocess.Popen(
        [
            executable,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        deadline = time.monotonic() + 10
        while True:  # waiting for a server we just started, not polling library state
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail(f"redis-server on port {port} did not start")
                time.sleep(0.05)
        client.close()
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(params=["FCALL", "EVALSHA"])
def call(request: pytest.FixtureRequest) -> str:
    """How the store calls its scripts: as a function library (Redis 7+) or by EVALSHA."""
    return str(request.param)


@pytest.fixture
def store(redis_url: str, call: str) -> Iterator[Store]:
    store = store_from_url(redis_url, namespace=f"rt{uuid.uuid4().hex[:10]}", functions=call == "FCALL")
    store.migrate()
    # Load every script and open the connection, so the measured calls are warm.
    spec = RunSpec("warm", "up", "w", limit=1)
    store.register(spec)
    outcome = store.claim(spec, 0, None)
    assert outcome.token is not None
    store.heartbeat([HolderRef("warm", "up", "w", outcome.token)])
    store.suspend("warm", "up", "w", outcome.token, delay=1.0)
    store.release("warm", "up", "w", token=outcome.token)
    yield store
    store.close()


def commands_sent(url: str, action: Callable[[], Any]) -> tuple[Any, list[str], dict[str, int]]:
    """Run ``action``; its result, the commands clients sent meanwhile, the commandstats deltas."""
    client, watcher = redis.Redis.from_url(url), redis.Redis.from_url(url)
    me = client.client_info()["addr"]  # the measuring connection: its commands are not the store's
    marker = f"end-of-measure-{uuid.uuid4().hex}"

    def stats() -> dict[str, int]:
        return {name: int(entry["calls"]) for name, entry in client.info("commandstats").items()}

    with watcher.monitor() as monitor:
        before = stats()
        result = action()
        after = stats()
        client.echo(marker)
        sent = []
        while True:
            command = monitor.next_command()
            if marker in command["command"]:
                break
            source = f"{command.get('client_address')}:{command.get('client_port')}"
            if command.get("client_type") != "lua" and source != me:
                sent.append(command["command"])
    client.close()
    watcher.close()
    deltas = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    deltas.pop("cmdstat_info", None)  # the measuring INFO itself
    return result, sent, {name: n for name, n in deltas.items() if n}


def verbs(sent: list[str]) -> list[str]:
    """The command names of what was sent, in order."""
    return [command.split()[0].upper() for command in sent]


def assert_one_call(call: str, sent: list[str], deltas: dict[str, int], what: str = "") -> None:
    """Exactly one command was sent, the script call ``call`` (FCALL or EVALSHA), and nothing loaded."""
    assert len(sent) == 1 and sent[0].upper().startswith(call), (what, sent)
    assert deltas.get(f"cmdstat_{call.lower()}") == 1, (what, deltas)
    loads = {"cmdstat_eval", "cmdstat_script|load", "cmdstat_function|load", "cmdstat_multi", "cmdstat_exec"}
    assert not loads & set(deltas), (what, deltas)
    other = {"cmdstat_fcall", "cmdstat_evalsha"} - {f"cmdstat_{call.lower()}"}
    assert not other & set(deltas), (what, deltas)


def test_uncontended_run_costs_three_round_trips(store: Store, redis_url: str, call: str) -> None:
    spec = RunSpec("tasks.sync", "store:7", "run-1", limit=1, max_queue_depth=2)
    outcome, sent, deltas = commands_sent(redis_url, lambda: store.register(spec))
    assert outcome.status is Registered.REGISTERED
    assert_one_call(call, sent, deltas)
    outcome, sent, deltas = commands_sent(redis_url, lambda: store.claim(spec, 0, b"payload"))
    assert outcome.decision is Decision.ADMITTED
    assert_one_call(call, sent, deltas)
    token = outcome.token
    outcome, sent, deltas = commands_sent(
        redis_url, lambda: store.release("tasks.sync", "store:7", "run-1", token=token)
    )
    assert outcome.released
    assert_one_call(call, sent, deltas)


def test_gating_and_handoff_cost_one_round_trip_each(store: Store, redis_url: str, call: str) -> None:
    holder, waiter = RunSpec("tasks.sync", "k", "holder"), RunSpec("tasks.sync", "k", "waiter")
    token = store.claim(holder, 0, None).token
    outcome, sent, deltas = commands_sent(redis_url, lambda: store.claim(waiter, 0, b"p"))
    assert outcome.decision is Decision.GATED
    assert_one_call(call, sent, deltas)
    outcome, sent, deltas = commands_sent(
        redis_url, lambda: store.release("tasks.sync", "k", "holder", token=token)
    )
    assert [w.run_id for w in outcome.wakes] == ["waiter"]  # the wake is decided in the same call
    assert_one_call(call, sent, deltas)


def test_heartbeat_of_many_holders_is_one_round_trip(store: Store, redis_url: str, call: str) -> None:
    refs = []
    for i in range(5):
        spec = RunSpec("tasks.sync", f"key-{i}", f"run-{i}")
        token = store.claim(spec, 0, None).token
        assert token is not None
        refs.append(HolderRef("tasks.sync", f"key-{i}", f"run-{i}", token))
    beat, sent, deltas = commands_sent(redis_url, lambda: store.heartbeat(refs))
    assert beat.lost == ()
    assert_one_call(call, sent, deltas)


def test_every_operation_is_one_call(store: Store, redis_url: str, call: str) -> None:
    # The fixture's first call loaded the function library; scripts are loaded one by one.
    loader = redis.Redis.from_url(redis_url)
    for script in store._scripts.values():  # type: ignore[attr-defined]  # else a first call loads it
        loader.script_load(script.script)
    loader.close()
    spec = RunSpec("s", "k", "r1")
    token = 1
    ops: list[Callable[[], Any]] = [
        lambda: store.register(spec, confirmed=False),
        lambda: store.confirm("s", "k", "r1"),
        lambda: store.claim(spec, 0, b"x"),
        lambda: store.heartbeat([HolderRef("s", "k", "r1", token), HolderRef("s", "k2", "r9", 4)]),
        lambda: store.suspend("s", "k", "r1", token, delay=1.0),
        lambda: store.release("s", "k", "r1", token=token),
        lambda: store.register(RunSpec("s", "k", "r2")),
        lambda: store.unregister("s", "k", "r2"),
        lambda: store.register(RunSpec("s", "k", "r3"), payload=b"p", delay=5.0, confirmed=False),
        lambda: store.park("s", "k", "r3"),
        lambda: store.snapshot(scope="s", key="k"),
    ]
    for number, op in enumerate(ops):
        outcome, sent, deltas = commands_sent(redis_url, op)
        assert_one_call(call, sent, deltas, what=f"operation {number}")
        token = getattr(outcome, "token", None) or token


def test_tick_due_reads_the_due_index_then_calls_each_due_key_once(
    store: Store, redis_url: str, call: str
) -> None:
    """A heartbeat's tick: the server's clock, one read of the namespace's due index, then one
    call per due key (which reads the key's scope and key itself)."""
    done, sent, _ = commands_sent(redis_url, lambda: store.tick_due())
    assert done == [] and verbs(sent) == ["TIME", "ZRANGEBYSCORE"], sent
    spec = RunSpec("s", "due", "r1", lease=0.1, orphan_timeout=0.1)
    token = store.claim(spec, 0, None).token
    # Due when r2's registration is unseen for its orphan timeout (plus a re-check of 0).
    store.register(RunSpec("s", "due", "r2", orphan_timeout=0.1, recheck=0.0), payload=b"p")
    time.sleep(0.3)
    done, sent, _ = commands_sent(redis_url, lambda: store.tick_due())
    assert [(d.scope, d.key, d.evicted, [w.run_id for w in d.wakes]) for d in done] == [
        ("s", "due", ("r1",), ["r2"])
    ]
    assert verbs(sent) == ["TIME", "ZRANGEBYSCORE", call], sent
    assert not store.release("s", "due", "r1", token=token).released


def test_a_flushed_server_gets_its_scripts_again_and_the_call_runs_once(
    store: Store, redis_url: str, call: str
) -> None:
    """A restarted or flushed server does not know the scripts: they are loaded, the call made again."""
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("FUNCTION FLUSH" if call == "FCALL" else "SCRIPT FLUSH")
    admin.close()
    spec = RunSpec("s", "flushed", "r1", limit=1)
    outcome, sent, _ = commands_sent(redis_url, lambda: store.register(spec))
    # Registered exactly once: a call that ran twice would answer EXISTS the second time.
    assert outcome.status is Registered.REGISTERED, outcome
    load = "FUNCTION" if call == "FCALL" else "SCRIPT"
    assert verbs(sent)[-2:] == [load, call], sent
    [snap] = store.snapshot(scope="s", key="flushed")
    assert [w.run_id for w in snap.waiters] == ["r1"]
    outcome, sent, deltas = commands_sent(redis_url, lambda: store.claim(spec, 0, None))
    assert outcome.decision is Decision.ADMITTED
    if call == "FCALL":  # one load brought every operation back
        assert_one_call(call, sent, deltas)
    else:  # scripts come back one by one
        assert verbs(sent)[-2:] == ["SCRIPT", "EVALSHA"], sent


@pytest.mark.parametrize("denied", [["-fcall", "-function"], ["-function"]], ids=["no-fcall", "no-load"])
def test_a_user_who_may_not_use_functions_gets_the_scripts_by_evalsha(
    redis_url: str, denied: list[str]
) -> None:
    admin = redis.Redis.from_url(redis_url)
    admin.function_flush()  # nobody loaded the library for this user
    user = f"nofn{uuid.uuid4().hex[:6]}"
    admin.acl_setuser(user, enabled=True, passwords=["+secret"], keys=["*"], commands=["+@all", *denied])
    admin.close()
    host_and_port = redis_url.removeprefix("redis://")
    store = store_from_url(f"redis://{user}:secret@{host_and_port}", namespace=f"rt{uuid.uuid4().hex[:10]}")
    try:
        store.migrate()
        spec = RunSpec("s", "k", "r1")
        assert store.register(spec).status is Registered.REGISTERED  # finds out, falls back
        outcome, sent, deltas = commands_sent(redis_url, lambda: store.claim(spec, 0, None))
        assert outcome.decision is Decision.ADMITTED
        assert_one_call("EVALSHA", sent, deltas)
    finally:
        store.close()


def test_a_function_call_forgets_what_the_previous_calls_saw(redis_url: str) -> None:
    """The library's state lives between calls: each call must read the key afresh.

    A process without functions (EVALSHA) takes a registration back between two calls of the
    library; the second call must count the line afresh, not from what the first call left behind.
    """
    namespace = f"rt{uuid.uuid4().hex[:10]}"
    with_functions = store_from_url(redis_url, namespace=namespace)
    by_evalsha = store_from_url(redis_url, namespace=namespace, functions=False)
    try:
        with_functions.migrate()
        first = RunSpec("s", "shared", "first", limit=1, max_queue_depth=0)
        second = RunSpec("s", "shared", "second", limit=1, max_queue_depth=0)
        assert with_functions.register(first).status is Registered.REGISTERED
        assert by_evalsha.unregister("s", "shared", "first")
        assert with_functions.register(second).status is Registered.REGISTERED
    finally:
        with_functions.close()
        by_evalsha.close()


def test_processes_loading_the_library_at_once_all_go_on(redis_url: str) -> None:
    """Workers starting together on a fresh server all find the library missing and all load it:
    those that lose the race (the library already exists) call it like the winner."""
    admin = redis.Redis.from_url(redis_url)
    admin.function_flush()
    admin.close()
    stores = [store_from_url(redis_url, namespace=f"rt{uuid.uuid4().hex[:10]}") for _ in range(4)]
    try:
        barrier = threading.Barrier(len(stores))
        original = redis.Redis.function_load

        def load_together(client: Any, code: str, replace: bool = False) -> Any:
            barrier.wait(timeout=10)  # every store has seen "Function not found" by now
            return original(client, code, replace)

        outcomes: list[Any] = []

        def register(store: Store) -> None:
            outcomes.append(store.register(RunSpec("s", "k", "r")))

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(redis.Redis, "function_load", load_together)
            threads = [threading.Thread(target=register, args=(store,)) for store in stores]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
        assert [o.status for o in outcomes] == [Registered.REGISTERED] * len(stores), outcomes
    finally:
        for store in stores:
            store.close()


def test_a_batch_of_confirms_is_one_write_and_one_call_each(
    store: Store, redis_url: str, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer's confirm thread sends its batch in one write: one round trip for many runs."""
    runs = [RunSpec("s", f"key-{i}", f"run-{i}") for i in range(20)]
    for run in runs:
        store.register(run, confirmed=False)
    store.confirm_many([("s", "warm", "nobody"), ("s", "warm", "nobody")])  # loads the script
    connection = store._thread_client().connection  # type: ignore[attr-defined]
    writes: list[Any] = []
    send = connection.send_packed_command

    def counted(command: Any, check_health: bool = True) -> None:
        writes.append(command)
        send(command, check_health)

    monkeypatch.setattr(connection, "send_packed_command", counted)
    confirmed, sent, deltas = commands_sent(
        redis_url, lambda: store.confirm_many([(r.scope, r.key, r.run_id) for r in runs])
    )
    assert confirmed == [True] * 20
    assert len(writes) == 1, writes
    assert verbs(sent) == [call] * 20
    assert deltas.get(f"cmdstat_{call.lower()}") == 20
    assert all(w.confirmed for snap in store.snapshot(scope="s") for w in snap.waiters)
