"""The Celery adapter in-process: memory transport, an embedded threads worker, every store.

Each test declares its own tasks with unique names on its own app and queue (``@app.task``
is shared across apps by default, and the memory transport's queues are process-global).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import itertools
import logging
import os
import socket
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain, group, shared_task, signals
from celery.contrib.testing.worker import start_worker
from celery.exceptions import Ignore, MaxRetriesExceededError, TaskRevokedError
from celery.result import AsyncResult
from celery.worker import state as worker_state
from conftest import StoreFactory, backend_params
from marks import needs
from prometheus_client import CollectorRegistry
from services import require_executable

from singleton_tasks import (
    SingletonConfig,
    SingletonConfigError,
    SingletonKeyError,
    SingletonPayloadError,
    SingletonQueueFullError,
    StoreUnavailableError,
    current_admission,
    singleton,
    store_from_url,
)
from singleton_tasks.celery import GENERATION_HEADER, SingletonTask, gatekeeper_for, install
from singleton_tasks.outcomes import (
    PAYLOAD_ON_REQUEST,
    ClaimOutcome,
    PayloadRequest,
    RegisterOutcome,
    RunSpec,
    RunState,
    Wake,
)
from singleton_tasks.stores import Store
from singleton_tasks.stores.memory import MemoryStore

FAST = {"retry_delay": 0.1, "retry_jitter": 0.02, "max_retry_delay": 0.3}


def noop(*args: Any, **kwargs: Any) -> None:
    """A body for tasks whose body does not matter."""


def unique(prefix: str = "t") -> str:
    return f"{prefix}.{uuid.uuid4().hex[:10]}"


@dataclass
class Rec:
    label: str
    key: str
    run_id: str
    token: int
    start: float
    end: float = 0.0


class Journal:
    """What the bodies did, thread-safe; ``running`` tracks concurrency per key."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[Rec] = []
        self.running: dict[str, int] = {}
        self.max_running: dict[str, int] = {}
        self.overlaps: list[str] = []

    @contextlib.contextmanager
    def body(self, label: str, key: str, limit: int = 1) -> Iterator[Rec]:
        admission = current_admission()
        assert admission is not None, "a singleton body runs with an admission"
        rec = Rec(label, key, admission.run_id, admission.token, time.monotonic())
        with self.lock:
            self.records.append(rec)
            self.running[key] = self.running.get(key, 0) + 1
            self.max_running[key] = max(self.max_running.get(key, 0), self.running[key])
            if self.running[key] > limit:
                self.overlaps.append(label)
        try:
            yield rec
        finally:
            with self.lock:
                self.running[key] -= 1
                rec.end = time.monotonic()

    def labels(self) -> list[str]:
        with self.lock:
            return [r.label for r in sorted(self.records, key=lambda r: r.start)]

    def get(self, label: str) -> list[Rec]:
        with self.lock:
            return [r for r in self.records if r.label == label]


def make_app(store: Store | str | None = None, **options: Any) -> Celery:
    app = Celery(unique("app"), broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.broker_transport_options = {"polling_interval": 0.01}
    app.conf.task_default_queue = unique("q")
    app.conf.worker_hijack_root_logger = False
    if store is not None:
        install(app, store, **{**FAST, **options})
    return app


@contextlib.contextmanager
def worker(app: Celery, concurrency: int = 4) -> Iterator[Any]:
    """An embedded threads-pool worker that stops in milliseconds, not seconds."""
    wake = app.task(name=f"{app.main}.wake", shared=False, ignore_result=True)(noop)
    stopped = threading.Event()

    def nudge() -> None:
        # The memory transport's loop blocks 2 s in drain_events, once more after the
        # terminate flag is seen: a message wakes it each time.
        while not stopped.wait(0.02):
            with contextlib.suppress(Exception):
                wake.delay()

    with start_worker(
        app, pool="threads", concurrency=concurrency, perform_ping_check=False, shutdown_timeout=30
    ) as w:
        try:
            yield w
        finally:
            worker_state.should_terminate = 0
            threading.Thread(target=nudge, daemon=True).start()
    stopped.set()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def queued(app: Celery) -> int:
    """Messages waiting in the app's queue (nothing consumes them without a worker)."""
    with app.connection() as conn:
        return int(conn.default_channel.queue_declare(queue=app.conf.task_default_queue).message_count)


def runs_of(store: Store, scope: str | None = None) -> list[str]:
    return [
        run_id
        for snap in store.snapshot(scope=scope)
        for run_id in [*(h.run_id for h in snap.holders), *(w.run_id for w in snap.waiters)]
    ]


@pytest.fixture
def journal() -> Journal:
    return Journal()


# -- the seed's story and the basic guarantees ----------------------------------------------
def test_seed_story_a_holds_a_gated_b_runs_at_once(store: Store, journal: Journal) -> None:
    app = make_app(store)
    release_a1 = threading.Event()

    @app.task(base=SingletonTask, singleton={"key": "store:{store_id}"}, name=unique(), shared=False)
    def sync_inventory(store_id: str, label: str) -> str:
        with journal.body(label, store_id):
            if label == "A1":
                assert release_a1.wait(10)
            return f"synced {label}"

    with worker(app):
        a1 = sync_inventory.delay("A", "A1")
        wait_for(lambda: bool(journal.get("A1")), what="A1 to start")
        a2 = sync_inventory.delay("A", "A2")
        b1 = sync_inventory.delay("B", "B1")
        assert b1.get(interval=0.01, timeout=10) == "synced B1"  # B runs at once while A1 holds
        time.sleep(0.3)  # several retry periods: A2 keeps being gated
        assert journal.get("A2") == []
        assert a2.state == "PENDING"  # a gated run is not FAILURE
        release_a1.set()
        assert a1.get(interval=0.01, timeout=10) == "synced A1"
        assert a2.get(interval=0.01, timeout=10) == "synced A2"  # the gated run's result is the real one
    (a1_rec,), (a2_rec,) = journal.get("A1"), journal.get("A2")
    assert a2_rec.start >= a1_rec.end
    assert journal.overlaps == []
    wait_for(lambda: runs_of(store) == [], what="the store to empty")


def test_no_overlap_enqueue_order_and_increasing_tokens(store: Store, journal: Journal) -> None:
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "acct:{account}"}, name=unique(), shared=False)
    def statement(account: str, label: str) -> str:
        with journal.body(label, account):
            time.sleep(0.03)
        return label

    labels = [f"r{i}" for i in range(6)]
    with worker(app, concurrency=4):
        results = [statement.delay("X", label) for label in labels]
        assert [r.get(interval=0.01, timeout=20) for r in results] == labels
    assert journal.labels() == labels  # started in enqueue order
    assert journal.overlaps == [] and journal.max_running["X"] == 1
    tokens = [journal.get(label)[0].token for label in labels]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)  # strictly increasing
    records = sorted(journal.records, key=lambda r: r.start)
    assert all(later.start >= earlier.end for earlier, later in itertools.pairwise(records))


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_limit_is_respected_and_reached(store: Store, journal: Journal) -> None:
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k", "limit": 2}, name=unique(), shared=False)
    def limited(label: str) -> str:
        with journal.body(label, "k", limit=2):
            time.sleep(0.1)
        return label

    with worker(app, concurrency=4):
        results = [limited.delay(f"r{i}") for i in range(6)]
        assert sorted(r.get(interval=0.01, timeout=20) for r in results) == sorted(f"r{i}" for i in range(6))
    assert journal.overlaps == []
    assert journal.max_running["k"] == 2


