"""Dramatiq cases (1–4, 7): in-process ``dramatiq.Worker`` threads on real Redis / RabbitMQ brokers.

The worker runs in this process (1 process × 8 threads) so that body start/end times are read
from one clock with microsecond precision; the brokers and the store are the real servers.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import redis
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.brokers.redis import RedisBroker
from dramatiq.common import dq_name, xq_name
from dramatiq.middleware import Middleware, Retries
from dramatiq.rate_limits import ConcurrentRateLimiter
from dramatiq.rate_limits.backends import RedisBackend
from dramatiq.worker import Worker

from singleton_tasks.dramatiq import SingletonMiddleware
from singleton_tasks.outcomes import RunState

from .common import (
    BROKER_REDIS_URL,
    BURST_TARGET,
    RABBITMQ_URL,
    STORE_REDIS_URL,
    THREADS,
    BareRoundTrips,
    Report,
    Row,
    Size,
    floor_target,
    flush_redis,
    handoff_target,
    percentile,
    private_redis,
    private_redis_with_replica,
    timed_sends,
    unique,
    wait_until,
)

BROKERS = {"redis": "RedisBroker", "rabbitmq": "RabbitmqBroker"}
FLOOR_NAME = "plain + 2 bare round trips"
DEFAULT_WORKER_TIMEOUT = 1000  # ms, dramatiq's default


# -- harness ---------------------------------------------------------------------------------
@dataclass
class Span:
    index: int
    start: float
    end: float
    thread: str


class Recorder:
    """What the bodies did (perf_counter seconds); ``done`` is set after ``expected`` bodies.

    A body with a negative index is a warm-up: not recorded, it sets ``warmed`` when it ends.
    """

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.lock = threading.Lock()
        self.spans: list[Span] = []
        self.running = 0
        self.max_running = 0
        self.done = threading.Event()
        self.warmed = threading.Event()

    @contextlib.contextmanager
    def body(self, index: int) -> Iterator[None]:
        if index < 0:
            yield
            self.warmed.set()
            return
        start = time.perf_counter()
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        try:
            yield
        finally:
            end = time.perf_counter()
            with self.lock:
                self.running -= 1
                self.spans.append(Span(index, start, end, threading.current_thread().name))
                if len(self.spans) >= self.expected:
                    self.done.set()

    def ordered(self) -> list[Span]:
        with self.lock:
            return sorted(self.spans, key=lambda s: s.start)


def overlaps(spans: list[Span]) -> int:
    """Bodies that started before the previous one (in start order) ended."""
    ordered = sorted(spans, key=lambda s: s.start)
    count, last_end = 0, float("-inf")
    for span in ordered:
        if span.start < last_end:
            count += 1
        last_end = max(last_end, span.end)
    return count


def is_fifo(spans: list[Span]) -> bool:
    order = [s.index for s in sorted(spans, key=lambda s: s.start)]
    return order == sorted(order)


class Tally(Middleware):
    """Counts deliveries and publishes per message id (placed before the singleton middleware)."""

    def __init__(self) -> None:
        self.on_ack: Callable[[], object] | None = None
        self.lock = threading.Lock()
        self.deliveries: list[tuple[float, str]] = []
        self.publishes: list[tuple[float, str, int]] = []

    def before_process_message(self, broker: Any, message: Any) -> None:
        with self.lock:
            self.deliveries.append((time.perf_counter(), message.message_id))

    def after_enqueue(self, broker: Any, message: Any, delay: int | None) -> None:
        with self.lock:
            self.publishes.append((time.perf_counter(), message.message_id, delay or 0))

    def after_ack(self, broker: Any, message: Any) -> None:
        if self.on_ack is not None:
            self.on_ack()


class RoundTripFloor(Middleware):
    """Plain Dramatiq plus one bare round trip where the gate admits and one where it releases."""

    def __init__(self) -> None:
        self.round_trips = BareRoundTrips()

    def before_process_message(self, broker: Any, message: Any) -> None:
        self.round_trips.ping()

    def before_ack(self, broker: Any, message: Any) -> None:
        self.round_trips.ping()


@dataclass
class Rig:
    kind: str
    broker: Any
    queue: str
    actor: Any
    recorder: Recorder
    middleware: SingletonMiddleware | None = None
    tally: Tally | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def make_broker(kind: str, middleware: list[Middleware]) -> Any:
    if kind == "redis":
        return RedisBroker(url=BROKER_REDIS_URL, middleware=middleware)  # type: ignore[no-untyped-call]
    return RabbitmqBroker(url=RABBITMQ_URL, middleware=middleware)


def make_rig(
    kind: str,
    variant: str,
    expected: int,
    *,
    body_seconds: float = 0.0,
    key: str | None = None,
    singleton_options: dict[str, Any] | None = None,
    store_url: str = STORE_REDIS_URL,
    hold: threading.Event | None = None,
    tally: bool = False,
) -> Rig:
    """A fresh broker, queue and actor for one run of one variant.

    variant: ``plain`` (no middleware), ``singleton`` (SingletonMiddleware), ``floor`` (plain
    plus two bare store round trips per message), ``crl`` (ConcurrentRateLimiter in the body, no
    Retries) or ``crl+retries``.
    ``key``: None = a distinct key per message; otherwise one shared key.
    ``hold``: the body of message 0 waits for this event (a long-running holder).
    """
    recorder = Recorder(expected)
    queue = unique("bench")
    middleware: list[Middleware] = []
    counter = Tally() if tally else None
    if counter is not None:
        middleware.append(counter)
    singleton: SingletonMiddleware | None = None
    if variant == "singleton":
        singleton = SingletonMiddleware(store=store_url, namespace=unique("ns"), **(singleton_options or {}))
        middleware.append(singleton)
    floor: RoundTripFloor | None = None
    if variant == "floor":
        floor = RoundTripFloor()
        middleware.append(floor)
    if variant == "crl+retries":
        # A common configuration: retry a busy key after ~1 s, exponential back-off from there.
        middleware.append(Retries(max_retries=100, min_backoff=1000))
    broker = make_broker(kind, middleware)
    limiter_client: redis.Redis | None = None
    options: dict[str, Any] = {}
    if variant == "singleton":
        options["singleton"] = {"key": key if key is not None else "k:{i}", "limit": 1}
    prefix = unique("crl")
    if variant.startswith("crl"):
        limiter_client = redis.Redis.from_url(store_url)
        backend = RedisBackend(client=limiter_client)

    def body(i: int) -> None:
        if variant.startswith("crl"):
            mutex = ConcurrentRateLimiter(  # type: ignore[no-untyped-call]
                backend, f"{prefix}:{key if key is not None else i}", limit=1
            )
            with mutex.acquire():
                work(i)
        else:
            work(i)

    def work(i: int) -> None:
        with recorder.body(i):
            if hold is not None and i == 0:
                hold.wait(600)
            elif body_seconds:
                time.sleep(body_seconds)

    actor = dramatiq.actor(broker=broker, actor_name=unique("act"), queue_name=queue, **options)(body)
    rig = Rig(kind, broker, queue, actor, recorder, singleton, counter)
    rig.extra["limiter_client"] = limiter_client
    rig.extra["floor"] = floor
    return rig


@contextlib.contextmanager
def worker(rig: Rig, worker_timeout: int = DEFAULT_WORKER_TIMEOUT) -> Iterator[Worker]:
    w = Worker(rig.broker, worker_threads=THREADS, worker_timeout=worker_timeout)
    w.start()
    try:
        yield w
    finally:
        w.stop(timeout=30_000)


def cleanup(rig: Rig) -> None:
    if rig.kind == "redis":
        flush_redis(BROKER_REDIS_URL)
    else:
        with contextlib.suppress(Exception):
            channel = rig.broker.channel
            for name in (rig.queue, dq_name(rig.queue), xq_name(rig.queue)):
                channel.queue_delete(queue=name)
    with contextlib.suppress(Exception):
        rig.broker.close()
    client = rig.extra.get("limiter_client")
    if client is not None:
        client.close()
    floor = rig.extra.get("floor")
    if floor is not None:
        floor.round_trips.close()
    flush_redis(STORE_REDIS_URL)


def send_all(rig: Rig, n: int) -> tuple[float, list[str]]:
    """Publish runs 0..n-1 in order; returns (seconds, message ids).

    The time includes the confirms, which the producer's confirm thread sends in batches: all
    of them are sent before this returns (so none is counted as the worker's).
    """
    t0 = time.perf_counter()
    ids = [rig.actor.send(i).message_id for i in range(n)]
    flush_confirms(rig)
    return time.perf_counter() - t0, ids


def flush_confirms(rig: Rig) -> None:
    """Wait until the producer's confirm thread has sent every confirm of the sends so far."""
    if rig.middleware is not None and not rig.middleware.gatekeeper.flush_confirms(60):
        raise RuntimeError("the confirms were not sent within 60 s")


# -- case 1: no-op throughput, distinct keys ------------------------------------------------
def case_noop(report: Report, size: Size, runs: int, kinds: list[str]) -> None:
    for kind in kinds:
        _noop(report, size.noop, runs, kind)


def _noop(report: Report, n: int, runs: int, kind: str) -> None:
    enqueue: dict[str, list[float]] = {}
    # CPU per run (this process, and the Redis server: the store, and the broker on RedisBroker)
    # does not depend on what else the machine runs, unlike throughput.
    cpu: dict[str, list[float]] = {}
    server_cpu: dict[str, list[float]] = {}
    server = redis.Redis.from_url(STORE_REDIS_URL)

    def server_seconds() -> float:
        info = server.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def run(variant: str) -> Callable[[], float | None]:
        def once() -> float:
            rig = make_rig(kind, variant, n)
            try:
                seconds, _ = send_all(rig, n)
                enqueue.setdefault(variant, []).append(n / seconds)
                cpu0, server0 = time.process_time(), server_seconds()
                with worker(rig):
                    t0 = time.perf_counter()
                    if not rig.recorder.done.wait(300):
                        raise RuntimeError(f"no-op {variant}: only {len(rig.recorder.spans)}/{n} ran")
                    t1 = max(s.end for s in rig.recorder.spans)
                    cpu.setdefault(variant, []).append((time.process_time() - cpu0) / n * 1e6)
                    server_cpu.setdefault(variant, []).append((server_seconds() - server0) / n * 1e6)
                return n / (t1 - t0)
            finally:
                cleanup(rig)

        return once

    from .common import alternate

    results = alternate(
        runs,
        [(variant, run(variant)) for variant in ("plain", "singleton", "floor", "crl")],
    )
    case = f"1 no-op ×{n:,}, distinct keys, {BROKERS[kind]}"
    key = "noop" if kind == "redis" else f"noop.{kind}"
    report.add(Row(case, "plain Dramatiq (no middleware)", "runs/s", results["plain"], key=f"{key}.plain"))
    report.add(
        Row(
            case,
            "SingletonMiddleware",
            "runs/s",
            results["singleton"],
            baseline="plain Dramatiq (no middleware)",
            key=f"{key}.singleton",
        )
    )
    report.add(
        Row(
            case,
            FLOOR_NAME,
            "runs/s",
            results["floor"],
            baseline="plain Dramatiq (no middleware)",
            key=f"{key}.floor",
            note="a PING where the gate admits and one where it releases: what 2 round trips cost",
        )
    )
    report.add(
        Row(
            case,
            "ConcurrentRateLimiter per key",
            "runs/s",
            results["crl"],
            baseline="plain Dramatiq (no middleware)",
            key=f"{key}.crl",
        )
    )
    report.add(
        Row(
            case,
            "enqueue: plain .send()",
            "msgs/s",
            enqueue["plain"],
            key=f"{key}.enq.plain",
            note="producer side, before the worker starts",
        )
    )
    report.add(
        Row(
            case,
            "enqueue: singleton .send()",
            "msgs/s",
            enqueue["singleton"],
            baseline="enqueue: plain .send()",
            key=f"{key}.enq.singleton",
            note="register per send; confirms batched off the caller's thread",
        )
    )
    names = {
        "plain": "plain Dramatiq",
        "singleton": "SingletonMiddleware",
        "floor": FLOOR_NAME,
        "crl": "ConcurrentRateLimiter",
    }
    measures = [
        ("worker CPU per run", cpu, "worker process, all threads"),
        (
            "Redis server CPU per run",
            server_cpu,
            "broker and store share the server" if kind == "redis" else "the store's server",
        ),
    ]
    for what, values, note in measures:
        add_cost_rows(report, case, what, values, names, f"{key}.{what.split()[0].lower()}_cpu", note)
    server.close()
    floor_target(
        report,
        "1",
        f"Dramatiq no-op, {BROKERS[kind]}",
        results,
        round_trips=2,
        others={"crl": "ConcurrentRateLimiter"},
    )


def add_cost_rows(
    report: Report,
    case: str,
    what: str,
    values: dict[str, list[float]],
    names: dict[str, str],
    key: str,
    note: str,
) -> None:
    """One row of ``what`` (µs, lower is better) per variant, each against the ``plain`` variant's."""
    for variant, name in names.items():
        report.add(
            Row(
                case,
                f"{what}: {name}",
                "µs",
                values[variant],
                baseline=None if variant == "plain" else f"{what}: {names['plain']}",
                higher_is_better=False,
                key=f"{key}.{variant}",
                note=note,
            )
        )


# -- case 13: .send() of a singleton actor vs plain ------------------------------------------
def case_send(report: Report, size: Size, runs: int, kinds: list[str]) -> None:
    """Producer side only: ``n`` sends in a loop, no worker; the singleton's time includes its
    confirms (batched off the caller's thread) until the last one was sent."""
    n = size.noop
    for kind in kinds:
        _send(report, n, runs, kind)


def _send(report: Report, n: int, runs: int, kind: str) -> None:
    rate: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def run(variant: str) -> Callable[[], float | None]:
        def once() -> float:
            rig = make_rig(kind, "plain" if variant == "floor" else variant, n)
            try:
                per_second, cpu_per_send = timed_sends(
                    n, rig.actor.send, lambda: flush_confirms(rig), floor=variant == "floor"
                )
                cpu.setdefault(variant, []).append(cpu_per_send)
                rate.setdefault(variant, []).append(per_second)
                return per_second
            finally:
                cleanup(rig)

        return once

    from .common import alternate

    alternate(runs, [(variant, run(variant)) for variant in ("plain", "singleton", "floor")])
    case = f"13 .send() ×{n:,}, distinct keys, {'RedisBroker' if kind == 'redis' else 'RabbitmqBroker'}"
    plain = "plain .send()"
    report.add(Row(case, plain, "msgs/s", rate["plain"], key=f"send.{kind}.plain"))
    report.add(
        Row(
            case,
            "singleton .send()",
            "msgs/s",
            rate["singleton"],
            baseline=plain,
            key=f"send.{kind}.singleton",
            note="register on the caller's thread; confirms batched by the confirm thread (timed)",
        )
    )
    report.add(
        Row(
            case,
            "plain .send() + 1 bare round trip",
            "msgs/s",
            rate["floor"],
            baseline=plain,
            key=f"send.{kind}.floor",
            note="a PING to the store's Redis per send: what the registration's round trip costs alone",
        )
    )
    names = {"plain": plain, "singleton": "singleton .send()"}
    add_cost_rows(
        report, case, "producer CPU per send", cpu, names, f"send.{kind}.cpu", "this process, all threads"
    )
    floor_target(report, "13", f"Dramatiq .send(), {BROKERS[kind]}", rate, round_trips=1)


# -- case 9: wait_replicas ------------------------------------------------------------------
WAIT_OPTIONS = "wait_replicas=1&wait_timeout_ms=1000"


def case_replicas(report: Report, size: Size, runs: int) -> None:
    """Case 1's no-op runs on a store whose primary has one replica, without and with WAIT."""
    n = size.noop
    enqueue: dict[str, list[float]] = {}
    with private_redis_with_replica() as primary_url:
        urls = {"no wait": primary_url, "wait_replicas=1": f"{primary_url}?{WAIT_OPTIONS}"}

        def run(variant: str) -> Callable[[], float | None]:
            def once() -> float:
                rig = make_rig("redis", "singleton", n, store_url=urls[variant])
                try:
                    seconds, _ = send_all(rig, n)
                    enqueue.setdefault(variant, []).append(n / seconds)
                    with worker(rig):
                        t0 = time.perf_counter()
                        if not rig.recorder.done.wait(300):
                            raise RuntimeError(f"replicas {variant}: only {len(rig.recorder.spans)}/{n} ran")
                        t1 = max(s.end for s in rig.recorder.spans)
                    return n / (t1 - t0)
                finally:
                    cleanup(rig)

            return once

        from .common import alternate

        results = alternate(runs, [(variant, run(variant)) for variant in urls])
    case = f"9 no-op ×{n:,}, store primary with 1 replica"
    report.add(Row(case, "SingletonMiddleware, no wait", "runs/s", results["no wait"], key="replicas.nowait"))
    report.add(
        Row(
            case,
            "SingletonMiddleware, wait_replicas=1",
            "runs/s",
            results["wait_replicas=1"],
            baseline="SingletonMiddleware, no wait",
            key="replicas.wait",
            note=f"?{WAIT_OPTIONS}: a WAIT behind every write, same round trip",
        )
    )
    report.add(Row(case, "enqueue, no wait", "msgs/s", enqueue["no wait"], key="replicas.enq.nowait"))
    report.add(
        Row(
            case,
            "enqueue, wait_replicas=1",
            "msgs/s",
            enqueue["wait_replicas=1"],
            baseline="enqueue, no wait",
            key="replicas.enq.wait",
            note="register per send and batched confirms, each write acknowledged by the replica",
        )
    )


# -- case 2: same-key burst -----------------------------------------------------------------
def case_burst(report: Report, size: Size, runs: int, kinds: list[str], worker_timeout: int) -> None:
    for kind in kinds:
        _burst(report, size, runs, kind, worker_timeout)


#: How a burst meets its worker: queued before the worker starts (its connections open and its
#: prefetch fills inside the burst), or sent to a worker that has already run a warm-up.
BURST_STARTS = {"queued": "queued before the worker starts", "running": "sent to a running worker"}


def warm_up(recorder: Recorder, send: Callable[[], object]) -> None:
    """Run one warm-up body (index -1) through a started worker and wait for it to end."""
    send()
    if not recorder.warmed.wait(60):
        raise RuntimeError("the warm-up run did not finish in 60 s")


@dataclass
class BurstOrders:
    """Per burst form: whether each run's bodies started in send order, and how many overlapped."""

    fifo: dict[str, list[bool]] = field(default_factory=lambda: {s: [] for s in BURST_STARTS})
    overlap_counts: dict[str, list[int]] = field(default_factory=lambda: {s: [] for s in BURST_STARTS})
    #: Per form, ms from the first send to the first body's start: the worker's pickup after
    #: idling, which plain pays too; the makespan starts after it (at the first body).
    pickups: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in BURST_STARTS})

    def record(self, start: str, spans: list[Span], sent_at: float | None = None) -> None:
        self.fifo[start].append(is_fifo(spans))
        self.overlap_counts[start].append(overlaps(spans))
        if sent_at is not None:
            self.pickups[start].append((spans[0].start - sent_at) * 1000)

    def note(self, start: str) -> str:
        fifo = self.fifo[start]
        return f"FIFO {sum(fifo)}/{len(fifo)} runs, overlaps {sum(self.overlap_counts[start])}"

    def kept(self, start: str) -> bool:
        return all(self.fifo[start]) and not any(self.overlap_counts[start])


