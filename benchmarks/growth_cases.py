"""Case 9, growth: what N runs on N distinct keys leave in each store, and what it costs.

Per store (memory, SQLite, Redis, PostgreSQL), in a namespace of its own:

1. ``runs`` runs on distinct keys (register → claim → release, as a worker does), then more up to
   ``idle`` keys: every key is idle (no holders, no waiters) with its settled marker. Memory and
   Redis make the extra keys by real runs too; the SQL stores (a real run costs ~1.5 ms on SQLite,
   more on PostgreSQL) by one bulk ``INSERT … SELECT`` per table of exactly the rows a settled run
   leaves — its key row and its settled row — copied from the last real run's rows with only the
   key and the run id changed, so the store is in the state runs would have left. The case asserts
   that the bulk rows equal the real runs' rows in every column the real rows agree on, and that
   the sweep past retention forgets them with the others;
2. entries and bytes after the ``runs`` runs, within the retention window;
3. admission (register + claim + release of one key) in that namespace vs a namespace with one idle
   key, interleaved;
4. ``singleton-tasks inspect`` of that namespace (in-process, through the CLI's own command);
5. past the retention window: entries and bytes left.

The stores decide time on a :class:`~singleton_tasks.testing.ManualClock` (a day of retention
passes in a step), then forget as a worker makes them: the SQL stores in ``sweep()`` (a worker's
heartbeat thread calls it), the memory store at its next operation. Redis expires idle state by
key TTLs on the server's own clock, so what Redis keeps past the window is what has no TTL (or a
longer one): that is what the case counts there.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import redis
from click.testing import CliRunner

from singleton_tasks import store_from_url
from singleton_tasks.outcomes import Decision, RunSpec
from singleton_tasks.stores import Store
from singleton_tasks.testing import ManualClock

from .common import POSTGRES_URL, STORE_REDIS_URL, Report, Row, Size, flush_redis, unique

RETENTION = 86_400.0  # the store option's default scale; the ManualClock steps over it
SQL_TABLES = ("singleton_keys", "singleton_runs", "singleton_settled")


@dataclass
class Footprint:
    entries: int  # keys, rows or Redis keys of the namespace
    bytes: int
    detail: str = ""


def one_run(store: Store, key: str) -> None:
    """An uncontended run of ``key``: registered, admitted, settled."""
    spec = RunSpec(scope="growth", key=key, run_id=uuid.uuid4().hex)
    store.register(spec)
    outcome = store.claim(spec, 0, None)
    if outcome.decision is not Decision.ADMITTED:
        raise RuntimeError(f"{key}: not admitted ({outcome.decision})")
    store.release("growth", key, spec.run_id, token=outcome.token)


def fill(store: Store, start: int, stop: int, threads: int) -> None:
    """Runs on keys ``k{start}`` … ``k{stop - 1}``, spread over ``threads`` threads."""
    errors: list[BaseException] = []

    def work(offset: int) -> None:
        try:
            for i in range(start + offset, stop, threads):
                one_run(store, f"k{i}")
        except BaseException as error:  # surfaced below
            errors.append(error)

    pool = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]


# -- SQL bulk fill: the rows a settled run leaves ---------------------------------------------------
# After ``release`` an idle key keeps its singleton_keys row and one singleton_settled row; the
# runs table is empty. The bulk rows copy the last real run's two rows, with the key ``k{n}`` and
# (settled) a fresh 32-hex run id, the shape of ``uuid4().hex``.
SQL_COPIED = ("singleton_keys", "singleton_settled")


def _columns(db: Any, table: str, *, postgres: bool) -> list[str]:
    if postgres:
        rows = db.execute(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = %s ORDER BY ordinal_position",
            [table],
        ).fetchall()
        return [row[0] for row in rows]
    return [row[1] for row in db.execute(f"PRAGMA table_info({table})").fetchall()]


def _copy_sql(table: str, columns: list[str], *, postgres: bool) -> str:
    """``INSERT … SELECT`` of the source key's row of ``table`` once per key number ``n``."""
    if postgres:
        series = "generate_series(%s::bigint, %s::bigint) AS s(n)"
        key, run_id, param = "'k' || s.n", "md5(random()::text || s.n::text)", "%s"
    else:
        series = "series"
        key, run_id, param = "'k' || series.n", "lower(hex(randomblob(16)))", "?"
    picked = [key if c == "key" else run_id if c == "run_id" else f"t.{c}" for c in columns]
    body = (
        f"INSERT INTO {table} ({', '.join(columns)}) SELECT {', '.join(picked)} "
        f"FROM {table} t, {series} WHERE t.namespace = {param} AND t.scope = 'growth' AND t.key = {param}"
    )
    if postgres:
        return body
    return f"WITH RECURSIVE series(n) AS (SELECT ? UNION ALL SELECT n + 1 FROM series WHERE n < ?) {body}"


