"""The scenarios of issue 5, each over framework × broker (SINGLETON_TEST_BROKER) × store.

Every scenario ends with the invariant checker over its whole log (``Harness.check``), which
prints its table and fails the test on any broken invariant; the asserts here add what is
specific to the scenario.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from integrations.checker import store_snapshots
from integrations.runlog import Body
from integrations.runner import (
    REPO,
    BackgroundLoad,
    Chaos,
    PostgresServer,
    RedisServer,
    Worker,
    make_driver,
    soak_keys,
    soak_load,
    wait_all_completed,
    wait_for,
)
from integrations.settings import SINGLETON_TASKS
from singleton_tasks.config import (
    DEFAULT_LEASE,
    DEFAULT_ORPHAN_TIMEOUT,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_JITTER,
)

from .conftest import Harness

pytestmark = pytest.mark.workers

SOAK_RUNS = int(os.environ.get("INTEGRATION_SOAK_RUNS", "2000"))
STORES = ["redis", "postgres"]
#: SQLite too (its workers share one file on one host) where a cell is cheap: kill the holder, SIGTERM,
#: live duplicate (plus the soak and producers at a cap). Not the lost holder: its eviction after
#: orphan_timeout is store logic the contract tests run on SQLite, and the cell would cost ~7 s per
#: environment. Not the outages: a SQLite store has no server to stop (see "store outage" below).
ONE_HOST_STORES = [*STORES, "sqlite"]


def started(h: Harness, run_id: str, *, count: int = 1, timeout: float = 30.0) -> list[Body]:
    """Wait until ``count`` bodies of the run have started; returns them in start order."""
    wait_for(
        lambda: len(h.log.bodies(h.settings.run, run_id)) >= count,
        timeout=timeout,
        what=f"{count} bodies of run {run_id}",
        workers=h.workers,
    )
    return h.log.bodies(h.settings.run, run_id)


def exited_cleanly(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Each process exits 0 within ``timeout``; one that does not is killed with the rest (a hung
    producer must fail this test, not leave a running process to the next one)."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            assert proc.returncode == 0, out.decode(errors="replace")[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def worker_of(h: Harness, body: Body) -> Worker:
    return next(w for w in h.workers.all if w.name == body.worker)


# -- 1. soak with SIGKILL --------------------------------------------------------------------------
@pytest.mark.timeout(900)
@pytest.mark.parametrize("store", ["redis", "postgres", "sqlite"])
def test_soak_with_sigkill(harness: Callable[..., Harness], framework: str, broker: str, store: str) -> None:
    """3 workers, 20 keys of mixed limits and caps, ≥ 2,000 runs, ~10 % raising, SIGKILL every 2–4 s."""
    # orphan_timeout 10 s: longer than any redelivery after a kill (RabbitMQ: at once; RedisBroker:
    # heartbeat_timeout 4 s; kombu Redis: visibility_timeout 8 s), short enough that a message the
    # broker loses stalls its key only briefly.
    h = harness("soak", framework, broker, store, pool="prefork", orphan_timeout=10.0)
    h.workers.start(3)
    chaos = Chaos(h.workers, every=(2.0, 4.0))
    chaos.start()
    try:
        # A fast machine may finish the runs before 3 kills: keep the load on until then.
        soak_load(h.producer, soak_keys(20), runs=SOAK_RUNS, more=lambda: chaos.kills < 3)
    finally:
        chaos.stop()
    h.drain([r.run_id for r in h.producer.accepted()], timeout=240)
    result = h.check()
    assert chaos.kills >= 3, "the soak must have killed workers"
    assert result.accepted >= SOAK_RUNS
    assert result.rejected > 0, "the capped keys were pushed past their cap"
    assert result.retried_runs > 0, "raising bodies were retried"


# -- 2. kill the holder ----------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", ONE_HOST_STORES)
def test_killed_holder_takes_its_slot_back(
    harness: Callable[..., Harness], framework: str, broker: str, store: str
) -> None:
    """The redelivered message of a SIGKILLed holder reclaims its slot before any same-key waiter."""
    h = harness("kill-holder", framework, broker, store, lease=3.0, orphan_timeout=60.0, pool="prefork")
    h.workers.start(2)
    holder = h.producer.send("mutex", "K", duration=6.0)
    first = started(h, holder.run_id)[0]
    waiters = [h.producer.send("mutex", "K", duration=0.2, item=i) for i in range(3)]
    # The waiters were delivered and gated before the kill.
    wait_for(
        lambda: any(
            len(s.waiters) == 3 and all(w.state.value != "pending" for w in s.waiters)
            for s in store_snapshots(h.settings.store_url, h.settings.namespace)
        ),
        timeout=20,
        what="three gated waiters",
        workers=h.workers,
    )
    killed_at = h.workers.kill(worker_of(h, first))
    h.workers.start(1, wait=False)
    wait_all_completed(
        h.log, h.settings.run, [holder.run_id] + [w.run_id for w in waiters], timeout=90, workers=h.workers
    )
    h.check()
    again = h.log.bodies(h.settings.run, holder.run_id)
    assert len(again) == 2 and again[0].end is None and again[1].outcome == "ok"
    assert again[1].start >= killed_at
    assert again[1].token is not None and first.token is not None and again[1].token > first.token
    waiter_starts = [h.log.bodies(h.settings.run, w.run_id)[0].start for w in waiters]
    assert all(start > again[1].start for start in waiter_starts), "a waiter slipped in before the holder"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", STORES)
def test_lost_holder_is_evicted_after_orphan_timeout(
    harness: Callable[..., Harness], framework: str, broker: str, store: str
) -> None:
    """A SIGKILLed holder whose message was purged is evicted after ``orphan_timeout``; the key moves on."""
    lease, orphan_timeout = 3.0, 3.0
    h = harness("lost-holder", framework, broker, store, lease=lease, orphan_timeout=orphan_timeout)
    (worker,) = h.workers.start(1)
    holder = h.producer.send("mutex", "L", duration=60.0)
    first = started(h, holder.run_id)[0]
    h.workers.kill(worker)
    h.driver.purge(expect=1)
    h.log.event(h.settings.run, "purge", detail=json.dumps([holder.run_id]))
    h.workers.start(1)
    waiter = h.producer.send("mutex", "L", duration=0.1)
    wait_all_completed(h.log, h.settings.run, [waiter.run_id], timeout=60, workers=h.workers)
    result = h.check()
    assert result.purged == [holder.run_id]
    assert h.log.bodies(h.settings.run, holder.run_id) == [first], "the purged run came back"
    next_start = h.log.bodies(h.settings.run, waiter.run_id)[0].start
    # Its lease ran out (≥ lease after its admission) and then orphan_timeout passed.
    assert next_start >= first.start + lease + orphan_timeout - 0.5


# -- 3. store outage -------------------------------------------------------------------------------
# Redis and PostgreSQL only: an outage stops the store's server while the broker stays up. A SQLite
# store is a file that every worker opens in-process; there is no server to stop, and a file made
# unreadable is a different failure (a permission error, not StoreUnavailableError at a timeout).
OUTAGE_KEYS = [("mutex", "o0"), ("mutex", "o1"), ("pair", "o2"), ("capped", "o3"), ("plain", "o4")]


def _outage(h: Harness, stop: Callable[[], None], start: Callable[[], None], down_for: float = 5.0) -> None:
    h.workers.start(2)
    load = BackgroundLoad(h.producer, OUTAGE_KEYS)
    load.start()
    try:
        time.sleep(3.0)
        h.log.event(h.settings.run, "store_stopping")
        stop()
        down_at = h.log.event(h.settings.run, "store_down")
        time.sleep(down_for)
        restart_at = h.log.event(h.settings.run, "store_restart")
        start()
        h.log.event(h.settings.run, "store_up")
        time.sleep(3.0)
    finally:
        load.stop()
    records = list(h.producer.records)
    accepted = [r.run_id for r in records if r.accepted]
    wait_all_completed(h.log, h.settings.run, accepted, timeout=120, workers=h.workers)
    h.check()
    during = [r for r in records if down_at < r.at < restart_at]
    assert during and all(not r.accepted for r in during if r.scope != "plain"), "accepted while down"
    assert all(r.error == "StoreUnavailableError" for r in during if r.scope != "plain")
    assert sum(r.accepted for r in records if r.at > restart_at + 1.0 and r.scope != "plain") > 0
    # No body started without a slot: nothing was admitted while the store was down.
    bodies = [
        b
        for b in h.log.bodies(h.settings.run)
        if b.scope in SINGLETON_TASKS and down_at + 0.5 < b.start < restart_at
    ]
    assert not bodies, f"singleton bodies started during the outage: {bodies[:5]}"


@pytest.mark.timeout(300)
def test_redis_store_outage(
    harness: Callable[..., Harness], redis_server: RedisServer, framework: str, broker: str
) -> None:
    """The store's own redis-server stops for 5 s under load (the broker stays up)."""
    h = harness(
        "outage",
        framework,
        broker,
        "redis",
        store_url=redis_server.url,
        orphan_timeout=120.0,
        store_timeout=2.0,
    )
    _outage(h, redis_server.stop, redis_server.start)