def add_burst_rows(
    report: Report,
    *,
    case: str,
    subject: str,
    key: str,
    target: tuple[str, str],
    results: dict[str, list[float]],
    ideal: float,
    orders: BurstOrders,
    starts: dict[str, str] | None = None,
) -> None:
    """The subject's row and target for each way a burst meets its worker (``BURST_STARTS``)."""
    for start, label in (starts or BURST_STARTS).items():
        order = orders.note(start)
        report.add(
            Row(
                case,
                f"{subject}, {label}",
                "s",
                results[start],
                baseline="ideal",
                higher_is_better=False,
                key=f"{key}.{start}",
                note=order,
            )
        )
        if orders.pickups[start]:
            report.add(
                Row(
                    case,
                    f"pickup, {label}: first send → first body start",
                    "ms",
                    orders.pickups[start],
                    higher_is_better=False,
                    key=f"{key}.{start}.pickup",
                    note="before the makespan starts; a plain worker pays it too",
                )
            )
        ratio = statistics.median(results[start]) / ideal
        ok = ratio <= BURST_TARGET and orders.kept(start)
        report.target(
            target[0],
            f"{target[1]}, {label}: ≤ {BURST_TARGET:.2f}× ideal, FIFO, 0 overlaps",
            f"{ratio:.2f}×, {order}",
            ok,
        )


