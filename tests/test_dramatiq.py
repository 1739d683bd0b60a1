"""Dramatiq adapter in process: StubBroker + Worker against every store (docs/concepts.md)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import pytest
from conftest import RABBITMQ_URL, StoreFactory, backend_params
from dramatiq.brokers.stub import StubBroker
from dramatiq.common import dq_name, xq_name
from dramatiq.middleware import AgeLimit, MiddlewareError
from dramatiq.results import ResultMissing, Results
from dramatiq.results.backends import StubBackend
from marks import needs
from prometheus_client import CollectorRegistry
from services import reachable, require_executable, require_server, unavailable

from singleton_tasks import (
    SchemaVersionError,
    SingletonConfig,
    SingletonConfigError,
    SingletonKeyError,
    SingletonQueueFullError,
    Store,
    StoreUnavailableError,
    current_admission,
    singleton,
    store_from_url,
)
from singleton_tasks.config import Timings
from singleton_tasks.dramatiq import GENERATION, InvalidKey, PayloadError, QueueFull, SingletonMiddleware
from singleton_tasks.outcomes import RegisterOutcome, RunSpec, RunState
from singleton_tasks.stores import SCHEMA_VERSION
from singleton_tasks.stores.memory import MemoryStore

QUEUE = "default"
FAST = {"retry_delay": 0.05, "retry_jitter": 0.01}
WAIT = 15.0  # bound of every wait for a broker condition


# -- harness ----------------------------------------------------------------------------------
@dataclass
class Attempt:
    label: str
    key: str
    run_id: str | None
    scope: str | None
    token: int | None
    failed: bool = False
    done: bool = False


class Journal:
    """What the bodies did, in order; tests wait on it with a bound."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[tuple[str, str, str]] = []  # ("start" | "end", label, key)
        self.attempts: list[Attempt] = []

    def begin(self, label: str, key: str) -> Attempt:
        admitted = current_admission()
        attempt = Attempt(
            label,
            key,
            admitted.run_id if admitted else None,
            admitted.scope if admitted else None,
            admitted.token if admitted else None,
        )
        with self.cond:
            self.events.append(("start", label, key))
            self.attempts.append(attempt)
            self.cond.notify_all()
        return attempt

    def finish(self, attempt: Attempt, *, failed: bool = False) -> None:
        with self.cond:
            attempt.failed, attempt.done = failed, True
            self.events.append(("end", attempt.label, attempt.key))
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout: float = WAIT) -> None:
        """Wait for a condition of the bodies or the broker, woken by bodies, re-checked every 10 ms."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; events: {self.events}"
                self.cond.wait(min(left, 0.01))

    def ran(self, label: str) -> list[Attempt]:
        with self.cond:
            return [a for a in self.attempts if a.label == label]

    def started(self) -> list[str]:
        with self.cond:
            return [label for kind, label, _key in self.events if kind == "start"]

    def finished(self, *labels: str) -> bool:
        done = {a.label for a in self.attempts if a.done and not a.failed}
        return set(labels) <= done

    def max_concurrency(self, key: str) -> int:
        running = peak = 0
        for kind, _label, event_key in self.events:
            if event_key == key:
                running += 1 if kind == "start" else -1
                peak = max(peak, running)
        return peak


class Probe(dramatiq.Middleware):
    """Sees every delivery (placed before SingletonMiddleware, so also the skipped ones) and publish."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deliveries: list[tuple[str, int]] = []
        self.published: list[dramatiq.Message[Any]] = []

    def before_process_message(self, broker: Any, message: Any) -> None:
        with self.lock:
            self.deliveries.append((message.message_id, message.options.get(GENERATION, 0)))

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        with self.lock:
            self.published.append(message)

    def delivered(self, run_id: str) -> int:
        with self.lock:
            return sum(1 for mid, _gen in self.deliveries if mid == run_id)

    def labels_published(self) -> set[str]:
        with self.lock:
            return {str(m.args[1]) for m in self.published if len(m.args) > 1}


@dataclass
class Env:
    broker: StubBroker
    middleware: SingletonMiddleware
    probe: Probe
    journal: Journal
    backend: StubBackend | None
    holds: dict[str, threading.Event] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    worker: dramatiq.Worker | None = None

    @property
    def store(self) -> Store:
        return self.middleware.store

    def start(self, threads: int = 4) -> None:
        self.worker = dramatiq.Worker(self.broker, worker_timeout=20, worker_threads=threads)
        self.worker.start()

    def hold(self, *labels: str) -> None:
        for label in labels:
            self.holds[label] = threading.Event()

    def let_go(self, label: str) -> None:
        self.holds[label].set()

    def join(self, *, fail_fast: bool = True) -> None:
        self.broker.join(QUEUE, timeout=int(WAIT * 1000), fail_fast=fail_fast)
        assert self.worker is not None
        self.worker.join()

    def keys(self) -> list[Any]:
        return self.store.snapshot()

    def gated(self, run_id: str) -> bool:
        """The run was delivered and deferred (its delayed copy is pending)."""
        return any(
            w.run_id == run_id and w.state is not RunState.PENDING
            for snap in self.keys()
            for w in snap.waiters
        )

    def job(self, name: str = "job", **options: Any) -> dramatiq.Actor[Any, Any]:
        """A singleton actor ``(key, label)``: records itself, may hold on an event, sleep or fail."""
        options.setdefault("singleton", {"key": "{key}"})
        journal, holds, failures = self.journal, self.holds, self.failures

        def body(key: str, label: str, sleep: float = 0.0) -> str:
            attempt = journal.begin(label, key)
            hold = holds.get(label)
            if hold is not None:
                assert hold.wait(WAIT)
            if sleep:
                time.sleep(sleep)
            if failures.get(label, 0):
                failures[label] -= 1
                journal.finish(attempt, failed=True)
                raise RuntimeError(f"{label} fails on purpose")
            journal.finish(attempt)
            return f"done:{label}"

        body.__name__ = name
        return dramatiq.actor(body, broker=self.broker, actor_name=name, **options)


