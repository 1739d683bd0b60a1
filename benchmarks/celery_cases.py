"""Celery cases (8): an embedded threads-pool worker (1 process × 8 threads) on real Redis / RabbitMQ."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

from singleton_tasks.celery import SingletonTask, install

from .common import (
    BROKER_REDIS_URL,
    RABBITMQ_URL,
    STORE_REDIS_URL,
    THREADS,
    BareRoundTrips,
    Report,
    Row,
    Size,
    alternate,
    flush_redis,
    ratio_to_floor,
    unique,
)
from .dramatiq_cases import BURST_STARTS, BurstOrders, Recorder, Span, add_burst_rows, warm_up

BROKERS = {"redis": "Redis", "rabbitmq": "RabbitMQ"}


def _app(kind: str, singleton: bool, acks_late: bool = False) -> Celery:
    url = BROKER_REDIS_URL if kind == "redis" else RABBITMQ_URL.rstrip("/") + "//"
    app = Celery(unique("bench"), broker=url, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        task_default_queue=unique("q"),
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        worker_prefetch_multiplier=4,
        task_acks_late=acks_late,
    )
    if singleton:
        install(app, STORE_REDIS_URL, namespace=unique("ns"))
    return app


class Rig:
    def __init__(
        self,
        kind: str,
        singleton: bool,
        expected: int,
        *,
        key: str | None,
        body: float,
        acks_late: bool = False,
        floor: bool = False,
    ) -> None:
        """``floor``: a bare store round trip before and after each body (where the gate's go)."""
        self.kind = kind
        self.app = _app(kind, singleton, acks_late)
        self.recorder = Recorder(expected)
        recorder = self.recorder

        def run(i: int) -> None:
            with recorder.body(i):
                if body:
                    time.sleep(body)

        options: dict[str, Any] = {"name": unique("task"), "shared": False}
        if singleton:
            options.update(base=SingletonTask, singleton={"key": key if key is not None else "k:{i}"})
        self.task = self.app.task(**options)(run)
        self.round_trips: BareRoundTrips | None = None
        if floor:
            round_trips = self.round_trips = BareRoundTrips()

            def ping(**_: Any) -> None:
                round_trips.ping()

            self._ping = ping  # signals hold receivers weakly
            signals.task_prerun.connect(ping, sender=self.task)
            signals.task_postrun.connect(ping, sender=self.task)

    def send(self, n: int) -> None:
        for i in range(n):
            self.task.delay(i)

    def close(self) -> None:
        if self.round_trips is not None:
            signals.task_prerun.disconnect(self._ping, sender=self.task)
            signals.task_postrun.disconnect(self._ping, sender=self.task)
            self.round_trips.close()
        with contextlib.suppress(Exception):
            with self.app.connection_for_write() as conn:
                conn.default_channel.queue_purge(self.app.conf.task_default_queue)
                if self.kind == "rabbitmq":
                    conn.default_channel.queue_delete(self.app.conf.task_default_queue)
        if self.kind == "redis":
            flush_redis(BROKER_REDIS_URL)
        flush_redis(STORE_REDIS_URL)


@contextlib.contextmanager
def _worker(rig: Rig) -> Iterator[None]:
    with start_worker(
        rig.app,
        pool="threads",
        concurrency=THREADS,
        perform_ping_check=False,
        shutdown_timeout=30,
        loglevel="CRITICAL",
    ):
        yield


def _measure(
    kind: str,
    singleton: bool,
    n: int,
    *,
    key: str | None,
    body: float,
    cap: float,
    acks_late: bool = False,
    floor: bool = False,
    start: str = "queued",
) -> list[Span]:
    """Run ``n`` bodies, queued before the worker starts or sent to it running (``BURST_STARTS``).

    Returns the body spans (first start → last end is timed).
    """
    rig = Rig(kind, singleton, n, key=key, body=body, acks_late=acks_late, floor=floor)
    try:
        if start == "queued":
            rig.send(n)
        with _worker(rig):
            if start == "running":
                warm_up(rig.recorder, lambda: rig.task.delay(-1))
                rig.send(n)
            if not rig.recorder.done.wait(cap):
                raise RuntimeError(f"celery: only {len(rig.recorder.spans)}/{n} bodies ran in {cap:.0f} s")
        return rig.recorder.ordered()
    finally:
        rig.close()


def case_celery(report: Report, size: Size, runs: int, kinds: list[str]) -> None:
    for kind in kinds:
        _celery(report, size, runs, kind)


def _celery(report: Report, size: Size, runs: int, kind: str) -> None:
    n = size.celery_noop

    def noop(singleton: bool, acks_late: bool = False, floor: bool = False) -> float:
        spans = _measure(kind, singleton, n, key=None, body=0.0, cap=300, acks_late=acks_late, floor=floor)
        return (n - 1) / (spans[-1].end - spans[0].start)

    # SingletonTask acks late (docs/concepts.md#leases); plain Celery acks early by default. The acks_late
    # baseline shows what that guarantee alone costs; the target is against the default.
    results = alternate(
        runs,
        [
            ("plain", lambda: noop(False)),
            ("singleton", lambda: noop(True)),
            ("late", lambda: noop(False, acks_late=True)),
            ("floor", lambda: noop(False, acks_late=True, floor=True)),
        ],
    )
    case = f"8 Celery no-op ×{n:,}, distinct keys, {BROKERS[kind]} broker"
    report.add(Row(case, "plain Celery", "runs/s", results["plain"], key=f"celery.{kind}.noop.plain"))
    report.add(
        Row(
            case,
            "plain Celery, acks_late=True",
            "runs/s",
            results["late"],
            baseline="plain Celery",
            key=f"celery.{kind}.noop.late",
            note="the delivery guarantee SingletonTask defaults to",
        )
    )
    report.add(
        Row(
            case,
            "plain Celery, acks_late=True + 2 bare round trips",
            "runs/s",
            results["floor"],
            baseline="plain Celery",
            key=f"celery.{kind}.noop.floor",
            note="a PING before and after each body: what the gate's 2 round trips cost",
        )
    )
    report.add(
        Row(
            case,
            "SingletonTask",
            "runs/s",
            results["singleton"],
            baseline="plain Celery",
            key=f"celery.{kind}.noop.singleton",
        )
    )
    ratio, measured = ratio_to_floor(results)
    report.target("8", f"Celery no-op on {BROKERS[kind]}: ≥ 0.80× plain", measured, ratio >= 0.8)

    b, body = size.celery_burst, size.burst_body
    ideal = b * body
    orders = BurstOrders()

    def burst(singleton: bool, start: str = "queued") -> float:
        spans = _measure(kind, singleton, b, key="burst", body=body, cap=120, start=start)
        if singleton:
            orders.record(start, spans)
        return spans[-1].end - spans[0].start

    # Plain Celery runs the burst 8 at a time (no mutex): shown for the cost of the worker alone.
    results = alternate(
        runs,
        [("plain", functools.partial(burst, False))]
        + [(start, functools.partial(burst, True, start)) for start in BURST_STARTS],
    )
    case = f"8 Celery burst {b}×{body * 1000:.0f} ms, one key, {BROKERS[kind]} broker"
    report.add(Row(case, "ideal", "s", [ideal], note="n × body (serial)"))
    report.add(
        Row(case, "plain Celery (no mutex, 8 in parallel)", "s", results["plain"], higher_is_better=False)
    )
    add_burst_rows(
        report,
        case=case,
        subject="SingletonTask",
        key=f"celery.{kind}.burst",
        target=("8", f"Celery burst on {BROKERS[kind]}"),
        results=results,
        ideal=ideal,
        orders=orders,
    )
