"""What every case shares: sizes, server URLs, the result model, statistics and the printed table."""

from __future__ import annotations

import logging
import math
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis

# Dedicated databases: the benchmark flushes them between runs (the test suite uses 13–15).
BROKER_REDIS_URL = os.environ.get("BENCH_BROKER_REDIS_URL", "redis://127.0.0.1:6379/12")
STORE_REDIS_URL = os.environ.get("BENCH_STORE_REDIS_URL", "redis://127.0.0.1:6379/11")
RABBITMQ_URL = os.environ.get("BENCH_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672")
POSTGRES_URL = os.environ.get("BENCH_POSTGRES_URL", "postgresql://127.0.0.1:5432/test")

THREADS = 8  # one worker process × 8 threads (the setting)

#: Each hot path's target: its median at least this share of its floor's, measured in the same run.
FLOOR_TARGET = 0.90
#: Same-key bursts: the makespan (first body's start → last body's end) over n × body, at most.
BURST_TARGET = 1.10
#: Handoff latency (one body's end → the next same-key body's start), milliseconds, at most.
HANDOFF_P50_MS = 3.0
HANDOFF_P99_MS = 10.0


@dataclass(frozen=True)
class Size:
    name: str
    noop: int  # case 1: no-op runs per run
    burst: int  # case 2: runs in the same-key burst
    burst_body: float  # seconds per burst body
    baseline_cap: float  # case 2: the ConcurrentRateLimiter + Retries baseline is stopped after this
    handoffs: int  # case 3
    round_trip_runs: int  # case 4
    waiters_many: int  # case 5: the "10,000 waiters" side
    admissions: int  # case 5: timed operations per side
    pg_seconds: float  # case 6: seconds per side per run
    hold: float  # case 7: the holder's body, seconds (60 at full size; shorter = scaled time)
    celery_noop: int  # case 8
    celery_burst: int
    growth_runs: int  # case 9: runs on distinct keys (the footprint is measured after these)
    growth_idle: int  # case 9: idle keys in the namespace when admission and inspect are timed
    growth_samples: int  # case 9: timed admissions per side


