"""The "defaults" forms of cases 2 and 3, and case 12 (idle broker load): a worker started as the
README's quickstart says, ``dramatiq app --processes 1 --threads 8``, with Dramatiq's defaults.

The worker is a real ``dramatiq`` process; its bodies append their ``perf_counter`` spans (one
system-wide monotonic clock on Linux) to a file that this process reads.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from dramatiq.common import dq_name, xq_name

from singleton_tasks import store_from_url
from singleton_tasks.outcomes import RunState

from .common import (
    BROKER_REDIS_URL,
    RABBITMQ_URL,
    STORE_REDIS_URL,
    Report,
    Row,
    Size,
    alternate,
    flush_redis,
    handoff_target,
    percentile,
    private_redis,
    unique,
    wait_until,
)
from .dramatiq_cases import (
    BROKERS,
    BurstOrders,
    Span,
    _commandstats,
    _delta,
    add_burst_rows,
)
from .quickstart_app import ACTOR, KEY, QuickstartConfig, build

ROOT = Path(__file__).resolve().parent.parent
DRAMATIQ = str(Path(sys.executable).with_name("dramatiq"))
COMMAND = "dramatiq app --processes 1 --threads 8"
BROKER_URLS = {"redis": BROKER_REDIS_URL, "rabbitmq": RABBITMQ_URL}


def read_spans(path: str) -> list[Span]:
    """The spans a worker process's bodies appended to ``path`` ("index start end" lines; the
    warm-up's index -1 left out), by start."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    spans = []
    for line in text.splitlines():
        index, start, end = line.split()
        if int(index) >= 0:
            spans.append(Span(int(index), float(start), float(end), "worker"))
    return sorted(spans, key=lambda s: s.start)


def wait_spans(path: str, n: int, timeout: float, command: str) -> list[Span]:
    """The spans of ``path`` once ``n`` bodies of ``command``'s worker have ended."""
    if not wait_until(lambda: len(read_spans(path)) >= n, timeout, 0.02):
        raise RuntimeError(f"{command}: only {len(read_spans(path))}/{n} bodies ran in {timeout:.0f} s")
    return read_spans(path)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the framework's warm shutdown), then SIGKILL if it is not gone in 30 s."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


@dataclass
class Quickstart:
    """One quickstart worker process and a producer of the same app in this process."""

    config: QuickstartConfig
    broker: Any
    actor: Any
    process: subprocess.Popen[bytes]

    def spans(self) -> list[Span]:
        return read_spans(self.config.spans)

    def wait_spans(self, n: int, timeout: float) -> list[Span]:
        return wait_spans(self.config.spans, n, timeout, COMMAND)

    def warm_up(self) -> None:
        """One run (index -1) through the started worker: the burst then meets a running worker."""
        self.actor.send(-1, 0.0)
        path = Path(self.config.spans)
        if not wait_until(lambda: path.exists() and path.read_text().startswith("-1 "), 60, 0.02):
            raise RuntimeError(f"{COMMAND}: the warm-up run did not finish in 60 s")


