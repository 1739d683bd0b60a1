"""Celery cases (8): an embedded threads-pool worker (1 process × 8 threads) on real Redis / RabbitMQ,
and the no-op on a ``celery worker --pool prefork`` process at Celery's defaults."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from celery import Celery, signals
from celery.contrib.testing.worker import start_worker

from singleton_tasks.celery import SingletonTask, gatekeeper_for, install

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
    floor_target,
    flush_redis,
    timed_sends,
    unique,
)
from .dramatiq_cases import BURST_STARTS, BurstOrders, Recorder, Span, add_burst_rows, add_cost_rows, warm_up

BROKERS = {"redis": "Redis", "rabbitmq": "RabbitMQ"}
#: The tools Celery users pick instead (docs/migrating.md), each locking in the store's Redis:
#: at ``.delay()``, unlocked when the run ends. Neither makes a duplicate wait: on distinct keys
#: they do the same work as a gate whose runs never wait.
OTHER_TOOLS = {"celery-singleton": "celery-singleton 0.3.1", "celery-once": "celery-once 3.0.1"}


def _app(kind: str, variant: str, acks_late: bool = False) -> Celery:
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
    if variant == "singleton":
        install(app, STORE_REDIS_URL, namespace=unique("ns"))
    elif variant == "celery-singleton":
        app.conf.singleton_backend_url = STORE_REDIS_URL
        app.conf.singleton_key_prefix = unique("cs") + ":"
    elif variant == "celery-once":
        app.conf.ONCE = {
            "backend": "celery_once.backends.Redis",
            "settings": {"url": STORE_REDIS_URL, "default_timeout": 3600},
        }
    return app


def _task_options(variant: str, key: str | None) -> dict[str, Any]:
    """``app.task`` options of ``variant``'s task: distinct keys (``k:{i}``), or one ``key``."""
    if variant == "singleton":
        return {"base": SingletonTask, "singleton": {"key": key if key is not None else "k:{i}"}}
    if variant == "celery-singleton":
        from celery_singleton import Singleton  # type: ignore[import-untyped]

        return {"base": Singleton, "unique_on": [] if key is not None else ["i"]}
    if variant == "celery-once":
        from celery_once import QueueOnce  # type: ignore[import-untyped]

        return {"base": QueueOnce, "once": {"keys": [] if key is not None else ["i"], "graceful": True}}
    return {}


class Rig:
    def __init__(
        self,
        kind: str,
        variant: str,
        expected: int,
        *,
        key: str | None,
        body: float,
        acks_late: bool = False,
        floor: bool = False,
    ) -> None:
        """``floor``: a bare store round trip before and after each body (where the gate's go)."""
        self.kind = kind
        self.app = _app(kind, variant, acks_late)
        self.recorder = Recorder(expected)
        recorder = self.recorder

        def run(i: int) -> None:
            with recorder.body(i):
                if body:
                    time.sleep(body)

        options = {"name": unique("task"), "shared": False, **_task_options(variant, key)}
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
        _cleanup(self.app, self.kind)


def _cleanup(app: Celery, kind: str) -> None:
    """The app's queue purged (deleted on RabbitMQ), the benchmark's databases flushed."""
    with contextlib.suppress(Exception):
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge(app.conf.task_default_queue)
            if kind == "rabbitmq":
                conn.default_channel.queue_delete(app.conf.task_default_queue)
    if kind == "redis":
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
    variant: str,
    n: int,
    *,
    key: str | None,
    body: float,
    cap: float,
    acks_late: bool = False,
    floor: bool = False,
    start: str = "queued",
) -> tuple[list[Span], float | None]:
    """Run ``n`` bodies, queued before the worker starts or sent to it running (``BURST_STARTS``).

    Returns the body spans (first start → last end is timed) and, sent to a running worker, when
    the first was sent.
    """
    rig = Rig(kind, variant, n, key=key, body=body, acks_late=acks_late, floor=floor)
    try:
        sent_at = None
        if start == "queued":
            rig.send(n)
        with _worker(rig):
            if start == "running":
                warm_up(rig.recorder, lambda: rig.task.delay(-1))
                sent_at = time.perf_counter()
                rig.send(n)
            if not rig.recorder.done.wait(cap):
                raise RuntimeError(f"celery: only {len(rig.recorder.spans)}/{n} bodies ran in {cap:.0f} s")
        return rig.recorder.ordered(), sent_at
    finally:
        rig.close()