@pytest.fixture
def make_env(store_factory: StoreFactory) -> Iterator[Callable[..., Env]]:
    made: list[Env] = []

    def make(*, position: str = "appended", results: bool = False, store: Any = None, **options: Any) -> Env:
        broker = StubBroker()
        broker.emit_after("process_boot")
        backend = StubBackend() if results else None
        probe = Probe()
        middleware = SingletonMiddleware(
            store if store is not None else store_factory(), **{**FAST, **options}
        )
        if position == "appended":  # what users write: after every default middleware
            if backend is not None:
                broker.add_middleware(Results(backend=backend))
            broker.add_middleware(probe)
            broker.add_middleware(middleware)
        else:  # inserted early: before AgeLimit, Retries and Results
            broker.add_middleware(probe, before=AgeLimit)
            broker.add_middleware(middleware, before=AgeLimit)
            if backend is not None:
                broker.add_middleware(Results(backend=backend))
        env = Env(broker, middleware, probe, Journal(), backend)
        made.append(env)
        dramatiq.set_broker(broker)  # composition (``|``, pipelines) uses the global broker
        return env

    previous = dramatiq.broker.global_broker
    yield make
    dramatiq.set_broker(previous)  # type: ignore[arg-type]
    for env in made:
        for hold in env.holds.values():
            hold.set()
        if env.worker is not None:
            env.worker.stop(timeout=10_000)
        env.broker.close()


POSITIONS = ["appended", "early"]


# -- the seed story, ordering, limits ---------------------------------------------------------
def test_seed_story_a_holds_a_waits_b_runs(make_env: Callable[..., Env]) -> None:
    env = make_env()
    job = env.job()
    env.start()
    env.hold("run-1")
    job.send("store:A", "run-1")
    env.journal.wait(lambda: env.journal.started() == ["run-1"])
    run2 = job.send("store:A", "run-2")
    job.send("store:B", "run-3")
    env.journal.wait(lambda: env.journal.finished("run-3") and env.probe.delivered(run2.message_id) >= 2)
    # run-3 ran at once on its own slot; run-2 was delivered and gated, never started.
    assert env.journal.started() == ["run-1", "run-3"]
    (snap,) = [s for s in env.keys() if s.key == "store:A"]
    assert len(snap.holders) == 1 and snap.holders[0].token > 0
    assert [w.run_id for w in snap.waiters] == [run2.message_id]
    env.let_go("run-1")
    env.join()
    assert env.journal.started() == ["run-1", "run-3", "run-2"]
    assert env.keys() == []


def test_same_key_never_overlaps_and_starts_in_enqueue_order(make_env: Callable[..., Env]) -> None:
    env = make_env()
    job = env.job()
    env.start(threads=4)
    a_labels = [f"a{i}" for i in range(8)]
    b_labels = [f"b{i}" for i in range(4)]
    env.hold("a0")  # A's first body runs until B's first is in: the keys run side by side, whatever the load
    for i in range(8):
        job.send("A", a_labels[i], 0.03)
        if i < 4:
            job.send("B", b_labels[i], 0.03)
    env.journal.wait(lambda: "b0" in env.journal.started())
    env.let_go("a0")
    env.join()
    started = env.journal.started()
    assert [label for label in started if label.startswith("a")] == a_labels
    assert [label for label in started if label.startswith("b")] == b_labels
    assert env.journal.max_concurrency("A") == 1
    assert env.journal.max_concurrency("B") == 1
    # Different keys ran side by side.
    events = env.journal.events
    running: set[str] = set()
    side_by_side = False
    for kind, _label, key in events:
        if kind == "start":
            running.add(key)
            side_by_side |= running == {"A", "B"}
        else:
            running.discard(key)
    assert side_by_side
    assert env.keys() == []


def test_limit_two_runs_two_at_once_never_three(make_env: Callable[..., Env]) -> None:
    env = make_env()

    @singleton(key=lambda key, label, sleep=0.0: f"acct:{key}", limit=2)
    @dramatiq.actor(broker=env.broker)
    def statement(key: str, label: str, sleep: float = 0.0) -> None:
        attempt = env.journal.begin(label, key)
        hold = env.holds.get(label)
        if hold is not None:
            assert hold.wait(WAIT)
        time.sleep(sleep)
        env.journal.finish(attempt)

    env.start(threads=6)
    labels = [f"s{i}" for i in range(8)]
    env.hold(*labels[:2])  # the first two stay in their bodies until both are in: two at once
    for label in labels:
        statement.send("1", label, 0.05)
    env.journal.wait(lambda: len(env.journal.started()) == 2)
    for label in labels[:2]:
        env.let_go(label)
    env.join()
    assert env.journal.max_concurrency("1") == 2
    assert {a.key for a in env.journal.attempts} == {"1"}
    tokens = sorted(a.token or 0 for a in env.journal.attempts)
    assert len(set(tokens)) == 8 and tokens[0] > 0  # one increasing token per admission
    # FIFO by admission: the first two tokens went to the first two sends (bodies may start in
    # either order under load, so body start times prove nothing here).
    assert {a.label for a in env.journal.attempts if a.token in tokens[:2]} == set(labels[:2])
    assert env.keys() == []