def test_different_keys_run_in_parallel(store: Store) -> None:
    app = make_app(store)
    barrier = threading.Barrier(3, timeout=10)

    @app.task(base=SingletonTask, singleton={"key": lambda key: f"k:{key}"}, name=unique(), shared=False)
    def parallel(key: str) -> str:
        barrier.wait()  # breaks (BrokenBarrierError) unless all three keys run at once
        return key

    with worker(app, concurrency=4):
        results = [parallel.delay(key) for key in "abc"]
        assert [r.get(interval=0.01, timeout=15) for r in results] == list("abc")


# -- max_queue_depth (docs/concepts.md#backlog-cap) ------------------------------------------------
def test_max_queue_depth_rejects_the_fourth_and_accepts_after_a_slot_frees(
    store: Store, journal: Journal
) -> None:
    app = make_app(store)
    gate_open = threading.Event()
    name = unique()

    @app.task(
        base=SingletonTask,
        singleton={"key": "store:{store_id}", "max_queue_depth": 2},
        name=name,
        shared=False,
    )
    def sync_inventory(store_id: str, label: str) -> str:
        with journal.body(label, store_id):
            assert gate_open.wait(10)
        return label

    accepted = [sync_inventory.delay("S", f"r{i}") for i in range(3)]
    assert queued(app) == 3
    with pytest.raises(SingletonQueueFullError) as caught:
        sync_inventory.delay("S", "r3")
    error = caught.value
    assert (error.task_name, error.scope, error.key, error.limit, error.max_queue_depth) == (
        name,
        name,
        "store:S",
        1,
        2,
    )
    assert queued(app) == 3  # nothing published
    assert sorted(runs_of(store)) == sorted(r.id for r in accepted)  # nothing stored
    with worker(app):
        wait_for(lambda: bool(journal.get("r0")), what="r0 to start")
        with pytest.raises(SingletonQueueFullError):
            sync_inventory.delay("S", "r3")  # a running holder still counts
        gate_open.set()
        assert accepted[0].get(interval=0.01, timeout=10) == "r0"
        wait_for(lambda: accepted[0].id not in runs_of(store), what="r0 to release its slot")
        late = sync_inventory.delay("S", "r3")  # accepted again
        assert [r.get(interval=0.01, timeout=10) for r in [*accepted, late]] == ["r0", "r1", "r2", "r3"]
    assert journal.overlaps == []


def test_on_full_drop_runs_the_first_limit_plus_depth_of_a_burst(
    store: Store, journal: Journal, metrics_registry: CollectorRegistry
) -> None:
    app = make_app(store)
    name = unique()

    @singleton(key="store:{store_id}", max_queue_depth=1, on_full="drop")
    @app.task(name=name, shared=False)
    def sync_inventory(store_id: str, label: str) -> str:
        with journal.body(label, store_id):
            time.sleep(0.05)
        return label

    results = [sync_inventory.delay("S", f"r{i}") for i in range(6)]  # no worker: the line fills
    assert metrics_registry.get_sample_value("singleton_tasks_dropped_total", {"task": name}) == 4
    assert queued(app) == 2  # nothing published for the dropped sends
    accepted = results[:2]
    assert runs_of(store) == [r.id for r in accepted]  # nothing registered for them either
    # A dropped send returns the result of the run last in line for its key.
    assert all(isinstance(r, AsyncResult) and r.id == accepted[1].id for r in results[2:])
    with worker(app):
        assert [r.get(interval=0.01, timeout=10) for r in results] == ["r0", "r1", "r1", "r1", "r1", "r1"]
        wait_for(lambda: runs_of(store) == [], what="the key to empty")
        last = sync_inventory.delay("S", "r6")  # accepted again
        assert last.get(interval=0.01, timeout=10) == "r6"
    assert journal.labels() == ["r0", "r1", "r6"] and journal.overlaps == []


def test_wait_seconds_times_each_admitted_run_from_its_send(
    store: Store, journal: Journal, metrics_registry: CollectorRegistry
) -> None:
    """``singleton_tasks_wait_seconds``: send → admission, across the gated run's deferrals and its wake."""
    app = make_app(store)
    name = unique()
    release_first = threading.Event()

    @singleton(key="store:{store_id}")
    @app.task(name=name, shared=False)
    def sync_inventory(store_id: str, label: str) -> str:
        with journal.body(label, store_id):
            if label == "first":
                assert release_first.wait(10)
        return label

    def sample(metric: str) -> float | None:
        return metrics_registry.get_sample_value(metric, {"task": name})

    with worker(app):
        first = sync_inventory.delay("A", "first")
        wait_for(lambda: bool(journal.get("first")), what="first to start")
        sent = time.monotonic()
        second = sync_inventory.delay("A", "second")  # waits: deferred (retry_delay 0.1 s), then woken
        time.sleep(0.4)
        release_first.set()
        assert [first.get(interval=0.01, timeout=10), second.get(interval=0.01, timeout=10)] == [
            "first",
            "second",
        ]
        waited = journal.get("second")[0].start - sent
    assert sample("singleton_tasks_admitted_total") == 2
    assert sample("singleton_tasks_wait_seconds_count") == 2  # every admitted run is timed
    total = sample("singleton_tasks_wait_seconds_sum")
    assert total is not None and 0.4 <= total <= waited + 0.2  # mostly the second's wait behind the first


def test_on_full_replace_runs_the_first_and_the_last_of_a_burst(
    store: Store, journal: Journal, metrics_registry: CollectorRegistry
) -> None:
    """``limit=1, max_queue_depth=1, on_full="replace"``: one running and one queued, with the
    latest arguments; the replaced runs' results are REVOKED."""
    app = make_app(store)
    name = unique()
    gate_open = threading.Event()

    @singleton(key="store:{store_id}", max_queue_depth=1, on_full="replace")
    @app.task(name=name, shared=False)
    def sync_inventory(store_id: str, label: str) -> str:
        with journal.body(label, store_id):
            assert gate_open.wait(10)
        return label

    with worker(app):
        first = sync_inventory.delay("S", "r0")
        wait_for(lambda: bool(journal.get("r0")), what="r0 to start")
        burst = [sync_inventory.delay("S", f"r{i}") for i in range(1, 11)]
        assert runs_of(store) == [first.id, burst[-1].id]  # one running, the latest one waiting
        for replaced in burst[:-1]:
            with pytest.raises(TaskRevokedError, match=r"replaced by run .* \(on_full='replace'\)"):
                replaced.get(interval=0.01, timeout=10)
            assert replaced.state == "REVOKED"
        gate_open.set()
        assert [first.get(interval=0.01, timeout=10), burst[-1].get(interval=0.01, timeout=10)] == [
            "r0",
            "r10",
        ]
        wait_for(lambda: runs_of(store) == [], what="the key to empty")
    replaced_total = metrics_registry.get_sample_value("singleton_tasks_replaced_total", {"task": name})
    assert replaced_total == 9
    assert journal.labels() == ["r0", "r10"] and journal.overlaps == []