def burst_spans(
    kind: str, n: int, body: float, worker_timeout: int, start: str
) -> tuple[list[Span], float | None]:
    """The bodies of one same-key burst of ``n`` (``start``: one of ``BURST_STARTS``), in start
    order, and, sent to a running worker, when the first was sent."""
    rig = make_rig(kind, "singleton", n, body_seconds=body, key="burst")
    try:
        if start == "queued":
            send_all(rig, n)
        with worker(rig, worker_timeout):
            sent_at = None
            if start == "running":
                warm_up(rig.recorder, lambda: rig.actor.send(-1))
                sent_at = time.perf_counter()
                send_all(rig, n)
            if not rig.recorder.done.wait(120):
                raise RuntimeError(f"burst: only {len(rig.recorder.spans)}/{n} ran")
            return rig.recorder.ordered(), sent_at
    finally:
        cleanup(rig)


def _burst(report: Report, size: Size, runs: int, kind: str, worker_timeout: int) -> None:
    n, body = size.burst, size.burst_body
    ideal = n * body
    orders = BurstOrders()
    base_done: list[int] = []
    base_fifo: list[bool] = []
    base_overlap: list[int] = []

    def subject(start: str) -> float:
        spans, sent_at = burst_spans(kind, n, body, worker_timeout, start)
        makespan = max(s.end for s in spans) - spans[0].start
        orders.record(start, spans, sent_at)
        if start == "queued":
            report.plots[f"burst.{kind}.singleton"] = (spans[0].start, spans)
        return makespan

    def baseline() -> float | None:
        rig = make_rig(kind, "crl+retries", n, body_seconds=body, key="burst")
        try:
            send_all(rig, n)
            with worker(rig, worker_timeout):
                t0 = time.perf_counter()
                finished = rig.recorder.done.wait(size.baseline_cap)
                spans = rig.recorder.ordered()
            base_done.append(len(spans))
            base_fifo.append(is_fifo(spans))
            base_overlap.append(overlaps(spans))
            report.plots[f"burst.{kind}.crl"] = (spans[0].start if spans else t0, spans)
            return (max(s.end for s in spans) - spans[0].start) if finished else None
        finally:
            cleanup(rig)

    from .common import alternate

    results = alternate(
        runs,
        [("crl", baseline)] + [(start, functools.partial(subject, start)) for start in BURST_STARTS],
    )
    timeout = f", worker_timeout={worker_timeout} ms" if kind == "redis" else ""
    case = f"2 burst {n}×{body * 1000:.0f} ms, one key, {BROKERS[kind]}{timeout}"
    report.add(
        Row(
            case,
            "ideal",
            "s",
            [ideal],
            key=f"burst.{kind}.ideal",
            note="n × body; makespan = first body start → last body end",
        )
    )
    add_burst_rows(
        report,
        case=case,
        subject="SingletonMiddleware",
        key=f"burst.{kind}",
        target=("2", f"burst on {BROKERS[kind]}{timeout}"),
        results=results,
        ideal=ideal,
        orders=orders,
    )
    unfinished = len(base_done) - len(results["crl"])
    text = (
        None
        if not unfinished
        else (f"did not finish in {size.baseline_cap:.0f} s ({unfinished}/{len(base_done)} runs)")
    )
    report.add(
        Row(
            case,
            "ConcurrentRateLimiter + Retries",
            "s",
            results["crl"],
            baseline="ideal",
            higher_is_better=False,
            key=f"burst.{kind}.crl",
            text=text,
            note=(
                f"bodies done per run {min(base_done)}–{max(base_done)}/{n}; "
                f"FIFO {sum(base_fifo)}/{len(base_fifo)}; overlaps {sum(base_overlap)}"
            ),
        )
    )


