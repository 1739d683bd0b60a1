"""The SQL stores against the memory store, and what only the SQL stores have."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import POSTGRES_URL, backend_params, look_at_runs_never_seen, require_server

from singleton_tasks import Store, store_from_url
from singleton_tasks.errors import SingletonConfigError, StoreUnavailableError
from singleton_tasks.outcomes import Decision, HolderRef, RunSpec
from singleton_tasks.stores._sql import SQLStore
from singleton_tasks.stores.sqlite import sqlite_path
from singleton_tasks.testing import ManualClock, at

SQL_BACKENDS = ["sqlite", "postgres"]


@pytest.fixture(params=backend_params(SQL_BACKENDS))
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sql.db'}"
    require_server(POSTGRES_URL, "PostgreSQL")
    return POSTGRES_URL


@pytest.fixture
def make_store(sql_url: str) -> Iterator[Callable[..., Store]]:
    made: list[Store] = []
    namespace = f"t{uuid.uuid4().hex[:12]}"

    def make(**options: Any) -> Store:
        options.setdefault("clock", ManualClock())
        store = store_from_url(sql_url, namespace=namespace, **options)
        store.migrate()
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


# -- the same random operations on the memory store and a SQL store give the same answers ----------

KEYS = ["k1", "k{2}", "k'3\n%s -- ;"]
RUNS = [f"r{i}" for i in range(7)]


def _session(seed: int, stores: list[Store]) -> None:
    rng = random.Random(seed)
    generations: dict[str, set[int]] = {r: {0} for r in RUNS}
    tokens: dict[str, int] = {}
    now = 1000.0
    for step in range(150):
        now += rng.choice([0.0, 0.5, 3.0, 20.0, 90.0, 700.0, 4000.0])
        key, run = rng.choice(KEYS), rng.choice(RUNS)
        spec = RunSpec(
            "scope",
            key,
            run,
            limit=2 if key == "k{2}" else 1,
            max_queue_depth=rng.choice([None, 1, 3]),
            lease=rng.choice([5.0, 60.0]),
            orphan_timeout=rng.choice([None, 100.0, 600.0]),
        )
        op = rng.choice(
            [
                "register",
                "claim",
                "claim",
                "release",
                "suspend",
                "heartbeat",
                "confirm",
                "unregister",
                "operator_release",
            ]
        )
        confirmed = rng.random() < 0.7
        generation = rng.choice([*sorted(generations[run]), 99])
        token = rng.choice([None, tokens.get(run, 1), 12345])
        refs = [HolderRef("scope", k, r, t) for r, t in sorted(tokens.items()) for k in KEYS]
        calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
            "register": ((spec,), {"confirmed": confirmed}),
            "claim": ((spec, generation, f"payload-{run}".encode()), {}),
            "release": (("scope", key, run), {"token": token}),
            "suspend": (("scope", key, run, tokens.get(run, 1)), {"delay": 10.0}),
            "heartbeat": ((refs,), {}),
            "confirm": (("scope", key, run), {}),
            "unregister": (("scope", key, run), {}),
            "operator_release": ((run,), {}),
        }
        args, kwargs = calls[op]
        answers = [(getattr(at(store, now), op)(*args, **kwargs), store.snapshot()) for store in stores]
        for other in answers[1:]:
            assert other == answers[0], f"seed {seed} step {step}: {op} {spec}"
        answer = answers[0][0]
        if op == "claim":
            if answer.decision is Decision.ADMITTED:
                tokens[run], generations[run] = answer.token, {generation}
            if answer.generation is not None:
                generations[run].add(answer.generation)
        for wake in getattr(answer, "wakes", ()):
            generations[wake.run_id].add(wake.generation)


@pytest.mark.parametrize("seed", range(12))
def test_same_answers_as_memory_store(make_store: Callable[..., Store], seed: int) -> None:
    memory = store_from_url(f"memory://diff-{uuid.uuid4().hex}", namespace="n", clock=ManualClock())
    _session(seed, [memory, make_store()])


# -- keys are data ---------------------------------------------------------------------------------

NASTY = [
    "{braces}",
    "'quote\"",
    "new\nline",
    "100%",
    "%s %(x)s",
    "-- comment",
    "a;DROP TABLE x;--",
    "🎉 emoji",
    ":name",
    "?",
    "x" * 512,
    "\\back\\slash",
    " lead and trail ",
]


@pytest.mark.parametrize("key", NASTY)
def test_keys_round_trip(make_store: Callable[..., Store], key: str) -> None:
    store = make_store()
    spec = RunSpec(key, key, key)
    admitted = store.claim(spec, 0, key.encode())
    assert admitted.decision is Decision.ADMITTED
    [snap] = store.snapshot(scope=key, key=key)
    assert (snap.scope, snap.key, snap.holders[0].run_id) == (key, key, key)
    assert store.release(key, key, key, token=admitted.token).released


def test_namespaces_are_isolated(sql_url: str) -> None:
    a = store_from_url(sql_url, namespace=f"a{uuid.uuid4().hex[:8]}")
    b = store_from_url(sql_url, namespace=f"b{uuid.uuid4().hex[:8]}")
    try:
        a.migrate()
        spec = RunSpec("s", "k", "r")
        assert a.claim(spec, 0, None).decision is Decision.ADMITTED
        assert b.claim(RunSpec("s", "k", "other"), 0, None).decision is Decision.ADMITTED
        assert [s.key for s in b.snapshot()] == ["k"]
        assert b.snapshot()[0].holders[0].run_id == "other"
    finally:
        a.close()
        b.close()


def test_an_idle_key_keeps_its_row_until_retention(make_store: Callable[..., Store], sql_url: str) -> None:
    store = make_store(retention=100.0)
    first = at(store, 1000.0).claim(RunSpec("s", "k", "r1"), 0, None).token
    assert at(store, 1001.0).release("s", "k", "r1", token=first).released
    assert store.snapshot() == []
    assert _rows(store, sql_url) == (1, 1)  # the key's row and the settled marker, until retention
    assert at(store, 1050.0).claim(RunSpec("s", "k", "r2"), 0, None).token > first  # counters kept
    assert at(store, 1051.0).release("s", "k", "r2", token=None).released
    assert at(store, 1200.0).sweep() == 3  # two markers and the key: nothing left
    assert _rows(store, sql_url) == (0, 0)


def test_a_call_that_writes_nothing_leaves_no_key_row(make_store: Callable[..., Store], sql_url: str) -> None:
    """Calls about runs the store never saw write nothing: no key row is left behind (a row that
    never held a run is never idle, so no sweep would ever remove it)."""
    store = at(make_store(retention=100.0), 1000.0)
    look_at_runs_never_seen(store)
    assert _rows(store, sql_url) == (0, 0)
    assert store.claim(RunSpec("s", "k1", "r1"), 0, b"r1").decision is Decision.ADMITTED  # the claim again
    assert _rows(store, sql_url) == (1, 0)


def _rows(store: Store, sql_url: str) -> tuple[int, int]:
    """(key rows, settled rows) of the store's namespace."""
    counts = []
    for table in ("singleton_keys", "singleton_settled"):
        query = f"SELECT count(*) FROM {table} WHERE namespace = '{store.namespace}'"
        if sql_url.startswith("sqlite"):
            import sqlite3

            with sqlite3.connect(sqlite_path(sql_url)) as connection:
                counts.append(connection.execute(query).fetchone()[0])
        else:
            import psycopg

            with psycopg.connect(sql_url) as connection:
                counts.append(connection.execute(query).fetchone()[0])  # type: ignore[index]
    return counts[0], counts[1]


