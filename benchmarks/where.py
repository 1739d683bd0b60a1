"""Where a hot path's time goes: the library's thread CPU per run, part by part, and the store's
Redis server time per run, beside the same figures for the path's floor.

    python -m benchmarks.where [--path noop|send|handoff] [--framework dramatiq|celery]
                               [--broker redis|rabbitmq] [--pool threads|prefork]
                               [-n 2000] [--rounds 3]

The case is that of ``python -m benchmarks`` (``noop``: case 1 or 8, no-op runs on distinct keys
in one worker process of 8 threads; ``send``: case 13, sends in a loop). Each round runs the
floor, then the singleton variant with every part below wrapped in a ``time.thread_time()``
timer: the parts are inclusive (a store call is also counted in the gatekeeper call that makes
it) and measured on the thread that runs them, so they add up to what the library costs that
thread, but not to the process's CPU (the framework's own threads, the broker's client, the
confirm thread's wake-ups). The timers themselves cost about 1 µs each. ``--pool prefork``
(the Celery no-op) times the same parts in the pool children of case 8's prefork form.

``handoff`` (Dramatiq's case 3) and ``burst`` (a one-key burst sent to a running worker: case 2
on Dramatiq, case 8's on Celery) split each handoff, from one body's end to the next body's
start, into stages between wall-clock stamps taken on entry to and return from the library's
calls on the holder's and the woken run's threads, beside a bare round trip to the store.
``-n`` is the handoffs (the runs of the burst) a round.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import click
import redis

from .common import STORE_REDIS_URL, BareRoundTrips, percentile, quiet_framework_logs

if TYPE_CHECKING:
    from .dramatiq_cases import Span

#: The parts timed, as (owner, attribute, label); an owner is imported when the part is timed.
PARTS: dict[str, list[tuple[str, str, str]]] = {
    "common": [
        ("singleton_tasks.runtime:Gatekeeper", "spec", "key and options (Gatekeeper.spec)"),
        ("singleton_tasks.runtime:Gatekeeper", "register", "register (Gatekeeper.register)"),
        ("singleton_tasks.runtime:Gatekeeper", "confirm_later", "confirm handed over (confirm_later)"),
        ("singleton_tasks.runtime:Gatekeeper", "claim", "claim (Gatekeeper.claim)"),
        ("singleton_tasks.runtime:Gatekeeper", "release", "release (Gatekeeper.release)"),
        ("singleton_tasks.stores.redis:RedisStore", "register", "  of which the store's register"),
        ("singleton_tasks.stores.redis:RedisStore", "claim", "  of which the store's claim"),
        ("singleton_tasks.stores.redis:RedisStore", "release", "  of which the store's release"),
        ("singleton_tasks.stores.redis:RedisStore", "confirm_many", "confirm batches (confirm thread)"),
        ("singleton_tasks.metrics", "observe_claim", "  of which metrics (claim)"),
        ("singleton_tasks.metrics", "observe_release", "  of which metrics (release)"),
    ],
    "dramatiq": [
        ("singleton_tasks.dramatiq:SingletonMiddleware", "before_enqueue", "hook: before_enqueue"),
        ("singleton_tasks.dramatiq:SingletonMiddleware", "after_enqueue", "hook: after_enqueue"),
        (
            "singleton_tasks.dramatiq:SingletonMiddleware",
            "before_process_message",
            "hook: before_process_message",
        ),
        ("singleton_tasks.dramatiq:SingletonMiddleware", "before_ack", "hook: before_ack (the release)"),
    ],
    "celery": [
        ("singleton_tasks.celery:SingletonTask", "apply_async", "hook: apply_async (all of the send)"),
        ("singleton_tasks.celery._task", "payload_to_register", "  of which the payload (encoding)"),
        ("singleton_tasks.celery:SingletonTask", "before_start", "hook: before_start"),
        ("singleton_tasks.runtime:Gatekeeper", "settle_or_retry", "hook: task_postrun's settle"),
    ],
}


#: The floor's bare round trip, timed in the floor's rounds.
FLOOR_PART = ("benchmarks.common:BareRoundTrips", "ping", "floor: one bare round trip (PING)")


def parts_of(framework: str, variant: str) -> list[tuple[str, str, str]]:
    """The parts timed in ``variant``'s rounds ("floor" or "singleton")."""
    return [FLOOR_PART] if variant == "floor" else [*PARTS["common"], *PARTS[framework]]