def test_on_full_drop_while_the_key_only_has_holders_returns_the_newest_holders_result(
    store: Store, journal: Journal
) -> None:
    app = make_app(store)
    gate_open = threading.Event()

    @app.task(
        base=SingletonTask,
        singleton={"key": "{store_id}", "max_queue_depth": 0, "on_full": "drop"},
        name=unique(),
        shared=False,
    )
    def sync_inventory(store_id: str, label: str) -> str:
        with journal.body(label, store_id):
            assert gate_open.wait(10)
        return label

    with worker(app):
        first = sync_inventory.delay("S", "r0")
        wait_for(lambda: bool(journal.get("r0")), what="r0 to start")
        again = sync_inventory.delay("S", "r1")
        assert again.id == first.id
        gate_open.set()
        assert again.get(interval=0.01, timeout=10) == "r0"
    assert journal.labels() == ["r0"]


# -- notify on release (docs/concepts.md#handoff) --------------------------------------------------
@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_release_wakes_the_next_waiter_long_before_the_retry_delay(store: Store, journal: Journal) -> None:
    app = make_app(store, retry_delay=30.0, max_retry_delay=30.0)

    @app.task(base=SingletonTask, singleton={"key": "burst"}, name=unique(), shared=False)
    def burst(label: str) -> str:
        with journal.body(label, "burst"):
            time.sleep(0.02)
        return label

    started = time.monotonic()
    with worker(app, concurrency=4):
        results = [burst.delay(f"r{i}") for i in range(10)]
        assert [r.get(interval=0.01, timeout=25) for r in results] == [f"r{i}" for i in range(10)]
    elapsed = time.monotonic() - started
    assert elapsed < 10, f"a 10-run burst took {elapsed:.1f}s: the handoffs waited for the 30 s timer"
    assert journal.overlaps == [] and journal.labels() == [f"r{i}" for i in range(10)]


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_a_run_that_can_only_wait_is_published_held_back_and_woken_by_the_release(
    store: Store, journal: Journal, caplog: pytest.LogCaptureFixture
) -> None:
    # B and C are enqueued behind the holder: each is published with its deferral's countdown (30 s
    # here) and parked in the store, so no worker claims and defers them first; the release
    # chain wakes them, far sooner than the countdown.
    app = make_app(store, retry_delay=30.0, max_retry_delay=30.0)
    job, release_holder = held_key_job(app, journal)
    results = [job.delay(label) for label in ("holder", "B", "C")]
    snap = store.snapshot()[0]
    assert [(w.run_id, w.state) for w in snap.waiters] == [
        (results[0].id, RunState.PENDING),  # first in line: published at once
        (results[1].id, RunState.GATED),  # parked with its payload
        (results[2].id, RunState.GATED),
    ]
    caplog.set_level(logging.DEBUG, logger="singleton_tasks")
    started = time.monotonic()
    with worker(app, concurrency=4):
        wait_for(lambda: bool(journal.get("holder")), what="the holder to start")
        release_holder.set()
        assert [r.get(interval=0.01, timeout=15) for r in results] == ["holder", "B", "C"]
    elapsed = time.monotonic() - started
    assert elapsed < 15, f"took {elapsed:.1f}s: the held-back copies waited for their 30 s countdown"
    assert journal.overlaps == [] and journal.labels() == ["holder", "B", "C"]
    decisions = [r.getMessage() for r in caplog.records if " key 'k' gen " in r.getMessage()]
    assert not [d for d in decisions if d.endswith("gated") or "gated (position" in d], decisions


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_a_woken_run_is_published_with_what_its_send_gave_it(store: Store, journal: Journal) -> None:
    # Held back runs are woken from their stored signatures by the thread that releases the key:
    # each must keep its sender's reply queue (rpc:// results), the parent and root of the body
    # that sent it, and an expiry counted from its send, not from the wake.
    app = make_app(store, retry_delay=30.0, max_retry_delay=30.0)
    gate_open = threading.Event()
    seen: dict[str, tuple[Any, ...]] = {}

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False, bind=True)
    def job(self: Any, label: str) -> str:
        with journal.body(label, "k"):
            if label == "holder":
                assert gate_open.wait(10)
        request = self.request
        seen[label] = (request.reply_to, request.parent_id, request.root_id, request.expires)
        return label

    @app.task(name=unique(), shared=False, bind=True)
    def sender(self: Any) -> list[str]:
        return [job.apply_async(("from-body",), expires=120).id, self.request.id, app.thread_oid]

    with worker(app, concurrency=4):
        holder = job.delay("holder")
        wait_for(lambda: bool(journal.get("holder")), what="the holder to start")
        sent_at = app.now()
        from_test = job.apply_async(("from-test",), expires=120)
        expiring = job.apply_async(("expiring",), expires=0.5)
        from_body, sender_id, sender_oid = sender.delay().get(interval=0.01, timeout=10)
        assert len(runs_of(store)) == 4  # each waits parked
        time.sleep(1.0)  # past the expiring run's expiry; the others' would move if counted from the wake
        gate_open.set()
        assert holder.get(interval=0.01, timeout=10) == "holder"
        assert from_test.get(interval=0.01, timeout=10) == "from-test"
        assert AsyncResult(from_body, app=app).get(interval=0.01, timeout=10) == "from-body"
        wait_for(lambda: not runs_of(store), what="the key to drain")
    assert expiring.state == "REVOKED" and "expiring" not in seen
    assert journal.labels() == ["holder", "from-test", "from-body"]
    assert seen["from-test"][:3] == (app.thread_oid, None, from_test.id)  # Celery's root of a top-level run
    assert seen["from-body"][:3] == (sender_oid, sender_id, sender_id)
    for label in ("from-test", "from-body"):
        expires_at = datetime.datetime.fromisoformat(seen[label][3])
        assert abs((expires_at - sent_at).total_seconds() - 120) < 0.5, (label, expires_at, sent_at)


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_a_run_deferred_again_and_again_keeps_no_parent(store: Store, journal: Journal) -> None:
    # Each deferral is published by the delivery it defers, inside its own before_start: Celery's
    # send_task would make the run its own parent, and its wake would carry that too.
    app = make_app(store)
    gate_open = threading.Event()
    parents: dict[str, Any] = {}
    deliveries: list[str] = []

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False, bind=True)
    def job(self: Any, label: str) -> str:
        with journal.body(label, "k"):
            if label == "holder":
                assert gate_open.wait(10)
        parents[label] = self.request.parent_id
        return label

    def delivered(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        if sender is not None and sender.name == job.name:
            deliveries.append(task_id or "")

    signals.task_prerun.connect(delivered, weak=False)
    try:
        with worker(app, concurrency=4):
            holder = job.delay("holder")
            wait_for(lambda: bool(journal.get("holder")), what="the holder to start")
            waiter = job.apply_async(("waiter",), countdown=0.05)  # published at once: delivered, deferred
            wait_for(lambda: deliveries.count(waiter.id) >= 3, what="the waiter's deferred copies")
            gate_open.set()
            assert waiter.get(interval=0.01, timeout=10) == "waiter"
            assert holder.get(interval=0.01, timeout=10) == "holder"
    finally:
        signals.task_prerun.disconnect(delivered)
    assert parents == {"holder": None, "waiter": None}


class _ClaimRecorder(MemoryStore):
    """A real memory store that records what each claim was given as its payload."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.claimed: list[tuple[str, int, object]] = []

    def claim(
        self, spec: RunSpec, generation: int, payload: bytes | PayloadRequest | None = None
    ) -> ClaimOutcome:
        self.claimed.append((spec.run_id, generation, payload))
        return super().claim(spec, generation, payload)


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_a_first_delivery_claims_without_encoding_its_message(journal: Journal) -> None:
    # Its registration stored the signature it was sent as, and its producer marked it so: the
    # claim asks for the delivered message only if the store has none. app.send_task registers
    # nothing and marks nothing.
    store = _ClaimRecorder(f"memory://{unique()}")
    app = make_app(store)
    app.conf.task_inherit_parent_priority = True
    job, release_holder = held_key_job(app, journal)
    release_holder.set()

    @app.task(name=unique(), shared=False)
    def sender() -> str:
        return str(job.delay("from a body").id)  # given its parent's priority by the publish

    with worker(app, concurrency=2):
        sent = job.delay("sent")
        assert sent.get(interval=0.01, timeout=10) == "sent"
        unregistered = app.send_task(job.name, ("unregistered",))
        assert unregistered.get(interval=0.01, timeout=10) == "unregistered"
        from_body = AsyncResult(sender.delay().get(interval=0.01, timeout=10), app=app)
        assert from_body.get(interval=0.01, timeout=10) == "from a body"

    def asked(run_id: str) -> list[tuple[int, object]]:
        return [(g, p if p is PAYLOAD_ON_REQUEST else type(p)) for r, g, p in store.claimed if r == run_id]

    assert asked(sent.id) == [(0, PAYLOAD_ON_REQUEST)]
    assert asked(unregistered.id) == [(0, bytes)]  # not marked by its producer: claimed with its message
    assert asked(from_body.id) == [(0, bytes)]  # its stored signature lacks the inherited priority


class _PublishReceiver:
    """Tags each message as it is sent, from a ``before_task_publish`` receiver."""

    def __init__(self, current: list[str]) -> None:
        self.current = current

    def tag(self, headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers is not None:
            headers.setdefault("trace_id", self.current[0])

    def connect(self) -> None:
        signals.before_task_publish.connect(self.tag, weak=False)

    def disconnect(self) -> None:
        signals.before_task_publish.disconnect(self.tag)


class _SendTaskWrapper:
    """Tags each message as it is sent, by wrapping ``Celery.send_task`` as sentry-sdk's Celery
    integration does (``functools.wraps``, headers added to the call's options)."""

    def __init__(self, current: list[str]) -> None:
        self.current = current
        self.original = Celery.send_task

    def connect(self) -> None:
        original, current = self.original, self.current

        @functools.wraps(original)
        def send_task(app: Celery, *args: Any, **options: Any) -> Any:
            options["headers"] = {"trace_id": current[0], **(options.get("headers") or {})}
            return original(app, *args, **options)

        Celery.send_task = send_task  # type: ignore[method-assign]

    def disconnect(self) -> None:
        Celery.send_task = self.original  # type: ignore[method-assign]


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
@pytest.mark.parametrize("connected", ["everywhere", "in the producer only"])
@pytest.mark.parametrize("tagger", [_PublishReceiver, _SendTaskWrapper], ids=["receiver", "wrapped"])
def test_a_woken_run_keeps_what_a_publish_hook_added_to_its_message(
    store: Store, journal: Journal, connected: str, tagger: type[_PublishReceiver | _SendTaskWrapper]
) -> None:
    # A before_task_publish receiver, or a wrapper of send_task (a tracing integration), tags the
    # message as it is sent, after the registration stored its signature: a waiter delivered and
    # gated is woken from what was delivered, tag and all, also when the worker has no such hook
    # (the producer is the one to know).
    app = make_app(store, retry_delay=30.0, max_retry_delay=30.0)
    job, release_holder = held_key_job(app, journal)
    tagged: dict[str, Any] = {}
    current = ["worker"]
    hook = tagger(current)

    def seen(sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
        if task is not None and task.name == job.name:
            tagged.setdefault(task_id, set()).add(getattr(task.request, "trace_id", None))

    hook.connect()
    signals.task_prerun.connect(seen, weak=False)
    try:
        with worker(app, concurrency=4):
            holder = job.delay("holder")
            wait_for(lambda: bool(journal.get("holder")), what="the holder to start")
            current[0] = "the sender's"
            waiter = job.apply_async(("waiter",), countdown=0.05)  # published at once: delivered, gated
            current[0] = "worker"
            if connected == "in the producer only":
                hook.disconnect()
            wait_for(lambda: waiter.id in tagged, what="the waiter's delivery")
            release_holder.set()  # the wake is published on the worker, where the trace is "worker"
            assert waiter.get(interval=0.01, timeout=10) == "waiter"
            assert holder.get(interval=0.01, timeout=10) == "holder"
    finally:
        hook.disconnect()
        signals.task_prerun.disconnect(seen)
    assert tagged[waiter.id] == {"the sender's"}


# -- retries keep the slot (docs/concepts.md#the-life-of-a-run) ------------------------------------
@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_self_retry_keeps_the_slot_and_exhaustion_releases_it(store: Store, journal: Journal) -> None:
    app = make_app(store)
    attempts: dict[str, int] = {}

    @app.task(
        base=SingletonTask,
        singleton={"key": "k", "max_queue_depth": 1},
        bind=True,
        name=unique(),
        shared=False,
        max_retries=2,
    )
    def flaky(self: Any, label: str, succeed_after: int) -> str:
        with journal.body(f"{label}#{self.request.retries}", "k"):
            attempts[label] = attempts.get(label, 0) + 1
            if attempts[label] <= succeed_after:
                raise self.retry(countdown=0.2)
        return label

    with worker(app):
        first = flaky.delay("first", 2)  # two retries, then success
        wait_for(lambda: bool(journal.get("first#0")), what="first to start")
        second = flaky.delay("second", 99)  # retries exhausted: FAILURE
        with pytest.raises(SingletonQueueFullError):
            flaky.delay("third", 0)  # first (retrying) + second fill limit + depth
        assert first.get(interval=0.01, timeout=10) == "first"  # its retries never hit the cap
        with pytest.raises(MaxRetriesExceededError):
            second.get(interval=0.01, timeout=10)
        third = flaky.delay("third", 0)
        assert third.get(interval=0.01, timeout=10) == "third"
    order = journal.labels()
    assert order == ["first#0", "first#1", "first#2", "second#0", "second#1", "second#2", "third#0"]
    assert journal.overlaps == []
    assert second.state == "FAILURE"


def test_autoretry_for_keeps_the_slot(store: Store, journal: Journal) -> None:
    app = make_app(store)
    failures = {"left": 2}

    @app.task(
        base=SingletonTask,
        singleton={"key": "k"},
        name=unique(),
        shared=False,
        autoretry_for=(ConnectionError,),
        retry_kwargs={"max_retries": 3, "countdown": 0.2},
    )
    def fetch(label: str) -> str:
        with journal.body(label, "k"):
            if label == "a" and failures["left"] > 0:
                failures["left"] -= 1
                raise ConnectionError("flaky upstream")
        return label

    with worker(app):
        a = fetch.delay("a")
        wait_for(lambda: bool(journal.get("a")), what="a to start")
        b = fetch.delay("b")
        assert a.get(interval=0.01, timeout=10) == "a" and b.get(interval=0.01, timeout=10) == "b"
    assert journal.labels() == ["a", "a", "a", "b"]  # b never slipped in between a's retries
    assert journal.overlaps == []


# -- canvas ------------------------------------------------------------------------------------
def test_chains_and_groups_complete(store: Store, journal: Journal) -> None:
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k", "max_queue_depth": 0}, name=unique(), shared=False)
    def add(x: int, y: int) -> int:
        with journal.body(f"add{x}+{y}", "k"):
            time.sleep(0.01)
        return x + y

    with worker(app):
        # With max_queue_depth=0 each step is dispatched while its parent still holds the slot:
        # the chain was accepted as a whole, so its steps never hit the cap.
        assert chain(add.s(1, 2), add.s(3), add.s(4)).delay().get(interval=0.01, timeout=15) == 10
        wait_for(lambda: runs_of(store) == [], what="the chain to settle")
    assert journal.overlaps == []

    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "g"}, name=unique(), shared=False)
    def double(x: int) -> int:
        with journal.body(f"double{x}", "g"):
            time.sleep(0.01)
        return 2 * x

    with worker(app):
        assert group(double.s(i) for i in range(5)).delay().get(interval=0.01, timeout=15) == [0, 2, 4, 6, 8]
    assert journal.overlaps == []


# -- revoke ------------------------------------------------------------------------------------
@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_revoke_of_a_waiter_and_of_a_retrying_holder(store: Store, journal: Journal) -> None:
    # Celery checks a revoke only before it hands a delivery to its pool. A re-check copy of the
    # waiter handed over just before the revoke landed is not stopped, and is admitted if the
    # holder's release comes before its claim (the body ran once in a loaded full run). With the
    # re-check timer out of reach no copy of the waiter comes due near the revoke: each copy
    # that reaches the worker after it (the wake, or the held-back message) is discarded.
    app = make_app(store, retry_delay=30.0, max_retry_delay=30.0)
    gate_open = threading.Event()
    name = unique()

    @app.task(base=SingletonTask, singleton={"key": "k"}, bind=True, name=name, shared=False, max_retries=50)
    def job(self: Any, label: str) -> str:
        with journal.body(label, "k"):
            if label == "holder":
                assert gate_open.wait(10)
            if label == "retrier":
                raise self.retry(countdown=0.3)
        return label

    with worker(app):
        holder = job.delay("holder")
        wait_for(lambda: bool(journal.get("holder")), what="holder to start")
        waiter = job.delay("waiter")
        after = job.delay("after")  # both published held back for 30 s and parked: gated in the store
        waiter.revoke()
        # Revocation reaches the worker asynchronously (its control channel): let it land first.
        wait_for(lambda: waiter.id in worker_state.revoked, what="the revoke to reach the worker")
        gate_open.set()
        assert holder.get(interval=0.01, timeout=10) == "holder"
        assert after.get(interval=0.01, timeout=10) == "after"  # the revoked waiter freed its place
        wait_for(lambda: waiter.id not in runs_of(store), what="the revoked waiter to leave the store")
        assert journal.get("waiter") == []

        retrier = job.delay("retrier")
        wait_for(lambda: bool(journal.get("retrier")), what="retrier to start")
        next_run = job.delay("next")
        time.sleep(0.1)
        retrier.revoke()  # a holder waiting for its retry: its retry copy is revoked
        wait_for(lambda: retrier.id in worker_state.revoked, what="the revoke to reach the worker")
        assert next_run.get(interval=0.01, timeout=10) == "next"
    assert journal.overlaps == []
    wait_for(lambda: runs_of(store) == [], what="the store to empty")


def held_key_job(app: Celery, journal: Journal) -> tuple[Any, threading.Event]:
    """A singleton task on key "k" whose "holder" run holds until the returned event is set."""
    gate_open = threading.Event()

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job(label: str) -> str:
        with journal.body(label, "k"):
            if label == "holder":
                assert gate_open.wait(10)
        return label

    return job, gate_open


def test_an_expired_waiter_is_settled(store: Store, journal: Journal) -> None:
    app = make_app(store)
    job, gate_open = held_key_job(app, journal)
    with worker(app):
        holder = job.delay("holder")
        wait_for(lambda: bool(journal.get("holder")), what="holder to start")
        expiring = job.apply_async(("expiring",), expires=0.3)  # its deferred copies keep the expiry
        after = job.delay("after")
        wait_for(lambda: expiring.id not in runs_of(store), what="the expired waiter to be settled")
        gate_open.set()
        assert holder.get(interval=0.01, timeout=10) == "holder"
        assert after.get(interval=0.01, timeout=10) == "after"
    assert journal.get("expiring") == []
    assert expiring.state == "REVOKED"


@pytest.mark.parametrize("copy_generation", [0, 7], ids=["admitted-copy", "stale-copy"])
def test_a_discarded_copy_of_a_running_holder_keeps_its_slot(
    store: Store, journal: Journal, copy_generation: int
) -> None:
    """An expired or revoked copy of a run that executes elsewhere must not free its slot.

    See docs/concepts.md#generations-and-stale-copies.
    """
    from celery import signals
    from celery.app.task import Context

    app = make_app(store)
    job, gate_open = held_key_job(app, journal)
    with worker(app):
        holder = job.delay("holder")
        wait_for(lambda: bool(journal.get("holder")), what="holder to start")
        follower = job.delay("follower")
        wait_for(lambda: follower.id in runs_of(store) and len(runs_of(store)) == 2, what="follower in line")
        # What the worker's main process announces when a delayed copy of the holder expires.
        copy = Context(id=holder.id, args=["holder"], kwargs={}, headers={GENERATION_HEADER: copy_generation})
        signals.task_revoked.send(sender=job, request=copy, terminated=False, expired=True)
        (snap,) = store.snapshot(scope=job.name)
        assert [h.run_id for h in snap.holders] == [holder.id]  # the slot stays with the running body
        assert [w.run_id for w in snap.waiters] == [follower.id]
        gate_open.set()
        assert holder.get(interval=0.01, timeout=10) == "holder"
        assert follower.get(interval=0.01, timeout=10) == "follower"
    assert [r.run_id for r in journal.records] == [holder.id, follower.id]
    assert journal.overlaps == []


# -- deterministic run ids (docs/concepts.md#keys-vs-run-ids) --------------------------------------
@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_deterministic_task_id_twice_publishes_once(store: Store, journal: Journal) -> None:
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def deploy(env: str) -> str:
        with journal.body(env, "k"):
            time.sleep(0.05)
        return env

    run_id = f"deploy-prod-{uuid.uuid4().hex[:6]}"
    first = deploy.apply_async(("prod",), task_id=run_id)
    second = deploy.apply_async(("prod",), task_id=run_id)
    assert isinstance(second, AsyncResult) and second.id == first.id == run_id
    assert queued(app) == 1
    assert runs_of(store) == [run_id]
    other = deploy.apply_async(("prod",))  # another run id with the same key: a real second run
    with worker(app):
        assert (
            first.get(interval=0.01, timeout=10) == "prod" and other.get(interval=0.01, timeout=10) == "prod"
        )
    assert [r.run_id for r in journal.records] == [run_id, other.id]


# -- store outage (docs/deployment.md#choosing-a-store) --------------------------------------------
OUTAGE_PORT = 16391


class RedisServer:
    """A dedicated redis-server the test starts and stops by its PID (data kept in an AOF)."""

    def __init__(self, directory: Path, port: int = OUTAGE_PORT) -> None:
        self.directory, self.port = directory, port
        self.process: subprocess.Popen[bytes] | None = None

    def listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def start(self) -> None:
        assert not self.listening(), f"port {self.port} is taken: the outage test needs its own server"
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(self.listening, timeout=10, what="redis-server to start")
        assert self.process.poll() is None, "redis-server exited"

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
            self.process = None
        assert not self.listening()


@pytest.fixture
@needs("redis")
def outage_redis(tmp_path: Path) -> Iterator[RedisServer]:
    require_executable("redis-server")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def test_store_outage_runs_nothing_without_a_slot_and_loses_nothing(
    outage_redis: RedisServer, journal: Journal
) -> None:
    store = store_from_url(f"redis://127.0.0.1:{OUTAGE_PORT}/0", namespace=unique("ns").replace(".", "-"))
    store.migrate()
    app = make_app(store, heartbeat_interval=0.2)
    holder_may_finish = threading.Event()

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job(label: str) -> str:
        with journal.body(label, "k"):
            if label == "holder":
                assert holder_may_finish.wait(20)
        return label

    try:
        with worker(app):
            holder = job.delay("holder")
            wait_for(lambda: bool(journal.get("holder")), what="holder to start")
            waiters = [job.delay(f"w{i}") for i in range(2)]
            time.sleep(0.2)
            outage_redis.stop()
            with pytest.raises(StoreUnavailableError, match=rf"{job.name} run .* \(key 'k'\)"):
                job.delay("refused")
            holder_may_finish.set()  # its release fails: retried in the background
            assert holder.get(interval=0.01, timeout=10) == "holder"
            time.sleep(0.5)  # the waiters' copies hit the outage at the gate: deferred, not run
            assert [r.label for r in journal.records] == ["holder"]
            outage_redis.start()
            assert [w.get(interval=0.01, timeout=15) for w in waiters] == ["w0", "w1"]  # nothing lost
        assert journal.labels() == ["holder", "w0", "w1"]
        assert journal.overlaps == []
        assert runs_of(store) == []
    finally:
        holder_may_finish.set()
        store.close()


# -- eager calls bypass the gate ------------------------------------------------------------------
def test_eager_calls_bypass_the_gate(store: Store) -> None:
    app = make_app(store)
    seen: list[object] = []

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job(x: int) -> int:
        seen.append(current_admission())
        return x + 1

    assert job.apply((1,)).get() == 2
    assert job(2) == 3
    app.conf.task_always_eager = True
    assert job.delay(3).get() == 4
    assert seen == [None, None, None]
    assert runs_of(store) == []


def test_direct_calls_and_apply_bypass_the_gate_logged_at_debug(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False, bind=True)
    def job(self: Any, x: int) -> tuple[int, str | None]:
        return x + 1, self.request.id

    caplog.set_level(logging.DEBUG, logger="singleton_tasks")
    assert job(1) == (2, None)
    assert [r.getMessage() for r in caplog.records] == [
        f"{job.name} called directly: it bypasses the singleton gate"
    ]
    caplog.clear()
    # .apply() runs the body under the tracer: its request (and id) is the body's, no direct-call log.
    assert job.apply((2,), task_id="fixed").get() == (3, "fixed")
    assert [r.getMessage() for r in caplog.records] == [
        f"{job.name} run fixed is eager: it bypasses the singleton gate"
    ]
    assert runs_of(store) == []


# -- bad input -------------------------------------------------------------------------------------
def test_key_errors_at_delay_raise_and_publish_nothing(store: Store) -> None:
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": lambda n: n}, name=unique(), shared=False)
    def numbered(n: object) -> object:
        return n

    with pytest.raises(SingletonKeyError):
        numbered.delay(5)  # the key callable returns an int
    with pytest.raises(SingletonKeyError):
        numbered.delay("x" * 600)  # too long
    assert queued(app) == 0 and runs_of(store) == []


def test_a_key_no_store_can_hold_fails_the_delay_and_publishes_nothing(store: Store) -> None:
    """A lone surrogate (os.listdir() of a name that is not UTF-8): refused alike on every store."""
    app = make_app(store)
    name = "\udcff.csv"

    @app.task(base=SingletonTask, singleton={"key": "report-{name}"}, name=unique(), shared=False)
    def templated(name: str) -> None: ...

    @app.task(base=SingletonTask, singleton={"key": lambda name: name}, name=unique(), shared=False)
    def called(name: str) -> None: ...

    for task, key in ((templated, "report-" + name), (called, name)):
        with pytest.raises(SingletonKeyError) as caught:
            task.delay(name)
        assert task.name in str(caught.value) and repr(key) in str(caught.value)
    assert queued(app) == 0 and runs_of(store) == []


def test_a_send_task_message_with_a_bad_key_fails_once(store: Store) -> None:
    app = make_app(store)
    name = unique()
    failures: list[str] = []

    from celery import signals

    def on_failure(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        if sender is not None and sender.name == name:
            failures.append(str(task_id))

    signals.task_failure.connect(on_failure, weak=False)
    try:

        @app.task(base=SingletonTask, singleton={"key": lambda n: n}, name=name, shared=False)
        def numbered(n: object) -> object:
            raise AssertionError("the body must not run without a key")

        with worker(app):
            result = app.send_task(name, args=[5])  # bypasses apply_async: checked at the gate
            with pytest.raises(SingletonKeyError):
                result.get(interval=0.01, timeout=10)
            time.sleep(0.3)
        assert failures == [result.id]  # once, not forever
        assert runs_of(store) == []
    finally:
        signals.task_failure.disconnect(on_failure)


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_send_task_messages_are_registered_at_first_sight(store: Store, journal: Journal) -> None:
    app = make_app(store)
    name = unique()

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=name, shared=False)
    def job(label: str) -> str:
        with journal.body(label, "k"):
            time.sleep(0.05)
        return label

    with worker(app):
        results = [app.send_task(name, args=[f"r{i}"]) for i in range(3)]
        assert sorted(r.get(interval=0.01, timeout=10) for r in results) == ["r0", "r1", "r2"]
    assert journal.overlaps == []


def test_malformed_singleton_attributes_fail_at_declaration() -> None:
    app = make_app("memory://decl")
    app.finalize()  # a finalized app creates the task class right away
    with pytest.raises(SingletonConfigError, match="nope"):

        @app.task(base=SingletonTask, singleton={"key": "{nope}"}, name=unique(), shared=False)
        def templated(store_id: str) -> None: ...

    for bad in (
        {"key": "k", "limit": 0},
        {"key": 42},
        {"key": "k", "max_queue_depth": -1},
        {"kee": "k"},
        "k",
    ):
        with pytest.raises(SingletonConfigError):

            @app.task(base=SingletonTask, singleton=bad, name=unique(), shared=False)
            def bad_task(store_id: str) -> None: ...

    def lazy_templated(store_id: str) -> None: ...

    lazy = make_app("memory://decl")
    lazy.task(base=SingletonTask, singleton={"key": "{nope}"}, name=unique(), shared=False)(lazy_templated)
    with pytest.raises(SingletonConfigError):
        lazy.finalize()  # the per-task class is made here, before any worker runs anything


def test_singleton_config_object_and_bound_tasks_are_accepted() -> None:
    app = make_app("memory://decl")

    @app.task(
        base=SingletonTask, singleton=SingletonConfig(key="{a}-{b}"), bind=True, name=unique(), shared=False
    )
    def bound(self: Any, a: int, b: int = 2) -> int:
        return a + b

    binding = type(bound._get_current_object())._singleton_bound
    assert binding is not None and binding.derive_key((1,), {}) == "1-2"


# -- acks defaults (docs/concepts.md#leases) -------------------------------------------------------
def test_acks_late_defaults_and_a_warning_when_overridden() -> None:
    app = make_app("memory://acks")

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def safe() -> None: ...

    assert safe.acks_late is True and safe.reject_on_worker_lost is True
    with pytest.warns(UserWarning, match="acks_late=False"):

        @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False, acks_late=False)
        def unsafe() -> None: ...

        assert unsafe.acks_late is False