def test_max_queue_depth_rejects_the_fourth_send(make_env: Callable[..., Env]) -> None:
    env = make_env()
    job = env.job(singleton={"key": "store:{key}", "max_queue_depth": 2})
    env.start()
    env.hold("r1")
    first = job.send("A", "r1")
    env.journal.wait(lambda: env.journal.started() == ["r1"])
    job.send("A", "r2")
    job.send("A", "r3")
    with pytest.raises(SingletonQueueFullError) as caught:
        job.send("A", "r4")
    error = caught.value
    assert isinstance(error, QueueFull) and isinstance(error, MiddlewareError)
    assert (error.task_name, error.scope, error.key, error.limit, error.max_queue_depth) == (
        "job",
        "job",
        "store:A",
        1,
        2,
    )
    assert "r4" not in env.probe.labels_published()  # nothing published
    (snap,) = env.keys()
    assert len(snap.holders) + len(snap.waiters) == 3  # nothing stored for r4
    assert first.message_id in {h.run_id for h in snap.holders}
    job.send("B", "other")  # other keys are unaffected
    env.let_go("r1")
    env.journal.wait(lambda: "r2" in env.journal.started())
    job.send("A", "r5")  # a slot freed: accepted again
    env.join()
    assert env.journal.started().count("r4") == 0
    assert [x for x in env.journal.started() if x.startswith("r")] == ["r1", "r2", "r3", "r5"]
    assert env.keys() == []


def test_on_full_drop_runs_the_first_limit_plus_depth_of_a_burst(
    make_env: Callable[..., Env], metrics_registry: CollectorRegistry
) -> None:
    env = make_env()
    job = env.job(singleton={"key": "{key}", "max_queue_depth": 1, "on_full": "drop"})
    burst = [job.send("A", f"d{i}") for i in range(6)]  # no worker yet: the line fills up
    direct = env.broker.enqueue(job.message("A", "direct"))  # every way to send drops alike
    dramatiq.group([job.message("A", "g1"), job.message("A", "g2")]).run()
    dropped = metrics_registry.get_sample_value("singleton_tasks_dropped_total", {"task": "job"})
    assert all(isinstance(message, dramatiq.Message) for message in [*burst, direct])
    assert env.probe.labels_published() == {"d0", "d1"}  # the others were never published
    (snap,) = env.keys()
    assert [w.run_id for w in snap.waiters] == [burst[0].message_id, burst[1].message_id]
    assert not snap.holders  # nothing registered for the dropped sends
    assert dropped == 4 + 1 + 2
    env.start()
    env.join()
    assert sorted(env.journal.started()) == ["d0", "d1"]
    assert env.keys() == []
    job.send("A", "after")  # the key emptied: accepted again
    env.join()
    assert env.journal.started()[-1] == "after"


def test_on_full_replace_runs_the_first_and_the_last_of_a_burst(make_env: Callable[..., Env]) -> None:
    """``limit=1, max_queue_depth=1, on_full="replace"``: one running and one queued, with the
    latest arguments; the replaced runs' messages are published and dropped as stale."""
    env = make_env()
    job = env.job(singleton={"key": "{key}", "max_queue_depth": 1, "on_full": "replace"})
    env.start()
    env.hold("p0")
    first = job.send("A", "p0")
    env.journal.wait(lambda: env.journal.started() == ["p0"])
    burst = [job.send("A", f"p{i}") for i in range(1, 11)]
    (snap,) = env.keys()
    assert [h.run_id for h in snap.holders] == [first.message_id]
    assert [w.run_id for w in snap.waiters] == [burst[-1].message_id]  # the latest send waits
    env.let_go("p0")
    env.join()
    assert env.journal.started() == ["p0", "p10"]
    assert env.keys() == []


# -- notify on release -----------------------------------------------------------------------
def test_release_wakes_the_next_waiter_without_the_timer(make_env: Callable[..., Env]) -> None:
    # With a 30 s fallback delay every waiter depending on the timer would take >= 29.75 s.
    env = make_env(retry_delay=30.0, retry_jitter=0.25)
    job = env.job()
    env.start()
    labels = [f"n{i}" for i in range(10)]
    began = time.monotonic()
    for label in labels:
        job.send("hot", label)
    env.journal.wait(lambda: env.journal.finished(*labels), timeout=10.0)
    assert time.monotonic() - began < 10.0
    assert env.journal.started() == labels
    assert env.journal.max_concurrency("hot") == 1


class _Tracer(dramatiq.Middleware):
    """A later middleware that tags every message it sees sent with the sender's trace id."""

    def __init__(self) -> None:
        self.current = "worker"

    def before_enqueue(self, broker: dramatiq.Broker, message: Any, delay: int) -> None:
        message.options.setdefault("trace_id", self.current)


class _Observer(dramatiq.Middleware):
    """Records the trace id of every delivery that gets past SingletonMiddleware (it tags nothing)."""

    def __init__(self) -> None:
        self.seen: dict[str, set[str]] = {}

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self.seen.setdefault(message.message_id, set()).add(message.options.get("trace_id"))


@pytest.mark.parametrize("connected", ["everywhere", "in the producer only"])
def test_a_woken_run_keeps_what_a_later_middleware_added_to_its_message(
    make_env: Callable[..., Env], connected: str
) -> None:
    # The registration stores the message before a later middleware's before_enqueue tags it:
    # the wake must publish the message as it was sent, not as it was registered, also when the
    # worker's broker has no such middleware (the producer is the one to know).
    env = make_env(retry_delay=30.0, retry_jitter=0.0)
    tracer, observer = _Tracer(), _Observer()
    env.broker.add_middleware(observer)
    env.broker.add_middleware(tracer)  # after SingletonMiddleware
    job = env.job()
    env.start()
    env.hold("holder")
    job.send("K", "holder")
    env.journal.wait(lambda: env.journal.started() == ["holder"])
    tracer.current = "the sender's"
    waiter = job.send("K", "waiter")
    tracer.current = "worker"
    if connected == "in the producer only":
        env.broker.middleware.remove(tracer)  # from here on, the worker's broker
    env.journal.wait(lambda: env.gated(waiter.message_id))
    env.let_go("holder")  # the wake is published on the worker, where the trace is "worker"
    env.journal.wait(lambda: env.journal.finished("waiter"))
    assert observer.seen[waiter.message_id] == {"the sender's"}  # the woken delivery: it ran