# -- case 3: handoff latency ----------------------------------------------------------------
def handoff_run(
    kind: str,
    handoffs: int,
    body: float,
    worker_timeout: int,
    singleton_options: dict[str, Any] | None = None,
) -> list[Span]:
    """The bodies of one key, in start order: run 0 holds until every other run is gated, then
    each release hands off (:func:`handoff_latencies`)."""
    n = handoffs + 1
    hold = threading.Event()
    rig = make_rig(
        kind, "singleton", n, body_seconds=body, key="handoff", hold=hold, singleton_options=singleton_options
    )
    assert rig.middleware is not None
    try:
        send_all(rig, n)
        with worker(rig, worker_timeout):
            store = rig.middleware.store

            def all_gated() -> bool:
                snaps = store.snapshot(scope=rig.actor.actor_name, key="handoff")
                return bool(snaps) and sum(w.state is RunState.GATED for w in snaps[0].waiters) >= n - 1

            if not wait_until(all_gated, 120, 0.05):
                raise RuntimeError("handoff: the waiters were not all gated in time")
            hold.set()
            if not rig.recorder.done.wait(600):
                raise RuntimeError(f"handoff: only {len(rig.recorder.spans)}/{n} ran")
            spans = rig.recorder.ordered()
        if overlaps(spans):
            raise RuntimeError("handoff: overlapping bodies")
        return spans
    finally:
        cleanup(rig)


