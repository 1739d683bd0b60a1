"""The scenario runner: real worker processes, load, faults, dedicated store servers.

- :class:`Driver` (one per framework): the worker command line, and the producer side of the same
  app (enqueue, a duplicate publish, purge).
- :class:`Workers`: starts ``dramatiq …`` / ``celery … worker`` processes in their own process
  groups, SIGKILLs or SIGTERMs them (logged as events), restarts them.
- :class:`Chaos`: SIGKILLs a random worker every few seconds and starts a replacement.
- :class:`Producer`: enqueues and logs every attempt (accepted, rejected by the cap, store down).
- :class:`RedisServer`, :class:`PostgresServer`: store servers owned by the runner, on their own
  loopback ports, stopped and restarted by PID for the outage scenario.

``python -m integrations.runner hammer …`` is one producer process of the "producers at a cap"
scenario (settings from ``INTEGRATION_*``).
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import glob
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from singleton_tasks import (
    SingletonPayloadError,
    SingletonQueueFullError,
    StoreUnavailableError,
    store_from_url,
)
from singleton_tasks.outcomes import KeySnapshot

from .checker import BROKER_LOSS_PER_KILL, explain_unfinished, lost_to_broker, store_snapshots
from .runlog import Enqueue, RunLog
from .settings import PLAIN_TASK, SINGLETON_TASKS, Settings, real_time, shift_clock

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


class ScenarioError(AssertionError):
    """The scenario could not reach the state it waits for (a timeout, a worker that died)."""


# -- frameworks --------------------------------------------------------------------------------
@dataclass
class Prepared:
    """A message built but not published yet: its run id is known before the enqueue can fail."""

    run_id: str
    publish: Callable[[], object]  # returns what the framework's send returned


class Driver(abc.ABC):
    """One framework: how to run its workers, and the producer side of the same app."""

    framework: ClassVar[str]
    ready_text: ClassVar[str]

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    @abc.abstractmethod
    def command(self, threads: int, worker: str, queue: str) -> list[str]:
        """The command line of worker instance ``worker``, consuming ``queue``."""

    @abc.abstractmethod
    def prepare(self, task: str, key: str, item: int, duration: float, fail: bool) -> Prepared:
        """Build one message of ``task``."""

    @abc.abstractmethod
    def duplicate(self, run_id: str) -> None:
        """Publish another copy of an already published run, as an at-least-once broker would."""

    @abc.abstractmethod
    def purge(self, expect: int = 0) -> None:
        """Drop every message of the scenario's queues (the "lost message" case).

        ``expect``: messages a killed worker held that the broker is about to return to the queue
        (RabbitMQ, on connection close): wait for them first, or they would survive the purge.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Close the producer side's connections (messages stay queued)."""

    def cleanup(self) -> None:
        """Remove the scenario's queues, then close."""
        self.close()


class DramatiqDriver(Driver):
    framework = "dramatiq"
    ready_text = "is ready for action"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        from .dramatiq_app import build

        self.app = build(settings)
        self.sent: dict[str, Any] = {}

    def command(self, threads: int, worker: str, queue: str) -> list[str]:
        # The worker's actors are declared on ``queue`` (INTEGRATION_QUEUE): it consumes that one.
        return [
            str(BIN / "dramatiq"),
            "integrations.dramatiq_app",
            "--processes",
            "1",
            "--threads",
            str(threads),
        ]

    def prepare(self, task: str, key: str, item: int, duration: float, fail: bool) -> Prepared:
        actor = self.app.actors[task]
        message = actor.message(key, item, duration, fail)

        def publish() -> object:
            self.sent[message.message_id] = message
            return actor.broker.enqueue(message)

        return Prepared(message.message_id, publish)

    def duplicate(self, run_id: str) -> None:
        from singleton_tasks.dramatiq import GENERATION

        # The copy of generation 0 is the one the first delivery admitted: a broker duplicate.
        self.app.broker.enqueue(self.sent[run_id].copy(options={GENERATION: 0}))

    def purge(self, expect: int = 0) -> None:
        broker: Any = self.app.broker
        if expect and self.settings.broker == "rabbitmq":
            wait_for(
                lambda: broker.get_queue_message_counts(self.settings.queue)[0] >= expect,
                timeout=15,
                what="the killed worker's messages back in the queue",
            )
        # RedisBroker: deleting the queue's message hash also drops the dead worker's unacked ids.
        broker.flush(self.settings.queue)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.app.middleware.gatekeeper.close()
        self.app.broker.close()

    def cleanup(self) -> None:
        broker: Any = self.app.broker
        with contextlib.suppress(Exception):
            broker.flush(self.settings.queue)
        if self.settings.broker == "rabbitmq":
            from dramatiq.common import dq_name, xq_name

            for name in (self.settings.queue, dq_name(self.settings.queue), xq_name(self.settings.queue)):
                with contextlib.suppress(Exception):
                    broker.channel.queue_delete(name)
        self.close()