def test_singleton_on_a_finalized_task_keeps_an_explicit_acks_choice_with_the_warning() -> None:
    app = make_app("memory://acks-stacked")
    app.finalize()  # @app.task returns the task itself: its options are only in its class

    @app.task(name=unique(), shared=False)
    def plain(k: str) -> None: ...

    singleton(key="{k}")(plain)
    assert plain.acks_late is True and plain.reject_on_worker_lost is True  # docs/concepts.md#leases
    with pytest.warns(UserWarning, match="acks_late=False") as warned:

        @singleton(key="{k}")
        @app.task(name=unique(), shared=False, acks_late=False)
        def unsafe(k: str) -> None: ...

    assert unsafe.acks_late is False and unsafe.reject_on_worker_lost is True  # as with base=SingletonTask
    assert len(warned) == 1


# -- @singleton stacked on existing tasks ----------------------------------------------------------
@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_singleton_decorator_on_app_task(store: Store, journal: Journal) -> None:
    app = make_app(store)

    @singleton(key="acct:{account}", limit=1)
    @app.task(name=unique())
    def generate_statement(account: str, label: str) -> str:
        with journal.body(label, account):
            time.sleep(0.05)
        return label

    with worker(app):
        results = [generate_statement.delay("A", f"r{i}") for i in range(3)]
        assert [r.get(interval=0.01, timeout=10) for r in results] == ["r0", "r1", "r2"]
    task = app.tasks[generate_statement.name]
    assert isinstance(task, SingletonTask) and task.acks_late is True
    assert journal.overlaps == [] and journal.labels() == ["r0", "r1", "r2"]