def handoff_latencies(spans: list[Span]) -> list[float]:
    """Ms from the end of one body to the start of the next: the release round trip, the wake
    publish, the broker fetch and the next claim."""
    return [(b.start - a.end) * 1000 for a, b in itertools.pairwise(spans)]


def idle_polls(worker_timeout: int, seconds: float = 2.0) -> float | None:
    """Broker commands per second of one idle worker (RedisBroker on a private redis-server)."""
    with private_redis() as (url, private):
        if not private:
            return None  # the shared server's other clients would be counted too
        broker = RedisBroker(url=url, middleware=[])  # type: ignore[no-untyped-call]

        def idle() -> None:
            pass

        dramatiq.actor(broker=broker, actor_name=unique("idle"), queue_name=unique("idle"))(idle)
        client = redis.Redis.from_url(url)
        w = Worker(broker, worker_threads=THREADS, worker_timeout=worker_timeout)
        w.start()
        try:
            time.sleep(max(0.5, 3 * worker_timeout / 1000))  # let the back-off reach its ceiling
            a = _commandstats(client)
            time.sleep(seconds)
            b = _commandstats(client)
        finally:
            w.stop(timeout=30_000)
            client.close()
            broker.close()
    delta = _delta(a, b)
    return sum(v for k, v in delta.items() if k in ("evalsha", "eval")) / seconds