class CeleryDriver(Driver):
    framework = "celery"
    ready_text = " ready."

    def __init__(self, settings: Settings, pool: str = "threads", max_tasks_per_child: int = 0) -> None:
        super().__init__(settings)
        from .celery_app import build

        self.pool = pool
        self.max_tasks_per_child = max_tasks_per_child  # > 0: a pool process exits after that many tasks
        self.app = build(settings)
        self.sent: dict[str, tuple[str, tuple[Any, ...]]] = {}

    def command(self, threads: int, worker: str, queue: str) -> list[str]:
        return [
            str(BIN / "celery"),
            "-A",
            "integrations.celery_app",
            "worker",
            "--pool",
            self.pool,
            "-c",
            str(threads),
            "-Q",
            queue,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-n",
            f"{worker}-{uuid.uuid4().hex[:6]}@%h",
            "--loglevel",
            "INFO",
            *(["--max-tasks-per-child", str(self.max_tasks_per_child)] if self.max_tasks_per_child else []),
        ]

    def prepare(self, task: str, key: str, item: int, duration: float, fail: bool) -> Prepared:
        from celery.utils import uuid as celery_uuid

        run_id = celery_uuid()
        args = (key, item, duration, fail)

        def publish() -> object:
            self.sent[run_id] = (task, args)
            return self.app.tasks[task].apply_async(args, task_id=run_id, queue=self.settings.queue)

        return Prepared(run_id, publish)

    def duplicate(self, run_id: str) -> None:
        # send_task bypasses SingletonTask.apply_async: a plain second copy of the same task id.
        task, args = self.sent[run_id]
        self.app.send_task(task, args, task_id=run_id, queue=self.settings.queue)

    def purge(self, expect: int = 0) -> None:
        with self.app.connection_for_write() as conn:
            queue = self.app.amqp.queues[self.settings.queue].bind(conn.default_channel)
            if expect and self.settings.broker == "rabbitmq":
                wait_for(
                    lambda: queue.queue_declare(passive=True).message_count >= expect,
                    timeout=15,
                    what="the killed worker's messages back in the queue",
                )
            queue.purge()
        if self.settings.broker == "redis":
            self._drop_unacked()

    def _drop_unacked(self) -> None:
        """kombu's Redis transport keeps a dead worker's unacked messages to restore them later."""
        import redis

        client = redis.Redis.from_url(self.settings.broker_url)
        try:
            ours = set(self.sent)
            for tag, raw in client.hgetall("unacked").items():
                text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
                if any(run_id in text for run_id in ours):
                    client.hdel("unacked", tag)
                    client.zrem("unacked_index", tag)
        finally:
            client.close()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            from singleton_tasks.celery import gatekeeper_for

            gatekeeper_for(self.app).close()
        self.app.close()

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            with self.app.connection_for_write() as conn:
                queue = self.app.amqp.queues[self.settings.queue].bind(conn.default_channel)
                queue.purge()
                if self.settings.broker == "rabbitmq":
                    queue.delete()
        self.close()


def make_driver(framework: str, settings: Settings, **options: Any) -> Driver:
    if framework == "dramatiq":
        return DramatiqDriver(settings)
    if framework == "celery":
        return CeleryDriver(settings, **options)
    raise ValueError(f"unknown framework {framework!r}")