@pytest.mark.timeout(300)
def test_postgres_store_restart(
    harness: Callable[..., Harness], postgres_server: PostgresServer, framework: str, broker: str
) -> None:
    """The store's own PostgreSQL is stopped (fast shutdown) for 5 s under load and started again."""
    h = harness(
        "outage",
        framework,
        broker,
        "postgres",
        store_url=postgres_server.url,
        orphan_timeout=120.0,
        store_timeout=2.0,
    )
    _outage(h, postgres_server.stop, postgres_server.start)


# -- 4. graceful shutdown --------------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", ONE_HOST_STORES)
def test_sigterm_with_holders_and_prefetched_waiters(
    harness: Callable[..., Harness], framework: str, broker: str, store: str
) -> None:
    """SIGTERM a worker that holds 4 slots and has their waiters prefetched: nothing lost, no stuck key."""
    # 5 threads: 4 run the holders, 1 gates waiters (their deferred copies wait in the worker's
    # memory, unacked); the rest stay prefetched, undelivered.
    h = harness("sigterm", framework, broker, store, orphan_timeout=60.0, threads=5, pool="prefork")
    (worker,) = h.workers.start(1)
    holders, waiters = [], []
    for k in range(4):
        holders.append(h.producer.send("mutex", f"T{k}", duration=2.5))
    for i in range(3):
        for k in range(4):
            waiters.append(h.producer.send("mutex", f"T{k}", duration=0.1, item=i))
    for holder in holders:
        started(h, holder.run_id)
    wait_for(
        lambda: (
            sum(
                len([w for w in s.waiters if w.state.value != "pending"])
                for s in store_snapshots(h.settings.store_url, h.settings.namespace)
            )
            >= 4
        ),
        timeout=20,
        what="waiters delivered and gated",
        workers=h.workers,
    )
    assert not any(b.end for holder in holders for b in h.log.bodies(h.settings.run, holder.run_id))
    h.workers.terminate(worker)
    exited = time.time()
    h.workers.start(1)
    everything = [r.run_id for r in holders + waiters]
    wait_all_completed(h.log, h.settings.run, everything, timeout=90, workers=h.workers)
    result = h.check()
    assert result.killed_bodies == 0
    for holder in holders:
        bodies = h.log.bodies(h.settings.run, holder.run_id)
        assert len(bodies) == 1 and bodies[0].outcome == "ok" and (bodies[0].end or 0) < exited