#: The body of each run of case 3 (s).
HANDOFF_BODY = 0.02


def case_handoff(report: Report, size: Size, kinds: list[str], timeouts: list[int]) -> None:
    body = HANDOFF_BODY
    idle_seconds = 1.0 if size.name == "small" else 3.0
    if "redis" in kinds:
        case = "3 idle RedisBroker worker: fetch scripts/s (private redis-server)"
        for wt in timeouts:
            polls = idle_polls(wt, idle_seconds)
            if polls is not None:
                report.add(
                    Row(
                        case,
                        f"worker_timeout={wt} ms",
                        "cmds/s",
                        [polls],
                        higher_is_better=False,
                        key=f"idle.{wt}",
                        note="the price of a short worker_timeout while idle",
                    )
                )
    for kind in kinds:
        for wt in timeouts if kind == "redis" else [DEFAULT_WORKER_TIMEOUT]:
            latencies = handoff_latencies(handoff_run(kind, size.handoffs, body, wt))
            label = f"worker_timeout={wt} ms" + (" (default)" if wt == DEFAULT_WORKER_TIMEOUT else "")
            case = f"3 handoff ×{size.handoffs} (body {body * 1000:.0f} ms), {BROKERS[kind]}"
            p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
            report.add(
                Row(
                    case,
                    label,
                    "ms",
                    latencies,
                    higher_is_better=False,
                    key=f"handoff.{kind}.{wt}",
                    note=f"p50 {p50:.2f}, p99 {p99:.2f}, max {max(latencies):.1f} ms (samples)",
                )
            )
            report.plots[f"handoff.{kind}.{wt}"] = latencies
            handoff_target(report, "3", f"{BROKERS[kind]} {label}", latencies)


