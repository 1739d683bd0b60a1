"""Where a hot path's time goes: the library's thread CPU per run, part by part, and the store's
Redis server time per run, beside the same figures for the path's floor.

    python -m benchmarks.where [--path noop|send] [--framework dramatiq|celery]
                               [--broker redis|rabbitmq] [-n 2000] [--rounds 3]

The case is that of ``python -m benchmarks`` (``noop``: case 1 or 8, no-op runs on distinct keys
in one worker process of 8 threads; ``send``: case 13, sends in a loop). Each round runs the
floor, then the singleton variant with every part below wrapped in a ``time.thread_time()``
timer: the parts are inclusive (a store call is also counted in the gatekeeper call that makes
it) and measured on the thread that runs them, so they add up to what the library costs that
thread, but not to the process's CPU (the framework's own threads, the broker's client, the
confirm thread's wake-ups). The timers themselves cost about 1 µs each.
"""

from __future__ import annotations

import collections
import functools
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click
import redis

from .common import STORE_REDIS_URL, quiet_framework_logs

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


@contextmanager
def timed_parts(parts: list[tuple[str, str, str]], timers: Timers) -> Iterator[None]:
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


CASES: dict[tuple[str, str], Callable[[str, str, int, _Measure], None]] = {
    ("dramatiq", "noop"): _dramatiq_noop,
    ("dramatiq", "send"): _dramatiq_send,
    ("celery", "noop"): _celery_noop,
    ("celery", "send"): _celery_send,
}


@click.command()
@click.option("--path", "path", type=click.Choice(["noop", "send"]), default="noop", show_default=True)
@click.option("--framework", type=click.Choice(["dramatiq", "celery"]), default="dramatiq", show_default=True)
@click.option("--broker", type=click.Choice(["redis", "rabbitmq"]), default="redis", show_default=True)
@click.option("-n", "n", type=click.IntRange(min=100), default=2000, show_default=True, help="Runs a round.")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
def main(path: str, framework: str, broker: str, n: int, rounds: int) -> None:
    """Print, per run, the thread CPU of each part of the library and the Redis server's time."""
    quiet_framework_logs()
    case = CASES[(framework, path)]
    server = ServerTime()
    per_run: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, list[float]] = collections.defaultdict(list)
    parts = {"floor": [FLOOR_PART], "singleton": [*PARTS["common"], *PARTS[framework]]}
    for _ in range(rounds):
        for variant in ("floor", "singleton"):
            timers = Timers()
            measure = _Measure(server, timers)
            with timed_parts(parts[variant], timers):
                case(broker, variant, n, measure)
            per_run[f"{variant}: process CPU"].append(measure.process / n * 1e6)
            per_run[f"{variant}: store server CPU"].append(measure.server_cpu / n * 1e6)
            scripts = f"{variant}: store scripts' execution (FCALL)"
            per_run[scripts].append(measure.scripts / n * 1e6)
            calls[scripts].append(measure.script_calls / n)
            for label, seconds in timers.seconds.items():
                per_run[label].append(seconds / n * 1e6)
                calls[label].append(timers.calls[label] / n)
    click.echo(f"{framework} {path}, {broker} broker, {n:,} runs × {rounds} rounds: medians per run")
    click.echo(f"{'':60} {'µs/run':>8} {'calls/run':>10}")
    order = [label for variant in parts.values() for _, _, label in variant]

    def rank(label: str) -> tuple[bool, int]:
        return label in order, order.index(label) if label in order else 0

    for label in sorted(per_run, key=rank):
        count = f"{statistics.median(calls[label]):10.2f}" if label in calls else ""
        click.echo(f"{label:60} {statistics.median(per_run[label]):8.1f} {count}")


if __name__ == "__main__":
    main()