# -- concurrency: many threads and stores, one holder at a time ---------------------------------------


@pytest.mark.slow  # a stress run of threads
def test_threads_never_overlap(make_store: Callable[..., Store]) -> None:
    stores = [make_store(), make_store()]
    inside: list[str] = []
    tokens: list[int] = []
    overlaps: list[tuple[str, ...]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        store = stores[index % 2]
        run = f"run-{index}"
        spec = RunSpec("s", "shared", run)
        try:
            store.register(spec)
            generation = 0
            while True:
                outcome = store.claim(spec, generation, None)
                if outcome.decision is Decision.ADMITTED:
                    break
                assert outcome.decision is Decision.GATED
                generation = outcome.generation or 0
            with lock:
                inside.append(run)
                tokens.append(outcome.token or 0)
                if len(inside) > 1:
                    overlaps.append(tuple(inside))
            with lock:
                inside.remove(run)
            assert store.release("s", "shared", run, token=outcome.token).released
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    assert not overlaps
    assert stores[0].snapshot() == []
    assert tokens == sorted(tokens) and len(set(tokens)) == 8  # strictly increasing
    last = stores[0].claim(RunSpec("s", "shared", "last"), 0, None).token
    assert last is not None and last > tokens[-1]


def test_sqlite_close_leaves_a_connection_in_use_to_its_thread(tmp_path: Path) -> None:
    """close() from one thread while another is inside a transaction (a worker's confirm or
    heartbeat thread at shutdown): closing a connection in use can crash the interpreter, so the
    using thread finishes and closes it itself."""
    import sqlite3

    store = store_from_url(f"sqlite:///{tmp_path / 'x.db'}", namespace="n")
    store.migrate()
    entered, proceed = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def use() -> None:
        with store._begin(write=False):  # type: ignore[attr-defined]
            connection = store._local.connection  # type: ignore[attr-defined]
            entered.set()
            proceed.wait(5)
            seen["row"] = connection.execute("SELECT 1").fetchone()
        try:
            connection.execute("SELECT 1")
        except sqlite3.ProgrammingError:
            seen["closed after"] = True

    user = threading.Thread(target=use)
    user.start()
    assert entered.wait(5)
    store.close()
    proceed.set()
    user.join(5)
    assert seen == {"row": (1,), "closed after": True}
    assert store.claim(RunSpec("s", "k", "r"), 0, None).decision is Decision.ADMITTED  # usable again
    store.close()


# -- errors and URLs -----------------------------------------------------------------------------------


def test_sqlite_paths() -> None:
    assert sqlite_path("sqlite:///relative.db") == "relative.db"
    assert sqlite_path("sqlite:////abs/path.db") == "/abs/path.db"
    assert sqlite_path("sqlite:///:memory:") == ":memory:"
    for bad in ("sqlite://", "sqlite:///", "sqlite://host/x.db", "sqlite:///x.db?mode=ro"):
        with pytest.raises(SingletonConfigError):
            sqlite_path(bad)


def test_sqlite_unopenable_file_is_unavailable(tmp_path: Path) -> None:
    store = store_from_url(f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}")
    with pytest.raises(StoreUnavailableError) as info:
        store.claim(RunSpec("s", "k", "r"), 0, None)
    assert info.value.__cause__ is not None


def test_sqlite_missing_schema_is_unavailable(tmp_path: Path) -> None:
    store = store_from_url(f"sqlite:///{tmp_path / 'x.db'}")
    assert store.schema_version() is None
    with pytest.raises(StoreUnavailableError):
        store.register(RunSpec("s", "k", "r"))
    store.close()


def test_sqlite_memory_works_within_a_process() -> None:
    store = store_from_url("sqlite:///:memory:")
    store.migrate()
    assert store.claim(RunSpec("s", "k", "r"), 0, None).decision is Decision.ADMITTED
    store.close()


def test_postgres_unreachable_is_unavailable_and_redacted() -> None:
    store = store_from_url("postgresql://user:s3cret@127.0.0.1:1/test", timeout=0.5)
    assert "s3cret" not in repr(store)
    with pytest.raises(StoreUnavailableError) as info:
        store.register(RunSpec("s", "k", "r"))
    assert "s3cret" not in str(info.value)
    assert info.value.__cause__ is not None
    store.close()


def test_postgres_bad_options() -> None:
    with pytest.raises(SingletonConfigError):
        store_from_url("postgresql://127.0.0.1/test", min_size=5, max_size=2)
    with pytest.raises(SingletonConfigError):
        store_from_url("postgresql://127.0.0.1/test", timeout=0)


# -- PostgreSQL: one row lock per key ----------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_keys_do_not_wait_on_each_other() -> None:
    require_server(POSTGRES_URL, "PostgreSQL")
    import psycopg

    namespace = f"t{uuid.uuid4().hex[:12]}"
    store = store_from_url(POSTGRES_URL, namespace=namespace, timeout=1.0)
    try:
        store.migrate()
        store.register(RunSpec("s", "locked", "r0"))
        with psycopg.connect(POSTGRES_URL) as blocker:
            # Another session holds key "locked" mid-operation.
            row = blocker.execute(
                "SELECT token FROM singleton_keys WHERE namespace = %s AND scope = 's' AND key = 'locked' "
                "FOR UPDATE",
                [namespace],
            ).fetchone()
            assert row is not None
            assert store.claim(RunSpec("s", "free", "r1"), 0, None).decision is Decision.ADMITTED
            with pytest.raises(StoreUnavailableError, match="lock"):
                store.claim(RunSpec("s", "locked", "r0"), 0, None)  # lock_timeout = timeout
        assert store.claim(RunSpec("s", "locked", "r0"), 0, None).decision is Decision.ADMITTED
    finally:
        store.close()


# -- many processes on one key --------------------------------------------------------------------------


# A gated waiter does not spin on the store (spinning writers can starve the releasing process
# of SQLite's write lock for seconds under load): it waits for the releaser's wake, as deferred
# messages do, with a fallback re-check like the retry timer.
_WAKE_FALLBACK = 5.0


def _process_worker(
    url: str, namespace: str, marker: str, index: int, runs: int, wakes: list[Any]
) -> list[int]:
    import os
    import queue

    store = store_from_url(url, namespace=namespace)
    tokens = []
    try:
        for n in range(runs):
            spec = RunSpec("s", "one-at-a-time", f"p{index}-{n}")
            store.register(spec)
            outcome = store.claim(spec, 0, None)
            while outcome.decision is not Decision.ADMITTED:
                assert outcome.decision is Decision.GATED, outcome
                generation = outcome.generation or 0
                try:
                    run_id, generation = wakes[index].get(timeout=_WAKE_FALLBACK)
                    assert run_id == spec.run_id
                except queue.Empty:
                    pass
                outcome = store.claim(spec, generation, None)
            fd = os.open(marker, os.O_CREAT | os.O_EXCL)  # fails if another process is inside
            os.close(fd)
            os.unlink(marker)
            assert outcome.token is not None
            tokens.append(outcome.token)
            released = store.release("s", "one-at-a-time", spec.run_id, token=outcome.token)
            assert released.released
            for wake in released.wakes:
                owner = int(wake.run_id[1:].split("-")[0])
                wakes[owner].put((wake.run_id, wake.generation))
    finally:
        store.close()
    return tokens


def test_processes_never_overlap(sql_url: str, tmp_path: Path) -> None:
    import multiprocessing

    namespace = f"t{uuid.uuid4().hex[:12]}"
    setup = store_from_url(sql_url, namespace=namespace)
    setup.migrate()
    marker = str(tmp_path / "inside")
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(4) as pool:
        wakes = [manager.Queue() for _ in range(4)]
        results = pool.starmap(_process_worker, [(sql_url, namespace, marker, i, 5, wakes) for i in range(4)])
    tokens = sorted(t for result in results for t in result)
    assert len(tokens) == len(set(tokens)) == 20  # every admission got its own token
    assert setup.snapshot() == []
    setup.close()


def _leave_idle_keys(store: Store, count: int) -> None:
    """``count`` keys, each left idle by one settled run: a key row and a settled marker each,
    both forgotten 100 s after 1000.0 (the store's retention is 100 s)."""
    for i in range(count):
        spec = RunSpec("s", f"k{i}", f"r{i}")
        token = at(store, 1000.0).claim(spec, 0, None).token
        assert at(store, 1000.0).release("s", spec.key, spec.run_id, token=token).released


def test_a_sweep_with_a_deadline_stops_after_the_transaction_that_passes_it(
    make_store: Callable[..., Store], sql_url: str
) -> None:
    """A worker's heartbeat thread sweeps in slices: a million expired rows take minutes to delete,
    and a heartbeat must not wait for all of them. The rest is left to the next call."""
    store = make_store(retention=100.0)
    assert isinstance(store, SQLStore)
    store.sweep_batch = 2
    _leave_idle_keys(store, 5)
    assert _rows(store, sql_url) == (5, 5)
    first = at(store, 1200.0).sweep(until=0.0)  # a deadline already past: one transaction
    assert first == 4  # two markers and two keys
    assert _rows(store, sql_url) == (3, 3)
    total = first
    while swept := store.sweep(until=0.0):
        total += swept
    assert total == 10
    assert _rows(store, sql_url) == (0, 0)
    _leave_idle_keys(store, 5)
    assert at(store, 1200.0).sweep() == 10  # without a deadline: everything, as before