class Timers:
    """Thread CPU spent in each wrapped callable, summed over every thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self._lock = threading.Lock()

    def wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                with self._lock:
                    self.seconds[label] += spent
                    self.calls[label] += 1

        return timed


def _owner(path: str) -> Any:
    import importlib

    module, _, name = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, name) if name else owner


class Stamps:
    """Wall-clock moments (``perf_counter``) at which wrapped callables were entered and returned,
    with the thread that made each call."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, str, str, str]] = []  # (moment, label, "in" | "out", thread)
        self._lock = threading.Lock()

    def wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        def stamped(*args: Any, **kwargs: Any) -> Any:
            thread = threading.current_thread().name
            with self._lock:
                self.seen.append((time.perf_counter(), label, "in", thread))
            try:
                return function(*args, **kwargs)
            finally:
                with self._lock:
                    self.seen.append((time.perf_counter(), label, "out", thread))

        return stamped

    def moments(self, label: str, edge: str, thread: str, after: float, before: float) -> list[float]:
        """The moments of ``label``'s ``edge`` on ``thread`` inside ``[after, before]``, in order."""
        return sorted(
            t
            for t, lb, e, th in self.seen
            if lb == label and e == edge and th == thread and after <= t <= before
        )

    def calls(self, label: str) -> list[tuple[float, float, str]]:
        """Each call of ``label`` as (entered, returned, thread)."""
        entered: dict[str, float] = {}
        calls = []
        for t, lb, edge, thread in sorted(self.seen):
            if lb != label:
                continue
            if edge == "in":
                entered.setdefault(thread, t)
            elif thread in entered:
                calls.append((entered.pop(thread), t, thread))
        return calls


class _Wrapper(Protocol):
    def wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]: ...


@contextmanager
def timed_parts(parts: list[tuple[str, str, str]], timers: _Wrapper) -> Iterator[None]:
    """``parts`` wrapped while inside; put back after."""
    undo: list[Callable[[], None]] = []
    try:
        for path, attribute, label in parts:
            owner = _owner(path)
            original = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
            setattr(owner, attribute, timers.wrap(getattr(owner, attribute), label))
            undo.append(functools.partial(setattr, owner, attribute, original))
        yield
    finally:
        for put_back in reversed(undo):
            put_back()


class ServerTime:
    """The store's Redis server: CPU and script calls between two readings."""

    def __init__(self) -> None:
        self.client = redis.Redis.from_url(STORE_REDIS_URL)

    def reading(self) -> tuple[float, float, int]:
        cpu = self.client.info("cpu")
        stats = self.client.info("commandstats")
        # The store's scripts are functions (FCALL, Redis 7+); RedisBroker's are EVALSHA.
        scripts = stats.get("cmdstat_fcall", {})
        return (
            float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            float(scripts.get("usec", 0)) / 1e6,
            int(scripts.get("calls", 0)),
        )


def _dramatiq_noop(broker: str, variant: str, n: int, measure: _Measure) -> None:
    from .dramatiq_cases import cleanup, make_rig, send_all, worker

    rig = make_rig(broker, variant, n)
    try:
        send_all(rig, n)
        measure.start()
        with worker(rig):
            if not rig.recorder.done.wait(300):
                raise RuntimeError(f"only {len(rig.recorder.spans)}/{n} runs ran")
        measure.stop()
    finally:
        cleanup(rig)


def _dramatiq_send(broker: str, variant: str, n: int, measure: _Measure) -> None:
    from .common import timed_sends
    from .dramatiq_cases import cleanup, flush_confirms, make_rig

    rig = make_rig(broker, "plain" if variant == "floor" else variant, n)
    try:
        rig.actor.send(-1)
        measure.start()
        timed_sends(n, rig.actor.send, lambda: flush_confirms(rig), floor=variant == "floor")
        measure.stop()
    finally:
        cleanup(rig)


def _celery_noop(broker: str, variant: str, n: int, measure: _Measure) -> None:
    from . import celery_cases

    floor = variant == "floor"
    variant = "plain" if floor else variant
    rig = celery_cases.Rig(broker, variant, n, key=None, body=0.0, acks_late=floor, floor=floor)
    try:
        rig.send(n)
        measure.start()
        with celery_cases._worker(rig):
            if not rig.recorder.done.wait(300):
                raise RuntimeError(f"only {len(rig.recorder.spans)}/{n} runs ran")
        measure.stop()
    finally:
        rig.close()