def case_celery(report: Report, size: Size, runs: int, kinds: list[str], prefork_runs: int) -> None:
    """``prefork_runs``: rounds of the prefork form, which starts a worker process per run."""
    for kind in kinds:
        _celery(report, size, runs, kind, prefork_runs)


def _celery(report: Report, size: Size, runs: int, kind: str, prefork_runs: int) -> None:
    n = size.celery_noop

    def noop(variant: str, acks_late: bool = False, floor: bool = False) -> float:
        spans, _ = _measure(kind, variant, n, key=None, body=0.0, cap=300, acks_late=acks_late, floor=floor)
        return (n - 1) / (spans[-1].end - spans[0].start)

    # SingletonTask acks late (docs/concepts.md#leases); plain Celery acks early by default. The acks_late
    # baseline shows what that guarantee alone costs; the target is against the default.
    results = alternate(
        runs,
        [
            ("plain", lambda: noop("plain")),
            ("singleton", lambda: noop("singleton")),
            ("late", lambda: noop("plain", acks_late=True)),
            ("floor", lambda: noop("plain", acks_late=True, floor=True)),
        ]
        + [(tool, functools.partial(noop, tool)) for tool in OTHER_TOOLS],
    )
    case = f"8 Celery no-op ×{n:,}, distinct keys, {BROKERS[kind]} broker"
    _noop_rows(report, case, f"Celery no-op, {BROKERS[kind]} broker", results, f"celery.{kind}.noop")

    _prefork(report, n, prefork_runs, kind)

    b, body = size.celery_burst, size.burst_body
    ideal = b * body
    orders = BurstOrders()

    def burst(variant: str, start: str = "queued") -> float:
        spans, sent_at = _measure(kind, variant, b, key="burst", body=body, cap=120, start=start)
        if variant == "singleton":
            orders.record(start, spans, sent_at)
        return spans[-1].end - spans[0].start

    # Plain Celery runs the burst 8 at a time (no mutex): shown for the cost of the worker alone.
    results = alternate(
        runs,
        [("plain", functools.partial(burst, "plain"))]
        + [(start, functools.partial(burst, "singleton", start)) for start in BURST_STARTS],
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


# -- case 8, prefork form: a `celery worker --pool prefork` process ------------------------------
PREFORK_COMMAND = "celery worker --pool prefork"
CELERY = str(Path(sys.executable).with_name("celery"))
ROOT = Path(__file__).resolve().parent.parent


def _prefork_noop(
    kind: str,
    variant: str,
    n: int,
    *,
    env: Mapping[str, str] | None = None,
    starting: Callable[[], None] | None = None,
) -> float:
    """Runs/s of ``n`` no-op runs on distinct keys, queued before a prefork worker starts at
    Celery's defaults (one child per CPU); first body start → last body end.

    ``env``: more of the worker's environment; ``starting``: called as the worker is started,
    after the sends (``benchmarks.where`` measures from there).
    """
    from .celery_prefork_app import PreforkConfig, build
    from .defaults_cases import stop_process, wait_spans

    workdir = Path(tempfile.mkdtemp(prefix="bench-prefork-"))
    config = PreforkConfig(kind, variant, unique("q"), unique("ns"), str(workdir / "spans"))
    app, task = build(config)
    try:
        for i in range(n):
            task.delay(i)
        if variant == "singleton" and not gatekeeper_for(app).flush_confirms(60):
            raise RuntimeError("prefork: the confirms were not sent within 60 s")
        # Celery's defaults: none of its settings from this environment.
        defaults = {k: v for k, v in os.environ.items() if not k.upper().startswith("CELERY_")}
        command = [CELERY, "--app", "benchmarks.celery_prefork_app", "worker", "--pool", "prefork"]
        if starting is not None:
            starting()
        process = subprocess.Popen(
            [*command, "--loglevel", "WARNING", "--logfile", str(workdir / "worker.log")],
            env={**defaults, **config.env(), **(env or {})},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            spans = wait_spans(config.spans, n, 300, PREFORK_COMMAND)
        finally:
            stop_process(process)
        return (n - 1) / (spans[-1].end - spans[0].start)
    finally:
        _cleanup(app, kind)
        shutil.rmtree(workdir, ignore_errors=True)


def _prefork(report: Report, n: int, runs: int, kind: str) -> None:
    """Case 8's no-op on the prefork pool: plain, the floor and SingletonTask, alternating."""
    from .celery_prefork_app import VARIANTS

    results = alternate(
        runs, [(variant, functools.partial(_prefork_noop, kind, variant, n)) for variant in VARIANTS]
    )
    pool = f"`{PREFORK_COMMAND}` ({os.cpu_count()} children)"
    case = f"8 Celery no-op ×{n:,}, distinct keys, {BROKERS[kind]} broker, {pool}"
    _noop_rows(
        report, case, f"Celery no-op, prefork, {BROKERS[kind]} broker", results, f"celery.{kind}.prefork"
    )


def _noop_rows(report: Report, case: str, what: str, results: dict[str, list[float]], key: str) -> None:
    """Case 8's no-op rows of whichever variants ran (``results``), and its target."""
    notes = {
        "late": ("plain Celery, acks_late=True", "the delivery guarantee SingletonTask defaults to"),
        "floor": (
            "plain Celery, acks_late=True + 2 bare round trips",
            "a PING before and after each body: what the gate's 2 round trips cost",
        ),
        "singleton": ("SingletonTask", ""),
        **{
            tool: (name, "locks at .delay(), unlocks when the run ends; a duplicate is refused, never queued")
            for tool, name in OTHER_TOOLS.items()
        },
    }
    report.add(Row(case, "plain Celery", "runs/s", results["plain"], key=f"{key}.plain"))
    for variant, (name, note) in notes.items():
        if variant in results:
            report.add(
                Row(
                    case,
                    name,
                    "runs/s",
                    results[variant],
                    baseline="plain Celery",
                    key=f"{key}.{variant}",
                    note=note,
                )
            )
    floor_target(
        report,
        "8",
        what,
        results,
        round_trips=2,
        floor_name="floor: plain, acks_late + 2 round trips",
        others={tool: name for tool, name in OTHER_TOOLS.items() if tool in results},
    )


# -- case 13 on Celery: .delay() ------------------------------------------------------------
def case_celery_send(report: Report, n: int, runs: int, kinds: list[str]) -> None:
    """Producer side only: ``n`` ``.delay()`` calls in a loop, no worker; the singleton's time
    includes its confirms (batched off the caller's thread) until the last one was sent."""
    for kind in kinds:
        _celery_send(report, n, runs, kind)


def _celery_send(report: Report, n: int, runs: int, kind: str) -> None:
    cpu: dict[str, list[float]] = {}

    def once(variant: str) -> float:
        rig = Rig(kind, "plain" if variant == "floor" else variant, n, key=None, body=0.0)

        def flush() -> None:
            if variant == "singleton" and not gatekeeper_for(rig.app).flush_confirms(60):
                raise RuntimeError("the confirms were not sent within 60 s")

        try:
            per_second, cpu_per_send = timed_sends(n, rig.task.delay, flush, floor=variant == "floor")
            cpu.setdefault(variant, []).append(cpu_per_send)
            return per_second
        finally:
            rig.close()

    variants = ["plain", "singleton", "floor", *OTHER_TOOLS]
    rate = alternate(runs, [(variant, functools.partial(once, variant)) for variant in variants])
    case = f"13 Celery .delay() ×{n:,}, distinct keys, {BROKERS[kind]} broker"
    plain = "plain .delay()"
    names = {
        "plain": plain,
        "singleton": "SingletonTask .delay()",
        "floor": "plain .delay() + 1 bare round trip",
        **OTHER_TOOLS,
    }
    notes = {
        "singleton": "register on the caller's thread; confirms batched by the confirm thread (timed)",
        "floor": "a PING to the store's Redis per send: what the registration's round trip costs alone",
    }
    for variant, name in names.items():
        report.add(
            Row(
                case,
                name,
                "msgs/s",
                rate[variant],
                baseline=None if variant == "plain" else plain,
                key=f"celery.send.{kind}.{variant}",
                note=notes.get(variant, ""),
            )
        )
    add_cost_rows(
        report,
        case,
        "producer CPU per send",
        cpu,
        names,
        f"celery.send.{kind}.cpu",
        "this process, all threads",
    )

    floor_target(
        report, "13", f"Celery .delay(), {BROKERS[kind]} broker", rate, round_trips=1, others=OTHER_TOOLS
    )
