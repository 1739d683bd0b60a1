"""The append-only log of a scenario run, in PostgreSQL, so it survives any worker's death.

Every body inserts its row when it starts (``end`` NULL) and fills ``end`` when it returns or
raises: a body killed mid-run keeps ``end`` NULL and the checker uses the kill time from
``integration_events``. Producers log every enqueue attempt (accepted or not), the runner logs
every fault it injects. Workers also log deliveries (``integration_deliveries``): every delivery of a
task message to task code, gated or not, with how it ended (a body, a deferral, a dropped copy), and on
Celery × Redis every message the consumer received (kombu recorded it as unacked by then).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from .settings import real_time

SCHEMA = """
CREATE TABLE IF NOT EXISTS integration_scenarios (
    run text PRIMARY KEY,
    name text NOT NULL,
    framework text NOT NULL,
    broker text NOT NULL,
    store text NOT NULL,
    store_url text NOT NULL,
    namespace text NOT NULL,
    settings jsonb NOT NULL,
    started double precision NOT NULL,
    finished double precision
);
CREATE TABLE IF NOT EXISTS integration_bodies (
    id bigserial PRIMARY KEY,
    run text NOT NULL,
    scope text NOT NULL,
    key text NOT NULL,
    run_id text NOT NULL,
    token bigint,
    pid integer NOT NULL,
    worker text NOT NULL,
    attempt integer NOT NULL,
    started double precision NOT NULL,
    ended double precision,
    outcome text
);
CREATE INDEX IF NOT EXISTS integration_bodies_run ON integration_bodies (run);
CREATE TABLE IF NOT EXISTS integration_enqueues (
    id bigserial PRIMARY KEY,
    run text NOT NULL,
    producer text NOT NULL,
    seq integer NOT NULL,
    scope text NOT NULL,
    key text NOT NULL,
    run_id text NOT NULL,
    lim integer,
    accepted boolean NOT NULL,
    error text,
    at double precision NOT NULL,
    returned double precision
);
ALTER TABLE integration_enqueues ADD COLUMN IF NOT EXISTS returned double precision;
CREATE INDEX IF NOT EXISTS integration_enqueues_run ON integration_enqueues (run);
CREATE TABLE IF NOT EXISTS integration_events (
    id bigserial PRIMARY KEY,
    run text NOT NULL,
    kind text NOT NULL,
    worker text NOT NULL DEFAULT '',
    at double precision NOT NULL,
    detail text NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS integration_events_run ON integration_events (run);
CREATE TABLE IF NOT EXISTS integration_deliveries (
    id bigserial PRIMARY KEY,
    run text NOT NULL,
    run_id text NOT NULL,
    kind text NOT NULL,
    worker text NOT NULL,
    pid integer NOT NULL,
    started double precision NOT NULL,
    ended double precision NOT NULL,
    detail text NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS integration_deliveries_run ON integration_deliveries (run);
"""

_SCHEMA_LOCK = 0x51_6E_67_6C  # pg_advisory_xact_lock id: concurrent CREATE IF NOT EXISTS races otherwise


class Flaky(Exception):
    """Raised by a body asked to fail its first attempt: the framework retries it."""


@dataclass(frozen=True)
class Body:
    """One execution of a body (one attempt of a run)."""

    scope: str
    key: str
    run_id: str
    token: int | None
    pid: int
    worker: str
    attempt: int
    start: float
    end: float | None
    outcome: str | None  # "ok" | "raised" | None (killed, or still running)


@dataclass(frozen=True)
class Enqueue:
    """One enqueue attempt by a producer."""

    producer: str
    seq: int
    scope: str
    key: str
    run_id: str
    limit: int | None  # None: not a singleton task
    accepted: bool
    error: str | None  # the exception's class name when not accepted
    at: float  # when the enqueue was called
    returned: float | None = None  # when it returned or raised


@dataclass(frozen=True)
class Event:
    """A fault or lifecycle step injected by the runner (``kill``, ``term``, ``start``, ``purge``, …)."""

    kind: str
    worker: str
    at: float
    detail: str


@dataclass(frozen=True)
class Delivery:
    """A message handed to a worker, logged when its handling ended (a delivery killed midway has no row).

    ``kind``: ``"delivery"`` — the framework handed the message to task code (Dramatiq: a middleware
    placed before the singleton gate; Celery: ``task_prerun`` … ``task_postrun``), ``started`` before
    the gate and ``ended`` after the body or the deferral; ``detail`` says how it ended (Celery: the
    state and, when ignored, the gate's reason — ``deferred …`` or ``stale copy dropped``; Dramatiq:
    ``processed`` or ``skipped``). ``"received"`` — Celery's consumer received the message
    (``task_received``: kombu has recorded it as unacked), ``started == ended``.
    """

    run_id: str
    kind: str
    worker: str
    pid: int
    start: float
    end: float
    detail: str


@dataclass(frozen=True)
class Scenario:
    run: str
    name: str
    framework: str
    broker: str
    store: str
    store_url: str
    namespace: str
    settings: dict[str, Any]
    started: float
    finished: float | None


@dataclass(frozen=True)
class RunData:
    """Everything logged for one scenario run."""

    scenario: Scenario
    bodies: tuple[Body, ...]
    enqueues: tuple[Enqueue, ...]
    events: tuple[Event, ...]
    deliveries: tuple[Delivery, ...] = ()


class RunLog:
    """A connection per process and thread (bodies of many threads, prefork children)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._local = threading.local()
        #: Every connection this process opened, by any thread: a thread that ends must not drop
        #: its connection open (a ResourceWarning); :meth:`close` closes them all.
        self._opened: list[psycopg.Connection[Any]] = []
        self._opened_lock = threading.Lock()
        self._opened_pid = os.getpid()

    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or getattr(self._local, "pid", None) != os.getpid():
            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
            self._local.conn, self._local.pid = conn, os.getpid()
            with self._opened_lock:
                if self._opened_pid != os.getpid():  # a forked child: the parent's are not its own
                    self._opened, self._opened_pid = [], os.getpid()
                self._opened.append(conn)
        return conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        for attempt in (1, 2):
            try:
                with self._conn().cursor() as cur:
                    cur.execute(sql, params)
                    return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                self._local.conn = None  # a dropped connection: reconnect once
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Close every connection this process opened (each thread's)."""
        with self._opened_lock:
            opened = self._opened if self._opened_pid == os.getpid() else []
            self._opened = []
        for conn in opened:
            conn.close()
        self._local.conn = None

    # -- schema and scenario rows ------------------------------------------------------------
    def ensure_schema(self) -> None:
        with psycopg.connect(self.url, connect_timeout=10) as conn:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [_SCHEMA_LOCK])
            conn.execute(SCHEMA)

    def begin(self, scenario: Scenario) -> None:
        self.execute(
            "INSERT INTO integration_scenarios VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, NULL)",
            [
                scenario.run,
                scenario.name,
                scenario.framework,
                scenario.broker,
                scenario.store,
                scenario.store_url,
                scenario.namespace,
                json.dumps(scenario.settings),
                scenario.started,
            ],
        )

    def finish(self, run: str, at: float | None = None) -> None:
        self.execute(
            "UPDATE integration_scenarios SET finished = %s WHERE run = %s", [at or real_time(), run]
        )

    # -- bodies --------------------------------------------------------------------------------
    def body_started(
        self, run: str, scope: str, key: str, run_id: str, token: int | None, worker: str, attempt: int
    ) -> int:
        rows = self.execute(
            "INSERT INTO integration_bodies (run, scope, key, run_id, token, pid, worker, attempt, started)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
            [run, scope, key, run_id, token, os.getpid(), worker, attempt, real_time()],
        )
        return int(rows[0][0])

    def body_ended(self, row: int, outcome: str) -> None:
        self.execute(
            "UPDATE integration_bodies SET ended = %s, outcome = %s WHERE id = %s",
            [real_time(), outcome, row],
        )

    @contextlib.contextmanager
    def body(
        self, run: str, scope: str, key: str, run_id: str, token: int | None, worker: str, attempt: int
    ) -> Iterator[None]:
        row = self.body_started(run, scope, key, run_id, token, worker, attempt)
        outcome = "raised"
        try:
            yield
            outcome = "ok"
        finally:
            self.body_ended(row, outcome)

    # -- deliveries ------------------------------------------------------------------------------
    def delivery(
        self, run: str, run_id: str, kind: str, worker: str, started: float, detail: str = ""
    ) -> None:
        self.execute(
            "INSERT INTO integration_deliveries (run, run_id, kind, worker, pid, started, ended, detail)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            [run, run_id, kind, worker, os.getpid(), started, real_time(), detail],
        )

    def deliveries(self, run: str, run_id: str | None = None) -> list[Delivery]:
        """The run's deliveries in start order (of one run id if given)."""
        select = "SELECT run_id, kind, worker, pid, started, ended, detail FROM integration_deliveries"
        return [Delivery(*row) for row in self._in_start_order(select, run, run_id)]

    # -- producers and faults ----------------------------------------------------------------------
    def enqueues(self, run: str, rows: Iterable[Enqueue]) -> None:
        batch = [
            [run, e.producer, e.seq, e.scope, e.key, e.run_id, e.limit, e.accepted, e.error, e.at, e.returned]
            for e in rows
        ]
        if not batch:
            return
        with self._conn().cursor() as cur:
            cur.executemany(
                "INSERT INTO integration_enqueues (run, producer, seq, scope, key, run_id, lim, accepted,"
                " error, at, returned) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                batch,
            )

    def event(
        self, run: str, kind: str, worker: str = "", detail: str = "", at: float | None = None
    ) -> float:
        at = real_time() if at is None else at
        self.execute(
            "INSERT INTO integration_events (run, kind, worker, at, detail) VALUES (%s, %s, %s, %s, %s)",
            [run, kind, worker, at, detail],
        )
        return at

    # -- reading -------------------------------------------------------------------------------
    def completed(self, run: str) -> set[str]:
        """Run ids with at least one body that returned."""
        rows = self.execute(
            "SELECT DISTINCT run_id FROM integration_bodies WHERE run = %s AND outcome = 'ok'", [run]
        )
        return {str(r[0]) for r in rows}

    def body_count(self, run: str) -> int:
        return int(self.execute("SELECT count(*) FROM integration_bodies WHERE run = %s", [run])[0][0])

    def bodies(self, run: str, run_id: str | None = None) -> list[Body]:
        """The run's bodies in start order (of one run id if given)."""
        select = (
            "SELECT scope, key, run_id, token, pid, worker, attempt, started, ended, outcome"
            " FROM integration_bodies"
        )
        return [Body(*row) for row in self._in_start_order(select, run, run_id)]

    def _in_start_order(self, select: str, run: str, run_id: str | None) -> list[tuple[Any, ...]]:
        sql, params = select + " WHERE run = %s", [run]
        if run_id is not None:
            sql += " AND run_id = %s"
            params.append(run_id)
        return self.execute(sql + " ORDER BY started, id", params)

    def load(self, run: str) -> RunData:
        found = self.execute(
            "SELECT run, name, framework, broker, store, store_url, namespace, settings, started, finished"
            " FROM integration_scenarios WHERE run = %s",
            [run],
        )
        if not found:
            raise LookupError(f"no scenario run {run!r} in the log")
        scenario = Scenario(*found[0])
        bodies = tuple(
            Body(*row)
            for row in self.execute(
                "SELECT scope, key, run_id, token, pid, worker, attempt, started, ended, outcome"
                " FROM integration_bodies WHERE run = %s ORDER BY started, id",
                [run],
            )
        )
        enqueues = tuple(
            Enqueue(*row)
            for row in self.execute(
                "SELECT producer, seq, scope, key, run_id, lim, accepted, error, at, returned"
                " FROM integration_enqueues WHERE run = %s ORDER BY at, id",
                [run],
            )
        )
        events = tuple(
            Event(*row)
            for row in self.execute(
                "SELECT kind, worker, at, detail FROM integration_events WHERE run = %s ORDER BY at, id",
                [run],
            )
        )
        return RunData(scenario, bodies, enqueues, events, tuple(self.deliveries(run)))

    def recent(self, limit: int = 20) -> list[tuple[str, str, float, float | None]]:
        rows = self.execute(
            "SELECT run, name, started, finished FROM integration_scenarios ORDER BY started DESC LIMIT %s",
            [limit],
        )
        return [(str(r[0]), str(r[1]), float(r[2]), r[3]) for r in rows]


def perform(
    log: RunLog,
    run: str,
    scope: str,
    key: str,
    run_id: str,
    token: int | None,
    worker: str,
    attempt: int,
    duration: float,
    fail: bool,
) -> None:
    """The body of every integration task: log, sleep ``duration``, raise on a first attempt if ``fail``."""
    with log.body(run, scope, key, run_id, token, worker, attempt):
        time.sleep(duration)
        if fail and attempt == 0:
            raise Flaky(f"{scope}/{key} run {run_id}: failing its first attempt on purpose")