def test_singleton_decorator_on_a_finalized_app_task_and_bind(store: Store, journal: Journal) -> None:
    app = make_app(store)
    app.finalize()

    @singleton(key="{account}", max_queue_depth=0)
    @app.task(name=unique(), bind=True, shared=False)
    def statement(self: Any, account: str) -> str:
        with journal.body(account, account):
            time.sleep(0.3)
        return self.request.id  # type: ignore[no-any-return]

    assert isinstance(statement, SingletonTask)
    first = statement.delay("A")
    with pytest.raises(SingletonQueueFullError):
        statement.delay("A")
    with worker(app):
        assert first.get(interval=0.01, timeout=10) == first.id


def test_singleton_decorator_validates_at_declaration_even_on_a_promise() -> None:
    app = make_app("memory://decl")
    with pytest.raises(SingletonConfigError, match="nope"):

        @singleton(key="{nope}")
        @app.task(name=unique(), shared=False)
        def task(account: str) -> None: ...

    app2 = make_app("memory://decl")

    @app2.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def already(account: str) -> None: ...

    with pytest.raises(SingletonConfigError, match="already a singleton"):
        singleton(key="k")(already._get_current_object())


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_singleton_decorator_on_shared_task(store_factory: StoreFactory, journal: Journal) -> None:
    name = unique("shared")

    @singleton(key="{account}")
    @shared_task(name=name)
    def shared_statement(account: str, label: str) -> str:
        with journal.body(label, account):
            time.sleep(0.05)
        return label

    app = make_app(store_factory())
    app.finalize()  # shared tasks are created per app at finalization
    task = app.tasks[name]
    assert isinstance(task, SingletonTask)
    with worker(app):
        results = [task.delay("A", f"r{i}") for i in range(3)]
        assert [r.get(interval=0.01, timeout=10) for r in results] == ["r0", "r1", "r2"]
    assert journal.overlaps == [] and journal.labels() == ["r0", "r1", "r2"]