def _celery_send(broker: str, variant: str, n: int, measure: _Measure) -> None:
    from singleton_tasks.celery import gatekeeper_for

    from . import celery_cases
    from .common import timed_sends

    floor = variant == "floor"
    rig = celery_cases.Rig(broker, "plain" if floor else variant, n, key=None, body=0.0)

    def flush() -> None:
        if not floor and not gatekeeper_for(rig.app).flush_confirms(60):
            raise RuntimeError("the confirms were not sent within 60 s")

    try:
        measure.start()
        timed_sends(n, rig.task.delay, flush, floor=floor)
        measure.stop()
    finally:
        rig.close()


def _celery_noop_prefork(broker: str, variant: str, n: int, measure: _Measure) -> None:
    from . import celery_cases
    from .celery_prefork_app import WHERE_ENV

    with tempfile.TemporaryDirectory(prefix="bench-where-") as directory:
        prefix = str(Path(directory) / "children")
        celery_cases._prefork_noop(broker, variant, n, env={WHERE_ENV: prefix}, starting=measure.start)
        measure.stop()
        # The pool children did the work: their CPU and timers, not this process's.
        measure.process = 0.0
        for path in Path(directory).glob("children.*"):
            child = json.loads(path.read_text())
            measure.process += child["process"]
            for label, seconds in child["seconds"].items():
                measure.timers.seconds[label] += seconds
                measure.timers.calls[label] += child["calls"][label]


#: Holds what ``time_pool_children`` wraps (collected, it would put the originals back).
_for_the_process_life = contextlib.ExitStack()


def time_pool_children(prefix: str, variant: str) -> None:
    """In a prefork worker's main process, before its pool forks: time ``variant``'s parts in
    every pool child, each writing its totals and its process CPU to ``prefix.<pid>`` as it
    exits (``worker_process_shutdown``, on the worker's warm shutdown)."""
    from celery import signals

    timers = Timers()
    _for_the_process_life.enter_context(timed_parts(parts_of("celery", variant), timers))

    def write_totals(**_: Any) -> None:
        totals = {"seconds": timers.seconds, "calls": timers.calls, "process": time.process_time()}
        Path(f"{prefix}.{os.getpid()}").write_text(json.dumps(totals))

    signals.worker_process_shutdown.connect(write_totals, weak=False)


class _Measure:
    """Process CPU and the store server's time across what ``start``/``stop`` enclose."""

    def __init__(self, server: ServerTime, timers: Timers) -> None:
        self.server = server
        self.timers = timers
        self.process = 0.0
        self.server_cpu = 0.0
        self.scripts = 0.0
        self.script_calls = 0

    def start(self) -> None:
        """From here: what ran before (the sends of a no-op case) is not counted."""
        self.timers.seconds.clear()
        self.timers.calls.clear()
        self._process0 = time.process_time()
        self._server0 = self.server.reading()

    def stop(self) -> None:
        cpu, scripts, calls = self.server.reading()
        self.process = time.process_time() - self._process0
        self.server_cpu = cpu - self._server0[0]
        self.scripts = scripts - self._server0[1]
        self.script_calls = calls - self._server0[2]


#: A handoff's moments after the holder's body ends, in the order they happen, until the woken
#: run's body starts: (what, (label, edge, side)). ``side`` "holder": the first such moment on the
#: holder's thread after its body ended; "woken": the last on the woken run's thread before its
#: body started.
Moments = list[tuple[str, tuple[str, str, str]]]

#: The store's calls in a handoff, stamped on both frameworks: what happens between the hook and
#: the call, and the call's round trip.
_STORE_CALLS = [
    ("singleton_tasks.stores.redis:RedisStore", "release", "release"),
    ("singleton_tasks.stores.redis:RedisStore", "claim", "claim"),
]
_RELEASE_MOMENTS = [
    ("the store's release is called", ("release", "in", "holder")),
    ("the store's release returns", ("release", "out", "holder")),
]
_CLAIM_MOMENTS = [
    ("the store's claim is called", ("claim", "in", "woken")),
    ("the store's claim returns", ("claim", "out", "woken")),
]