def test_a_woken_run_keeps_what_the_workers_middleware_added_when_it_left_the_delay_queue(
    make_env: Callable[..., Env],
) -> None:
    # A message sent with a delay is moved to its queue by the worker's consumer thread, through
    # the worker's middleware: what a later middleware adds there is not in the message the
    # producer's registration stored, so its wake must publish the delivered message.
    env = make_env(retry_delay=30.0, retry_jitter=0.0)
    tracer, observer = _Tracer(), _Observer()
    env.broker.add_middleware(observer)
    job = env.job()
    env.start()
    env.hold("holder")
    job.send("K", "holder")
    env.journal.wait(lambda: env.journal.started() == ["holder"])
    waiter = job.send_with_options(args=("K", "waiter"), delay=200)  # no tracer in the producer
    tracer.current = "moved"
    env.broker.add_middleware(tracer)  # the worker's, after SingletonMiddleware
    env.journal.wait(lambda: env.gated(waiter.message_id))
    tracer.current = "worker"
    env.let_go("holder")
    env.journal.wait(lambda: env.journal.finished("waiter"))
    assert observer.seen[waiter.message_id] == {"moved"}  # the woken delivery: it ran


def test_woken_copy_and_delayed_copy_run_the_body_once(make_env: Callable[..., Env]) -> None:
    env = make_env(retry_delay=0.3, retry_jitter=0.0)
    job = env.job()
    env.start()
    env.hold("holder")
    job.send("K", "holder")
    env.journal.wait(lambda: env.journal.started() == ["holder"])
    waiter = job.send("K", "waiter")
    env.journal.wait(lambda: env.gated(waiter.message_id))
    env.let_go("holder")  # the release wakes the waiter while its delayed copy is pending
    env.join()  # waits for the delayed copy too
    assert len(env.journal.ran("waiter")) == 1
    assert env.probe.delivered(waiter.message_id) >= 3  # first sight, woken copy, delayed copy
    assert env.keys() == []


# -- retries, results, pipelines, skips -------------------------------------------------------
@pytest.mark.parametrize("position", POSITIONS)
def test_retried_holder_keeps_its_slot(make_env: Callable[..., Env], position: str) -> None:
    env = make_env(position=position)
    job = env.job(max_retries=3, min_backoff=150, max_backoff=200)
    env.failures["flaky"] = 1
    env.start()
    job.send("K", "flaky")
    env.journal.wait(lambda: env.journal.started() == ["flaky"])
    other = job.send("K", "other")
    env.join()
    # No same-key run slipped in between the failure and the retry.
    assert env.journal.events == [
        ("start", "flaky", "K"),
        ("end", "flaky", "K"),
        ("start", "flaky", "K"),
        ("end", "flaky", "K"),
        ("start", "other", "K"),
        ("end", "other", "K"),
    ]
    assert env.probe.delivered(other.message_id) >= 2  # it was gated meanwhile
    tokens = [a.token for a in env.journal.attempts]
    assert tokens[0] is not None and tokens == sorted(tokens) and len(set(tokens)) == 3
    assert env.keys() == []


@pytest.mark.parametrize("position", POSITIONS)
def test_exhausted_retries_release_the_slot(make_env: Callable[..., Env], position: str) -> None:
    env = make_env(position=position)
    job = env.job(max_retries=1, min_backoff=50, max_backoff=60)
    env.failures["doomed"] = 99
    env.start()
    doomed = job.send("K", "doomed")
    job.send("K", "next")
    env.join(fail_fast=False)
    assert [a.label for a in env.journal.attempts] == ["doomed", "doomed", "next"]
    assert [m.message_id for m in env.broker.dead_letters] == [doomed.message_id]
    assert env.keys() == []


@pytest.mark.parametrize("position", POSITIONS)
def test_results_never_premature_none_and_never_overwritten(
    make_env: Callable[..., Env], position: str
) -> None:
    env = make_env(position=position, results=True, retry_delay=0.1, retry_jitter=0.0)
    assert env.backend is not None
    job = env.job(store_results=True)
    env.start()
    env.hold("first")
    job.send("K", "first")
    env.journal.wait(lambda: env.journal.started() == ["first"])
    second = job.send("K", "second")
    env.journal.wait(lambda: env.probe.delivered(second.message_id) >= 2)  # deferred at least once
    with pytest.raises(ResultMissing):
        env.backend.get_result(second, block=False)
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(second.get_result(backend=env.backend, block=True)))
    waiter.start()
    env.let_go("first")
    waiter.join(WAIT)
    assert got == ["done:second"]
    env.join()  # the stale delayed copy is dropped after the real result was stored
    assert env.backend.get_result(second) == "done:second"
    assert env.keys() == []


@pytest.mark.parametrize("position", POSITIONS)
def test_pipelines_and_groups_of_singletons_complete(make_env: Callable[..., Env], position: str) -> None:
    env = make_env(position=position, results=True)
    assert env.backend is not None
    # max_queue_depth=0: each pipeline step is enqueued while the previous one still holds the
    # slot; the framework's continuation must pass the cap, not be lost inside emit_after.
    job = env.job(store_results=True, singleton={"key": "{key}", "max_queue_depth": 0})
    env.start()
    pipe = (
        job.message_with_options(args=("P", "p1"))
        | job.message_with_options(args=("P", "p2"), pipe_ignore=True)
        | job.message_with_options(args=("P", "p3"), pipe_ignore=True)
    )
    pipe.run()
    last = pipe.messages[-1]
    assert last.get_result(backend=env.backend, block=True, timeout=int(WAIT * 1000)) == "done:p3"
    env.journal.wait(lambda: env.keys() == [])  # p3 released
    env.hold("g0")
    grouped = dramatiq.group([job.message("G", f"g{i}") for i in range(3)], broker=env.broker)
    with pytest.raises(SingletonQueueFullError):
        grouped.run()  # the user's own sends do hit the cap: g0 in flight, depth 0
    env.let_go("g0")
    unlimited = env.job("free", store_results=True)
    group = dramatiq.group([unlimited.message("H", f"h{i}") for i in range(4)], broker=env.broker)
    group.run()
    results = [
        m.get_result(backend=env.backend, block=True, timeout=int(WAIT * 1000)) for m in group.children
    ]
    assert results == [f"done:h{i}" for i in range(4)]
    env.join()
    assert [x for x in env.journal.started() if x.startswith("p")] == ["p1", "p2", "p3"]
    assert env.journal.max_concurrency("H") == 1
    assert env.keys() == []


