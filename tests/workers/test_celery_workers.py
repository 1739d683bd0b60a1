"""Real ``celery worker`` processes (prefork and threads pools) on Redis and RabbitMQ brokers (issue 4)."""

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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery_app import AppConfig, build
from conftest import BROKER_REDIS_URL, POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_server

from singleton_tasks import store_from_url

pytestmark = pytest.mark.workers

APP_DIR = Path(__file__).parent
CELERY = str(Path(sys.executable).with_name("celery"))
LOG_URL = os.environ.get("SINGLETON_TEST_LOG_REDIS_URL", "redis://127.0.0.1:6379/13")
BROKERS = {"redis": BROKER_REDIS_URL, "rabbitmq": RABBITMQ_URL}
STORES = {"redis": REDIS_URL, "postgres": POSTGRES_URL}


def brokers() -> list[str]:
    chosen = os.environ.get("SINGLETON_TEST_BROKER")  # tox runs one broker per environment
    return [chosen] if chosen else list(BROKERS)


class Workers:
    """Two ``celery worker`` processes (prefork ×2 and threads ×2) and a producer app in this process."""

    def __init__(self, config: AppConfig, logs: Path) -> None:
        self.config = config
        self.logs = logs
        self.app = build(config)
        self.record = self.app.tasks["workers.record"]
        self.log = redis.Redis.from_url(config.log_url)
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, pools: tuple[str, ...] = ("prefork", "threads")) -> None:
        env = {**os.environ, **self.config.env()}
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
        self.log.delete(self.config.log_key, self.config.log_key + ":deliveries")
        with contextlib.suppress(Exception):
            from singleton_tasks.celery import gatekeeper_for

            gatekeeper_for(self.app).close()

    def runs(self) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.log.lrange(self.config.log_key, 0, -1)]

    def deliveries(self, run_id: str) -> list[dict[str, Any]]:
        entries = [json.loads(raw) for raw in self.log.lrange(self.config.log_key + ":deliveries", 0, -1)]
        return [e for e in entries if e["run_id"] == run_id]

    def wait(self, predicate: Callable[[], bool], *, timeout: float = 25, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():  # bounded wait for other processes
            if time.monotonic() > deadline:
                dump = "\n".join(p.read_text()[-3000:] for p in sorted(self.logs.glob("celery-*.log")))
                pytest.fail(f"timed out waiting for {what}; runs={self.runs()}\n{dump}")
            if any(p.poll() is not None for p in self.processes):
                pytest.fail(f"a worker process exited while waiting for {what}")
            time.sleep(0.05)


@pytest.fixture
def make_workers(tmp_path: Path) -> Iterator[Callable[..., Workers]]:
    made: list[Workers] = []

    def make(broker: str, store: str, **options: Any) -> Workers:
        require_server(BROKERS[broker], "RabbitMQ" if broker == "rabbitmq" else "Redis")
        require_server(STORES[store], "PostgreSQL" if store == "postgres" else "Redis")
        require_server(LOG_URL, "Redis")
        namespace = f"c{uuid.uuid4().hex[:10]}"
        if store == "postgres":
            migrated = store_from_url(STORES[store], namespace=namespace)
            migrated.migrate()
            migrated.close()
        config = AppConfig(
            broker_url=BROKERS[broker],
            store=STORES[store],
            namespace=namespace,
            queue=f"singleton_{namespace}",
            log_url=LOG_URL,
            log_key=f"singleton-celery-test:{namespace}",
            **options,
        )
        workers = Workers(config, tmp_path)
        made.append(workers)
        return workers

    yield make
    for workers in made:
        workers.stop()


def assert_serialized(runs: list[dict[str, Any]], key: str, sent: list[str]) -> None:
    mine = sorted((r for r in runs if r["key"] == key), key=lambda r: r["start"])
    assert [r["run_id"] for r in mine] == sent  # every run completed once, in enqueue order
    for before, after in itertools.pairwise(mine):
        assert after["start"] >= before["end"], f"{key}: {before} overlaps {after}"
    tokens = [r["token"] for r in mine]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("broker", brokers())
def test_workers_serialize_each_key_in_order(
    make_workers: Callable[..., Workers], broker: str, store: str
) -> None:
    workers = make_workers(broker, store)
    workers.start()
    sent: dict[str, list[str]] = {"A": [], "B": []}
    for i in range(5):
        for key in ("A", "B"):
            sent[key].append(workers.record.delay(key, f"{key}{i}", 0.2).id)
    for i in range(4):
        workers.record.delay(f"C{i}", f"C{i}", 0.1)
    workers.wait(lambda: len(workers.runs()) == 14, what="14 runs")
    time.sleep(0.5)  # nothing runs twice
    runs = workers.runs()
    assert len(runs) == 14 and len({r["run_id"] for r in runs}) == 14
    for key in ("A", "B"):
        assert_serialized(runs, key, sent[key])
    a_runs = [r for r in runs if r["key"] == "A"]
    b_runs = [r for r in runs if r["key"] == "B"]
    assert any(a["start"] < b["end"] and b["start"] < a["end"] for a in a_runs for b in b_runs)
    assert len({r["pid"] for r in runs}) >= 2  # both worker processes (and pools) took part


@pytest.mark.parametrize("pool", ["prefork", "threads"])
@pytest.mark.parametrize("store", list(STORES))
def test_visibility_timeout_redelivery_of_a_live_holder_is_deferred(
    make_workers: Callable[..., Workers], store: str, pool: str
) -> None:
    if "redis" not in brokers():
        pytest.skip("the Redis broker's visibility timeout")
    # A 1 s lease: only the heartbeats of the pool process running the holder keep it live.
    workers = make_workers("redis", store, visibility_timeout=1.0, lease=1.0)
    workers.start(pools=(pool, pool))
    holder = workers.record.delay("K", "holder", 4.0)
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