# -- worker processes ------------------------------------------------------------------------------
@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    logfile: Path
    started: float
    expected_exit: bool = False

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        try:
            return self.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Workers:
    """The worker processes of one scenario run; every signal sent is logged as an event."""

    def __init__(self, driver: Driver, log: RunLog, logdir: Path, *, threads: int = 4) -> None:
        self.driver = driver
        self.log = log
        self.logdir = logdir
        self.threads = threads
        self.all: list[Worker] = []
        self._names = itertools.count()
        self._lock = threading.Lock()

    @property
    def run(self) -> str:
        return self.driver.settings.run

    def alive(self) -> list[Worker]:
        with self._lock:
            return [w for w in self.all if w.alive and not w.expected_exit]

    def start(
        self, count: int = 1, *, wait: bool = True, threads: int | None = None, **overrides: Any
    ) -> list[Worker]:
        """Start ``count`` workers; ``overrides`` change their settings (another queue, a clock shift)."""
        started = []
        for _ in range(count):
            name = f"w{next(self._names)}"
            settings = self.driver.settings.with_(worker=name, **overrides)
            logfile = self.logdir / f"{self.run}-{name}.log"
            env = {
                **os.environ,
                **settings.env(),
                "PYTHONPATH": _pythonpath(),
                "dramatiq_worker_timeout": "100",
            }
            command = self.driver.command(threads or self.threads, name, settings.queue)
            with logfile.open("wb") as out:
                proc = subprocess.Popen(
                    command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            worker = Worker(name, proc, logfile, time.time())
            with self._lock:
                self.all.append(worker)
            detail = f"pid {proc.pid}" + "".join(f" {k}={v}" for k, v in sorted(overrides.items()))
            self.log.event(self.run, "start", name, detail)
            started.append(worker)
        if wait:
            self.wait_ready(started)
        return started

    def wait_ready(self, workers: Sequence[Worker], timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        for worker in workers:
            while self.driver.ready_text not in worker.text():
                if not worker.alive:
                    raise ScenarioError(f"worker {worker.name} exited at start:\n{worker.text()[-4000:]}")
                if time.monotonic() > deadline:
                    raise ScenarioError(
                        f"worker {worker.name} not ready in {timeout}s:\n{worker.text()[-4000:]}"
                    )
                time.sleep(0.05)

    def kill(self, worker: Worker) -> float:
        """SIGKILL the worker's whole process group (the CLI's parent and its children)."""
        worker.expected_exit = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)
        # Logged once the group is dead: a body killed mid-run ended no later than this.
        return self.log.event(self.run, "kill", worker.name, f"pid {worker.proc.pid}")

    def terminate(self, worker: Worker, timeout: float = 60.0) -> float:
        """SIGTERM: the framework's graceful shutdown; waits for the process to exit."""
        worker.expected_exit = True
        at = self.log.event(self.run, "term", worker.name, f"pid {worker.proc.pid}")
        worker.proc.send_signal(signal.SIGTERM)
        try:
            worker.proc.wait(timeout)
        except subprocess.TimeoutExpired as error:
            raise ScenarioError(f"worker {worker.name} ignored SIGTERM for {timeout}s") from error
        self.log.event(self.run, "exited", worker.name, f"rc {worker.proc.returncode}")
        return at

    def check(self) -> None:
        """Fail when a worker died that nobody killed."""
        with self._lock:
            dead = [w for w in self.all if not w.alive and not w.expected_exit]
        if dead:
            raise ScenarioError(
                "worker(s) exited unexpectedly: "
                + "; ".join(f"{w.name} rc={w.proc.returncode}\n{w.text()[-3000:]}" for w in dead)
            )

    def stop_all(self) -> None:
        with self._lock:
            workers = list(self.all)
        for worker in workers:
            if worker.alive:
                worker.expected_exit = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.proc.pid, signal.SIGTERM)
        for worker in workers:
            try:
                worker.proc.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait(5)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(worker.proc.pid, signal.SIGKILL)  # stray children of a SIGTERMed parent

    def tail(self, chars: int = 2500) -> str:
        return "\n".join(f"--- {w.name} ---\n{w.text()[-chars:]}" for w in self.all)


def _pythonpath() -> str:
    existing = os.environ.get("PYTHONPATH")
    return f"{REPO}{os.pathsep}{existing}" if existing else str(REPO)


