"""Real ``dramatiq`` worker processes on RedisBroker and RabbitmqBroker (issue 3).

Most tests share one pair of workers (2 processes × 2 threads) per store, with the fallback
re-check 30 s away so that every handoff they see is a wake; each test uses its own keys.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
from dramatiq.results import ResultFailure
from dramatiq_app import AppConfig, build
from services import free_port
from worker_env import (
    BROKERS,
    LOG_URL,
    STORES,
    assert_waits_timed_from_send,
    brokers,
    fresh_namespace,
    metrics_setup,
    scraped,
)

from singleton_tasks import SingletonQueueFullError, store_from_url
from singleton_tasks.outcomes import KeySnapshot

pytestmark = pytest.mark.workers

APP_DIR = Path(__file__).parent
DRAMATIQ = str(Path(sys.executable).with_name("dramatiq"))


class App:
    """Two worker processes plus a producer of the same app in this process."""

    def __init__(self, config: AppConfig, logs: Path) -> None:
        self.config = config
        self.logs = logs
        self.broker, self.actors = build(config)
        self.record = self.actors["record"]
        self.results = self.broker.get_results_backend()
        self.log = redis.Redis.from_url(config.log_url)
        self.workers: list[subprocess.Popen[bytes]] = []

    def start_workers(
        self,
        count: int = 2,
        threads: int = 4,
        worker_timeout_ms: int = 100,
        processes: int = 1,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = {
            **os.environ,
            **self.config.env(),
            "dramatiq_worker_timeout": str(worker_timeout_ms),
            **(env or {}),
        }
        files = []
        for i in range(count):
            path = self.logs / f"worker-{i}.log"
            files.append(path)
            self.workers.append(
                subprocess.Popen(
                    [
                        DRAMATIQ,
                        "dramatiq_app",
                        "--path",
                        str(APP_DIR),
                        "--processes",
                        str(processes),
                        "--threads",
                        str(threads),
                        "--log-file",
                        str(path),
                    ],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self.wait(
            lambda: all(p.exists() and "is ready for action" in p.read_text() for p in files),
            timeout=20,
            what="workers ready",
        )

    def stop(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        self.broker.flush_all()
        leftovers = self.log.keys(self.config.log_key + "*")
        if leftovers:  # DEL with no key is an error
            self.log.delete(*leftovers)
        self.broker.close()

    def runs(self, key: str | None = None) -> list[dict[str, Any]]:
        """Finished attempts (of one key), in the order they were logged."""
        entries = [json.loads(raw) for raw in self.log.lrange(self.config.log_key, 0, -1)]
        return [e for e in entries if key is None or e["key"] == key]

    def started(self, key: str) -> list[str]:
        """Labels of the attempts of a key that have started, in start order."""
        entries = [json.loads(raw) for raw in self.log.lrange(self.config.log_key + ":started", 0, -1)]
        return [e["label"] for e in entries if e["key"] == key]

    def keys(self, key: str) -> list[KeySnapshot]:
        """The store's view of a key (every scope): empty once nothing holds or waits."""
        store = store_from_url(self.config.store, namespace=self.config.namespace)
        try:
            return store.snapshot(key=key)
        finally:
            store.close()

    def deliveries(self, run_id: str) -> list[dict[str, Any]]:
        entries = [json.loads(raw) for raw in self.log.lrange(self.config.log_key + ":deliveries", 0, -1)]
        return [e for e in entries if e["run_id"] == run_id]

    def wait(self, predicate: Callable[[], bool], *, timeout: float = 25, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():  # bounded wait for other processes
            if time.monotonic() > deadline:
                dump = "\n".join(p.read_text()[-3000:] for p in sorted(self.logs.glob("worker-*.log")))
                pytest.fail(f"timed out waiting for {what}; runs={self.runs()}\n{dump}")
            if any(p.poll() is not None for p in self.workers):
                pytest.fail(f"a worker process exited while waiting for {what}")
            time.sleep(0.05)


def _new_app(broker: str, store: str, logs: Path, **options: Any) -> App:
    namespace = fresh_namespace(broker, store, "w")
    config = AppConfig(
        broker=broker,
        broker_url=BROKERS[broker],
        store=STORES[store],
        namespace=namespace,
        queue=f"singleton_{namespace}",
        log_url=LOG_URL,
        log_key=f"singleton-test:{namespace}",
        **options,
    )
    return App(config, logs)


@pytest.fixture
def make_app(tmp_path: Path) -> Iterator[Callable[..., App]]:
    apps: list[App] = []

    def make(broker: str, store: str, **options: Any) -> App:
        app = _new_app(broker, store, tmp_path, **options)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.stop()


@pytest.fixture(scope="module", params=[(b, s) for b in brokers() for s in STORES], ids="-".join)
def shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    """One worker pair (2 processes × 2 threads) per broker and store; a waiter's fallback is 30 s."""
    broker, store = request.param
    app = _new_app(broker, store, tmp_path_factory.mktemp("shared"), retry_delay=30.0)
    try:
        app.start_workers(threads=2)
        yield app
    finally:
        app.stop()


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def test_workers_serialize_each_key_in_order(shared: App) -> None:
    """The seed's story at scale: each key's runs one at a time, in enqueue order; keys in parallel."""
    app = shared
    a, b = unique("A"), unique("B")
    sent: dict[str, list[str]] = {a: [], b: []}
    for i in range(6):
        for key in (a, b):
            sent[key].append(app.record.send(key, f"{key}/{i}", 0.25).message_id)
    others = [unique("C") for _ in range(4)]
    for key in others:
        app.record.send(key, key, 0.1)
    every = [a, b, *others]
    app.wait(lambda: sum(len(app.runs(k)) for k in every) == 16, what="16 runs")
    runs = [r for k in every for r in app.runs(k)]
    assert len({r["run_id"] for r in runs}) == 16  # every run completed, once
    for key in (a, b):
        mine = sorted(app.runs(key), key=lambda r: r["start"])
        assert [r["run_id"] for r in mine] == sent[key]  # enqueue order
        for before, after in itertools.pairwise(mine):
            assert after["start"] >= before["end"], f"{key}: {before} overlaps {after}"
        tokens = [r["token"] for r in mine]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert any(x["start"] < y["end"] and y["start"] < x["end"] for x in app.runs(a) for y in app.runs(b))
    # Which of the two processes runs what is the broker's choice (one may prefetch everything):
    # serialization across processes is proven by the integrations soak (3 workers, SIGKILLs).


@pytest.mark.parametrize("store", list(STORES))
def test_woken_copy_and_delayed_copy_run_once_on_redis(make_app: Callable[..., App], store: str) -> None:
    if "redis" not in brokers():
        pytest.skip("RedisBroker only")
    app = make_app("redis", store, retry_delay=3.0)
    app.start_workers()
    holder = app.record.send("K", "holder", 0.8)
    app.wait(lambda: len(app.deliveries(holder.message_id)) >= 1, what="the holder's delivery")
    waiter = app.record.send("K", "waiter", 0.0)
    # First sight (gated, delayed copy due in 3 s), then the woken copy when the holder settles,
    # then the delayed copy: on RedisBroker both copies are delivered; the body runs once.
    app.wait(lambda: len(app.deliveries(waiter.message_id)) >= 3, timeout=15, what="three deliveries")
    runs = app.runs()
    assert [r["label"] for r in runs] == ["holder", "waiter"]
    assert runs[1]["start"] - runs[0]["end"] < 2.0  # handed off by the wake, not the 3 s timer
    gens = [d["gen"] for d in app.deliveries(waiter.message_id)]
    assert len(set(gens)) == 3


def test_workers_hand_off_by_wake_not_timer(shared: App) -> None:
    # Every waiter's fallback re-check is 30 s away: only the wake on release can finish the burst.
    app, hot = shared, unique("hot")
    began = time.time()
    sent = [app.record.send(hot, f"h{i}", 0.05).message_id for i in range(10)]
    app.wait(lambda: len(app.runs(hot)) == 10, timeout=15, what="10 runs")
    runs = sorted(app.runs(hot), key=lambda r: r["start"])
    assert [r["run_id"] for r in runs] == sent
    assert runs[-1]["end"] - began < 15
    for before, after in itertools.pairwise(runs):
        assert after["start"] >= before["end"]


def test_a_wake_is_fetched_at_once_by_a_redis_worker_backing_off_for_seconds(
    make_app: Callable[..., App],
) -> None:
    """At ``worker_timeout=10000`` the RedisBroker consumer of a quiet queue sleeps for seconds
    between fetches; the worker thread that publishes a wake fetches it itself, so each handoff
    takes a fraction of that back-off (docs/concepts.md#handoff)."""
    if "redis" not in brokers():
        pytest.skip("RedisBroker only")
    app = make_app("redis", "redis", retry_delay=30.0)  # the waiters' fallback timer: out of reach
    app.start_workers(count=1, threads=8, worker_timeout_ms=10_000)
    key = unique("quiet")
    sent = [app.record.send(key, f"q{i}", 3.0).message_id for i in range(3)]
    # One fetch takes all three; while each 3 s body runs, the consumer's back-off grows past
    # 1.28 s per sleep (5 ms doubling, with jitter), so a wake left to it would wait ~0.3-5 s.
    app.wait(lambda: len(app.runs(key)) == 3, timeout=40, what="3 runs")
    runs = sorted(app.runs(key), key=lambda r: r["start"])
    assert [r["run_id"] for r in runs] == sent
    gaps = [after["start"] - before["end"] for before, after in itertools.pairwise(runs)]
    assert all(0 <= gap < 0.3 for gap in gaps), gaps


def test_pair_never_exceeds_its_limit(shared: App) -> None:
    app, key = shared, unique("P")
    sent = [app.actors["pair"].send(key, f"p{i}", 0.3).message_id for i in range(6)]
    app.wait(lambda: len(app.runs(key)) == 6, what="6 runs")
    runs = app.runs(key)
    assert sorted(r["run_id"] for r in runs) == sorted(sent)
    assert max_concurrency(runs) <= 2
    # Two slots: admission (token) order and body start order may differ by a hair.
    assert len({r["token"] for r in runs}) == 6


def max_concurrency(runs: list[dict[str, Any]]) -> int:
    edges = sorted([(r["start"], 1) for r in runs] + [(r["end"], -1) for r in runs])  # ends first on ties
    return max(itertools.accumulate(change for _, change in edges))


def test_a_full_backlog_rejects_publishes_nothing_and_accepts_again(shared: App) -> None:
    """``capped``: limit 1 + max_queue_depth 2. The 4th send raises; after a slot frees, one is accepted."""
    app, key = shared, unique("C")
    capped = app.actors["capped"]
    accepted = [capped.send(key, "c1", 1.5), capped.send(key, "c2", 0.0), capped.send(key, "c3", 0.0)]
    rejected = capped.message(key, "c4", 0.0)
    with pytest.raises(SingletonQueueFullError) as raised:
        app.broker.enqueue(rejected)
    error = raised.value
    assert (error.task_name, error.scope, error.key, error.limit, error.max_queue_depth) == (
        "capped",
        "capped",
        key,
        1,
        2,
    )
    stored = {run.run_id for snap in app.keys(key) for run in (*snap.holders, *snap.waiters)}
    assert stored == {m.message_id for m in accepted}  # nothing stored for the rejected run
    app.wait(lambda: app.started(key)[:2] == ["c1", "c2"], what="c1 settled and c2 admitted")
    accepted.append(capped.send(key, "c5", 0.0))  # backlog c2 + c3 + c5: at the cap again
    app.wait(lambda: len(app.runs(key)) == 4, what="the four accepted runs")
    assert [r["label"] for r in sorted(app.runs(key), key=lambda r: r["start"])] == ["c1", "c2", "c3", "c5"]
    app.wait(lambda: app.keys(key) == [], what="the key to empty")
    assert app.deliveries(rejected.message_id) == []  # never published


def test_gated_waiters_do_not_occupy_worker_threads(shared: App) -> None:
    """4 threads in all; one key held for 6 s with 10 waiters: 20 other keys still run meanwhile."""
    app, held = shared, unique("H")
    app.record.send(held, "holder", 6.0)
    app.wait(lambda: app.started(held) == ["holder"], what="the holder to start")
    waiters = [app.record.send(held, f"w{i}", 0.0).message_id for i in range(10)]
    others = [unique("O") for _ in range(20)]
    for key in others:
        app.record.send(key, key, 0.05)
    app.wait(lambda: all(app.runs(key) for key in others), timeout=20, what="20 other keys")
    assert app.runs(held) == []  # the holder is still running, and no waiter ran
    assert all(app.deliveries(w) for w in waiters)  # the waiters were delivered, and gated
    app.wait(lambda: len(app.runs(held)) == 11, timeout=25, what="the holder and its waiters")
    assert [r["run_id"] for r in sorted(app.runs(held), key=lambda r: r["start"])][1:] == waiters


def test_a_retried_holder_keeps_its_slot_and_exhaustion_releases_it(shared: App) -> None:
    app, kept, doomed = shared, unique("R"), unique("X")
    retrying = {"max_retries": 2, "min_backoff": 500, "max_backoff": 600}
    app.record.send_with_options(args=(kept, "flaky", 0.1), kwargs={"fails": 1}, **retrying)
    app.record.send_with_options(args=(doomed, "doomed", 0.1), kwargs={"fails": 99}, **retrying)
    app.wait(lambda: app.started(kept) == ["flaky"] and app.started(doomed) == ["doomed"], what="starts")
    app.record.send(kept, "other", 0.0)
    app.record.send(doomed, "next", 0.0)
    app.wait(lambda: len(app.runs(kept)) == 3 and len(app.runs(doomed)) == 4, what="every attempt")
    # No same-key run slipped in between a failed attempt and its retry.
    attempts = [(r["label"], r["outcome"]) for r in sorted(app.runs(kept), key=lambda r: r["start"])]
    assert attempts == [("flaky", "raise"), ("flaky", "ok"), ("other", "ok")]
    attempts = [(r["label"], r["outcome"]) for r in sorted(app.runs(doomed), key=lambda r: r["start"])]
    assert attempts == [("doomed", "raise")] * 3 + [("next", "ok")]
    for key in (kept, doomed):
        runs = sorted(app.runs(key), key=lambda r: r["start"])
        for before, after in itertools.pairwise(runs):
            assert after["start"] >= before["end"]
        app.wait(lambda key=key: app.keys(key) == [], what=f"{key} to empty")


def test_a_gated_run_gets_its_real_result(shared: App) -> None:
    app, key = shared, unique("S")
    app.record.send(key, "first", 1.5)
    app.wait(lambda: app.started(key) == ["first"], what="the holder to start")
    second = app.record.send(key, "second", 0.0)
    app.wait(
        lambda: any(
            w.run_id == second.message_id and w.state.value != "pending"
            for s in app.keys(key)
            for w in s.waiters
        ),
        what="the second run to be gated",
    )
    # A premature None stored by Results at the deferral would be returned here at once.
    assert second.get_result(backend=app.results, block=True, timeout=25_000) == "done:second"
    assert [r["label"] for r in app.runs(key)] == ["first", "second"]


def test_age_limit_expiry_releases_and_the_key_moves_on(shared: App) -> None:
    app, key = shared, unique("A")
    app.record.send(key, "long", 2.5)
    app.wait(lambda: app.started(key) == ["long"], what="the holder to start")
    aged = app.record.send_with_options(args=(key, "aged", 0.0), max_age=800)
    app.record.send(key, "after", 0.0)
    app.wait(lambda: len(app.runs(key)) == 2, what="the holder and the run after the aged one")
    assert [r["label"] for r in app.runs(key)] == ["long", "after"]
    assert app.deliveries(aged.message_id)  # delivered, then skipped by AgeLimit
    app.wait(lambda: app.keys(key) == [], what="the key to empty")
    with pytest.raises(ResultFailure, match="age limit"):
        aged.get_result(backend=app.results)  # AgeLimit failed it: its result says so, as without us


def test_pipelines_and_groups_of_singletons_complete(shared: App) -> None:
    app, piped, grouped = shared, unique("P"), unique("G")
    record = app.record
    pipe = dramatiq.pipeline(
        [
            record.message(piped, "p1", 0.1),
            record.message_with_options(args=(piped, "p2", 0.1), pipe_ignore=True),
            record.message_with_options(args=(piped, "p3", 0.1), pipe_ignore=True),
        ],
        broker=app.broker,
    )
    pipe.run()
    group = dramatiq.group([record.message(grouped, f"g{i}", 0.2) for i in range(4)], broker=app.broker)
    group.run()
    assert pipe.get_result(block=True, timeout=25_000) == "done:p3"
    assert list(group.get_results(block=True, timeout=25_000)) == [f"done:g{i}" for i in range(4)]
    assert [r["label"] for r in sorted(app.runs(piped), key=lambda r: r["start"])] == ["p1", "p2", "p3"]
    runs = sorted(app.runs(grouped), key=lambda r: r["start"])
    assert len(runs) == 4
    for before, after in itertools.pairwise(runs):
        assert after["start"] >= before["end"]


def _unacked(app: App) -> dict[str, set[bytes]]:
    """The RedisBroker's ack sets of this app's queues (every worker id): messages fetched, not acked."""
    sets: dict[str, set[bytes]] = {}
    for name in app.log.scan_iter(match=b"dramatiq:__acks__.*", count=1000):
        if name.decode().endswith((app.config.queue, app.config.queue + ".DQ")):
            members = app.log.smembers(name)
            if members:
                sets[name.decode()] = members
    return sets


def test_a_burst_through_a_graceful_shutdown_runs_every_run_once_and_leaves_nothing_unacked(
    make_app: Callable[..., App],
) -> None:
    """Worker threads that release during a graceful shutdown still publish wakes and fetch them
    (their consumers run until the threads stop): what they fetched goes back to the queue, the
    next worker runs every run once, in order, by wakes alone, and no ack set keeps a message."""
    if "redis" not in brokers():
        pytest.skip("RedisBroker only")
    app = make_app("redis", "redis", retry_delay=30.0)  # a lost wake waits 30 s: past every wait below
    app.start_workers(count=1, threads=4, worker_timeout_ms=10_000)
    keys = [unique("burst") for _ in range(6)]
    sent = {key: [app.record.send(key, f"{key}/{i}", 0.3).message_id for i in range(5)] for key in keys}
    every = [run_id for runs in sent.values() for run_id in runs]
    app.wait(lambda: sum(len(app.runs(k)) for k in keys) >= 5, timeout=20, what="the burst under way")
    first = app.workers.pop()
    first.send_signal(signal.SIGTERM)  # mid-burst: four bodies finish, release, wake and fetch
    first.wait(30)
    assert first.returncode == 0
    (app.logs / "worker-0.log").rename(app.logs / "worker-0-first.log")
    app.start_workers(count=1, threads=4, worker_timeout_ms=10_000)
    app.wait(lambda: sum(len(app.runs(k)) for k in keys) >= len(every), timeout=25, what="every run")
    for key in keys:
        runs = sorted(app.runs(key), key=lambda r: r["start"])
        assert [r["run_id"] for r in runs] == sent[key]  # each once, in order
        for before, after in itertools.pairwise(runs):
            assert after["start"] >= before["end"]
    app.wait(lambda: all(not app.keys(k) for k in keys), timeout=10, what="every key idle")
    second = app.workers.pop()
    second.send_signal(signal.SIGTERM)
    second.wait(30)
    assert second.returncode == 0
    assert _unacked(app) == {}


@pytest.mark.parametrize("broker", brokers())
def test_the_prometheus_middleware_serves_the_singleton_metrics_of_the_worker_processes(
    make_app: Callable[..., App], broker: str, tmp_path: Path
) -> None:
    """docs/operations.md#dramatiq-workers as written: a scrape of the ``dramatiq`` command (two
    worker processes) counts every admission and times each from its send."""
    port = free_port()
    setup = metrics_setup("metrics/dramatiq", tmp_path)
    app = make_app(broker, "redis", metrics_setup=str(setup))
    prometheus = {
        "dramatiq_prom_db": str(tmp_path / "prometheus"),
        "dramatiq_prom_host": "127.0.0.1",
        "dramatiq_prom_port": str(port),
    }
    app.start_workers(count=1, processes=2, threads=2, env=prometheus)
    key, sent_by = unique("M"), {}
    for label in ("m0", "m1", "m2"):  # one at a time, 0.3 s each: m1 and m2 wait
        app.record.send(key, label, 0.3)
        sent_by[label] = time.time()
    for i in range(3):
        app.record.send(unique("N"), f"n{i}", 0.0)
    app.wait(lambda: len(app.runs()) == 6, what="6 runs")
    app.wait(
        lambda: scraped(port, "singleton_tasks_admitted_total", task="record") == 6,
        timeout=10,
        what=f"the scrape of port {port} to count 6 admissions",
    )
    assert scraped(port, "singleton_tasks_wait_seconds_count", task="record") == 6
    assert_waits_timed_from_send(
        scraped(port, "singleton_tasks_wait_seconds_sum", task="record"), app.runs(key), sent_by
    )