@pytest.mark.parametrize("position", POSITIONS)
def test_age_limit_expiry_releases(make_env: Callable[..., Env], position: str) -> None:
    env = make_env(position=position)
    # max_age leaves the first delivery time to reach the gate under load: a copy older than it
    # is failed by AgeLimit before the gate sees it, and the waiter is never gated.
    max_age = 1500
    job = env.job(max_age=max_age)
    env.start()
    env.hold("long")
    job.send("K", "long")
    env.journal.wait(lambda: env.journal.started() == ["long"])
    expired = job.send("K", "expired")
    env.journal.wait(lambda: env.gated(expired.message_id))
    # Let the gated waiter's age, counted from its message's timestamp, pass max_age.
    time.sleep(max(0.0, (expired.message_timestamp + max_age + 50) / 1000 - time.time()))
    env.let_go("long")
    env.join(fail_fast=False)
    job.send("K", "after")
    env.join(fail_fast=False)
    assert env.journal.started() == ["long", "after"]
    # AgeLimit runs before our gate: when the holder's wake copy and the delayed copy of the aged
    # run both arrive, each is failed to the dead letters (a re-driven extra copy is then stale).
    assert {m.message_id for m in env.broker.dead_letters} == {expired.message_id}
    assert env.keys() == []


def test_current_admission_tokens_strictly_increase(make_env: Callable[..., Env]) -> None:
    env = make_env()
    job = env.job()
    env.start()
    sent = [job.send("K", f"t{i}") for i in range(6)]
    env.join()
    attempts = env.journal.attempts
    assert [a.run_id for a in attempts] == [m.message_id for m in sent]
    assert {(a.scope, a.key) for a in attempts} == {("job", "K")}
    tokens = [a.token or 0 for a in attempts]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens) and tokens[0] >= 1
    # The token counter outlives the idle key.
    job.send("K", "later")
    env.join()
    assert (env.journal.ran("later")[0].token or 0) > tokens[-1]
    assert current_admission() is None


def test_gated_waiters_do_not_occupy_worker_threads(make_env: Callable[..., Env]) -> None:
    env = make_env()
    job = env.job()
    env.start(threads=2)
    env.hold("long")
    job.send("K", "long")
    env.journal.wait(lambda: env.journal.started() == ["long"])
    waiters = [f"w{i}" for i in range(10)]
    others = [f"o{i}" for i in range(20)]
    for label in waiters:
        job.send("K", label)
    for i, label in enumerate(others):
        job.send(f"other-{i}", label)
    # One thread runs the long body; the other serves 20 runs and many deferrals of 10 waiters.
    env.journal.wait(lambda: env.journal.finished(*others))
    assert not env.journal.finished("long")
    assert not any(label in env.journal.started() for label in waiters)
    env.let_go("long")
    env.join()
    assert [x for x in env.journal.started() if x.startswith("w")] == waiters
    assert env.keys() == []


@pytest.mark.slow  # waits out leases and heartbeats on real time
def test_heartbeats_keep_a_long_run_holding(make_env: Callable[..., Env]) -> None:
    env = make_env(lease=3.0)  # the shortest lease: heartbeats every second
    job = env.job()
    env.start()
    job.send("K", "long", 4.0)
    env.journal.wait(lambda: env.journal.started() == ["long"])
    job.send("K", "next")
    env.join()
    # The lease was extended while the body ran past it: no takeover, no overlap.
    assert env.journal.started() == ["long", "next"]
    assert env.journal.max_concurrency("K") == 1
    assert env.keys() == []


@pytest.mark.slow  # waits out leases and heartbeats on real time
def test_a_task_lease_shorter_than_the_workers_is_heartbeated_by_its_own(
    make_env: Callable[..., Env],
) -> None:
    """The worker's lease is 60 s (heartbeats every 20 s); the task's own lease is 3 s.

    Heartbeated at the worker's pace, the holder would be evicted 6 s in (lease + orphan timeout)
    by the next run's re-checks, and the next run would start while it still runs.
    """
    env = make_env(lease=60.0)
    job = env.job("short", singleton={"key": "{key}", "lease": 3.0, "orphan_timeout": 3.0})
    env.start()
    job.send("K", "long", 8.0)
    env.journal.wait(lambda: env.journal.started() == ["long"])
    job.send("K", "next")
    env.join()
    assert env.journal.started() == ["long", "next"]
    assert env.journal.max_concurrency("K") == 1
    assert env.keys() == []


# -- declaration, bad input, no middleware ----------------------------------------------------
@pytest.mark.parametrize("backend", ["memory"])  # declaration never reaches the store
def test_bad_singleton_option_fails_at_declaration(make_env: Callable[..., Env]) -> None:
    env = make_env()
    for option in ({"key": "{nope}"}, {"limit": 1}, {"key": "x", "limit": 0}, 42, {"key": "x", "bad": 1}):
        with pytest.raises(SingletonConfigError):
            env.job(f"bad{uuid.uuid4().hex[:6]}", singleton=option)
    env.job("good", singleton=SingletonConfig(key="{label}"))