class Chaos(threading.Thread):
    """SIGKILLs a random live worker every ``every`` seconds (uniform range) and starts a replacement."""

    def __init__(
        self, workers: Workers, every: tuple[float, float] = (2.0, 4.0), seed: int | None = None
    ) -> None:
        super().__init__(name="chaos", daemon=True)
        self.workers = workers
        self.every = every
        self.random = random.Random(seed)
        self.kills = 0
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.wait(self.random.uniform(*self.every)):
                alive = self.workers.alive()
                if not alive:
                    continue
                self.workers.kill(self.random.choice(alive))
                self.kills += 1
                self.workers.start(1, wait=False)
        except BaseException as error:  # reported by stop(): a silent chaos thread proves nothing
            self.error = error

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)
        if self.error is not None:
            raise ScenarioError(f"chaos thread failed: {self.error!r}") from self.error


# -- producers ---------------------------------------------------------------------------------
@dataclass
class Producer:
    """Enqueues through the app and logs every attempt; thread-safe."""

    driver: Driver
    log: RunLog
    name: str = "p0"
    records: list[Enqueue] = field(default_factory=list)
    _seq: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _flushed: int = 0
    #: What each send returned (the framework's message or result), by run id.
    returned: dict[str, object] = field(default_factory=dict)

    def send(
        self,
        task: str,
        key: str,
        duration: float = 0.0,
        fail: bool = False,
        item: int = 0,
        *,
        via: Driver | None = None,
    ) -> Enqueue:
        """Enqueue one run; ``via``: another driver of the same run (the app on another queue)."""
        prepared = (via or self.driver).prepare(task, key, item, duration, fail)
        with self._lock:
            seq = next(self._seq)
        at = real_time()
        error: str | None = None
        try:
            returned = prepared.publish()
            with self._lock:
                self.returned[prepared.run_id] = returned
        except SingletonQueueFullError:
            error = "SingletonQueueFullError"
        except StoreUnavailableError:
            error = "StoreUnavailableError"
        except SingletonPayloadError as raised:
            error = type(raised).__name__  # Dramatiq: PayloadError; Celery: SingletonPayloadError
        limit = SINGLETON_TASKS[task][0] if task in SINGLETON_TASKS else None
        scope = task if task in SINGLETON_TASKS else PLAIN_TASK
        record = Enqueue(
            self.name, seq, scope, key, prepared.run_id, limit, error is None, error, at, real_time()
        )
        with self._lock:
            self.records.append(record)
        return record

    def mark_dropped(self, run_ids: set[str], error: str = "dropped") -> None:
        """Log these sends as not accepted: they returned without raising, and never run
        (``on_full="drop"``, or ``"replace"`` for a run a later send replaced: ``error="replaced"``)."""
        with self._lock:
            assert self._flushed == 0 or all(r.run_id not in run_ids for r in self.records[: self._flushed])
            self.records = [
                dataclasses.replace(r, accepted=False, error=error) if r.run_id in run_ids else r
                for r in self.records
            ]

    def accepted(self) -> list[Enqueue]:
        with self._lock:
            return [r for r in self.records if r.accepted]

    def flush(self) -> None:
        with self._lock:
            batch, self._flushed = self.records[self._flushed :], len(self.records)
        self.log.enqueues(self.driver.settings.run, batch)