#: Per framework: the calls stamped (owner, attribute, label) and a handoff's moments.
HANDOFF: dict[str, tuple[list[tuple[str, str, str]], Moments]] = {
    "dramatiq": (
        [
            ("singleton_tasks.dramatiq:SingletonMiddleware", "before_ack", "settle"),
            *_STORE_CALLS,
            ("singleton_tasks.dramatiq", "fetch_for_this_worker", "fetch"),
            ("singleton_tasks.dramatiq:SingletonMiddleware", "before_process_message", "gate"),
        ],
        [
            ("its settle hook (before_ack) is entered", ("settle", "in", "holder")),
            *_RELEASE_MOMENTS,
            ("the wake is published (RedisBroker: fetched next)", ("fetch", "in", "holder")),
            ("this worker's fetch returns", ("fetch", "out", "holder")),
            ("the woken delivery reaches the gate", ("gate", "in", "woken")),
            *_CLAIM_MOMENTS,
        ],
    ),
    "celery": (
        [
            ("singleton_tasks.runtime:Gatekeeper", "settle_or_retry", "settle"),
            *_STORE_CALLS,
            ("singleton_tasks.celery._settle", "publish_wakes", "publish"),
            ("singleton_tasks.celery:SingletonTask", "before_start", "gate"),
        ],
        [
            ("its settle (task_postrun) is entered", ("settle", "in", "holder")),
            *_RELEASE_MOMENTS,
            ("the wake is published", ("publish", "out", "holder")),
            ("the woken delivery reaches the gate (before_start)", ("gate", "in", "woken")),
            *_CLAIM_MOMENTS,
        ],
    ),
}


def _spans_of(path: str, framework: str, broker: str, n: int, worker_timeout: int) -> list[Span]:
    """One round's bodies of one key, in start order: case 3's handoffs (Dramatiq) or a burst
    sent to a running worker (case 2 on Dramatiq, case 8's on Celery)."""
    from . import celery_cases, dramatiq_cases

    if path == "handoff":
        return dramatiq_cases.handoff_run(broker, n, dramatiq_cases.HANDOFF_BODY, worker_timeout)
    if framework == "dramatiq":
        return dramatiq_cases.burst_spans(broker, n, BURST_BODY, worker_timeout, "running")[0]
    return celery_cases._measure(
        broker, "singleton", n, key="burst", body=BURST_BODY, cap=120, start="running"
    )[0]


#: The body of each run of ``--path burst`` (s): the medium size's, which the README reports.
BURST_BODY = 0.02


def _handoffs(path: str, framework: str, broker: str, n: int, rounds: int, worker_timeout: int) -> None:
    from .dramatiq_cases import HANDOFF_BODY

    parts, moments = HANDOFF[framework]
    whole = "whole handoff (body end → next body start)"
    others = "other deliveries' gate hooks inside the gap (summed)"
    stages: dict[str, list[float]] = {what: [] for what, _ in moments}
    stages["the woken run's body starts"] = []
    stages[whole], stages[others] = [], []
    for _ in range(rounds):
        stamps = Stamps()
        with timed_parts(parts, stamps):
            spans = _spans_of(path, framework, broker, n, worker_timeout)
        gates = stamps.calls("gate")
        for held, woken in itertools.pairwise(spans):
            found: list[float | None] = [held.end]
            for _, (label, edge, side) in moments:
                holder = side == "holder"
                seen = stamps.moments(
                    label, edge, held.thread if holder else woken.thread, held.end, woken.start
                )
                found.append((seen[0] if holder else seen[-1]) if seen else None)
            found.append(woken.start)
            for what, (a, b) in zip(stages, itertools.pairwise(found), strict=False):
                if a is not None and b is not None:
                    stages[what].append((b - a) * 1000)
            stages[whole].append((woken.start - held.end) * 1000)
            own = max((c for c in gates if c[2] == woken.thread and c[0] <= woken.start), default=None)
            stages[others].append(
                sum(
                    max(0.0, min(end, woken.start) - max(begin, held.end))
                    for begin, end, thread in gates
                    if (begin, end, thread) != own
                )
                * 1000
            )
    body = HANDOFF_BODY if path == "handoff" else BURST_BODY
    stages["floor: a bare PING to the store's Redis, back to back"] = _bare_round_trips(500)
    # A handoff's first round trip meets a store (and a thread) idle for a body's length: on a VM,
    # waking them costs more than the round trip itself.
    after_idle = f"floor: a bare PING after {body * 1000:.0f} ms idle (a body's time)"
    stages[after_idle] = _bare_round_trips(200, idle=body)
    what_ran = "case 3's handoffs" if path == "handoff" else f"a one-key burst of {n} × {body * 1000:.0f} ms"
    timeout = f", worker_timeout {worker_timeout} ms" if framework == "dramatiq" else ""
    click.echo(f"{framework} {path}, {broker} broker{timeout}: {what_ran}, {rounds} rounds")
    click.echo(f"{'ms from the moment before, until':60} {'p50':>7} {'p90':>7} {'samples':>8}")
    for what, values in stages.items():
        if not values:
            continue  # a stage with no moment inside the handoff
        p50, p90 = percentile(values, 50), percentile(values, 90)
        click.echo(f"{what:60} {p50:7.3f} {p90:7.3f} {len(values):8}")