SIZES = {
    "small": Size("small", 300, 25, 0.02, 1.5, 50, 50, 2_000, 200, 0.5, 3.0, 200, 25, 1_000, 1_000, 200),
    "medium": Size(
        "medium", 2_000, 50, 0.02, 15.0, 200, 200, 10_000, 500, 1.5, 12.0, 1_000, 50, 20_000, 100_000, 500
    ),
    "full": Size(
        "full",
        5_000,
        50,
        0.02,
        60.0,
        500,
        500,
        10_000,
        1_000,
        3.0,
        60.0,
        5_000,
        50,
        200_000,
        1_000_000,
        1_000,
    ),
}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def quiet_framework_logs() -> None:
    """Retries, skips and rate-limit failures log per message: noise that costs time, not signal."""
    for name in ("dramatiq", "celery", "kombu", "pika", "amqp", "singleton_tasks"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


class BareRoundTrips:
    """One ``PING`` per call to the store's Redis, on a connection pinned to the calling thread.

    The floor of the issue's own design: two store round trips per uncontended run (admit,
    release) cost at least two of these, however lean the code around them.
    """

    def __init__(self, url: str = STORE_REDIS_URL) -> None:
        self._pool = redis.ConnectionPool.from_url(url)
        self._local = threading.local()

    def ping(self) -> None:
        client: redis.Redis | None = getattr(self._local, "client", None)
        if client is None:
            client = redis.Redis(connection_pool=self._pool, single_connection_client=True)
            self._local.client = client
        client.ping()

    def close(self) -> None:
        self._pool.disconnect()


class SpanFile:
    """The file a worker process's bodies append their spans to, as "index start end" lines
    (perf_counter seconds; defaults_cases.read_spans reads them): one unbuffered ``O_APPEND``
    write per span, so the lines of concurrent processes never interleave; opened once per
    process (a forked child opens its own)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: tuple[int, int] | None = None  # (pid, fd)

    def write(self, index: int, start: float, end: float) -> None:
        if self._fd is None or self._fd[0] != os.getpid():
            self._fd = (os.getpid(), os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        os.write(self._fd[1], f"{index} {start!r} {end!r}\n".encode())


def timed_sends(
    n: int, send: Callable[[int], object], flush: Callable[[], None], *, floor: bool
) -> tuple[float, float]:
    """Sends ``0..n-1`` in a loop after one untimed send (connections open, schema checked), then
    ``flush``: (sends per second, this process's CPU µs per send). ``floor``: a bare ``PING``
    to the store's Redis before each send (case 13's floor)."""
    pings = BareRoundTrips() if floor else None
    try:
        send(-1)
        if pings is not None:
            pings.ping()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            if pings is not None:
                pings.ping()
            send(i)
        flush()
        seconds = time.perf_counter() - t0
        return n / seconds, (time.process_time() - cpu0) / n * 1e6
    finally:
        if pings is not None:
            pings.close()


def flush_redis(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def reachable(url: str, default_port: int) -> bool:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=1):
            return True
    except OSError:
        return False


@contextmanager
def private_redis() -> Iterator[tuple[str, bool]]:
    """A throw-away redis-server (its INFO counts only our commands); the shared one if none is installed.

    Yields ``(url, private)``.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        yield STORE_REDIS_URL, False
        return
    with _redis_server(binary) as port:
        yield f"redis://127.0.0.1:{port}/0", True


@contextmanager
def private_redis_with_replica() -> Iterator[str]:
    """A throw-away primary with one replica in sync; yields the primary's URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed")
    with _redis_server(binary) as primary, _redis_server(binary, "--replicaof", "127.0.0.1", str(primary)):
        client = redis.Redis(host="127.0.0.1", port=primary)
        deadline = time.monotonic() + 20
        while client.info("replication").get("slave0", {}).get("state") != "online":
            if time.monotonic() > deadline:
                raise RuntimeError("the private replica did not sync")
            time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{primary}/0"


@contextmanager
def _redis_server(binary: str, *args: str) -> Iterator[int]:
    """A redis-server on a free loopback port, nothing on disk; yields the port, stops it by PID."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not reachable(f"redis://127.0.0.1:{port}/0", port):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("private redis-server did not start")
            time.sleep(0.02)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


# -- results ---------------------------------------------------------------------------------
@dataclass
class Row:
    """One measured variant: its per-run values (or per-operation samples)."""

    case: str
    variant: str
    unit: str
    values: list[float]
    baseline: str | None = None  # the variant of the same case this row is compared with
    higher_is_better: bool = True
    note: str = ""
    text: str | None = None  # shown instead of the median (e.g. "did not finish")
    key: str = ""  # a stable handle for targets and plots

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan


@dataclass
class Target:
    case: str
    goal: str
    measured: str
    passed: bool | None  # None: not measured (skipped)
    why: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: dict[str, Any] = field(default_factory=dict)  # data for --plot
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def row(self, key: str) -> Row | None:
        return next((r for r in self.rows if r.key == key), None)

    def target(self, case: str, goal: str, measured: str, passed: bool | None, why: str = "") -> None:
        self.targets.append(Target(case, goal, measured, passed, why))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def floor_target(
    report: Report,
    case: str,
    what: str,
    results: dict[str, list[float]],
    *,
    round_trips: int,
    floor_name: str | None = None,
    others: dict[str, str] | None = None,
) -> None:
    """Case ``case``'s target for ``what``: the ``singleton`` median over the ``floor`` one (plain
    plus ``round_trips`` bare round trips), measured in the same rounds; the chart's bars for
    ``--plot`` (floor_ratios.png): plain, the floor, the subject and ``others`` (variant → name)."""
    plain = statistics.median(results["plain"])
    subject = statistics.median(results["singleton"])
    floor = statistics.median(results["floor"])
    plural = "s" if round_trips > 1 else ""
    names = {
        "plain": "plain",
        "floor": floor_name or f"floor: plain + {round_trips} round trip{plural}",
        "singleton": "singleton-tasks",
        **(others or {}),
    }
    report.plots[f"floor.{what}"] = {
        name: statistics.median(results[variant]) / floor
        for variant, name in names.items()
        if results[variant]
    }
    report.target(
        case,
        f"{what}: ≥ {FLOOR_TARGET:.2f}× the floor (median of alternating rounds)",
        f"{subject / floor:.2f}× the floor ({subject / plain:.2f}× plain; "
        f"the floor, plain + {round_trips} bare round trip{plural}: "
        f"{floor / plain:.2f}× plain)",
        subject / floor >= FLOOR_TARGET,
    )


def handoff_target(report: Report, case: str, what: str, latencies: Sequence[float]) -> None:
    """The handoff target of ``what``: p50 and p99 of ``latencies`` (ms)."""
    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    report.target(
        case,
        f"handoff {what}: p50 ≤ {HANDOFF_P50_MS:g} ms, p99 ≤ {HANDOFF_P99_MS:g} ms",
        f"p50 {p50:.2f} ms, p99 {p99:.2f} ms",
        p50 <= HANDOFF_P50_MS and p99 <= HANDOFF_P99_MS,
    )


def fmt(value: float) -> str:
    if math.isnan(value):
        return "—"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def render(report: Report, header: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title=header, show_lines=False)
    for name, justify in (
        ("case", "left"),
        ("variant", "left"),
        ("median", "right"),
        ("min–max", "right"),
        ("unit", "left"),
        ("n", "right"),
        ("vs baseline", "right"),
        ("note", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    by_key = {(r.case, r.variant): r for r in report.rows}
    for row in report.rows:
        ratio = ""
        base = by_key.get((row.case, row.baseline)) if row.baseline else None
        if base is not None and row.values and base.values and base.median:
            ratio = f"{row.median / base.median:.2f}×"
        elif row.baseline and base is not None and base.text:
            ratio = f"vs {base.text}"
        median = row.text if row.text is not None else fmt(row.median)
        spread = f"{fmt(min(row.values))}–{fmt(max(row.values))}" if row.values else ""
        table.add_row(row.case, row.variant, median, spread, row.unit, str(len(row.values)), ratio, row.note)
    console.print(table)
    targets = Table(title="Targets")
    for name in ("case", "target", "measured", "result", "why / note"):
        targets.add_column(name)
    for t in report.targets:
        result = "skipped" if t.passed is None else ("PASS" if t.passed else "MISS")
        targets.add_row(t.case, t.goal, t.measured, result, t.why)
    console.print(targets)
    for note in report.notes:
        console.print(f"• {note}", soft_wrap=True)


def alternate(
    runs: int, variants: Sequence[tuple[str, Callable[[], float | None]]]
) -> dict[str, list[float]]:
    """Run the variants in turn, ``runs`` times each (baseline and subject interleaved)."""
    out: dict[str, list[float]] = {name: [] for name, _ in variants}
    for _ in range(runs):
        for name, fn in variants:
            value = fn()
            if value is not None:
                out[name].append(value)
    return out


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Benchmark-side polling only (the library never polls)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