def soak_load(
    producer: Producer,
    keys: Sequence[tuple[str, str]],
    *,
    runs: int,
    max_outstanding: int = 6,
    fail_rate: float = 0.1,
    plain_every: int = 10,
    max_duration: float = 0.05,
    timeout: float = 240.0,
    seed: int | None = None,
    more: Callable[[], bool] | None = None,
) -> None:
    """Enqueue until ``runs`` singleton runs were accepted (and ``more()`` is false), keeping each
    key's backlog bounded.

    A bounded backlog keeps every message's first delivery well within ``orphan_timeout``, so any
    FIFO inversion the checker finds is one the rules should not have allowed. Capped keys are
    pushed past their cap on purpose (the rejections are checked too).
    """
    rng = random.Random(seed)
    log, run = producer.log, producer.driver.settings.run
    completed: set[str] = set()
    outstanding: dict[tuple[str, str], list[str]] = {k: [] for k in keys}
    full: set[tuple[str, str]] = set()
    accepted = 0
    refreshed = 0.0
    deadline = time.monotonic() + timeout
    item = itertools.count()
    while accepted < runs or (more is not None and more()):
        if time.monotonic() > deadline:
            raise ScenarioError(f"soak load: only {accepted}/{runs} runs accepted in {timeout}s")
        if time.monotonic() - refreshed > 0.25:
            completed = log.completed(run)
            refreshed = time.monotonic()
            for pending in outstanding.values():
                pending[:] = [r for r in pending if r not in completed]
            full.clear()
            producer.flush()
        open_keys = [
            k
            for k in keys
            if k not in full
            and len(outstanding[k]) < max_outstanding + (3 if SINGLETON_TASKS[k[0]][1] is not None else 0)
        ]
        if not open_keys:
            time.sleep(0.02)
            continue
        task, key = rng.choice(open_keys)
        record = producer.send(task, key, rng.uniform(0, max_duration), rng.random() < fail_rate, next(item))
        if record.accepted:
            accepted += 1
            outstanding[(task, key)].append(record.run_id)
        else:
            full.add((task, key))  # rejected at its cap: try it again after the next refresh
        if plain_every and accepted % plain_every == 0 and record.accepted:
            producer.send(
                PLAIN_TASK, f"plain{rng.randrange(4)}", rng.uniform(0, max_duration), False, next(item)
            )
    producer.flush()


class BackgroundLoad(threading.Thread):
    """Enqueues round-robin over ``keys`` every ``interval`` s until stopped (outage scenarios)."""

    def __init__(
        self,
        producer: Producer,
        keys: Sequence[tuple[str, str]],
        *,
        interval: float = 0.03,
        max_duration: float = 0.05,
        seed: int | None = None,
    ) -> None:
        super().__init__(name="load", daemon=True)
        self.producer = producer
        self.keys = list(keys)
        self.interval = interval
        self.max_duration = max_duration
        self.random = random.Random(seed)
        self.error: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            for i in itertools.count():
                if self._stop_event.wait(self.interval):
                    return
                task, key = self.keys[i % len(self.keys)]
                self.producer.send(task, key, self.random.uniform(0, self.max_duration), False, i)
        except BaseException as error:
            self.error = error

    def stop(self) -> None:
        self._stop_event.set()
        self.join(60)
        if self.error is not None:
            raise ScenarioError(f"load thread failed: {self.error!r}") from self.error


def soak_keys(count: int = 20) -> list[tuple[str, str]]:
    """``count`` keys over the three singleton tasks: 40 % limit 1, 30 % limit 2, 30 % capped."""
    mutex = round(count * 0.4)
    pair = round(count * 0.3)
    capped = count - mutex - pair
    return (
        [("mutex", f"m{i}") for i in range(mutex)]
        + [("pair", f"p{i}") for i in range(pair)]
        + [("capped", f"c{i}") for i in range(capped)]
    )