@contextlib.contextmanager
def quickstart(
    kind: str,
    singleton: bool,
    broker_url: str | None = None,
    store_url: str = STORE_REDIS_URL,
    wake_fetch: bool = True,
) -> Iterator[Quickstart]:
    """Start ``dramatiq benchmarks.quickstart_app --processes 1 --threads 8`` and wait until it is ready."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-quickstart-"))
    config = QuickstartConfig(
        broker=kind,
        broker_url=broker_url or BROKER_URLS[kind],
        store=store_url if singleton else "",
        namespace=unique("qs"),
        queue=unique("qs").replace("-", "_"),
        spans=str(workdir / "spans"),
        wake_fetch="on" if wake_fetch else "off",
    )
    broker, actor = build(config)
    log = workdir / "worker.log"
    # Dramatiq's defaults: none of its settings from this environment.
    env = {k: v for k, v in os.environ.items() if not k.lower().startswith("dramatiq_")}
    process = subprocess.Popen(
        [
            DRAMATIQ,
            "benchmarks.quickstart_app",
            "--path",
            str(ROOT),
            "--processes",
            "1",
            "--threads",
            "8",
            "--log-file",
            str(log),
        ],
        env={**env, **config.env()},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run = Quickstart(config, broker, actor, process)
    try:
        ready = wait_until(lambda: log.exists() and "is ready for action" in log.read_text(), 60, 0.05)
        if not ready or process.poll() is not None:
            raise RuntimeError(
                f"{COMMAND}: the worker did not start ({log.read_text()[-2000:] if log.exists() else ''})"
            )
        yield run
    finally:
        stop_process(process)
        _cleanup(run)
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()


def _cleanup(run: Quickstart) -> None:
    """The benchmark's own databases are flushed, as every case does (common.flush_redis)."""
    if run.config.broker == "redis":
        flush_redis(run.config.broker_url)
    else:
        with contextlib.suppress(Exception):
            channel = run.broker.channel
            for name in (run.config.queue, dq_name(run.config.queue), xq_name(run.config.queue)):
                channel.queue_delete(queue=name)
    with contextlib.suppress(Exception):
        run.broker.close()
    if run.config.store:
        flush_redis(run.config.store)


# -- case 2, defaults form ------------------------------------------------------------------
def case_burst_defaults(report: Report, size: Size, runs: int, kinds: list[str]) -> None:
    """The same-key burst against a quickstart worker, sent to it running and idle."""
    n, body = size.burst, size.burst_body
    ideal = n * body
    for kind in kinds:
        orders = BurstOrders()
        without = BurstOrders()

        def once(
            fetch: bool, kind: str = kind, orders: BurstOrders = orders, without: BurstOrders = without
        ) -> float:
            with quickstart(kind, singleton=True, wake_fetch=fetch) as run:
                run.warm_up()
                for i in range(n):
                    run.actor.send(i, body)
                spans = run.wait_spans(n, 120)
            (orders if fetch else without).record("running", spans)
            return max(s.end for s in spans) - spans[0].start

        results = alternate(runs, [("off", lambda: once(False)), ("running", lambda: once(True))])
        case = f"2d burst {n}×{body * 1000:.0f} ms, one key, {BROKERS[kind]}, `{COMMAND}` (defaults)"
        report.add(Row(case, "ideal", "s", [ideal], key=f"burstd.{kind}.ideal", note="n × body"))
        report.add(
            Row(
                case,
                "without the wake fetch (the consumer's poll alone)",
                "s",
                results["off"],
                baseline="ideal",
                higher_is_better=False,
                key=f"burstd.{kind}.nofetch",
                note=without.note("running"),
            )
        )
        add_burst_rows(
            report,
            case=case,
            subject="SingletonMiddleware",
            key=f"burstd.{kind}",
            target=("2d", f"burst on {BROKERS[kind]} at Dramatiq's defaults"),
            results=results,
            ideal=ideal,
            orders=orders,
            starts={"running": "sent to the running, idle worker"},
        )


# -- case 3, defaults form ------------------------------------------------------------------
def handoffs_defaults(kind: str, handoffs: int, body: float) -> list[float]:
    """Run 0 holds until every other run is gated; then each release hands off (ms per gap)."""
    n = handoffs + 1
    with quickstart(kind, singleton=True) as run:
        store = store_from_url(run.config.store, namespace=run.config.namespace)
        try:
            run.actor.send(0, 0.0, True)
            for i in range(1, n):
                run.actor.send(i, body)

            def all_gated() -> bool:
                snaps = store.snapshot(scope=ACTOR, key=KEY)
                return bool(snaps) and sum(w.state is RunState.GATED for w in snaps[0].waiters) >= n - 1

            if not wait_until(all_gated, 120, 0.05):
                raise RuntimeError("handoff (defaults): the waiters were not all gated in time")
        finally:
            store.close()
        Path(run.config.release_file).touch()
        spans = run.wait_spans(n, 600)
    return [(b.start - a.end) * 1000 for a, b in itertools.pairwise(spans)]