def _rows_of(
    db: Any, table: str, columns: list[str], namespace: str, key: str, param: str
) -> list[tuple[Any, ...]]:
    return [
        tuple(row)
        for row in db.execute(
            f"SELECT {', '.join(columns)} FROM {table} WHERE namespace = {param} AND scope = 'growth' "
            f"AND key = {param}",
            [namespace, key],
        ).fetchall()
    ]


def _check_bulk(db: Any, namespace: str, real: tuple[str, str], bulk: str, *, postgres: bool) -> None:
    """The bulk key's rows equal the real runs' rows in every column the real rows agree on (the
    key, run ids and per-run values such as tokens differ between real runs too), and are as many."""
    param = "%s" if postgres else "?"
    for table in (*SQL_COPIED, "singleton_runs"):
        columns = _columns(db, table, postgres=postgres)
        first, last = (_rows_of(db, table, columns, namespace, key, param) for key in real)
        made = _rows_of(db, table, columns, namespace, bulk, param)
        if not (len(first) == len(last) == len(made)):
            raise RuntimeError(f"{table}: {len(made)} bulk rows, real runs left {len(first)} and {len(last)}")
        for a, b, m in zip(first, last, made, strict=True):
            for column, x, y, z in zip(columns, a, b, m, strict=True):
                if x == y and z != x:
                    raise RuntimeError(f"{table}.{column}: bulk row has {z!r}, real runs left {x!r}")
                if column == "run_id" and len(z) != len(x):
                    raise RuntimeError(f"{table}.run_id: bulk {z!r} is not shaped like {x!r}")