def test_key_errors_at_send_and_at_processing(
    make_env: Callable[..., Env], caplog: pytest.LogCaptureFixture
) -> None:
    env = make_env()

    def key(key: Any, label: str) -> str:
        return key if isinstance(key, str) else 42  # type: ignore[return-value]

    @dramatiq.actor(broker=env.broker, singleton={"key": key})
    def keyed(key: Any, label: str) -> None:
        env.journal.finish(env.journal.begin(label, str(key)))

    env.start()
    with pytest.raises(SingletonKeyError) as caught:
        keyed.send(7, "bad-send")
    assert isinstance(caught.value, InvalidKey) and isinstance(caught.value, MiddlewareError)
    assert "bad-send" not in env.probe.labels_published()
    # Another producer enqueued it without the middleware: the gate fails it to the dead letters.
    raw = dramatiq.Message(queue_name=QUEUE, actor_name="keyed", args=(7, "raw"), kwargs={}, options={})
    with caplog.at_level(logging.ERROR, logger="singleton_tasks"):
        env.broker.queues[QUEUE].put(raw.encode())
        env.join(fail_fast=False)
    assert [m.message_id for m in env.broker.dead_letters] == [raw.message_id]
    ours = [r for r in caplog.records if r.name == "singleton_tasks" and raw.message_id in r.getMessage()]
    assert len(ours) == 1
    assert env.journal.attempts == []


def test_a_key_no_store_can_hold_fails_the_send_and_publishes_nothing(make_env: Callable[..., Env]) -> None:
    """A lone surrogate (os.listdir() of a name that is not UTF-8): refused alike on every store."""
    env = make_env()
    name = "report-\udcff.csv"
    templated = env.job("templated")  # key "{key}"
    called = env.job("called", singleton={"key": lambda key, label, sleep=0.0: key})
    for actor in (templated, called):
        with pytest.raises(SingletonKeyError) as caught:
            actor.send(name, "unstorable")
        assert isinstance(caught.value, MiddlewareError)
        assert actor.actor_name in str(caught.value) and repr(name) in str(caught.value)
    assert env.probe.published == [] and env.keys() == []


def test_singleton_actor_without_middleware_fails_at_send() -> None:
    broker = StubBroker()

    @singleton(key="{x}")
    @dramatiq.actor(broker=broker)
    def lonely(x: int) -> None:
        pass

    with pytest.raises(SingletonConfigError, match="SingletonMiddleware"):
        lonely.send(1)
    with pytest.raises(SingletonConfigError):
        lonely.message(1)
    assert broker.queues[QUEUE].qsize() == 0
    broker.close()


@pytest.mark.parametrize("backend", ["memory"])  # the store is unreachable below
def test_plain_actors_never_touch_the_store(make_env: Callable[..., Env]) -> None:
    # An unreachable store: any store call would fail the send or defer the delivery forever.
    env = make_env(store="redis://127.0.0.1:1/0", results=True)
    assert env.backend is not None

    @dramatiq.actor(broker=env.broker, store_results=True)
    def plain(x: int) -> int:
        return x * 2

    env.start()
    message = plain.send(21)
    env.join()
    assert message.get_result(backend=env.backend) == 42
    assert GENERATION not in message.options


class _CallsByThread(MemoryStore):
    """A real memory store that notes which thread made each call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, str, int]] = []  # (operation, thread name, runs)

    def _note(self, operation: str, runs: int = 1) -> None:
        self.calls.append((operation, threading.current_thread().name, runs))

    def register(
        self, spec: RunSpec, *, payload: bytes | None = None, delay: float = 0.0, confirmed: bool = True
    ) -> RegisterOutcome:
        self._note("register")
        return super().register(spec, payload=payload, delay=delay, confirmed=confirmed)

    def confirm(self, scope: str, key: str, run_id: str) -> bool:
        self._note("confirm")
        return super().confirm(scope, key, run_id)

    def confirm_many(self, runs: Sequence[tuple[str, str, str]]) -> list[bool]:
        self._note("confirm_many", len(runs))
        return super().confirm_many(runs)


@pytest.mark.parametrize("backend", ["memory"])  # the store is given
def test_send_makes_one_store_call_and_confirms_off_the_callers_thread(make_env: Callable[..., Env]) -> None:
    """docs/concepts.md#costs: ``.send()`` registers; the confirm follows from the confirm thread, batched."""
    store = _CallsByThread(f"memory://{uuid.uuid4().hex}")
    env = make_env(store=store)
    job = env.job()
    me = threading.current_thread().name
    for i in range(20):
        job.send(f"K{i}", f"r{i}")
    assert [op for op, thread, _ in store.calls if thread == me] == ["register"] * 20
    assert env.middleware.gatekeeper.flush_confirms(WAIT)
    batches = [(thread, runs) for op, thread, runs in store.calls if op == "confirm_many"]
    assert {thread for thread, _ in batches} == {"singleton-confirm"}
    assert sum(runs for _, runs in batches) == 20
    assert all(w.confirmed for snap in env.keys() for w in snap.waiters)


_SEND_AND_EXIT = """
import sys
import dramatiq
from dramatiq.brokers.stub import StubBroker
from singleton_tasks.dramatiq import SingletonMiddleware

broker = StubBroker(middleware=[SingletonMiddleware(sys.argv[1], namespace=sys.argv[2])])

@dramatiq.actor(broker=broker, singleton={"key": "{key}"})
def job(key):
    pass

job.send("K")
"""


def test_a_producer_that_exits_right_after_send_confirms_first(tmp_path: Any) -> None:
    """The confirm thread's batch is sent at interpreter exit, not dropped with the thread."""
    url, namespace = f"sqlite:///{tmp_path / 'store.db'}", f"n{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "-c", _SEND_AND_EXIT, url, namespace], capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    store = store_from_url(url, namespace=namespace)
    try:
        [snap] = store.snapshot()
        assert [w.confirmed for w in snap.waiters] == [True]
    finally:
        store.close()