# -- 5. producers at a cap -------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("store", ["redis", "postgres", "sqlite"])
def test_producers_at_a_cap(harness: Callable[..., Harness], framework: str, broker: str, store: str) -> None:
    """2 processes × 8 threads enqueue 160 runs of one key with max_queue_depth=5 and no worker."""
    limit, depth = SINGLETON_TASKS["capped"]
    assert depth == 5
    h = harness("cap", framework, broker, store)
    start_at = time.time() + 4.0
    env = {**os.environ, **h.settings.env(), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "integrations.runner",
                "hammer",
                "--framework",
                framework,
                "--name",
                f"p{i}",
                "--threads",
                "8",
                "--per-thread",
                "10",
                "--key",
                "C",
                "--start-at",
                str(start_at),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    exited_cleanly(procs, timeout=120)
    enqueues = h.log.load(h.settings.run).enqueues
    assert len(enqueues) == 160
    accepted = {e.run_id for e in enqueues if e.accepted}
    assert len(accepted) == limit + depth
    assert {e.error for e in enqueues if not e.accepted} == {"SingletonQueueFullError"}
    assert len({e.producer.split(".")[0] for e in enqueues}) == 2  # both producer processes raced
    (snap,) = store_snapshots(h.settings.store_url, h.settings.namespace)
    assert {w.run_id for w in snap.waiters} == accepted and not snap.holders
    h.workers.start(1)
    wait_all_completed(h.log, h.settings.run, sorted(accepted), timeout=60, workers=h.workers)
    h.check()


# -- 6. live duplicate -----------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("store", ONE_HOST_STORES)
def test_live_duplicate_is_deferred_never_concurrent(
    harness: Callable[..., Harness], framework: str, broker: str, store: str
) -> None:
    """A second copy of a running holder's message (a duplicate publish / a visibility-timeout
    redelivery) is delivered while the holder runs, deferred, and dropped after: the body runs once."""
    visibility = framework == "celery" and broker == "redis"
    h = harness(
        "duplicate", framework, broker, store, lease=3.0, visibility_timeout=2.0 if visibility else 8.0
    )
    h.workers.start(2)
    holder = h.producer.send("mutex", "D", duration=6.0)
    first = started(h, holder.run_id)[0]
    if not visibility:
        h.driver.duplicate(holder.run_id)
        h.log.event(h.settings.run, "duplicate", detail=holder.run_id)
    waiter = h.producer.send("mutex", "D", duration=0.1)
    wait_all_completed(h.log, h.settings.run, [holder.run_id, waiter.run_id], timeout=60, workers=h.workers)
    time.sleep(2.0)  # the duplicate's deferred copies come back and must be dropped
    h.check()
    bodies = h.log.bodies(h.settings.run, holder.run_id)
    assert len(bodies) == 1 and bodies[0].start == first.start, f"the holder ran {len(bodies)} bodies"
    body = bodies[0]
    assert body.outcome == "ok" and body.end is not None
    # The duplicate really arrived: a delivery of the holder's run to task code (before the gate)
    # that began while the holder's body was running, and that the gate turned away.
    deliveries = [d for d in h.log.deliveries(h.settings.run, holder.run_id) if d.kind == "delivery"]
    during = [d for d in deliveries if body.start < d.start < body.end]
    assert during, (
        f"no second copy of {holder.run_id} was delivered while its body ran "
        f"[{body.start:.3f}, {body.end:.3f}]: deliveries {deliveries}"
    )
    for d in during:
        assert d.detail.startswith(("skipped", "IGNORED")), f"the duplicate was not turned away: {d}"
    assert len(h.log.bodies(h.settings.run, waiter.run_id)) == 1


# -- 7. skewed clocks ------------------------------------------------------------------------------
#: How far the skewed hosts' clocks are off: a quarter hour either way, and just under a minute.
CLOCK_SHIFTS = [900.0, -900.0, 59.0]
SKEW_HOLD = 12.0  # the first run of each key
SKEW_GAP = 3.0  # the second run is enqueued this long after the first
LEASE_LOST = ("lost its slot", "evicted orphaned holder")


def _skew_warning(shift: float) -> str:
    return "ahead of" if shift > 0 else "behind"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", STORES)
def test_skewed_clocks_share_keys_safely(
    harness: Callable[..., Harness], framework: str, broker: str, store: str
) -> None:
    """Workers and producers whose ``time.time`` is off by +900 s, −900 s or +59 s share keys with a
    true-clock worker (each worker on its own queue): a 12 s holder and a second run 3 s later never
    overlap, get increasing tokens, and the second starts as soon as the first ends.

    Keys ``A*``: holder on the true worker, second run on a skewed one; ``B*``: the other way round;
    ``P*``: both enqueued by a producer process with a skewed clock (holder to the true worker,
    second run to the worker skewed alike). Every decision is the store's, so no skew can evict a
    heartbeating holder or hold a key up for the skew's length.
    """
    h = harness("skew", framework, broker, store, lease=3.0, orphan_timeout=10.0, threads=8)
    queues = {shift: f"{h.settings.queue}_s{i}" for i, shift in enumerate(CLOCK_SHIFTS)}
    drivers = {shift: make_driver(framework, h.settings.with_(queue=q)) for shift, q in queues.items()}
    try:
        workers = h.workers.start(1, wait=False)
        skewed = {
            shift: h.workers.start(1, wait=False, threads=4, queue=queues[shift], clock_shift=shift)[0]
            for shift in CLOCK_SHIFTS
        }
        h.workers.wait_ready([*workers, *skewed.values()])
        env = {**os.environ, **h.settings.env(), "PYTHONPATH": str(REPO)}
        producers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "integrations.runner",
                    "pair",
                    "--framework",
                    framework,
                    "--name",
                    f"skewed{i}",
                    "--key",
                    f"P{i}",
                    "--duration",
                    str(SKEW_HOLD),
                    "--gap",
                    str(SKEW_GAP),
                    "--second-queue",
                    queues[shift],
                ],
                cwd=REPO,
                env={**env, "INTEGRATION_CLOCK_SHIFT": str(shift)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for i, shift in enumerate(CLOCK_SHIFTS)
        ]
        for i, shift in enumerate(CLOCK_SHIFTS):
            h.producer.send("mutex", f"A{i}", SKEW_HOLD)
            h.producer.send("mutex", f"B{i}", SKEW_HOLD, via=drivers[shift])
        time.sleep(SKEW_GAP)
        for i, shift in enumerate(CLOCK_SHIFTS):
            h.producer.send("mutex", f"A{i}", 0.2, item=1, via=drivers[shift])
            h.producer.send("mutex", f"B{i}", 0.2, item=1)
        exited_cleanly(producers, timeout=60)
        h.producer.flush()
        enqueues = h.log.load(h.settings.run).enqueues
        assert all(e.accepted for e in enqueues) and len(enqueues) == 6 * len(CLOCK_SHIFTS)
        wait_all_completed(h.log, h.settings.run, [e.run_id for e in enqueues], timeout=90, workers=h.workers)
        h.check()
        for key in sorted({e.key for e in enqueues}):
            bodies = sorted((b for b in h.log.bodies(h.settings.run) if b.key == key), key=lambda b: b.start)
            line = [e.run_id for e in sorted((e for e in enqueues if e.key == key), key=lambda e: e.at)]
            firsts = {b.run_id: b for b in reversed(bodies)}  # each run's first body
            first, second = firsts[line[0]], firsts[line[1]]
            assert first.start < second.start, f"key {key}: not in enqueue order"
            # One at a time, tokens rising in start order. A run may run again after it settled: on
            # Dramatiq's RedisBroker another worker's maintenance takes a skewed worker's heartbeat
            # for a dead worker's and requeues its unacked messages; the admitted copy coming back
            # after settlement is a new claim (docs/concepts.md#the-life-of-a-run) — never
            # alongside another body.
            for before, after in itertools.pairwise(bodies):
                assert before.end is not None and after.start >= before.end, f"key {key}: overlap"
                assert before.token is not None and after.token is not None and after.token > before.token
            # Woken at the release, not after a skew-sized (or lease-sized) wait.
            assert first.end is not None
            waited = second.start - first.end
            assert 0 <= waited < 8.0, f"key {key}: the second run waited {waited:.1f}s"
        for worker in h.workers.all:
            for text in LEASE_LOST:
                assert text not in worker.text(), f"{worker.name}: {text!r}\n{worker.text()[-3000:]}"
        for shift, worker in skewed.items():  # the shift took effect: the worker saw it against the store
            assert _skew_warning(shift) in worker.text(), f"{worker.name} ({shift:+}s) logged no skew warning"
    finally:
        for driver in drivers.values():
            driver.cleanup()