# -- case 4: store round trips per uncontended run ------------------------------------------
_HANDSHAKE = {"client|setinfo", "hello", "select", "auth", "client|setname", "info", "ping"}


def _commandstats(client: redis.Redis) -> dict[str, int]:
    stats: dict[str, Any] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) - a.get(k, 0)}


def case_round_trips(report: Report, size: Size) -> None:
    """Count the store's commands on a private redis-server (INFO commandstats deltas).

    Commands run inside a Lua script are counted by Redis too, so round trips are the
    FCALL (or EVALSHA) calls; the scripts are loaded first so that no load or retry is counted.
    """
    n = size.round_trip_runs
    with private_redis() as (url, private):
        client = redis.Redis.from_url(url)
        rig = make_rig("redis", "singleton", n, store_url=url, tally=True)
        assert rig.middleware is not None and rig.tally is not None
        acked = threading.Semaphore(0)
        rig.tally.on_ack = acked.release
        try:
            _warm_scripts(rig.middleware.store)
            a = _commandstats(client)
            send_all(rig, n)
            b = _commandstats(client)
            with worker(rig):
                for _ in range(n):  # the release happens before the ack
                    if not acked.acquire(timeout=120):
                        raise RuntimeError("round trips: runs did not finish")
                c = _commandstats(client)
        finally:
            cleanup(rig)
            client.close()
    producer, consumer = _delta(a, b), _delta(b, c)
    scripted = ("fcall", "evalsha", "eval")
    per_run = sum(consumer.get(k, 0) for k in scripted) / n
    p_per_run = sum(producer.get(k, 0) for k in scripted) / n
    top = {k: v for k, v in consumer.items() if k not in _HANDSHAKE and k not in scripted}
    where = "private redis-server" if private else "shared Redis: other clients add noise"
    case = f"4 store round trips per uncontended run ({n} runs, RedisBroker)"
    report.add(
        Row(
            case,
            "worker side (FCALL calls)",
            "RT/run",
            [per_run],
            higher_is_better=False,
            key="rt.worker",
            note=f"{where}; boot: {consumer.get('get', 0)} GET (schema check); "
            f"commands inside the scripts: {sum(top.values()) / n:.0f}/run",
        )
    )
    report.add(
        Row(
            case,
            "producer side (FCALL calls)",
            "RT/run",
            [p_per_run],
            higher_is_better=False,
            key="rt.producer",
            note="register at .send(), confirm from the confirm thread: one FCALL each, "
            "the confirms sent in batches (one write each)",
        )
    )
    report.target(
        "4",
        "worker-side store round trips per uncontended run = 2",
        f"{per_run:.2f}",
        abs(per_run - 2) < 0.01,
    )