def _bare_round_trips(count: int, idle: float = 0.0) -> list[float]:
    """Ms of ``count`` of the floor's bare round trips, one at a time, each after ``idle`` seconds."""
    round_trips = BareRoundTrips()
    try:
        round_trips.ping()
        times = []
        for _ in range(count):
            if idle:
                time.sleep(idle)
            start = time.perf_counter()
            round_trips.ping()
            times.append((time.perf_counter() - start) * 1000)
        return times
    finally:
        round_trips.close()


CASES: dict[tuple[str, str], Callable[[str, str, int, _Measure], None]] = {
    ("dramatiq", "noop"): _dramatiq_noop,
    ("dramatiq", "send"): _dramatiq_send,
    ("celery", "noop"): _celery_noop,
    ("celery", "noop-prefork"): _celery_noop_prefork,
    ("celery", "send"): _celery_send,
}


@click.command()
@click.option(
    "--path",
    "path",
    type=click.Choice(["noop", "send", "handoff", "burst"]),
    default="noop",
    show_default=True,
)
@click.option("--framework", type=click.Choice(["dramatiq", "celery"]), default="dramatiq", show_default=True)
@click.option("--broker", type=click.Choice(["redis", "rabbitmq"]), default="redis", show_default=True)
@click.option("-n", "n", type=click.IntRange(min=100), default=2000, show_default=True, help="Runs a round.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--pool",
    type=click.Choice(["threads", "prefork"]),
    default="threads",
    show_default=True,
    help="Celery no-op: case 8 on its threads pool, or its prefork form (`celery worker --pool prefork`).",
)
@click.option(
    "--worker-timeout",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Dramatiq's worker_timeout (ms) for handoff and burst; the default is Dramatiq's.",
)
def main(path: str, framework: str, broker: str, n: int, rounds: int, pool: str, worker_timeout: int) -> None:
    """Print, per run, the thread CPU of each part of the library and the Redis server's time
    (``handoff``: the stages of each handoff)."""
    quiet_framework_logs()
    if path in ("handoff", "burst"):
        if path == "handoff" and framework != "dramatiq":
            raise click.UsageError("--path handoff is Dramatiq's case 3: use --path burst for Celery")
        _handoffs(path, framework, broker, n, rounds, worker_timeout)
        return
    if pool == "prefork" and (framework, path) != ("celery", "noop"):
        raise click.UsageError("--pool prefork is the Celery no-op's only")
    prefork = pool == "prefork"
    case = CASES[(framework, "noop-prefork" if prefork else path)]
    process = "the pool children's CPU" if prefork else "process CPU"
    server = ServerTime()
    per_run: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, list[float]] = collections.defaultdict(list)
    parts = {variant: parts_of(framework, variant) for variant in ("floor", "singleton")}
    for _ in range(rounds):
        for variant in ("floor", "singleton"):
            timers = Timers()
            measure = _Measure(server, timers)
            with timed_parts(parts[variant], timers):
                case(broker, variant, n, measure)
            per_run[f"{variant}: {process}"].append(measure.process / n * 1e6)
            per_run[f"{variant}: store server CPU"].append(measure.server_cpu / n * 1e6)
            scripts = f"{variant}: store scripts' execution (FCALL)"
            per_run[scripts].append(measure.scripts / n * 1e6)
            calls[scripts].append(measure.script_calls / n)
            for label, seconds in timers.seconds.items():
                per_run[label].append(seconds / n * 1e6)
                calls[label].append(timers.calls[label] / n)
    shape = f"{framework} {path}" + (", prefork pool" if prefork else "")
    click.echo(f"{shape}, {broker} broker, {n:,} runs × {rounds} rounds: medians per run")
    click.echo(f"{'':60} {'µs/run':>8} {'calls/run':>10}")
    order = [label for variant in parts.values() for _, _, label in variant]

    def rank(label: str) -> tuple[bool, int]:
        return label in order, order.index(label) if label in order else 0

    for label in sorted(per_run, key=rank):
        count = f"{statistics.median(calls[label]):10.2f}" if label in calls else ""
        click.echo(f"{label:60} {statistics.median(per_run[label]):8.1f} {count}")


if __name__ == "__main__":
    main()
