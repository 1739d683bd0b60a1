"""Case 10: the store on a 3-primary + 3-replica Redis Cluster beside the standalone Redis store.

The cluster comes from ``--cluster-url`` / ``BENCH_CLUSTER_URL``, or is started on loopback ports
7101-7106 for the case (``tests/loopback_cluster.py``, run from the repository) and stopped by PID.
The broker is the standalone Redis either way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from singleton_tasks.stores.redis_cluster import RedisClusterStore, cluster_seeds

from .common import BROKER_REDIS_URL, STORE_REDIS_URL, Report, Row, Size, alternate
from .dramatiq_cases import (
    BURST_STARTS,
    BurstOrders,
    add_burst_rows,
    cleanup,
    make_rig,
    send_all,
    warm_up,
    worker,
)

CLUSTER_URL = os.environ.get("BENCH_CLUSTER_URL")
LAUNCHER = Path(__file__).resolve().parent.parent / "tests" / "loopback_cluster.py"


@contextlib.contextmanager
def cluster_url(url: str | None) -> Iterator[str]:
    """``url``, or the URL of a loopback cluster started for the case and stopped by PID."""
    if url:
        yield url
        return
    if not LAUNCHER.exists():
        raise RuntimeError(f"no cluster URL given and no {LAUNCHER} to start one (--cluster-url)")
    process = subprocess.Popen([sys.executable, str(LAUNCHER)], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line.startswith("redis+cluster://"):
            raise RuntimeError(f"the loopback cluster did not start: {line!r}")
        yield line
    finally:
        process.terminate()  # the launcher stops its nodes by PID
        process.wait(30)


def _servers(store_url: str) -> list[redis.Redis]:
    """The broker's Redis and the store's servers, each once (the standalone store shares the
    broker's server by default; a cluster: every node, replicas too)."""
    urls = [BROKER_REDIS_URL]
    if store_url.split("://")[0] in RedisClusterStore.schemes:
        cluster = RedisCluster.from_url(cluster_seeds(store_url)[0])
        urls += [f"redis://{node.host}:{node.port}" for node in cluster.get_nodes()]  # type: ignore[no-untyped-call]
        cluster.close()
    else:
        urls.append(store_url)
    by_address: dict[tuple[str, int], str] = {}
    for url in urls:
        options = redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
        by_address.setdefault((options.get("host", "localhost"), int(options.get("port", 6379))), url)
    return [redis.Redis.from_url(url) for url in by_address.values()]


def _cpu_seconds(servers: list[redis.Redis]) -> float:
    """The servers' CPU time so far (INFO cpu), summed."""
    total = 0.0
    for server in servers:
        info = server.info("cpu")
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


def _noop(store_url: str, n: int, costs: dict[str, list[float]] | None = None) -> float:
    """Runs/s of n no-op runs of distinct keys, queued before the worker starts.

    ``costs`` gets this process's CPU per run (µs, ``worker``) and the CPU per run of the broker's
    and the store's Redis servers (``servers``).
    """
    rig = make_rig("redis", "singleton", n, store_url=store_url)
    servers = _servers(store_url)
    try:
        send_all(rig, n)
        cpu0, servers0 = time.process_time(), _cpu_seconds(servers)
        with worker(rig):
            t0 = time.perf_counter()
            if not rig.recorder.done.wait(300):
                raise RuntimeError(f"no-op on {store_url}: only {len(rig.recorder.spans)}/{n} ran")
            t1 = max(s.end for s in rig.recorder.spans)
            if costs is not None:
                costs.setdefault("worker", []).append((time.process_time() - cpu0) / n * 1e6)
                costs.setdefault("servers", []).append((_cpu_seconds(servers) - servers0) / n * 1e6)
        return n / (t1 - t0)
    finally:
        cleanup(rig)
        for server in servers:
            server.close()


def _burst(
    store_url: str, n: int, body: float, worker_timeout: int, orders: BurstOrders, start: str
) -> float:
    """Makespan of n same-key runs of ``body`` seconds (first body start to last body end)."""
    rig = make_rig("redis", "singleton", n, body_seconds=body, key="burst", store_url=store_url)
    try:
        if start == "queued":
            send_all(rig, n)
        with worker(rig, worker_timeout):
            if start == "running":
                warm_up(rig.recorder, lambda: rig.actor.send(-1))
                send_all(rig, n)
            if not rig.recorder.done.wait(120):
                raise RuntimeError(f"burst: only {len(rig.recorder.spans)}/{n} ran")
            spans = rig.recorder.ordered()
        orders.record(start, spans)
        return max(s.end for s in spans) - spans[0].start
    finally:
        cleanup(rig)


def case_cluster(report: Report, size: Size, runs: int, url: str | None, worker_timeout: int) -> None:
    with cluster_url(url or CLUSTER_URL) as cluster:
        costs: dict[str, dict[str, list[float]]] = {"standalone": {}, "cluster": {}}
        noop = alternate(
            runs,
            [
                ("standalone", functools.partial(_noop, STORE_REDIS_URL, size.noop, costs["standalone"])),
                ("cluster", functools.partial(_noop, cluster, size.noop, costs["cluster"])),
            ],
        )
        orders = BurstOrders()
        n, body = size.burst, size.burst_body
        burst = alternate(
            runs,
            [
                (start, functools.partial(_burst, cluster, n, body, worker_timeout, orders, start))
                for start in BURST_STARTS
            ],
        )
    case = f"9 no-op ×{size.noop:,}, distinct keys, Redis Cluster store (3 primaries + 3 replicas)"
    report.add(
        Row(case, "standalone Redis store", "runs/s", noop["standalone"], key="cluster.noop.standalone")
    )
    report.add(
        Row(
            case,
            "Redis Cluster store",
            "runs/s",
            noop["cluster"],
            baseline="standalone Redis store",
            key="cluster.noop.cluster",
            note="broker: the standalone Redis; cluster nodes on the same host",
        )
    )
    # Where the time goes: the worker's CPU, and the servers' (six cluster nodes beside the broker).
    for what, note in (
        ("worker", "worker process, all threads"),
        ("servers", "the broker's Redis and the store's servers (standalone: one server for both)"),
    ):
        label = "worker CPU per run" if what == "worker" else "Redis servers' CPU per run"
        for variant, name in (("standalone", "standalone Redis store"), ("cluster", "Redis Cluster store")):
            report.add(
                Row(
                    case,
                    f"{label}: {name}",
                    "µs",
                    costs[variant][what],
                    baseline=None if variant == "standalone" else f"{label}: standalone Redis store",
                    higher_is_better=False,
                    key=f"cluster.noop.{what}_cpu.{variant}",
                    note=note,
                )
            )
    ratio = statistics.median(noop["cluster"]) / statistics.median(noop["standalone"])
    report.target("9", "cluster no-op ≥ 0.90× standalone", f"{ratio:.2f}×", ratio >= 0.90)
    burst_case = (
        f"9 burst {n}×{body * 1000:.0f} ms, one key, Redis Cluster store, worker_timeout={worker_timeout} ms"
    )
    report.add(Row(burst_case, "ideal", "s", [n * body], key="cluster.burst.ideal", note="n × body"))
    add_burst_rows(
        report,
        case=burst_case,
        subject="SingletonMiddleware on Redis Cluster",
        key="cluster.burst",
        target=("9", "burst on a Redis Cluster store"),
        results=burst,
        ideal=n * body,
        orders=orders,
    )