def sqlite_bulk(path: str, namespace: str, start: int, stop: int) -> None:
    with contextlib.closing(sqlite3.connect(path, timeout=30.0, isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")
        for table in SQL_COPIED:
            columns = _columns(db, table, postgres=False)
            db.execute(
                _copy_sql(table, columns, postgres=False), [start, stop - 1, namespace, f"k{start - 1}"]
            )
        db.execute("COMMIT")
        _check_bulk(db, namespace, ("k0", f"k{start - 1}"), f"k{stop - 1}", postgres=False)


def postgres_bulk(namespace: str, start: int, stop: int) -> None:
    import psycopg

    with psycopg.connect(POSTGRES_URL) as db:
        for table in SQL_COPIED:
            columns = _columns(db, table, postgres=True)
            db.execute(
                _copy_sql(table, columns, postgres=True), [start, stop - 1, namespace, f"k{start - 1}"]
            )
        db.commit()
        _check_bulk(db, namespace, ("k0", f"k{start - 1}"), f"k{stop - 1}", postgres=True)
        db.execute("ANALYZE singleton_keys")
        db.execute("ANALYZE singleton_settled")
        db.commit()


# -- footprints ---------------------------------------------------------------------------------
def deep_size(root: object) -> int:
    """Bytes of ``root`` and everything it references (dicts, sequences, dataclasses), once each."""
    seen: set[int] = set()
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif is_dataclass(obj):
            stack.extend(getattr(obj, f.name) for f in fields(obj))
    return total


def memory_footprint(store: Store) -> Footprint:
    server: Any = store._server  # type: ignore[attr-defined]  # the benchmark reads the dicts directly
    ours = {ident: data for ident, data in server.keys.items() if ident[0] == store.namespace}
    markers = sum(len(data.settled) for data in ours.values())
    heap = [entry for entry in server.idle if entry[1][0] == store.namespace]
    return Footprint(
        len(ours) + markers, deep_size(ours) + deep_size(heap), f"{len(ours)} keys, {markers} markers"
    )


def sqlite_footprint(store: Store, path: str) -> Footprint:
    with contextlib.closing(sqlite3.connect(path)) as db:
        counts = [
            db.execute(f"SELECT count(*) FROM {table} WHERE namespace = ?", [store.namespace]).fetchone()[0]
            for table in SQL_TABLES
        ]
        page_size, pages, free = (
            db.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("page_size", "page_count", "freelist_count")
        )
    return Footprint(sum(counts), (pages - free) * page_size, _rows(counts) + " (pages in use)")


def postgres_footprint(store: Store) -> Footprint:
    import psycopg

    counts, size = [], 0
    with psycopg.connect(POSTGRES_URL) as db:
        for table in SQL_TABLES:
            rows, row_bytes = db.execute(
                f"SELECT count(*), coalesce(sum(pg_column_size(t.*)), 0) FROM {table} t WHERE namespace = %s",
                [store.namespace],
            ).fetchone() or (0, 0)
            counts.append(int(rows))
            size += int(row_bytes)
    return Footprint(sum(counts), size, _rows(counts) + " (row bytes)")


def _rows(counts: list[int]) -> str:
    return ", ".join(
        f"{n} {table.removeprefix('singleton_')}" for n, table in zip(counts, SQL_TABLES, strict=True)
    )


def redis_keys(store: Store) -> Iterator[bytes]:
    client = redis.Redis.from_url(STORE_REDIS_URL)
    try:
        pattern = store.namespace.replace("[", "\\[").replace("*", "\\*").replace("?", "\\?") + ":*"
        yield from client.scan_iter(match=pattern, count=5000)
    finally:
        client.close()


def redis_footprint(store: Store, *, lasting_only: bool) -> Footprint:
    """Every key of the namespace, or (``lasting_only``) those Redis keeps past the retention window:
    without a TTL, or with one longer than the retention."""
    client = redis.Redis.from_url(STORE_REDIS_URL)
    keys = list(redis_keys(store))
    count, size = 0, 0
    try:
        for at in range(0, len(keys), 1000):
            batch = keys[at : at + 1000]
            pipe = client.pipeline(transaction=False)
            for key in batch:
                pipe.pttl(key)
                pipe.memory_usage(key, samples=0)
            replies = pipe.execute()
            for ttl, used in zip(replies[::2], replies[1::2], strict=True):
                if lasting_only and 0 <= ttl <= RETENTION * 1000:
                    continue
                count += 1
                size += int(used or 0)
    finally:
        client.close()
    what = "keys without a TTL within the retention" if lasting_only else "keys (MEMORY USAGE)"
    return Footprint(count, size, what)


# -- the stores -----------------------------------------------------------------------------------
@dataclass
class Subject:
    name: str
    url: str
    threads: int  # fill threads: a network store overlaps round trips
    footprint: Callable[[Store], Footprint]
    lasting: Callable[[Store], Footprint]  # what is left past the retention window
    cleanup: Callable[[str], None]
    # Idle keys ``k{start}`` … ``k{stop - 1}`` without runs: the rows runs would leave (SQL stores)
    bulk: Callable[[str, int, int], None] | None = None


def subjects(tmp: str) -> list[Subject]:
    sqlite_path = os.path.join(tmp, "growth.db")

    def pg_cleanup(namespace: str) -> None:
        import psycopg

        with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
            for table in SQL_TABLES:
                db.execute(f"DELETE FROM {table} WHERE namespace LIKE %s", [namespace + "%"])

    return [
        Subject(
            "memory",
            f"memory://growth-{uuid.uuid4().hex[:8]}",
            1,
            memory_footprint,
            memory_footprint,
            _nothing,
        ),
        Subject(
            "sqlite",
            f"sqlite:///{sqlite_path}",
            1,
            lambda s: sqlite_footprint(s, sqlite_path),
            lambda s: sqlite_footprint(s, sqlite_path),
            _nothing,
            lambda namespace, start, stop: sqlite_bulk(sqlite_path, namespace, start, stop),
        ),
        Subject(
            "redis",
            STORE_REDIS_URL,
            8,
            lambda s: redis_footprint(s, lasting_only=False),
            lambda s: redis_footprint(s, lasting_only=True),
            lambda _ns: flush_redis(STORE_REDIS_URL),
        ),
        Subject(
            "postgres", POSTGRES_URL, 8, postgres_footprint, postgres_footprint, pg_cleanup, postgres_bulk
        ),
    ]


def _nothing(_namespace: str) -> None:
    return None


def admission_us(store: Store, key: str) -> float:
    t0 = time.perf_counter()
    one_run(store, key)
    return (time.perf_counter() - t0) * 1e6


def inspect_seconds(url: str, namespace: str) -> tuple[float, str]:
    from singleton_tasks.cli import cli

    t0 = time.perf_counter()
    result = CliRunner().invoke(cli, ["inspect", "--store", url, "--namespace", namespace, "--json"])
    elapsed = time.perf_counter() - t0
    if result.exit_code != 0:
        raise RuntimeError(f"inspect failed: {result.output[-500:]}")
    return elapsed, result.output


# -- the case ---------------------------------------------------------------------------------------
def case_growth(report: Report, size: Size, stores: list[str] | None = None) -> None:
    runs, idle, samples = size.growth_runs, max(size.growth_idle, size.growth_runs), size.growth_samples
    case = f"9 growth, {runs:,} runs on distinct keys"
    with tempfile.TemporaryDirectory(prefix="growth-") as tmp:
        for subject in subjects(tmp):
            if stores is not None and subject.name not in stores:
                continue
            namespace = unique("growth")
            try:
                _one_store(report, case, subject, namespace, runs, idle, samples)
            finally:
                subject.cleanup(namespace)


def _one_store(
    report: Report, case: str, subject: Subject, namespace: str, runs: int, idle: int, samples: int
) -> None:
    now = time.time()
    clock = ManualClock(now)
    store = store_from_url(subject.url, namespace=namespace, retention=RETENTION, clock=clock)
    few = store_from_url(subject.url, namespace=namespace + "-one", retention=RETENTION, clock=clock)
    store.migrate()
    name = subject.name
    try:
        t0 = time.perf_counter()
        fill(store, 0, runs, subject.threads)
        filled = time.perf_counter() - t0
        gc.collect()
        after = subject.footprint(store)
        t2 = time.perf_counter()
        if subject.bulk is not None and idle > runs:
            subject.bulk(namespace, runs, idle)
            how = f"{runs:,} runs filled in {filled:.1f} s ({subject.threads} threads), "
            how += f"{idle - runs:,} idle keys bulk-inserted"
        else:
            fill(store, runs, idle, subject.threads)
            how = f"{idle:,} runs filled in {filled:.1f} s ({subject.threads} threads)"
        how += f" (rest {time.perf_counter() - t2:.1f} s)"
        one_run(few, "k0")  # the other namespace: one idle key

        # Admission: the same idle key reused on each side, interleaved (drift hits both).
        one: list[float] = []
        many: list[float] = []
        for _ in range(samples):
            one.append(admission_us(few, "k0"))
            many.append(admission_us(store, "k0"))
        # In-process through the CLI's own command (a memory store is only visible in this process).
        inspect_s, output = inspect_seconds(subject.url, namespace)
        if json.loads(output)["totals"]["keys"] != 0:
            raise RuntimeError(f"inspect of an idle namespace listed keys: {output[:300]}")

        clock.advance(RETENTION + 1.0)
        t1 = time.perf_counter()
        swept = store.sweep()
        if name == "memory":
            one_run(store, "after")  # the memory store forgets at its next operation
        sweep_s = time.perf_counter() - t1
        gc.collect()
        left = subject.lasting(store)
        if subject.bulk is not None and (left.entries != 0 or swept < 2 * idle):
            # Every idle key, bulk or run, had a key row and a settled row: the sweep forgets them all.
            raise RuntimeError(f"{name}: swept {swept:,} rows of {idle:,} idle keys, {left.detail} left")
    finally:
        store.close()
        few.close()

    per_key = after.bytes / runs if runs else 0.0
    report.add(Row(case, f"{name}: entries after the runs", "entries", [after.entries], note=after.detail))
    report.add(
        Row(case, f"{name}: bytes after the runs", "bytes", [after.bytes], note=f"{per_key:,.0f} B per key")
    )
    report.add(Row(case, f"{name}: entries past retention", "entries", [left.entries], note=left.detail))
    report.add(
        Row(
            case,
            f"{name}: bytes past retention",
            "bytes",
            [left.bytes],
            note=f"swept {swept:,} in {sweep_s:.2f} s" if name in ("sqlite", "postgres") else "",
        )
    )
    base = f"{name}: admission, 1 idle key"
    report.add(Row(case, base, "µs", one, higher_is_better=False, key=f"growth.{name}.one"))
    report.add(
        Row(
            case,
            f"{name}: admission, {idle:,} idle keys",
            "µs",
            many,
            baseline=base,
            higher_is_better=False,
            key=f"growth.{name}.many",
        )
    )
    report.add(Row(case, f"{name}: inspect, {idle:,} idle keys", "s", [inspect_s], higher_is_better=False))
    ratio = statistics.median(many) / statistics.median(one)
    report.notes.append(f"case 9 {name}: {how}")
    report.target(
        f"9 {name}",
        "entries past retention constant; admission ≤ 1.2× at many idle keys; inspect < 1 s",
        f"{left.entries} left ({left.bytes:,} B); {ratio:.2f}×; {inspect_s:.2f} s",
        left.entries <= 2 and ratio <= 1.2 and inspect_s < 1.0,
    )