def case_handoff_defaults(report: Report, size: Size, runs: int, kinds: list[str]) -> None:
    body = 0.02
    per_run = max(10, size.handoffs // runs)
    for kind in kinds:
        latencies: list[float] = []
        for _ in range(runs):
            latencies.extend(handoffs_defaults(kind, per_run, body))
        case = f"3d handoff (body {body * 1000:.0f} ms), {BROKERS[kind]}, `{COMMAND}` (defaults)"
        p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
        report.add(
            Row(
                case,
                f"{runs} workers × {per_run} handoffs",
                "ms",
                latencies,
                higher_is_better=False,
                key=f"handoffd.{kind}",
                note=f"p50 {p50:.2f}, p99 {p99:.2f}, max {max(latencies):.1f} ms (samples)",
            )
        )
        handoff_target(report, "3d", f"{BROKERS[kind]} at Dramatiq's defaults", latencies)


# -- case 12: idle broker load --------------------------------------------------------------
def idle_fetches(singleton: bool, settle: float, seconds: float) -> tuple[float, float] | None:
    """(broker fetch scripts/s, store commands/s) of an idle quickstart worker on a private Redis.

    Broker (db 0) and store (db 1) share the server as in the quickstart; the broker's calls are
    its EVALSHA scripts (fetches, and maintenance riding on them), the store's its FCALLs.
    """
    with private_redis() as (url, private):
        if not private:
            return None  # the shared server's other clients would be counted too
        base = url.rsplit("/", 1)[0]
        client = redis.Redis.from_url(url)
        try:
            with quickstart("redis", singleton, broker_url=f"{base}/0", store_url=f"{base}/1"):
                time.sleep(settle)  # the consumers' back-off reaches its ceiling
                a = _commandstats(client)
                time.sleep(seconds)
                b = _commandstats(client)
        finally:
            client.close()
    delta = _delta(a, b)
    broker = sum(v for k, v in delta.items() if k in ("evalsha", "eval"))
    store = sum(v for k, v in delta.items() if k.startswith("fcall"))
    return broker / seconds, store / seconds


def case_idle(report: Report, size: Size, runs: int) -> None:
    settle, seconds = (2.0, 2.0) if size.name == "small" else (4.0, 6.0)
    stores: dict[str, list[float]] = {"plain": [], "singleton": []}

    def measure(singleton: bool) -> float | None:
        figures = idle_fetches(singleton, settle, seconds)
        if figures is None:
            return None
        stores["singleton" if singleton else "plain"].append(figures[1])
        return figures[0]

    results = alternate(runs, [("plain", lambda: measure(False)), ("singleton", lambda: measure(True))])
    if not results["plain"]:
        report.target("12", "idle broker load ≤ 2× plain", "no redis-server to start", None)
        return
    case = f"12 idle RedisBroker worker, `{COMMAND}` (defaults): broker fetch calls/s (private redis-server)"
    report.add(
        Row(case, "plain Dramatiq", "calls/s", results["plain"], higher_is_better=False, key="idle.plain")
    )
    report.add(
        Row(
            case,
            "SingletonMiddleware",
            "calls/s",
            results["singleton"],
            baseline="plain Dramatiq",
            higher_is_better=False,
            key="idle.singleton",
            note=f"the store's calls/s on the same server: {statistics_text(stores['singleton'])}",
        )
    )
    ratio = median(results["singleton"]) / median(results["plain"])
    report.target("12", "idle worker's broker fetch calls ≤ 2× plain Dramatiq's", f"{ratio:.2f}×", ratio <= 2)


def median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)


def statistics_text(values: list[float]) -> str:
    return f"{median(values):.2f}" if values else "—"