class _PublishFails(dramatiq.Middleware):
    """After SingletonMiddleware: the publish of a message labelled ``lost`` fails (no after_enqueue)."""

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        if message.args[1:2] == ("lost",):
            raise MiddlewareError("the broker refused the publish")


@pytest.mark.parametrize("backend", ["memory"])  # the store is given
def test_a_failed_publish_is_never_confirmed_and_leaves_no_ghost(make_env: Callable[..., Env]) -> None:
    """docs/concepts.md#the-life-of-a-run: the registration of a publish that failed stays
    unconfirmed, and the next run of its key is admitted once the registration grace passed."""
    store = _CallsByThread(f"memory://{uuid.uuid4().hex}", timings=Timings(registration_grace=0.5))
    env = make_env(store=store)
    env.broker.add_middleware(_PublishFails())
    job = env.job()
    with pytest.raises(MiddlewareError, match="refused"):
        job.send("K", "lost")
    job.send("K", "next")
    assert env.middleware.gatekeeper.flush_confirms(WAIT)
    [snap] = env.keys()
    assert [w.confirmed for w in snap.waiters] == [False, True]  # lost, then next
    env.start()
    env.journal.wait(lambda: env.journal.finished("next"))
    assert env.journal.started() == ["next"]


def test_duplicate_start_of_a_registered_run_id_runs_once(make_env: Callable[..., Env]) -> None:
    env = make_env()
    job = env.job()
    env.start()
    env.hold("dup")
    first = job.send("K", "dup")
    env.journal.wait(lambda: env.journal.started() == ["dup"])
    again = dramatiq.Message(
        queue_name=QUEUE,
        actor_name="job",
        args=("K", "dup"),
        kwargs={},
        options={},
        message_id=first.message_id,
    )
    env.broker.enqueue(again)
    env.let_go("dup")
    env.join()
    assert len(env.journal.ran("dup")) == 1
    assert env.keys() == []


@pytest.mark.rabbitmq
def test_worker_threads_connect_to_rabbitmq_before_their_first_publish() -> None:
    # The wake of a release is often a thread's first publish: it must not wait for a connect.
    require_server(RABBITMQ_URL, "RabbitMQ")
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    threads = 3
    connected: list[bool] = []
    booted = threading.Barrier(threads + 1, timeout=WAIT)

    class Observer(dramatiq.Middleware):
        def after_worker_thread_boot(self, broker: Any, thread: Any) -> None:
            # Listed before SingletonMiddleware, so Dramatiq calls this hook after its.
            connected.append(getattr(broker.state, "connection", None) is not None)
            booted.wait()

    singleton_middleware = SingletonMiddleware(store=f"memory://{uuid.uuid4().hex}")
    broker = RabbitmqBroker(url=RABBITMQ_URL, middleware=[Observer(), singleton_middleware])
    worker = dramatiq.Worker(broker, worker_threads=threads)
    worker.start()
    try:
        booted.wait()
    finally:
        worker.stop()
        broker.close()
    assert connected == [True] * threads


@pytest.mark.rabbitmq
def test_a_wake_goes_ahead_of_a_queued_backlog_on_rabbitmq_priority_queues() -> None:
    # The woken run's turn has come: it must not wait behind plain messages queued before its wake.
    require_server(RABBITMQ_URL, "RabbitMQ")
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

    journal = Journal()
    holds = {"A": threading.Event(), "blocker": threading.Event()}
    deferred = threading.Event()

    class Observer(dramatiq.Middleware):
        def after_skip_message(self, broker: Any, message: Any) -> None:
            deferred.set()  # B was claimed, denied and deferred

    # A re-check timer far beyond WAIT: only the wake can run B in time.
    singleton_middleware = SingletonMiddleware(
        store=f"memory://{uuid.uuid4().hex}", retry_delay=60.0, retry_jitter=0.0
    )
    # confirm_delivery: the wake is queued before the ack that frees the prefetch slot is sent
    # (they travel on different connections; without confirms the slot may go to P0 first).
    broker = RabbitmqBroker(
        url=RABBITMQ_URL, max_priority=5, confirm_delivery=True, middleware=[Observer(), singleton_middleware]
    )
    queue = f"wake-first-{uuid.uuid4().hex[:8]}"

    def body(label: str) -> None:
        attempt = journal.begin(label, "K")
        hold = holds.get(label)
        if hold is not None:
            assert hold.wait(WAIT)
        journal.finish(attempt)

    job = dramatiq.actor(
        body, broker=broker, actor_name=f"job_{queue}", queue_name=queue, singleton={"key": "K"}
    )
    plain = dramatiq.actor(body, broker=broker, actor_name=f"plain_{queue}", queue_name=queue)
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=20)
    worker.queue_prefetch = 2  # A and the blocker fill the window: the backlog stays in RabbitMQ
    worker.start()
    try:
        job.send("A")
        journal.wait(lambda: journal.started() == ["A"])
        job.send("B")
        assert deferred.wait(WAIT)
        plain.send("blocker")
        journal.wait(lambda: journal.started() == ["A", "blocker"])
        backlog = [f"P{i}" for i in range(5)]
        for label in backlog:
            plain.send(label)
        holds["A"].set()
        journal.wait(lambda: "B" in journal.started())
        holds["blocker"].set()
        journal.wait(lambda: journal.finished("A", "B", "blocker", *backlog))
    finally:
        for hold in holds.values():
            hold.set()
        worker.stop()
        for name in (queue, dq_name(queue), xq_name(queue)):
            with contextlib.suppress(Exception):
                broker.channel.queue_delete(queue=name)
        broker.close()
    assert journal.started() == ["A", "blocker", "B", *backlog]