def test_singleton_decorator_refuses_what_it_cannot_handle() -> None:
    from celery import Task
    from celery.local import Proxy

    class ClassBased(Task):  # type: ignore[misc]
        def run(self, x: int) -> int:
            return x

    with pytest.raises(SingletonConfigError, match="task class"):
        singleton(key="k")(ClassBased)
    with pytest.raises(SingletonConfigError, match="not a shared task"):
        singleton(key="k")(Proxy(lambda: object()))


# -- generations --------------------------------------------------------------------------------
def test_a_stale_copy_is_dropped_and_never_runs(store: Store, journal: Journal) -> None:
    app = make_app(store)
    name = unique()

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=name, shared=False)
    def job(label: str) -> str:
        with journal.body(label, "k"):
            pass
        return label

    with worker(app):
        result = job.delay("once")
        assert result.get(interval=0.01, timeout=10) == "once"
        wait_for(lambda: runs_of(store) == [], what="the run to settle")
        # A copy with a generation that was never live (an old deferral) arrives late.
        app.send_task(name, args=("once",), task_id=result.id, headers={GENERATION_HEADER: 7})
        time.sleep(0.3)
    assert journal.labels() == ["once"]
    assert runs_of(store) == []


def test_without_install_the_app_conf_store_is_used(tmp_path: Path) -> None:
    app = make_app()
    app.conf.singleton_store = f"sqlite:///{tmp_path / 'conf.db'}"

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job() -> None: ...

    job.delay()
    assert gatekeeper_for(app).store.url == f"sqlite:///{tmp_path / 'conf.db'}"
    assert len(runs_of(gatekeeper_for(app).store)) == 1
    gatekeeper_for(app).close()