# -- waiting -----------------------------------------------------------------------------------
def wait_for(
    predicate: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    workers: Workers | None = None,
    interval: float = 0.1,
) -> None:
    """Poll another process's progress (worker processes, the log) until ``predicate`` holds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if workers is not None:
            workers.check()
        if time.monotonic() > deadline:
            tail = workers.tail() if workers is not None else ""
            raise ScenarioError(f"timed out after {timeout}s waiting for {what}\n{tail}")
        time.sleep(interval)


def wait_all_completed(
    log: RunLog, run: str, run_ids: Sequence[str], *, timeout: float, workers: Workers | None = None
) -> None:
    wanted = set(run_ids)
    missing: set[str] = set(wanted)

    def done() -> bool:
        nonlocal missing
        missing = wanted - log.completed(run)
        return not missing

    try:
        wait_for(
            done, timeout=timeout, what=f"{len(wanted)} runs to complete", workers=workers, interval=0.25
        )
    except ScenarioError as error:
        raise ScenarioError(
            f"{len(missing)} run(s) never completed: {sorted(missing)[:10]}\n{error}\n"
            + unfinished_story(log, run, sorted(missing)[:10])
        ) from None


def unfinished_story(log: RunLog, run: str, run_ids: Sequence[str]) -> str:
    """:func:`explain_unfinished` over the log and the store as they are now."""
    data = log.load(run)
    try:
        snapshots = store_snapshots(data.scenario.store_url, data.scenario.namespace)
    except StoreUnavailableError as error:
        snapshots = []
        note = f"(store unavailable: {error})\n"
    else:
        note = ""
    return note + explain_unfinished(data, run_ids, snapshots)


def wait_drained(
    log: RunLog,
    settings: Settings,
    run_ids: Sequence[str],
    *,
    timeout: float,
    workers: Workers,
    broker_may_lose: bool,
) -> set[str]:
    """Wait until every run completed; returns the runs a lossy broker lost (empty unless allowed).

    With ``broker_may_lose``, the wait also ends when every missing run is one the SIGKILLs lost in
    transit (:func:`integrations.checker.lost_to_broker`, at most one per kill) and the last kill is
    longer ago than the broker's redelivery time (kombu Redis: visibility_timeout) plus a margin, so
    a message a dead worker had recorded is back by then. The checker re-derives and reports them.
    """
    wanted = set(run_ids)
    missing: set[str] = set(wanted)
    grace = settings.visibility_timeout + 10.0

    def lost_by_broker() -> bool:
        kills = [
            float(row[0])
            for row in log.execute(
                "SELECT at FROM integration_events WHERE run = %s AND kind = 'kill'", [settings.run]
            )
        ]
        if len(missing) > len(kills) * BROKER_LOSS_PER_KILL:
            return False  # more than the kills can have lost: keep waiting (and fail at the timeout)
        if time.time() - max(kills, default=0.0) < grace:
            return False  # the broker may still redeliver
        return set(lost_to_broker(log.load(settings.run), missing).excused) == missing

    def done() -> bool:
        nonlocal missing
        missing = wanted - log.completed(settings.run)
        return not missing or (broker_may_lose and lost_by_broker())

    try:
        wait_for(done, timeout=timeout, what=f"{len(wanted)} runs to complete", workers=workers, interval=0.5)
    except ScenarioError as error:
        raise ScenarioError(
            f"{len(missing)} run(s) never completed: {sorted(missing)[:10]}\n{error}\n"
            + unfinished_story(log, settings.run, sorted(missing)[:10])
        ) from None
    return missing


def wait_store_idle(
    settings: Settings, *, timeout: float = 20.0, ignore: set[str] | frozenset[str] = frozenset()
) -> list[KeySnapshot]:
    """Wait until no key has holders or waiters (releases and wakes settle right after the bodies)."""
    busy: list[KeySnapshot] = []

    def idle() -> bool:
        nonlocal busy
        try:
            snaps = store_snapshots(settings.store_url, settings.namespace)
        except StoreUnavailableError:
            return False
        busy = [
            s
            for s in snaps
            if any(h.run_id not in ignore for h in s.holders)
            or any(w.run_id not in ignore for w in s.waiters)
        ]
        return not busy

    with contextlib.suppress(ScenarioError):
        wait_for(idle, timeout=timeout, what="the store to be idle", interval=0.25)
    return busy


def migrate(settings: Settings) -> None:
    store = store_from_url(settings.store_url, namespace=settings.namespace)
    try:
        store.migrate()
    finally:
        store.close()


# -- store servers owned by the runner ------------------------------------------------------------
def port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def pick_port(preferred: int) -> int:
    for port in range(preferred, preferred + 50):
        if port_free(port):
            return port
    raise ScenarioError(f"no free loopback port from {preferred}")


def wait_port(port: int, *, up: bool, timeout: float = 30.0) -> None:
    wait_for(lambda: port_free(port) != up, timeout=timeout, what=f"port {port} {'up' if up else 'down'}")


class RedisServer:
    """A redis-server of the runner's own (AOF, fsync always: a restart keeps the store's data)."""

    def __init__(self, directory: Path, port: int = 16400) -> None:
        self.directory = directory
        self.port = pick_port(port)
        self.proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ScenarioError("redis-server is not installed")
        log = (self.directory / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.directory),
                "--daemonize",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        wait_port(self.port, up=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # by PID: this server only
            self.proc.wait(20)
        self.proc = None
        wait_port(self.port, up=False)


def postgres_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    """A PostgreSQL cluster of the runner's own under a temporary directory, on another port."""

    def __init__(self, directory: Path, port: int = 16432) -> None:
        self.bin = postgres_bin()
        if self.bin is None:
            raise ScenarioError("PostgreSQL server binaries (/usr/lib/postgresql/*/bin) are not installed")
        self.directory = directory
        self.data = directory / "data"
        self.port = pick_port(port)
        self._as: list[str] = []
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        assert self.bin is not None
        done = subprocess.run([*self._as, *args], capture_output=True, text=True, timeout=120, cwd="/tmp")
        if done.returncode != 0:
            raise ScenarioError(f"{' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")

    def init(self) -> None:
        assert self.bin is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._as:
            shutil.chown(self.directory, "postgres", "postgres")
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8"
        )

    def start(self) -> None:
        assert self.bin is not None
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.directory} "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.directory / "pg.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )
        wait_port(self.port, up=True)

    def stop(self, mode: str = "fast") -> None:
        assert self.bin is not None
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
        wait_port(self.port, up=False)

    def pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None


