"""The examples' real-server modes, as their docstrings say, with real worker processes (issue 16).

Each example's worker command runs from the repository's root against the Redis store and the
Redis broker; the example's producer (``--producer-only``) sends its burst twice, the second time
after the first has drained: each time exactly the fourth same-key run is refused (nothing is
left behind in the store), the bodies run one per key at a time with increasing fencing tokens,
and the worker logs no ERROR or CRITICAL line. The examples use the broker's default queue, so
concurrent runs of these tests (other checkouts on the same servers) take turns on a Redis lock.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import BROKER_REDIS_URL, REDIS_URL, purge_namespaces
from services import require_server
from worker_env import LOG_URL

pytestmark = pytest.mark.workers

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WAIT = 60.0


@contextlib.contextmanager
def exclusive(queue_keys: str) -> Iterator[None]:
    """Hold the examples' lock, then clear the default queue's leftovers (a killed earlier run)."""
    require_server(LOG_URL, "Redis")
    require_server(BROKER_REDIS_URL, "Redis")
    require_server(REDIS_URL, "Redis")
    log = redis.Redis.from_url(LOG_URL)
    lock = log.lock("singleton-tests:examples", timeout=300, blocking_timeout=300)
    assert lock.acquire(), "another run of the example tests held the lock for 5 minutes"
    broker = redis.Redis.from_url(BROKER_REDIS_URL)
    try:
        stale = list(broker.scan_iter(match=queue_keys, count=1000))
        if stale:
            broker.delete(*stale)
        yield
    finally:
        broker.close()
        lock.release()
        log.close()


@contextlib.contextmanager
def worker(command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def produce(example: str, env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, f"examples/{example}", "--producer-only"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def wait_for_syncs(log: Path, count: int) -> list[tuple[str, int]]:
    """The bodies' lines in the worker's log, once ``count`` of them are there."""
    deadline = time.monotonic() + WAIT
    while True:
        found = [
            (s, int(t)) for s, t in re.findall(r"syncing store (\w) \(fencing token (\d+)\)", log.read_text())
        ]
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"timed out; worker log:\n{log.read_text()}"
        time.sleep(0.1)


def check_story(example: str, env: dict[str, str], log: Path, task_name: str) -> None:
    for burst in (1, 2):
        out = produce(example, env)
        assert out.count("refused: ") == 1, out
        assert f"refused: {task_name}: the queue of key 'store:A'" in out
        syncs = wait_for_syncs(log, 4 * burst)
        time.sleep(0.5)  # nothing more than the accepted runs ever runs
        syncs = wait_for_syncs(log, 4 * burst)
        assert len(syncs) == 4 * burst, syncs
        a_tokens = [token for store, token in syncs if store == "A"]
        b_tokens = [token for store, token in syncs if store == "B"]
        # One at a time, in order: each token above the one before (tokens come from the store clock).
        assert len(a_tokens) == 3 * burst and a_tokens == sorted(set(a_tokens))
        assert len(b_tokens) == burst and b_tokens == sorted(set(b_tokens))
    text = log.read_text()
    assert not re.search(r"\b(ERROR|CRITICAL)\b", text), text
    assert "unregistered" not in text


def example_env(namespace: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
        "SINGLETON_TASKS_STORE": REDIS_URL,
        "SINGLETON_TASKS_NAMESPACE": namespace,
        "SINGLETON_RETRY_DELAY": "0.3",
        **extra,
    }


def test_dramatiq_example_with_real_workers_on_redis_broker(tmp_path: Path) -> None:
    namespace = f"exd{uuid.uuid4().hex[:10]}"
    env = example_env(namespace, DRAMATIQ_BROKER_URL=BROKER_REDIS_URL, dramatiq_worker_timeout="100")
    log = tmp_path / "dramatiq.log"
    command = [
        str(BIN / "dramatiq"),
        "examples.dramatiq_sync_inventory",
        "--processes",
        "2",
        "--threads",
        "2",
    ]
    try:
        with exclusive("dramatiq:default*"), worker(command, env, log):
            deadline = time.monotonic() + WAIT
            while "ready for action" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            check_story("dramatiq_sync_inventory.py", env, log, "sync_inventory")
    finally:
        purge_namespaces("redis", REDIS_URL, {namespace})


def test_celery_example_with_real_workers_on_redis_broker(tmp_path: Path) -> None:
    namespace = f"exc{uuid.uuid4().hex[:10]}"
    env = example_env(namespace, CELERY_BROKER_URL=BROKER_REDIS_URL)
    log = tmp_path / "celery.log"
    command = [
        str(BIN / "celery"),
        "-A",
        "examples.celery_sync_inventory",
        "worker",
        "--pool",
        "threads",
        "-c",
        "4",
        "--loglevel",
        "INFO",  # the docstring's command, logging its readiness and every task
    ]
    try:
        with exclusive("*celery*"), worker(command, env, log):
            deadline = time.monotonic() + WAIT
            while " ready." not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            check_story("celery_sync_inventory.py", env, log, "shop.sync_inventory")
    finally:
        purge_namespaces("redis", REDIS_URL, {namespace})