def test_without_any_store_the_embedded_default_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from singleton_tasks.stores import choice

    monkeypatch.setattr(choice, "_default_warned", False)
    monkeypatch.delenv(choice.STORE_ENV, raising=False)
    monkeypatch.setattr(choice, "default_store_url", lambda: "memory://default-store")
    app = make_app()

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job() -> None: ...

    with pytest.warns(UserWarning, match="no store configured"):
        job.delay()
    app2 = make_app()
    app2.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)(noop)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gatekeeper_for(app2).store  # noqa: B018 — the warning is given once per process
    assert os.environ.get(choice.STORE_ENV) is None


def test_user_ignore_in_the_body_settles_the_run(store: Store) -> None:
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def skipper() -> None:
        raise Ignore()

    with worker(app):
        skipper.delay()
        wait_for(lambda: runs_of(store) == [], what="the ignored run to settle")


# -- prefork ------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_pool_process_heartbeats_with_its_own_thread() -> None:
    from singleton_tasks.outcomes import HolderRef
    from singleton_tasks.runtime import Gatekeeper

    gatekeeper = Gatekeeper(store_from_url("memory://fork"), heartbeat_interval=0.05)
    ref = HolderRef("scope", "key", "run", 1)
    parent = gatekeeper.heartbeats
    parent.track(ref, 60.0, "tasks.t")  # the parent's heartbeat thread runs
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what a prefork pool process sees
        try:
            child = gatekeeper.heartbeats
            child.track(ref, 60.0, "tasks.t")
            thread = child._thread
            ok = child is not parent and thread is not None and thread.is_alive()
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)
        gatekeeper.close()


