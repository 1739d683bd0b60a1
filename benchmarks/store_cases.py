"""Store-level cases: admission cost against the backlog (5) and PostgreSQL lock scope (6)."""

from __future__ import annotations

import functools
import statistics
import threading
import time
import uuid
from collections.abc import Callable

from singleton_tasks import store_from_url
from singleton_tasks.outcomes import Decision, RunSpec
from singleton_tasks.stores import Store

from .common import POSTGRES_URL, STORE_REDIS_URL, Report, Row, Size, flush_redis, unique


# -- case 5: admission cost at few vs many waiters ------------------------------------------
class Line:
    """One key with a holder and ``waiters`` gated waiters (each delivered once, payload stored)."""

    PAYLOAD = b"x" * 400  # about the size of an encoded Dramatiq message

    def __init__(self, store: Store, key: str, waiters: int) -> None:
        self.store, self.key = store, key
        self.holder = self._spec()
        store.register(self.holder)
        self.token = store.claim(self.holder, 0, self.PAYLOAD).token
        self.back: list[tuple[RunSpec, int]] = []
        for _ in range(waiters):
            self.back.append(self.enqueue())

    def _spec(self) -> RunSpec:
        return RunSpec(scope="bench", key=self.key, run_id=uuid.uuid4().hex)

    def enqueue(self) -> tuple[RunSpec, int]:
        """A new waiter at the back of the line: registered, delivered, gated."""
        spec = self._spec()
        self.store.register(spec)
        outcome = self.store.claim(spec, 0, self.PAYLOAD)
        assert outcome.decision is Decision.GATED and outcome.generation is not None
        return spec, outcome.generation

    def recheck_back(self) -> float:
        """The last waiter's delayed copy re-checks (stays gated): seconds."""
        spec, generation = self.back[-1]
        t0 = time.perf_counter()
        outcome = self.store.claim(spec, generation, self.PAYLOAD)
        elapsed = time.perf_counter() - t0
        assert outcome.decision is Decision.GATED and outcome.generation is not None
        self.back[-1] = (spec, outcome.generation)
        return elapsed

    def handoff(self) -> tuple[float, float, float]:
        """Release the holder, admit the head (its wake), register a new waiter at the back."""
        t0 = time.perf_counter()
        released = self.store.release("bench", self.key, self.holder.run_id, token=self.token)
        t1 = time.perf_counter()
        (wake,) = released.wakes
        spec, _ = self.back.pop(0)
        assert wake.run_id == spec.run_id
        t2 = time.perf_counter()
        outcome = self.store.claim(spec, wake.generation, self.PAYLOAD)
        t3 = time.perf_counter()
        assert outcome.decision is Decision.ADMITTED
        self.holder, self.token = spec, outcome.token
        spec_new = self._spec()
        t4 = time.perf_counter()
        self.store.register(spec_new)
        t5 = time.perf_counter()
        gated = self.store.claim(spec_new, 0, self.PAYLOAD)
        assert gated.generation is not None
        self.back.append((spec_new, gated.generation))
        return t1 - t0, t3 - t2, t5 - t4


def case_admission(report: Report, size: Size) -> None:
    store = store_from_url(STORE_REDIS_URL, namespace=unique("adm"))
    store.migrate()
    few, many = 10, size.waiters_many
    try:
        t0 = time.perf_counter()
        lines = {few: Line(store, "few", few), many: Line(store, "many", many)}
        setup = time.perf_counter() - t0
        samples: dict[tuple[int, str], list[float]] = {
            (w, op): [] for w in lines for op in ("recheck", "release", "admit", "register")
        }
        for _ in range(size.admissions):  # interleaved: drift on a shared machine hits both sides
            for waiters, line in lines.items():
                samples[(waiters, "recheck")].append(line.recheck_back())
                release, admit, register = line.handoff()
                samples[(waiters, "release")].append(release)
                samples[(waiters, "admit")].append(admit)
                samples[(waiters, "register")].append(register)
    finally:
        store.close()
        flush_redis(STORE_REDIS_URL)
    case = f"5 store ops on one key, {few} vs {many:,} gated waiters (Redis store)"
    worst = 0.0
    labels = {
        "admit": "claim → admitted (head, woken)",
        "recheck": "claim → gated (back of line)",
        "release": "release + wake",
        "register": "register at the back",
    }
    for op, label in labels.items():
        a = [v * 1e6 for v in samples[(few, op)]]
        b = [v * 1e6 for v in samples[(many, op)]]
        base = f"{label} @ {few}"
        report.add(Row(case, base, "µs", a, higher_is_better=False, key=f"adm.{op}.few"))
        report.add(
            Row(
                case,
                f"{label} @ {many:,}",
                "µs",
                b,
                baseline=base,
                higher_is_better=False,
                key=f"adm.{op}.many",
            )
        )
        worst = max(worst, statistics.median(b) / statistics.median(a))
    report.notes.append(
        f"case 5 set-up (two lines, {few + many:,} waiters registered and gated) took {setup:.1f} s"
    )
    report.target(
        "5", f"admission at {few} vs {many:,} waiters ≤ 1.5×", f"worst op {worst:.2f}×", worst <= 1.5
    )


# -- case 6: PostgreSQL, distinct keys vs one key --------------------------------------------
def _admissions(
    store: Store, threads: int, seconds: float, key_of: Callable[[int], str], limit: int
) -> float:
    """Threads loop register → claim (admitted) → release; returns admissions per second."""
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop(t: int) -> None:
        key = key_of(t)
        start.wait()
        try:
            while not stop.is_set():
                spec = RunSpec(scope="bench", key=key, run_id=uuid.uuid4().hex, limit=limit)
                store.register(spec)
                outcome = store.claim(spec, 0, None)
                if outcome.decision is not Decision.ADMITTED:
                    raise RuntimeError(f"not admitted: {outcome.decision}")
                store.release("bench", key, spec.run_id, token=outcome.token)
                counts[t] += 1
        except BaseException as error:  # surfaced below
            errors.append(error)

    workers = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join(30)
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def _same_key(tag: str, thread: int) -> str:
    return f"s{tag}"


def case_postgres(report: Report, size: Size, runs: int) -> None:
    threads = 16
    store = store_from_url(POSTGRES_URL, namespace=unique("pg"), min_size=threads, max_size=threads)
    store.migrate()
    distinct: list[float] = []
    same: list[float] = []
    try:
        _admissions(store, threads, 0.3, lambda t: f"warm{t}", threads)  # open the pool's connections
        for _ in range(runs):
            tag = uuid.uuid4().hex[:6]
            distinct.append(
                _admissions(store, threads, size.pg_seconds, functools.partial("d{0}:{1}".format, tag), 1)
            )
            # limit = 16 on the shared key, so every claim is admitted: only the row lock differs.
            same.append(
                _admissions(store, threads, size.pg_seconds, functools.partial(_same_key, tag), threads)
            )
    finally:
        store.close()
    case = f"6 PostgreSQL store, {threads} threads, register+claim+release"
    report.add(Row(case, "one key (limit 16)", "admissions/s", same, key="pg.same"))
    report.add(
        Row(case, "distinct keys", "admissions/s", distinct, baseline="one key (limit 16)", key="pg.distinct")
    )
    ratio = statistics.median(distinct) / statistics.median(same)
    report.target("6", "PostgreSQL distinct keys ≥ 5× one key", f"{ratio:.2f}×", ratio >= 5)