# -- one producer process of the "producers at a cap" scenario ---------------------------------
def hammer(
    framework: str,
    settings: Settings,
    *,
    name: str,
    threads: int,
    per_thread: int,
    task: str,
    key: str,
    start_at: float,
) -> None:
    """``threads`` threads each enqueue ``per_thread`` runs of one key, all starting at ``start_at``."""
    driver = make_driver(framework, settings)
    log = RunLog(settings.log_url)
    # One producer per thread: enqueue order is defined within a thread, not across threads.
    producers = [Producer(driver, log, f"{name}.t{i}") for i in range(threads)]
    barrier = threading.Barrier(threads)

    def work(producer: Producer) -> None:
        barrier.wait()
        delay = start_at - real_time()
        if delay > 0:
            time.sleep(delay)  # both processes start together
        for _ in range(per_thread):
            producer.send(task, key)

    pool = [threading.Thread(target=work, args=(p,)) for p in producers]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    for producer in producers:
        producer.flush()
    log.close()
    driver.close()


def pair(
    framework: str,
    settings: Settings,
    *,
    name: str,
    task: str,
    key: str,
    duration: float,
    gap: float,
    second_queue: str,
) -> None:
    """One producer process (its clock shifted by ``settings.clock_shift``): a holder of
    ``duration`` s on ``settings.queue``, then ``gap`` s later a short run of the same key on
    ``second_queue`` (another worker's)."""
    first = make_driver(framework, settings)
    second = make_driver(framework, settings.with_(queue=second_queue))
    shift_clock(settings.clock_shift)
    log = RunLog(settings.log_url)
    producer = Producer(first, log, name)
    try:
        producer.send(task, key, duration)
        time.sleep(gap)
        producer.send(task, key, 0.2, item=1, via=second)
        producer.flush()
    finally:
        log.close()
        first.close()
        second.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integrations.runner")
    sub = parser.add_subparsers(dest="command", required=True)
    ham = sub.add_parser("hammer", help="one producer process at a cap (settings from INTEGRATION_*)")
    ham.add_argument("--framework", required=True, choices=["dramatiq", "celery"])
    ham.add_argument("--name", required=True)
    ham.add_argument("--threads", type=int, default=8)
    ham.add_argument("--per-thread", type=int, default=10)
    ham.add_argument("--task", default="capped")
    ham.add_argument("--key", required=True)
    ham.add_argument("--start-at", type=float, default=0.0)
    two = sub.add_parser("pair", help="a holder, then a second run of its key (settings from INTEGRATION_*)")
    two.add_argument("--framework", required=True, choices=["dramatiq", "celery"])
    two.add_argument("--name", required=True)
    two.add_argument("--task", default="mutex")
    two.add_argument("--key", required=True)
    two.add_argument("--duration", type=float, required=True)
    two.add_argument("--gap", type=float, required=True)
    two.add_argument("--second-queue", required=True)
    args = parser.parse_args(argv)
    if args.command == "pair":
        pair(
            args.framework,
            Settings.from_env(),
            name=args.name,
            task=args.task,
            key=args.key,
            duration=args.duration,
            gap=args.gap,
            second_queue=args.second_queue,
        )
        return 0
    hammer(
        args.framework,
        Settings.from_env(),
        name=args.name,
        threads=args.threads,
        per_thread=args.per_thread,
        task=args.task,
        key=args.key,
        start_at=args.start_at,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
