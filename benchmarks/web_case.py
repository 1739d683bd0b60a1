"""``python -m benchmarks.web_case``: ``singleton-tasks web`` over 10,000 busy keys on Redis.

What one snapshot interval costs: the server's CPU to read the store and build the frame (one
per interval, however many pages are open), then each open page's slice (a filter, a page of
50 lanes, its JSON); and the store's load per snapshot (Redis commands and server CPU, from
``INFO``, server-wide: run it on a quiet Redis). The keys are written in a namespace of their
own in the benchmarks' store database and deleted after.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid

import click
import redis

from singleton_tasks import store_from_url
from singleton_tasks.outcomes import RunSpec
from singleton_tasks.web.lanes import page_of, read_frame

from .__main__ import machine
from .common import STORE_REDIS_URL

URL = STORE_REDIS_URL  # the benchmarks' store database (BENCH_STORE_REDIS_URL)


def _server_load(client: redis.Redis) -> tuple[int, float]:
    """Commands processed and the server's CPU seconds, so far."""
    stats = client.info("stats")
    cpu = client.info("cpu")
    return int(stats["total_commands_processed"]), float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


@click.command()
@click.option("--keys", default=10_000, show_default=True, help="Busy keys (one holder, one waiter each).")
@click.option("--rounds", default=5, show_default=True, help="Snapshots measured (the median is shown).")
@click.option("--pages", default=10, show_default=True, help="Open pages, each sliced per frame.")
def main(keys: int, rounds: int, pages: int) -> None:
    namespace = f"bench-web-{uuid.uuid4().hex[:8]}"
    store = store_from_url(URL, namespace=namespace)
    client = redis.Redis.from_url(URL)
    try:
        store.migrate()
        started = time.perf_counter()
        for i in range(keys):
            key = f"account:{i:05d}"
            holder = RunSpec(scope="tasks.sync", key=key, run_id=f"h{i}", lease=3600.0)
            store.register(holder)
            store.register(RunSpec(scope="tasks.sync", key=key, run_id=f"w{i}", lease=3600.0))
            store.claim(holder, 0, None)
        seeded = time.perf_counter() - started
        walls, cpus, commands, server_cpus, slices = [], [], [], [], []
        frame = read_frame(store)
        for _ in range(rounds):
            before = _server_load(client)
            wall, cpu = time.perf_counter(), time.process_time()
            frame = read_frame(store)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            after = _server_load(client)
            commands.append(after[0] - before[0] - 2)  # less the two INFO calls
            server_cpus.append(after[1] - before[1])
            cpu = time.process_time()
            for page in range(1, pages + 1):
                json.dumps(page_of(frame, task="tasks", page=page))
            slices.append((time.process_time() - cpu) / pages)
        assert frame["totals"]["keys"] == keys, frame["totals"]
        frame_bytes = len(json.dumps(page_of(frame)))
        median = statistics.median
        print(f"machine: {machine()}")
        print(f"busy keys: {keys} (seeded in {seeded:.1f} s), {rounds} snapshots, {pages} pages open")
        print(f"snapshot + frame, wall:          {median(walls) * 1000:8.1f} ms")
        print(f"snapshot + frame, server CPU:    {median(cpus) * 1000:8.1f} ms (once per interval)")
        print(f"one page's slice + JSON, CPU:    {median(slices) * 1000:8.2f} ms (per page per interval)")
        print(f"one page's event, size:          {frame_bytes / 1024:8.1f} KiB (50 lanes)")
        print(f"Redis commands per snapshot:     {median(commands):8.0f}")
        print(f"Redis server CPU per snapshot:   {median(server_cpus) * 1000:8.1f} ms")
    finally:
        store.close()
        batch = list(client.scan_iter(match=f"{namespace}:*", count=5000))
        for start in range(0, len(batch), 1000):
            client.delete(*batch[start : start + 1000])
        client.close()


if __name__ == "__main__":
    main()