def test_constructible_from_a_dotted_path_with_kwargs() -> None:
    module_name, _, class_name = "singleton_tasks.dramatiq.SingletonMiddleware".rpartition(".")
    middleware = getattr(importlib.import_module(module_name), class_name)(
        store="redis://user:secret@127.0.0.1:6379/0", namespace="app", retry_delay=0.5, lease=30.0
    )
    assert isinstance(middleware, SingletonMiddleware)
    assert middleware.gatekeeper.options.retry_delay == 0.5
    assert "secret" not in repr(middleware)
    assert middleware.actor_options == {"singleton"}


# -- store outage ----------------------------------------------------------------------------
OUTAGE_PORT = 16390


class RedisServer:
    """A throwaway redis-server this test starts and stops by its own PID."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not reachable(f"redis://127.0.0.1:{self.port}"):  # bounded wait for the server
            assert time.monotonic() < deadline, "redis-server did not come up"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
@needs("redis")
def outage_redis() -> Iterator[RedisServer]:
    require_executable("redis-server")
    if reachable(f"redis://127.0.0.1:{OUTAGE_PORT}"):
        unavailable(f"port {OUTAGE_PORT} is taken")
    server = RedisServer(OUTAGE_PORT)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("backend", ["memory"])  # the store is the throwaway Redis below
def test_store_outage_runs_no_body_without_a_slot_and_loses_nothing(
    make_env: Callable[..., Env], outage_redis: RedisServer
) -> None:
    url = f"redis://127.0.0.1:{OUTAGE_PORT}/0"
    env = make_env(store=url, namespace=f"o{uuid.uuid4().hex[:8]}", heartbeat_interval=0.1)
    job = env.job()
    env.start()
    env.hold("r1")
    job.send("K", "r1")
    env.journal.wait(lambda: env.journal.started() == ["r1"])
    waiting = [job.send("K", label) for label in ("r2", "r3")]
    env.journal.wait(lambda: all(env.gated(m.message_id) for m in waiting))

    outage_redis.stop()
    before = {m.message_id: env.probe.delivered(m.message_id) for m in waiting}
    with pytest.raises(StoreUnavailableError) as caught:
        job.send("K", "r4")
    assert isinstance(caught.value, MiddlewareError)
    assert job.actor_name in str(caught.value) and "'K'" in str(caught.value)  # names task and key
    assert "r4" not in env.probe.labels_published()
    # Deliveries keep coming back and are deferred (fail closed); the holder finishes meanwhile.
    env.journal.wait(lambda: all(env.probe.delivered(mid) >= n + 3 for mid, n in before.items()))
    env.let_go("r1")
    env.journal.wait(lambda: env.journal.finished("r1"))
    assert env.journal.started() == ["r1"]  # no body ran without a slot

    outage_redis.start()  # empty: the runs re-register at their next delivery
    env.journal.wait(lambda: env.journal.finished("r2", "r3"))
    env.join()
    assert sorted(env.journal.started()) == ["r1", "r2", "r3"]
    assert env.journal.max_concurrency("K") == 1


# Not PostgreSQL: its schema version is database-wide, other tests would see the change.
@pytest.mark.parametrize("backend", backend_params(["memory", "sqlite", "redis"]))
def test_worker_refuses_to_start_on_an_incompatible_schema(store_factory: StoreFactory) -> None:
    store = store_factory()
    store.set_schema_version_for_tests(SCHEMA_VERSION + 1)  # type: ignore[attr-defined]
    broker = StubBroker()
    broker.add_middleware(SingletonMiddleware(store))
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=1)
    try:
        with pytest.raises(SchemaVersionError):
            worker.start()
    finally:
        store.set_schema_version_for_tests(SCHEMA_VERSION)  # type: ignore[attr-defined]
        broker.close()


# -- the line keeps every run (docs/concepts.md#the-line) ---------------------------------------
def test_an_argument_json_cannot_carry_fails_the_send_and_leaves_no_trace(
    make_env: Callable[..., Env],
) -> None:
    """Encoded before anything is written: a typed error, nothing registered, nothing published,
    and the next run of the key is not held up by anything."""
    env = make_env()
    job = env.job()
    with pytest.raises(PayloadError) as caught:
        job.send("K", "unencodable", sleep=object())  # type: ignore[arg-type]
    assert isinstance(caught.value, TypeError) and isinstance(caught.value, MiddlewareError)
    assert job.actor_name in str(caught.value)
    assert env.probe.published == [] and env.keys() == []
    job.send("K", "next")
    env.start()
    env.journal.wait(lambda: env.journal.finished("next"))
    assert env.journal.started() == ["next"]


@pytest.mark.slow  # waits out leases and heartbeats on real time
def test_a_run_whose_every_copy_was_lost_is_issued_again_by_the_heartbeat_thread(
    make_env: Callable[..., Env],
) -> None:
    """A purged queue: the store still has the run and its payload; once it owns the free slot and
    nothing of it came for orphan_timeout + re-check, a worker's heartbeat thread issues it
    again, and it runs once. Then the key admits the next run in order."""
    env = make_env(orphan_timeout=1.0, max_retry_delay=0.2, heartbeat_interval=0.25)
    job = env.job()
    lost = job.send("K", "lost")
    env.broker.flush(QUEUE)  # its only copy is gone
    assert [w.run_id for snap in env.keys() for w in snap.waiters] == [lost.message_id]
    sent_at = time.monotonic()
    env.start()
    env.journal.wait(lambda: env.journal.finished("lost"))
    # orphan_timeout + re-check (0.2 s + jitter) + one heartbeat interval, with slack for the host
    assert time.monotonic() - sent_at < 1.0 + 0.25 + 0.25 + 2.0
    job.send("K", "next")
    env.journal.wait(lambda: env.journal.finished("next"))
    assert env.journal.started() == ["lost", "next"]
    env.join()
    assert env.keys() == []