def _warm_scripts(store: Any) -> None:
    """Load every script once (an uncontended run on a throw-away key) before counting."""
    from singleton_tasks.outcomes import RunSpec

    spec = RunSpec(scope="warm", key=unique("warm"), run_id=unique("run"))
    store.migrate()
    store.register(spec, confirmed=False)
    store.confirm(spec.scope, spec.key, spec.run_id)
    outcome = store.claim(spec, 0, None)
    store.release(spec.scope, spec.key, spec.run_id, token=outcome.token)


# -- case 7: back-of-line waiters -----------------------------------------------------------
def backline_run(size: Size, seed: bool, waiters: int, worker_timeout: int) -> dict[str, float]:
    scale = size.hold / 60.0  # 1.0 at full size: real seconds; smaller sizes run in scaled time
    delay = 1.0 * scale
    options = {
        "retry_delay": delay,
        "retry_jitter": 0.25 * scale,
        # The seed re-checked every waiter at the fixed retry delay.
        "max_retry_delay": delay if seed else 10.0 * scale,
    }
    hold = threading.Event()
    rig = make_rig(
        "redis", "singleton", waiters + 1, key="backline", hold=hold, singleton_options=options, tally=True
    )
    assert rig.tally is not None
    try:
        _, ids = send_all(rig, waiters + 1)
        with worker(rig, worker_timeout):
            if not wait_until(lambda: bool(rig.recorder.running), 30, 0.005):
                raise RuntimeError("back-of-line: holder did not start")
            started = time.perf_counter()
            time.sleep(size.hold)
            hold.set()
            if not rig.recorder.done.wait(120):
                raise RuntimeError("back-of-line: waiters did not all run")
            spans = rig.recorder.ordered()
        holder, nxt = spans[0], spans[1]
        window = holder.end - started

        def rechecks(message_id: str) -> int:
            times = sorted(t for t, mid in rig.tally.deliveries if mid == message_id)  # type: ignore[union-attr]
            return sum(1 for t in times[1:] if started <= t <= holder.end)  # the first is the original send

        per_minute = 60.0 * scale / window
        total = sum(1 for t, _ in rig.tally.deliveries if started <= t <= holder.end)
        return {
            "back": rechecks(ids[-1]) * per_minute,
            "head": rechecks(ids[1]) * per_minute,
            "all": total * per_minute,
            "handoff": (nxt.start - holder.end) * 1000,
        }
    finally:
        cleanup(rig)


def case_backline(report: Report, size: Size, runs: int, worker_timeouts: list[int]) -> None:
    waiters = 10
    scale = size.hold / 60.0
    for wt in worker_timeouts:
        seed_runs: list[dict[str, float]] = []
        subject_runs: list[dict[str, float]] = []
        for _ in range(runs):
            seed_runs.append(backline_run(size, True, waiters, wt))
            subject_runs.append(backline_run(size, False, waiters, wt))
        case = f"7 {waiters} waiters behind a {size.hold:.0f} s holder, RedisBroker, worker_timeout={wt} ms"
        for label, key, unit in (
            ("back-of-line waiter", "back", "msgs/min"),
            ("head-of-line waiter", "head", "msgs/min"),
            ("all waiters", "all", "msgs/min"),
            ("handoff after the hold", "handoff", "ms"),
        ):
            seed_label = f"{label}: seed (fixed {1.0:.0f} s re-check)"
            report.add(
                Row(
                    case,
                    seed_label,
                    unit,
                    [r[key] for r in seed_runs],
                    higher_is_better=False,
                    key=f"backline.{wt}.seed.{key}",
                )
            )
            report.add(
                Row(
                    case,
                    f"{label}: max_retry_delay back-off",
                    unit,
                    [r[key] for r in subject_runs],
                    baseline=seed_label,
                    higher_is_better=False,
                    key=f"backline.{wt}.subject.{key}",
                )
            )
        back = statistics.median(r["back"] for r in subject_runs)
        h_seed = statistics.median(r["handoff"] for r in seed_runs)
        h_sub = statistics.median(r["handoff"] for r in subject_runs)
        report.target(
            "7",
            f"back-of-line ≤ 6 msgs/min, handoff unchanged (worker_timeout={wt} ms)",
            f"{back:.1f}/min; handoff {h_sub:.1f} ms vs seed {h_seed:.1f} ms",
            back <= 6 and h_sub <= max(h_seed * 1.5, h_seed + 5),
        )
    if scale != 1.0:
        report.notes.append(
            f"case 7 ran in scaled time ×{scale:.3g}: hold {size.hold:.0f} s, retry_delay {scale:.3g} s, "
            f"max_retry_delay {10 * scale:.3g} s; messages are counted over the hold and reported per "
            f"scaled minute ({60 * scale:.3g} s), i.e. extrapolated to a 60 s hold at 1 s / 10 s delays."
        )
