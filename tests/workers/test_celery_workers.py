"""Real ``celery worker`` processes (prefork and threads pools) on Redis and RabbitMQ brokers (issue 4).

Most tests share one pair of workers (prefork ×2 and threads ×2) per broker and store, with the
fallback re-check 30 s away so that every handoff they see is a wake; each test uses its own
keys. The tests that need other worker options start their own.
"""

from __future__ import annotations

import contextlib
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

import pytest
import redis
from celery import chain, group
from celery.exceptions import WorkerLostError
from celery.result import AsyncResult
from celery.utils.nodenames import anon_nodename
from celery_app import AppConfig, build, go_key
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
from singleton_tasks.outcomes import KeySnapshot, RunState

pytestmark = pytest.mark.workers

APP_DIR = Path(__file__).parent
CELERY = str(Path(sys.executable).with_name("celery"))


class Workers:
    """Two ``celery worker`` processes (prefork ×2 and threads ×2) and a producer app in this process."""

    def __init__(self, config: AppConfig, logs: Path) -> None:
        self.config = config
        self.logs = logs
        self.app = build(config)
        self.record = self.app.tasks["workers.record"]
        self.tasks = self.app.tasks
        self.log = redis.Redis.from_url(config.log_url)
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        pools: tuple[str, ...] = ("prefork", "threads"),
        options: tuple[str, ...] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = {**os.environ, **self.config.env(), **(env or {})}
        files = []
        for i, pool in enumerate(pools):
            path = self.logs / f"celery-{i}-{pool}.log"
            files.append(path)
            self.processes.append(
                subprocess.Popen(
                    [
                        CELERY,
                        "-A",
                        "celery_app",
                        "--workdir",
                        str(APP_DIR),
                        "worker",
                        "--pool",
                        pool,
                        "--concurrency",
                        "2",
                        "--queues",
                        self.config.queue,
                        "--hostname",
                        f"w{i}-{self.config.namespace}@%h",
                        "--without-gossip",
                        "--without-mingle",
                        "--without-heartbeat",
                        "--loglevel",
                        "INFO",
                        "--logfile",
                        str(path),
                        *options,
                    ],
                    env=env,
                    cwd=APP_DIR,
                    start_new_session=True,  # its own process group, with its pool children
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        self.wait(
            lambda: all(p.exists() and " ready." in p.read_text() for p in files),
            timeout=25,
            what="workers ready",
        )

    def stop(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGQUIT)  # cold shutdown: deferred copies are not worth waiting for
        for proc in self.processes:
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                # py-amqp's close can hang for 10 s; the worker and its pool children are our session.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        with contextlib.suppress(Exception), self.app.connection() as conn:
            conn.default_channel.queue_delete(self.config.queue)
        leftovers = self.log.keys(self.config.log_key + "*")
        if leftovers:  # DEL with no key is an error
            self.log.delete(*leftovers)
        with contextlib.suppress(Exception):
            from singleton_tasks.celery import gatekeeper_for

            gatekeeper_for(self.app).close()
        self._close_connections()

    def _close_connections(self) -> None:
        """Close the result backend's sockets: left to the garbage collector, each warns (and
        fails the test that happens to be running then). The broker connections are kombu's
        process-wide pool's, shared with the next module's app: not closed here."""
        backend = self.app.backend
        with contextlib.suppress(Exception):
            backend.result_consumer.stop()  # the Redis backend's pubsub, the rpc backend's consumer
        client = getattr(backend, "client", None)
        if client is not None:
            client.connection_pool.disconnect()
        self.app.close()
        self.log.close()

    def runs(self, key: str | None = None) -> list[dict[str, Any]]:
        """Finished attempts (of one key), in the order they were logged."""
        entries = [json.loads(raw) for raw in self.log.lrange(self.config.log_key, 0, -1)]
        return [e for e in entries if key is None or e["key"] == key]

    def started(self, key: str) -> list[str]:
        """Labels of the attempts of a key that have started, in start order."""
        entries = [json.loads(raw) for raw in self.log.lrange(self.config.log_key + ":started", 0, -1)]
        return [e["label"] for e in entries if e["key"] == key]

    def deliveries(self, run_id: str | None = None) -> list[dict[str, Any]]:
        entries = [json.loads(raw) for raw in self.log.lrange(self.config.log_key + ":deliveries", 0, -1)]
        return [e for e in entries if run_id is None or e["run_id"] == run_id]

    def snapshot(self, scope: str, key: str) -> list[KeySnapshot]:
        """The store's view of one key: empty once nothing holds or waits."""
        store = store_from_url(self.config.store, namespace=self.config.namespace)
        try:
            return store.snapshot(scope=scope, key=key)
        finally:
            store.close()

    def stored(self, scope: str, key: str) -> set[str]:
        return {run.run_id for snap in self.snapshot(scope, key) for run in (*snap.holders, *snap.waiters)}

    def go(self, name: str) -> None:
        """Let the body started with ``until=name`` finish."""
        self.log.rpush(go_key(self.config, name), "go")
        self.log.expire(go_key(self.config, name), 120)

    def wait_revoked(self, task_id: str) -> None:
        """Until every worker has logged the revoke of ``task_id`` (a broadcast: no reply)."""
        paths = sorted(self.logs.glob("celery-*.log"))
        self.wait(
            lambda: all(f"Tasks flagged as revoked: {task_id}" in p.read_text() for p in paths),
            what=f"every worker to flag {task_id} as revoked",
        )

    def wait_gated(self, key: str, run_id: str) -> None:
        """Until ``run_id`` waits gated: published held back, or delivered and deferred."""
        self.wait(
            lambda: any(
                w.run_id == run_id and w.state is RunState.GATED
                for snap in self.snapshot("workers.record", key)
                for w in snap.waiters
            ),
            what=f"{run_id} to wait gated",
        )

    def wait(self, predicate: Callable[[], bool], *, timeout: float = 25, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():  # bounded wait for other processes
            if time.monotonic() > deadline:
                dump = "\n".join(p.read_text()[-3000:] for p in sorted(self.logs.glob("celery-*.log")))
                pytest.fail(f"timed out waiting for {what}; runs={self.runs()}\n{dump}")
            if any(p.poll() is not None for p in self.processes):
                pytest.fail(f"a worker process exited while waiting for {what}")
            time.sleep(0.05)


def _new_workers(broker: str, store: str, logs: Path, **options: Any) -> Workers:
    namespace = fresh_namespace(broker, store, "c")
    config = AppConfig(
        broker_url=BROKERS[broker],
        store=STORES[store],
        namespace=namespace,
        queue=f"singleton_{namespace}",
        log_url=LOG_URL,
        log_key=f"singleton-celery-test:{namespace}",
        **options,
    )
    return Workers(config, logs)


@pytest.fixture
def make_workers(tmp_path: Path) -> Iterator[Callable[..., Workers]]:
    made: list[Workers] = []

    def make(broker: str, store: str, **options: Any) -> Workers:
        workers = _new_workers(broker, store, tmp_path, **options)
        made.append(workers)
        return workers

    yield make
    for workers in made:
        workers.stop()


@pytest.fixture(scope="module", params=[(b, s) for b in brokers() for s in STORES], ids="-".join)
def shared(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """One worker pair (prefork ×2, threads ×2) per broker and store; a waiter's fallback is 30 s."""
    broker, store = request.param
    workers = _new_workers(broker, store, tmp_path_factory.mktemp("shared"), retry_delay=30.0)
    try:
        workers.start()
        yield workers
    finally:
        workers.stop()


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def by_start(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(runs, key=lambda r: r["start"])


def assert_serialized(runs: list[dict[str, Any]], key: str, sent: list[str]) -> None:
    mine = by_start([r for r in runs if r["key"] == key])
    assert [r["run_id"] for r in mine] == sent  # every run completed once, in enqueue order
    assert_one_at_a_time(mine)
    tokens = [r["token"] for r in mine]  # current_admission() tokens strictly increase per key
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def assert_one_at_a_time(runs: list[dict[str, Any]]) -> None:
    for before, after in itertools.pairwise(by_start(runs)):
        assert after["start"] >= before["end"], f"{before} overlaps {after}"


def test_workers_serialize_each_key_in_order(shared: Workers) -> None:
    """The seed's story at scale: each key's runs one at a time, in enqueue order; keys in parallel."""
    workers = shared
    a, b = unique("A"), unique("B")
    sent: dict[str, list[str]] = {a: [], b: []}
    for i in range(5):
        for key in (a, b):
            sent[key].append(workers.record.delay(key, f"{key}/{i}", 0.2).id)
    others = [unique("C") for _ in range(4)]
    for key in others:
        workers.record.delay(key, key, 0.1)
    every = [a, b, *others]
    workers.wait(lambda: sum(len(workers.runs(k)) for k in every) == 14, what="14 runs")
    time.sleep(0.5)  # nothing runs twice
    runs = [r for k in every for r in workers.runs(k)]
    assert len(runs) == 14 and len({r["run_id"] for r in runs}) == 14
    for key in (a, b):
        assert_serialized(runs, key, sent[key])
    a_runs, b_runs = workers.runs(a), workers.runs(b)
    assert any(x["start"] < y["end"] and y["start"] < x["end"] for x in a_runs for y in b_runs)
    assert len({r["pid"] for r in runs}) >= 2  # both worker processes (and pools) took part


def test_workers_hand_off_by_wake_not_timer(shared: Workers) -> None:
    """Every waiter's fallback re-check is 30 s away: only the wake on release can finish the burst."""
    workers, hot = shared, unique("hot")
    sent = [workers.record.delay(hot, f"h{i}", 0.05).id for i in range(10)]
    workers.wait(lambda: len(workers.runs(hot)) == 10, timeout=15, what="10 runs within 15 s")
    assert_serialized(workers.runs(hot), hot, sent)


def test_a_full_backlog_rejects_publishes_nothing_and_accepts_again(shared: Workers) -> None:
    """``workers.capped``: limit 1, max_queue_depth 2. The 4th .delay() raises; accepted again later."""
    workers, key, go = shared, unique("C"), unique("go")
    capped = workers.tasks["workers.capped"]
    accepted = [
        capped.delay(key, "c1", 0.0, until=go),
        capped.delay(key, "c2", 0.0),
        capped.delay(key, "c3", 0.0),
    ]
    with pytest.raises(SingletonQueueFullError) as raised:
        capped.delay(key, "c4", 0.0)
    error = raised.value
    assert (error.task_name, error.scope, error.key, error.limit, error.max_queue_depth) == (
        "workers.capped",
        "workers.capped",
        key,
        1,
        2,
    )
    rejected_id = f"rejected-{key}"
    with pytest.raises(SingletonQueueFullError):
        capped.apply_async((key, "c4", 0.0), task_id=rejected_id)
    assert workers.stored("workers.capped", key) == {r.id for r in accepted}  # nothing stored for c4
    workers.wait(lambda: workers.started(key) == ["c1"], what="c1 to start")
    workers.go(go)
    workers.wait(lambda: workers.started(key)[:2] == ["c1", "c2"], what="c1 settled and c2 admitted")
    accepted.append(capped.delay(key, "c5", 0.0))  # backlog c2 + c3 + c5: at the cap again
    assert [r.get(timeout=25) for r in accepted] == ["c1", "c2", "c3", "c5"]
    runs = by_start(workers.runs(key))
    assert [r["label"] for r in runs] == ["c1", "c2", "c3", "c5"]
    assert_one_at_a_time(runs)
    workers.wait(lambda: workers.snapshot("workers.capped", key) == [], what="the key to empty")
    assert workers.deliveries(rejected_id) == []
    assert [d for d in workers.deliveries() if d["args"][:2] == [key, "c4"]] == []  # never published


def test_retries_keep_the_slot_and_exhaustion_releases_it(shared: Workers) -> None:
    """``self.retry()`` (``workers.flaky``) and ``autoretry_for`` (``workers.auto``), 0.5 s countdown."""
    workers = shared
    cases = {name: (unique("R"), unique("X")) for name in ("workers.flaky", "workers.auto")}
    first: dict[str, AsyncResult] = {}
    followers: dict[str, AsyncResult] = {}
    for name, (kept, doomed) in cases.items():
        first[kept] = workers.tasks[name].delay(kept, "flaky", 0.2, fails=1)
        first[doomed] = workers.tasks[name].delay(doomed, "doomed", 0.2, fails=99)
    for name, (kept, doomed) in cases.items():
        workers.wait(
            lambda k=kept, d=doomed: workers.started(k) != [] and workers.started(d) != [],
            what=f"{name}'s first attempts",
        )
        followers[kept] = workers.tasks[name].delay(kept, "other", 0.0)
        followers[doomed] = workers.tasks[name].delay(doomed, "next", 0.0)
    for name, (kept, doomed) in cases.items():
        workers.wait(
            lambda k=kept, d=doomed: len(workers.runs(k)) == 3 and len(workers.runs(d)) == 4,
            what=f"every attempt of {name}",
        )
        # No same-key run slipped in between a failed attempt and its retry.
        attempts = [(r["label"], r["outcome"]) for r in by_start(workers.runs(kept))]
        assert attempts == [("flaky", "raise"), ("flaky", "ok"), ("other", "ok")], name
        attempts = [(r["label"], r["outcome"]) for r in by_start(workers.runs(doomed))]
        assert attempts == [("doomed", "raise")] * 3 + [("next", "ok")], name
        assert first[kept].get(timeout=10) == "flaky" and followers[kept].get(timeout=10) == "other"
        with pytest.raises(RuntimeError, match="attempt 3 fails on purpose"):
            first[doomed].get(timeout=10)
        assert followers[doomed].get(timeout=10) == "next"
        for key in (kept, doomed):
            assert_one_at_a_time(workers.runs(key))
            workers.wait(lambda k=key, n=name: workers.snapshot(n, k) == [], what=f"{key} to empty")


def test_a_gated_run_gets_its_real_result(shared: Workers) -> None:
    workers, key, go = shared, unique("S"), unique("go")
    first = workers.record.delay(key, "first", 0.0, until=go)
    workers.wait(lambda: workers.started(key) == ["first"], what="the holder to start")
    second = workers.record.delay(key, "second", 0.0)
    workers.wait(
        lambda: any(
            w.run_id == second.id and w.state is not RunState.PENDING
            for snap in workers.snapshot("workers.record", key)
            for w in snap.waiters
        ),
        what="the second run to be gated",
    )
    assert second.state == "PENDING"  # the deferral stored nothing
    workers.go(go)
    # A failure or a premature result stored at the deferral would be returned here.
    assert second.get(timeout=25) == "second"
    assert first.get(timeout=5) == "first"
    assert [r["label"] for r in by_start(workers.runs(key))] == ["first", "second"]


def test_chains_and_groups_of_singletons_complete(shared: Workers) -> None:
    """Each next step is published while the step before still holds the key: it is gated and woken."""
    workers, chained, grouped = shared, unique("P"), unique("G")
    compute = workers.tasks["workers.compute"]
    flow = chain(compute.s(1, chained, 10), compute.s(chained, 100), compute.s(chained, 1000)).apply_async()
    together = group(workers.record.s(grouped, f"g{i}", 0.2) for i in range(4)).apply_async()
    assert flow.get(timeout=25) == 1111 and flow.parent.get(timeout=5) == 111
    assert together.get(timeout=25) == ["g0", "g1", "g2", "g3"]
    assert [r["label"] for r in by_start(workers.runs(chained))] == ["+10", "+100", "+1000"]
    runs = by_start(workers.runs(grouped))
    assert [r["label"] for r in runs] == ["g0", "g1", "g2", "g3"]
    assert_one_at_a_time(runs)
    assert_one_at_a_time(workers.runs(chained))


def test_revoking_a_waiter_skips_it_and_the_key_moves_on(shared: Workers) -> None:
    workers, key, go = shared, unique("V"), unique("go")
    holder = workers.record.delay(key, "holder", 0.0, until=go)
    workers.wait(lambda: workers.started(key) == ["holder"], what="the holder to start")
    revoked = workers.record.delay(key, "revoked", 0.0)
    after = workers.record.delay(key, "after", 0.0)
    workers.wait_gated(key, revoked.id)
    revoked.revoke()
    workers.wait_revoked(revoked.id)
    workers.go(go)  # the holder's release wakes the revoked waiter: discarded, its settlement wakes the next
    assert after.get(timeout=25) == "after"
    assert [r["label"] for r in by_start(workers.runs(key))] == ["holder", "after"]
    assert "revoked" not in workers.started(key)
    assert holder.get(timeout=5) == "holder"
    workers.wait(lambda: revoked.state == "REVOKED", what="the revoked state")
    workers.wait(lambda: workers.snapshot("workers.record", key) == [], what="the key to empty")


def test_revoking_a_running_holder_lets_it_finish_then_the_key_moves_on(shared: Workers) -> None:
    workers, key, go = shared, unique("H"), unique("go")
    holder = workers.record.delay(key, "holder", 0.0, until=go)
    workers.wait(lambda: workers.started(key) == ["holder"], what="the holder to start")
    waiter = workers.record.delay(key, "waiter", 0.0)
    workers.wait_gated(key, waiter.id)
    holder.revoke()  # without terminate: Celery lets a started task run to its end
    workers.wait_revoked(holder.id)
    assert workers.runs(key) == []
    workers.go(go)
    assert waiter.get(timeout=25) == "waiter"
    # (holder.get() may raise TaskRevokedError: the worker not running it marks it revoked.)
    runs = by_start(workers.runs(key))
    assert [r["label"] for r in runs] == ["holder", "waiter"]
    assert_one_at_a_time(runs)
    workers.wait(lambda: workers.snapshot("workers.record", key) == [], what="the key to empty")


def test_a_task_id_started_twice_publishes_once(shared: Workers) -> None:
    """``apply_async(task_id=X)`` again while X holds or waits publishes nothing (docs/concepts.md)."""
    workers, key, go = shared, unique("D"), unique("go")
    held, waiting = f"held-{key}", f"waiting-{key}"
    first = workers.record.apply_async((key, "first", 0.0), {"until": go}, task_id=held)
    workers.wait(lambda: workers.started(key) == ["first"], what="the holder to start")
    second = workers.record.apply_async((key, "second", 0.0), task_id=waiting)
    workers.wait_gated(key, waiting)
    assert workers.record.apply_async((key, "dup", 0.0), task_id=held).id == held
    assert workers.record.apply_async((key, "dup", 0.0), task_id=waiting).id == waiting
    assert workers.stored("workers.record", key) == {held, waiting}
    workers.go(go)
    assert second.get(timeout=25) == "second" and first.get(timeout=5) == "first"
    assert [r["label"] for r in by_start(workers.runs(key))] == ["first", "second"]
    assert len(workers.deliveries(held)) == 1  # admitted at its only delivery
    # A published duplicate would have been delivered while the key was held (and deferred).
    assert [d for d in workers.deliveries() if d["args"][:2] == [key, "dup"]] == []


@pytest.mark.parametrize("pool", ["prefork", "threads"])
@pytest.mark.parametrize("store", list(STORES))
def test_visibility_timeout_redelivery_of_a_live_holder_is_deferred(
    make_workers: Callable[..., Workers], store: str, pool: str
) -> None:
    if "redis" not in brokers():
        pytest.skip("the Redis broker's visibility timeout")
    # The shortest lease (3 s) under a 7 s body: only the heartbeats of the pool process running
    # the holder keep it live.
    workers = make_workers("redis", store, visibility_timeout=1.0, lease=3.0)
    workers.start(pools=(pool, pool))
    holder = workers.record.delay("K", "holder", 7.0)
    # kombu restores the unacked, still-running message after ~1 s: the copy meets a live lease.
    workers.wait(
        lambda: len(workers.deliveries(holder.id)) >= 2, timeout=15, what="a redelivery of the holder"
    )
    follower = workers.record.delay("K", "follower", 0.0)
    workers.wait(lambda: len(workers.runs()) >= 2, timeout=20, what="both runs")
    time.sleep(1.5)
    runs = workers.runs()
    assert [r["label"] for r in runs] == ["holder", "follower"]  # the duplicate never ran
    assert runs[1]["start"] >= runs[0]["end"]
    assert any(d["redelivered"] for d in workers.deliveries(holder.id))
    assert follower.get(timeout=5) == "follower"


@pytest.mark.parametrize("how", ["revoke-terminate", "hard-time-limit"])
@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("broker", brokers())
def test_a_killed_prefork_holder_is_settled_by_the_main_process(
    make_workers: Callable[..., Workers], broker: str, store: str, how: str
) -> None:
    workers = make_workers(broker, store)
    workers.start(pools=("prefork",))
    options = {"time_limit": 1.5} if how == "hard-time-limit" else {}
    holder = workers.record.apply_async(("K", "holder", 30.0), **options)
    workers.wait(lambda: len(workers.deliveries(holder.id)) >= 1, what="the holder to start")
    waiter = workers.record.delay("K", "waiter", 0.0)
    time.sleep(0.5)
    assert workers.runs() == []
    if how == "revoke-terminate":
        holder.revoke(terminate=True)  # task_revoked in the main process settles the killed run
    # else: the hard time limit kills the child; task_failure in the main process settles it
    workers.wait(lambda: len(workers.runs()) == 1, timeout=15, what="the waiter to run")
    assert [r["label"] for r in workers.runs()] == ["waiter"]
    assert waiter.get(timeout=5) == "waiter"


@pytest.mark.parametrize("store", list(STORES))
def test_a_prefork_pool_process_confirms_what_it_sent_before_it_exits(
    make_workers: Callable[..., Workers], store: str
) -> None:
    """A pool process ends with ``os._exit`` (here after its one task): the runs its task sent are
    confirmed before it is gone (docs/concepts.md#the-life-of-a-run)."""
    workers = make_workers(brokers()[0], store)
    workers.start(("prefork",), ("--concurrency", "1", "--max-tasks-per-child", "1"))
    key, nobody = unique("sent"), unique("nobody")  # a queue no worker consumes: no delivery confirms
    try:
        pid, sent = workers.tasks["workers.send_to"].delay(key, 20, nobody).get(timeout=20)

        def exited() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return False

        workers.wait(exited, what=f"pool process {pid} to exit")
        confirmed = {
            w.run_id: w.confirmed for snap in workers.snapshot("workers.record", key) for w in snap.waiters
        }
        assert confirmed == dict.fromkeys(sent, True)
    finally:
        with contextlib.suppress(Exception), workers.app.connection() as conn:
            conn.default_channel.queue_delete(nobody)


@pytest.mark.parametrize(
    ("settings", "requeued"),
    [
        ({}, False),  # Celery's defaults: acked before the run, so the lost run fails
        ({"task_reject_on_worker_lost": True}, False),  # acked before the run: nothing to requeue
        ({"task_acks_late": True, "task_reject_on_worker_lost": True}, True),
    ],
    ids=["defaults", "reject-acked-early", "late-reject"],
)
@pytest.mark.parametrize("broker", brokers())
def test_a_task_without_a_singleton_option_loses_its_worker_as_the_app_settings_say(
    make_workers: Callable[..., Workers], broker: str, settings: dict[str, bool], requeued: bool
) -> None:
    """``workers.plain`` (``SingletonTask``, no ``singleton`` option) is a plain Celery task: a killed
    pool process fails its run with ``WorkerLostError`` or requeues it as the app's settings say
    (Celery's ``test_on_failure_WorkerLostError*`` tests in ``t/unit/worker/test_request.py``)."""
    workers = make_workers(broker, "redis", app_conf=json.dumps(settings))
    workers.start(pools=("prefork",))
    go = unique("go")
    lost = workers.tasks["workers.plain"].delay("plain", "lost", 0.0, until=go)
    workers.wait(lambda: len(workers.deliveries(lost.id)) == 1, what="the run to start")
    os.kill(workers.deliveries(lost.id)[0]["pid"], signal.SIGKILL)
    if requeued:
        workers.wait(lambda: len(workers.deliveries(lost.id)) == 2, what="the requeued run to start again")
        workers.go(go)
        assert lost.get(timeout=25) == "lost"
        return
    workers.wait(lambda: lost.state == "FAILURE", what="the lost run to fail")
    time.sleep(1.0)  # a requeued copy would have been delivered again by now
    assert len(workers.deliveries(lost.id)) == 1
    assert isinstance(lost.result, WorkerLostError)


@pytest.mark.parametrize("broker", brokers())
def test_an_rpc_result_of_a_woken_run_reaches_its_sender(
    make_workers: Callable[..., Workers], broker: str
) -> None:
    """The waiter is published held back and woken by the worker that releases the key, from the
    signature stored at its send: its ``rpc://`` result goes to this process's reply queue, and
    it names this process as its origin."""
    workers = make_workers(
        broker, "redis", retry_delay=30.0, app_conf=json.dumps({"result_backend": "rpc://"})
    )
    workers.start()
    key, go = unique("R"), unique("go")
    holder = workers.record.delay(key, "holder", 0.0, until=go)
    workers.wait(lambda: workers.started(key) == ["holder"], what="the holder to start")
    waiter = workers.record.delay(key, "waiter", 0.0)
    workers.wait_gated(key, waiter.id)
    workers.go(go)
    assert waiter.get(timeout=25) == "waiter"
    assert holder.get(timeout=5) == "holder"
    woken = [d for d in workers.deliveries(waiter.id) if d["gen"]]
    assert len(woken) == 1  # it ran as the woken copy
    assert woken[0]["origin"] == anon_nodename()  # this process's, as Celery names a sender


@pytest.mark.parametrize("broker", brokers())
def test_a_prefork_worker_serves_the_singleton_metrics_of_its_pool_processes(
    make_workers: Callable[..., Workers], broker: str, tmp_path: Path
) -> None:
    """docs/operations.md#celery-workers as written (prometheus_client's multiprocess mode): the
    worker's main process serves what its two pool processes counted and timed."""
    port = free_port()
    setup = metrics_setup("metrics/celery", tmp_path, replace=("(9808,", f"({port},"))
    directory = tmp_path / "prometheus"
    directory.mkdir()
    workers = make_workers(broker, "redis", metrics_setup=str(setup))
    workers.start(("prefork",), env={"PROMETHEUS_MULTIPROC_DIR": str(directory)})
    key, sent, sent_by = unique("M"), [], {}
    for label in ("m0", "m1", "m2"):  # one at a time, 0.3 s each: m1 and m2 wait
        sent.append(workers.record.delay(key, label, 0.3))
        sent_by[label] = time.time()
    sent += [workers.record.delay(unique("N"), f"n{i}", 0.0) for i in range(3)]
    assert [result.get(timeout=20) for result in sent] == ["m0", "m1", "m2", "n0", "n1", "n2"]
    assert scraped(port, "singleton_tasks_admitted_total", task="workers.record") == 6
    assert scraped(port, "singleton_tasks_wait_seconds_count", task="workers.record") == 6
    waited = scraped(port, "singleton_tasks_wait_seconds_sum", task="workers.record")
    assert_waits_timed_from_send(waited, workers.runs(key), sent_by)