# -- worker start (docs/deployment.md#choosing-a-store) --------------------------------------------
# Not PostgreSQL: its schema version is database-wide, other tests would see the change.
@pytest.mark.parametrize("backend", backend_params(["memory", "sqlite", "redis"]))
def test_worker_refuses_to_start_on_an_incompatible_schema(
    store_factory: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    from celery.worker import WorkController

    from singleton_tasks.stores import SCHEMA_VERSION

    store = store_factory()
    app = make_app(store)
    store.set_schema_version_for_tests(SCHEMA_VERSION + 1)  # type: ignore[attr-defined]
    try:
        controller = WorkController(app=app, pool_cls="solo", concurrency=1, without_heartbeat=True)
        runner = threading.Thread(target=controller.start, daemon=True)
        runner.start()
        runner.join(30)  # with a compatible schema it would consume until stopped
        assert not runner.is_alive(), "the worker started against an incompatible schema"
        assert controller.exitcode == 1
        assert "migrate" in caplog.text
    finally:
        store.set_schema_version_for_tests(SCHEMA_VERSION)  # type: ignore[attr-defined]


# -- an ambiguous store failure at enqueue (the reply lost after the write) -----------------------
class _ReplyLostOnRegister(MemoryStore):
    """A real memory store whose first register writes, then fails like a timed-out round trip."""

    failures = 1

    def register(
        self, spec: RunSpec, *, payload: bytes | None = None, delay: float = 0.0, confirmed: bool = True
    ) -> RegisterOutcome:
        outcome = super().register(spec, payload=payload, delay=delay, confirmed=confirmed)
        if self.failures:
            self.failures -= 1
            raise StoreUnavailableError("reply lost: timed out after the command was sent")
        return outcome


def test_a_registration_whose_reply_was_lost_is_undone(journal: Journal) -> None:
    store = _ReplyLostOnRegister(f"memory://{unique()}")
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job(label: str) -> str:
        with journal.body(label, "k"):
            return label

    with pytest.raises(StoreUnavailableError, match="reply lost"):
        job.delay("lost")
    assert queued(app) == 0 and runs_of(store) == []  # nothing published, no ghost in line
    later = job.delay("later")
    with worker(app):
        assert later.get(interval=0.01, timeout=10) == "later"
    assert journal.labels() == ["later"]


class _ParkFails(MemoryStore):
    """A real memory store whose park fails like an outage."""

    def park(self, scope: str, key: str, run_id: str) -> tuple[Wake, ...]:
        raise StoreUnavailableError("store down at the park")


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_a_run_whose_park_fails_is_published_and_runs_after_its_countdown(journal: Journal) -> None:
    store = _ParkFails(f"memory://{unique()}")
    app = make_app(store)
    job, _ = held_key_job(app, journal)
    first, second = job.delay("first"), job.delay("second")  # no error: second was published
    assert queued(app) == 2
    assert [w.state for w in store.snapshot()[0].waiters] == [RunState.PENDING] * 2
    # Published, so confirmed like any other run: never taken for one that was not.
    assert gatekeeper_for(app).flush_confirms(10)
    assert [w.confirmed for w in store.snapshot()[0].waiters] == [True, True]
    with worker(app):
        assert [r.get(interval=0.01, timeout=10) for r in (first, second)] == ["first", "second"]
    assert journal.labels() == ["first", "second"] and journal.overlaps == []


def test_a_run_with_its_own_countdown_is_not_held_back(store: Store, journal: Journal) -> None:
    job, _ = held_key_job(make_app(store), journal)
    job.delay("first")
    own = job.apply_async(("own",), countdown=0.05)
    held = job.delay("held")
    states = {w.run_id: w.state for w in store.snapshot()[0].waiters}
    assert states[own.id] is RunState.PENDING and states[held.id] is RunState.GATED


# -- the line keeps every run (docs/concepts.md#the-line) ---------------------------------------
def test_an_argument_json_cannot_carry_fails_the_delay_and_leaves_no_trace(
    store: Store, journal: Journal
) -> None:
    """Encoded before anything is written: a typed error, nothing registered or published."""
    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job(label: str, extra: Any = None) -> str:
        with journal.body(label, "k"):
            return label

    with pytest.raises(SingletonPayloadError) as caught:
        job.delay("unencodable", object())
    assert isinstance(caught.value, TypeError) and job.name in str(caught.value)
    assert queued(app) == 0 and runs_of(store) == []
    with worker(app):
        assert job.delay("next").get(interval=0.01, timeout=10) == "next"


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_a_run_whose_every_copy_was_lost_is_issued_again_by_the_worker(
    store: Store, journal: Journal
) -> None:
    """A purged queue: the store still has the run and its payload; the worker's heartbeat thread
    (in its main process) issues it again once it owns the free slot and nothing of it came for
    orphan_timeout + re-check, and it runs once."""
    app = make_app(store, orphan_timeout=1.0, max_retry_delay=0.2, heartbeat_interval=0.25)

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job(label: str) -> str:
        with journal.body(label, "k"):
            return label

    lost = job.delay("lost")
    assert gatekeeper_for(app).flush_confirms(10)
    with app.connection() as conn:
        conn.default_channel.queue_purge(app.conf.task_default_queue)
    assert queued(app) == 0 and runs_of(store) == [lost.id]
    with worker(app):
        assert lost.get(interval=0.01, timeout=15) == "lost"
        assert job.delay("next").get(interval=0.01, timeout=10) == "next"
    assert journal.labels() == ["lost", "next"] and journal.overlaps == []


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
def test_options_only_the_producer_uses_never_fail_the_send(store: Store, journal: Journal) -> None:
    """A Queue object, an eta given as text: the message is fine; the send works as in Celery."""
    import datetime

    from kombu import Queue

    app = make_app(store)

    @app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)
    def job(label: str) -> str:
        with journal.body(label, "k"):
            return label

    queued_on = job.apply_async(("queue object",), queue=Queue(app.conf.task_default_queue))
    eta = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=0.2)
    timed = job.apply_async(("eta text",), eta=eta.isoformat(), countdown=0)
    with worker(app):
        assert queued_on.get(interval=0.01, timeout=10) == "queue object"
        assert timed.get(interval=0.01, timeout=10) == "eta text"