# -- 8. a task lease shorter than the middleware's -------------------------------------------------
@pytest.mark.timeout(180)
def test_task_lease_shorter_than_middleware_heartbeat(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """Task ``brief`` (lease 5 s, orphan_timeout 5 s) runs a 25 s body under a middleware with its
    defaults (lease 60 s: heartbeats every 20 s if they followed the middleware): the holder is
    heartbeated on its own lease, never evicted, and a waiter behind it starts only after it ends.

    One store per framework (Redis for Dramatiq, PostgreSQL for Celery): the heartbeat pace is the
    worker's, the same for every store.
    """
    store = "redis" if framework == "dramatiq" else "postgres"
    h = harness(
        "task-lease",
        framework,
        broker,
        store,
        lease=DEFAULT_LEASE,
        orphan_timeout=DEFAULT_ORPHAN_TIMEOUT,
        retry_delay=DEFAULT_RETRY_DELAY,
        retry_jitter=DEFAULT_RETRY_JITTER,
        threads=2,
    )
    (worker,) = h.workers.start(1)
    holder = h.producer.send("brief", "S", duration=25.0)
    first = started(h, holder.run_id)[0]
    waiter = h.producer.send("brief", "S", duration=0.2, item=1)
    wait_all_completed(h.log, h.settings.run, [holder.run_id, waiter.run_id], timeout=90, workers=h.workers)
    h.check()
    bodies = h.log.bodies(h.settings.run, holder.run_id)
    assert bodies == [first] or (len(bodies) == 1 and bodies[0].start == first.start)
    assert bodies[0].end is not None and bodies[0].end - bodies[0].start >= 25.0
    (second,) = h.log.bodies(h.settings.run, waiter.run_id)
    assert second.start >= bodies[0].end, "the waiter overlapped the 25 s holder"
    for text in LEASE_LOST:
        assert text not in worker.text(), f"{text!r} in the worker's log:\n{worker.text()[-3000:]}"


# -- 9. purged copies ------------------------------------------------------------------------------
#: One store per scenario (the rules are the same on every store, the contract suite runs them;
#: the CI budget pays for one cell per environment): Redis here, where the rules are Lua and the
#: due keys a per-namespace index the heartbeat threads read; PostgreSQL for scenarios 10 and 11.
PURGE_STORE = "redis"
#: Short timings, so "within orphan_timeout + re-check + one heartbeat interval of its turn" is
#: seconds: re-check = max_retry_delay + retry_jitter.
SHORT = {
    "lease": 3.0,
    "orphan_timeout": 3.0,
    "retry_delay": 0.3,
    "retry_jitter": 0.1,
    "max_retry_delay": 1.0,
    "heartbeat_interval": 0.5,
}
#: How long after its turn a re-issued run takes to be delivered and start (a publish, a poll, a
#: worker thread), on a loaded 2-core machine.
DELIVERY_SLACK = 2.0


def reissue_bound(settings: dict[str, float]) -> float:
    """How long after its turn a waiter whose copies are lost is issued again
    (docs/deployment.md#purging-broker-queues)."""
    recheck = settings["max_retry_delay"] + settings["retry_jitter"]
    return settings["orphan_timeout"] + recheck + settings["heartbeat_interval"]


def ran_once_in_line(h: Harness, line: list[str]) -> list[Body]:
    """Each run of ``line`` (registration order) ran exactly one body, and they started in that
    order one after the other; returns the bodies."""
    bodies = []
    for run_id in line:
        ran = h.log.bodies(h.settings.run, run_id)
        assert len(ran) == 1 and ran[0].outcome == "ok", f"run {run_id} ran {len(ran)} bodies: {ran}"
        bodies.append(ran[0])
    for before, after in itertools.pairwise(bodies):
        assert before.end is not None and after.start >= before.end, (
            f"{after.run_id} started at {after.start:.3f}, before {before.run_id} (registered "
            f"earlier) ended at {before.end}"
        )
    return bodies


@pytest.mark.timeout(240)
def test_purged_waiters_run_in_order_within_the_bound(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """Every copy of a key's waiters is purged (queue and delay queue; the worker is stopped first,
    so it hands back the deferred and held-back copies it held), gated waiters and a pending one
    (sent while no worker consumes, never delivered): each still runs exactly once, in registration
    order, within orphan_timeout + re-check + one heartbeat interval of its turn, with no other
    traffic on the key (the new worker's heartbeat thread issues the first one). A capped key
    (``max_queue_depth=5``) counts its purged waiters until they settle, then admits again.

    Celery has no delay queue: its deferred and held-back copies wait in the worker as ETA
    messages, unacked; the graceful stop hands them back to the broker, where the purge finds them.
    """
    h = harness("purged-line", framework, broker, PURGE_STORE, threads=4, **SHORT)
    bound = reissue_bound(SHORT)
    limit, depth = SINGLETON_TASKS["capped"]
    assert depth is not None
    (worker,) = h.workers.start(1)
    holders = {
        "Q": h.producer.send("mutex", "Q", duration=2.0),
        "C": h.producer.send("capped", "C", duration=2.0),
    }
    for holder in holders.values():
        started(h, holder.run_id)
    gated = {
        "Q": [h.producer.send("mutex", "Q", duration=0.1, item=i) for i in (1, 2)],
        "C": [h.producer.send("capped", "C", duration=0.1, item=i) for i in range(1, depth + 1)],
    }
    assert all(r.accepted for line in gated.values() for r in line)
    assert not h.producer.send("capped", "C", item=99).accepted, "the capped key was not full"
    wait_for(
        lambda: (
            sum(
                len([w for w in s.waiters if w.state.value != "pending"])
                for s in store_snapshots(h.settings.store_url, h.settings.namespace)
            )
            == sum(len(line) for line in gated.values())
        ),
        timeout=20,
        what="every waiter gated",
        workers=h.workers,
    )
    # A graceful stop: the holders finish (their releases publish wakes) and the worker hands every
    # copy it held back to the broker. Then, with no worker, a pending waiter of each key (the
    # capped one has a place again: its holder settled).
    h.workers.terminate(worker)
    pending = {
        "Q": h.producer.send("mutex", "Q", duration=0.1, item=3),
        "C": h.producer.send("capped", "C", duration=0.1, item=6),
    }
    assert all(r.accepted for r in pending.values())
    lines = {key: [r.run_id for r in [*gated[key], pending[key]]] for key in gated}
    h.driver.purge()
    time.sleep(1.0)  # a copy the broker requeued for the closed connection just after the purge
    h.driver.purge()
    h.log.event(h.settings.run, "purge", detail=json.dumps([r for line in lines.values() for r in line]))
    # The purged waiters still count against the cap: nothing settled them.
    assert not h.producer.send("capped", "C", item=98).accepted, "the capped key forgot its purged waiters"
    h.workers.start(1)
    ready = time.time()
    everything = [r for line in lines.values() for r in line]
    wait_all_completed(h.log, h.settings.run, everything, timeout=60, workers=h.workers)
    for key, line in lines.items():
        bodies = ran_once_in_line(h, line)
        ends = [b.end for b in h.log.bodies(h.settings.run, holders[key].run_id)]
        turn = max(ready, *(end or 0.0 for end in ends))
        for body in bodies:
            late = body.start - turn
            assert late <= bound + DELIVERY_SLACK, (
                f"key {key}: run {body.run_id} started {late:.1f}s after its turn (bound {bound:.1f}s)"
            )
            turn = body.end or body.start
    # Settled, the capped key admits again: exactly limit + max_queue_depth.
    again = [h.producer.send("capped", "C", duration=0.1, item=20 + i) for i in range(limit + depth)]
    assert all(r.accepted for r in again), "the capped key still counts settled runs"
    assert not h.producer.send("capped", "C", item=97).accepted
    wait_all_completed(h.log, h.settings.run, [r.run_id for r in again], timeout=60, workers=h.workers)
    result = h.check()
    assert sorted(result.purged_ran) == sorted(everything) and not result.purged


# -- 10. a queue backlog ---------------------------------------------------------------------------
BACKLOG_STORE = "postgres"
#: Seconds of plain messages queued ahead of the key's runs on a one-thread worker: several times
#: orphan_timeout + re-check, so the key's first run is issued again several times before it is
#: delivered at all.
BACKLOG = 16.0
BACKLOG_GAP = 2.5  # a send of the key this often
#: A body's end is logged just before its release reaches the store.
RELEASE_SLACK = 0.5


@pytest.mark.timeout(240)
def test_queue_backlog_keeps_the_cap_and_the_order(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """A key (limit 1, ``max_queue_depth=2``, orphan_timeout 3 s) sent every 2.5 s to a one-thread
    worker whose queue holds 16 s of plain messages ahead: its runs wait far longer than
    orphan_timeout + re-check for their first delivery, and count all the while. Exactly
    ``limit + max_queue_depth`` are accepted until one settles (the rest raise
    SingletonQueueFullError); every accepted run runs once, in order; the copies the store issued
    again for the first run while it waited never run it twice.
    """
    h = harness("backlog", framework, broker, BACKLOG_STORE, threads=1, **SHORT)
    limit, depth = SINGLETON_TASKS["narrow"]
    assert depth is not None
    cap = limit + depth
    h.workers.start(1)
    for i in range(round(BACKLOG / 0.5)):
        h.producer.send("plain", "bg", duration=0.5, item=i)
    sends = []
    deadline = time.monotonic() + BACKLOG + 60.0
    settled_at: float | None = None
    while settled_at is None or not any(r.accepted and r.at > settled_at for r in sends):
        assert time.monotonic() < deadline, "the key's first run never settled"
        sends.append(h.producer.send("narrow", "N", duration=0.2, item=len(sends)))
        first = next(r for r in sends if r.accepted)
        ended = [b.end for b in h.log.bodies(h.settings.run, first.run_id) if b.end is not None]
        settled_at = min(ended, default=None)
        time.sleep(BACKLOG_GAP)
    accepted = [r for r in sends if r.accepted]
    wait_all_completed(h.log, h.settings.run, [r.run_id for r in accepted], timeout=60, workers=h.workers)
    line = [r.run_id for r in accepted]
    bodies = dict(zip(line, ran_once_in_line(h, line), strict=True))
    for send in sends:
        # Runs in flight at the send: accepted earlier, body not ended by then. The store counts at
        # least these (a run counts until its release, just after its body's end).
        in_flight = [r for r in accepted if r.at < send.at and (bodies[r.run_id].end or 0.0) > send.at]
        if send.accepted:
            assert len(in_flight) < cap, f"accepted at {send.at:.1f} over the cap: {len(in_flight)} in flight"
        else:
            assert send.error == "SingletonQueueFullError", send
            just_ended = [
                r for r in accepted if send.at - RELEASE_SLACK <= (bodies[r.run_id].end or 0.0) <= send.at
            ]
            assert len(in_flight) + len(just_ended) >= cap, f"rejected at {send.at:.1f} below the cap"
    rejected = [r for r in sends if not r.accepted]
    waited = bodies[accepted[0].run_id].start - accepted[0].at
    recheck_bound = SHORT["orphan_timeout"] + SHORT["max_retry_delay"] + SHORT["retry_jitter"]
    assert waited > 3 * recheck_bound, f"the first run waited only {waited:.1f}s for its delivery"
    assert len(rejected) >= 3, "the cap was never reached"
    # The store issued the waiting first run again (its copies were overdue): those copies were
    # delivered too, and dropped.
    copies = [d for d in h.log.deliveries(h.settings.run, accepted[0].run_id) if d.kind == "delivery"]
    assert len(copies) >= 2, f"the first run was never issued again: {copies}"
    h.check()


# -- 11. an argument the broker cannot encode -------------------------------------------------------
#: The worker's re-check delay is 10 s here (the library's default): a registration left behind by
#: the failed send would hold the next run up for seconds.
AT_ONCE = 2.0


@pytest.mark.timeout(120)
def test_unencodable_argument_raises_and_leaves_nothing(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """``.send()`` / ``.delay()`` of a run with an ``object()`` argument raises the adapter's typed
    error (Dramatiq ``PayloadError``, Celery ``SingletonPayloadError``): nothing in the store,
    nothing published, and the key's next run starts at once."""
    h = harness("unencodable", framework, broker, "postgres")
    h.workers.start(1)
    bad = h.producer.send("mutex", "U", duration=0.1, item=object())  # type: ignore[arg-type]
    assert not bad.accepted
    assert bad.error == ("PayloadError" if framework == "dramatiq" else "SingletonPayloadError")
    assert store_snapshots(h.settings.store_url, h.settings.namespace) == [], "the failed send registered"
    follower = h.producer.send("mutex", "U", duration=0.1, item=1)
    wait_all_completed(h.log, h.settings.run, [follower.run_id], timeout=30, workers=h.workers)
    (body,) = h.log.bodies(h.settings.run, follower.run_id)
    assert body.start - follower.at < AT_ONCE, f"the next run waited {body.start - follower.at:.1f}s"
    time.sleep(1.0)  # a published copy of the failed send would have been delivered by now
    assert h.log.deliveries(h.settings.run, bad.run_id) == [], "the failed send was published"
    assert h.log.bodies(h.settings.run, bad.run_id) == []
    h.check()


# -- 12. on_full="drop" ------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_burst_over_the_cap_runs_the_first_limit_plus_depth_and_drops_the_rest(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """Task ``coalesced`` (limit 1, ``max_queue_depth=1``, ``on_full="drop"``): a burst of 12 sends with
    no worker raises nothing; exactly the first two are registered, the others publish nothing and
    leave nothing; a worker then runs exactly those two, in order."""
    limit, depth = SINGLETON_TASKS["coalesced"]
    assert depth is not None
    h = harness("drop", framework, broker, "redis")
    sends = [h.producer.send("coalesced", "D", duration=0.2, item=i) for i in range(12)]
    assert all(r.accepted for r in sends), "a dropped send raised"
    (snap,) = store_snapshots(h.settings.store_url, h.settings.namespace)
    kept = [r.run_id for r in sends[: limit + depth]]
    assert [w.run_id for w in snap.waiters] == kept and not snap.holders
    dropped = {r.run_id for r in sends[limit + depth :]}
    h.producer.mark_dropped(dropped)
    if framework == "celery":  # the result of the run last in line
        assert {h.producer.returned[run_id].id for run_id in dropped} == {kept[-1]}  # type: ignore[attr-defined]
    h.workers.start(1)
    wait_all_completed(h.log, h.settings.run, kept, timeout=60, workers=h.workers)
    assert ran_once_in_line(h, kept)
    time.sleep(1.0)  # a published copy of a dropped send would have been delivered by now
    assert not any(h.log.deliveries(h.settings.run, run_id) for run_id in dropped), (
        "a dropped send was published"
    )
    h.check()


# -- 13. on_full="replace" ---------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_burst_while_the_first_runs_replaces_the_waiter_and_runs_the_first_and_the_last(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """Task ``latest`` (limit 1, ``max_queue_depth=1``, ``on_full="replace"``): while its first run
    runs, a burst of 19 sends of the key raises nothing, each replacing the one before in line;
    exactly the first and the last run, once each, in order. The replaced runs' copies are
    delivered and dropped, never run."""
    assert SINGLETON_TASKS["latest"] == (1, 1)
    h = harness("replace", framework, broker, "redis")
    h.workers.start(1)
    first = h.producer.send("latest", "R", duration=3.0, item=0)
    started(h, first.run_id)
    burst = [h.producer.send("latest", "R", duration=0.2, item=i) for i in range(1, 20)]
    assert all(r.accepted for r in burst), "a replacing send raised"
    (snap,) = store_snapshots(h.settings.store_url, h.settings.namespace)
    assert [x.run_id for x in snap.holders] == [first.run_id]
    assert [w.run_id for w in snap.waiters] == [burst[-1].run_id], "the latest send is not the one waiting"
    replaced = {r.run_id for r in burst[:-1]}
    h.producer.mark_dropped(replaced, error="replaced")
    wait_all_completed(h.log, h.settings.run, [first.run_id, burst[-1].run_id], timeout=60, workers=h.workers)
    assert ran_once_in_line(h, [first.run_id, burst[-1].run_id])
    time.sleep(1.0)  # a replaced run's copies have been delivered (and dropped) by now
    assert not any(h.log.bodies(h.settings.run, run_id) for run_id in replaced), "a replaced run ran"
    h.check()
