"""Races on the real servers: 2 processes x 8 threads hit one key at once (docs/concepts.md#backlog-cap).

Overlap is measured outside the store: a counter shared by the processes
(``multiprocessing.Value`` under its lock) goes up right *after* an admission and down right
*before* the release, so it can only undercount the holders a store allows at once; it must
still never exceed the limit. Every admission's fencing token is returned to the parent.
"""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from conftest import backend_params

from singleton_tasks import Store, store_from_url
from singleton_tasks.outcomes import Decision, Registered, RunSpec

PROCESSES = 2
THREADS = 8
ROUNDS = 3
SCOPE = "races"

real_backends = pytest.mark.parametrize("backend", backend_params(["sqlite", "redis", "postgres"]))


def _in_threads(body: Callable[[int], Any], barrier: Any) -> tuple[list[Any], list[str]]:
    """Run ``body(thread_index)`` on THREADS threads released together; results and errors."""
    results: list[Any] = []
    errors: list[str] = []
    start = threading.Barrier(THREADS)

    def thread(index: int) -> None:
        try:
            start.wait()
            results.append(body(index))
        except BaseException as error:  # reported to the parent, which fails the test
            errors.append(f"{type(error).__name__}: {error}")

    barrier.wait()  # both processes are connected and ready
    threads = [threading.Thread(target=thread, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def mutex_process(
    url: str,
    namespace: str,
    key: str,
    limit: int,
    process: int,
    barrier: Any,
    counter: Any,
    peak: Any,
    out: Any,
) -> None:
    store = store_from_url(url, namespace=namespace)
    store.snapshot(scope=SCOPE, key=key)  # connect before the start line
    rng = random.Random(process)

    def body(thread: int) -> list[tuple[str, int]]:
        admissions = []
        for round_ in range(ROUNDS):
            spec = RunSpec(SCOPE, key, f"p{process}-t{thread}-r{round_}", limit=limit)
            assert store.register(spec).status is Registered.REGISTERED
            generation = 0
            while True:  # a deferral loop as the broker would run it, minus the delay
                outcome = store.claim(spec, generation, b"payload")
                if outcome.decision is Decision.ADMITTED:
                    break
                assert outcome.decision is Decision.GATED, outcome
                assert outcome.generation is not None
                generation = outcome.generation
                time.sleep(0.005)
            assert outcome.token is not None
            with counter.get_lock():
                counter.value += 1
                peak.value = max(peak.value, counter.value)
            # The body lasts until the key is full (or 0.2 s): on a loaded host a slow store
            # would otherwise hand off so late that the holders never overlap at all.
            full_by = time.monotonic() + 0.2
            while counter.value < limit and time.monotonic() < full_by:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.005, 0.015))
            with counter.get_lock():
                counter.value -= 1
            release = store.release(SCOPE, key, spec.run_id, token=outcome.token)
            assert release.released and not release.lost, release
            admissions.append((spec.run_id, outcome.token))
        return admissions

    try:
        results, errors = _in_threads(body, barrier)
    finally:
        store.close()
    out.put(([a for admissions in results for a in admissions], errors))


def cap_process(
    url: str, namespace: str, key: str, depth: int, replace: bool, process: int, barrier: Any, out: Any
) -> None:
    store = store_from_url(url, namespace=namespace)
    store.snapshot(scope=SCOPE, key=key)

    def body(thread: int) -> list[tuple[str, str, str | None]]:
        outcomes = []
        for i in range(ROUNDS):
            run_id = f"p{process}-t{thread}-{i}"
            spec = RunSpec(SCOPE, key, run_id, limit=2, max_queue_depth=depth, replace_when_full=replace)
            outcome = store.register(spec)
            outcomes.append((run_id, outcome.status.value, outcome.replaced))
        return outcomes

    try:
        results, errors = _in_threads(body, barrier)
    finally:
        store.close()
    out.put(([s for statuses in results for s in statuses], errors))


def run_processes(
    target: Callable[..., None], before: tuple[Any, ...], after: tuple[Any, ...] = ()
) -> list[tuple[list[Any], list[str]]]:
    """Start PROCESSES spawned ``target(*before, index, barrier, *after, queue)``; their reports."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    out = context.Queue()
    processes = [
        context.Process(target=target, args=(*before, index, barrier, *after, out), daemon=True)
        for index in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    reports = [out.get(timeout=90) for _ in processes]
    for process in processes:
        process.join(timeout=30)
        assert process.exitcode == 0, process.exitcode
    return reports


@pytest.mark.slow  # child processes and threads
@real_backends
@pytest.mark.timeout(180)
def test_limit_holds_across_processes_and_threads(
    store_factory: Callable[..., Store], store_url: str
) -> None:
    namespace = f"race{uuid.uuid4().hex[:10]}"
    parent = store_factory(namespace=namespace)  # creates the schema
    key, limit = "one key", 2
    context = multiprocessing.get_context("spawn")
    counter, peak = context.Value("i", 0), context.Value("i", 0)
    reports = run_processes(mutex_process, (store_url, namespace, key, limit), (counter, peak))
    errors = [e for _, errs in reports for e in errs]
    assert errors == []
    admissions = [a for adm, _ in reports for a in adm]
    runs = PROCESSES * THREADS * ROUNDS
    assert len(admissions) == runs and len({run_id for run_id, _ in admissions}) == runs
    tokens = sorted(token for _, token in admissions)
    assert len(set(tokens)) == runs, "two admissions got the same fencing token"
    assert peak.value <= limit, f"{peak.value} runs held the key at once (limit {limit})"
    assert peak.value == limit, "the key was never contended: the race did not happen"
    assert counter.value == 0
    assert parent.snapshot(scope=SCOPE, key=key) == []


@real_backends
@pytest.mark.parametrize("on_full", ["raise", "replace"])
@pytest.mark.timeout(180)
def test_cap_holds_across_processes_and_threads(
    store_factory: Callable[..., Store], store_url: str, on_full: str
) -> None:
    """Over the cap a send is refused, or (``on_full="replace"``) replaces the newest waiter: the
    key holds exactly ``limit + max_queue_depth`` runs either way."""
    namespace = f"cap{uuid.uuid4().hex[:10]}"
    parent = store_factory(namespace=namespace)
    key, depth = "capped key", 5
    reports = run_processes(cap_process, (store_url, namespace, key, depth, on_full == "replace"))
    assert [e for _, errs in reports for e in errs] == []
    outcomes = [o for got, _ in reports for o in got]
    statuses = [status for _, status, _ in outcomes]
    assert len(statuses) == PROCESSES * THREADS * ROUNDS
    assert statuses.count("registered") == 2 + depth
    over = "replaced" if on_full == "replace" else "full"
    assert statuses.count(over) == len(statuses) - (2 + depth)
    replaced = [old for _, _, old in outcomes if old is not None]
    assert len(set(replaced)) == len(replaced)  # each run replaced at most once
    snaps = parent.snapshot(scope=SCOPE, key=key)
    assert len(snaps) == 1 and len(snaps[0].waiters) == 2 + depth
    in_line = {run_id for run_id, status, _ in outcomes if status != "full"} - set(replaced)
    assert {w.run_id for w in snaps[0].waiters} == in_line
