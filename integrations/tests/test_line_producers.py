"""Issue 26, "How it is proven": sends from processes that end with ``os._exit``, and the line
under skewed clocks.

1. **sends from multiprocessing fork children** — every child builds the app, sends one run of a
   capped key and returns (multiprocessing ends it with ``os._exit``): the cap is exact, every
   accepted run stays in the line past the registration grace (a confirm lost at the child's exit
   would get it dropped, and the cap would then admit one more) and runs once, in the store's
   registration order.
2. **sends from Celery prefork tasks** — a task (``relay``) that sends a singleton run, run by a
   prefork worker with ``--max-tasks-per-child 1`` (each pool process exits with ``os._exit`` after
   one task): the same checks as 1. Celery only.
3. **skewed workers on one queue** — two workers whose clocks are off by +900 s and −900 s share
   one queue; a key of task ``brief`` (orphan_timeout 5 s) has a holder and 8 waiters: each release
   hands the slot to the next run in line at once, and a run sent 35 s later does not overtake them.
   On Dramatiq a deferred copy's ETA is the deferring worker's clock: the other worker keeps a copy
   deferred by the fast one for 1,800 s (issue 26, item 3). The line must not wait for those copies.

Every scenario ends with the checker (``Harness.check``). Its invariant 4 compares start order with
enqueue order within one producer only; each child here is a producer of its own, so the order
across children is asserted here, against the store's line.
"""

from __future__ import annotations

import itertools
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import pytest

from integrations.celery_app import RELAY_TASK
from integrations.checker import store_snapshots
from integrations.runlog import Enqueue
from integrations.runner import CeleryDriver, Workers, make_driver, wait_all_completed, wait_for
from integrations.settings import SINGLETON_TASKS, Settings, real_time
from singleton_tasks import SingletonQueueFullError
from singleton_tasks.config import (
    DEFAULT_LEASE,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_ORPHAN_TIMEOUT,
    DEFAULT_REGISTRATION_GRACE,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_JITTER,
)
from singleton_tasks.outcomes import KeySnapshot

from .conftest import Harness

pytestmark = pytest.mark.workers

#: The library's own timings (the scenarios' defaults are shorter): nothing here needs them short.
LIBRARY_TIMINGS = {
    "lease": DEFAULT_LEASE,
    "orphan_timeout": DEFAULT_ORPHAN_TIMEOUT,
    "retry_delay": DEFAULT_RETRY_DELAY,
    "retry_jitter": DEFAULT_RETRY_JITTER,
}
#: The capped task: limit 1, max_queue_depth 5 — six runs in line at most.
CAPPED = "capped"
#: Past the registration grace by this much before the line is looked at again (the store's clock
#: and the test's may differ a little; the store drops a stale registration at its next call).
GRACE_MARGIN = 1.0


def _line(h: Harness) -> KeySnapshot:
    (snap,) = store_snapshots(h.settings.store_url, h.settings.namespace)
    return snap


def _line_order(snap: KeySnapshot) -> list[str]:
    return [w.run_id for w in sorted(snap.waiters, key=lambda w: w.position)]


def _assert_registration_order(enqueues: list[Enqueue], line: list[str]) -> None:
    """A send that returned before another began registered first: the line must agree."""
    place = {run_id: i for i, run_id in enumerate(line)}
    for a in enqueues:
        for b in enqueues:
            if a.returned is not None and a.returned < b.at:
                assert place[a.run_id] < place[b.run_id], f"{b.run_id} registered before {a.run_id}"


def _assert_ran_once_in_line_order(h: Harness, line: list[str]) -> None:
    bodies = [b for b in h.log.bodies(h.settings.run) if b.run_id in line]
    assert sorted(b.run_id for b in bodies) == sorted(line), "a run ran more than once, or never"
    started = [b.run_id for b in sorted(bodies, key=lambda b: b.start)]
    assert started == line, f"bodies started in the order {started}, the store's line is {line}"


def _sends_keep_cap_and_line(
    h: Harness, enqueues: list[Enqueue], key: str, *, senders: str, settle: float = 0.0
) -> None:
    """Scenarios 1 and 2, once the processes that sent ``enqueues`` (one run each of ``key``) exited
    (``settle`` s after the last send): exactly ``limit + max_queue_depth`` accepted, all confirmed
    and in line in registration order; past the registration grace the line is unchanged and the
    cap still refuses a send (a lost confirm would have got a run dropped); a worker started then
    runs each run once, in that order."""
    limit, depth = SINGLETON_TASKS[CAPPED]
    assert depth is not None
    accepted = [e for e in enqueues if e.accepted]
    assert len(accepted) == limit + depth, f"{len(accepted)} sends accepted"
    assert {e.error for e in enqueues if not e.accepted} == {"SingletonQueueFullError"}
    last = max(e.returned or e.at for e in accepted)
    time.sleep(max(0.0, last + settle - real_time()))
    snap = _line(h)
    line = _line_order(snap)
    assert not snap.holders and sorted(line) == sorted(e.run_id for e in accepted)
    unconfirmed = [w.run_id for w in snap.waiters if not w.confirmed]
    assert not unconfirmed, f"sends of exited {senders} left unconfirmed: {unconfirmed}"
    _assert_registration_order(accepted, line)

    # Past the grace an unconfirmed registration is dropped: a lost confirm shows as a missing run
    # and a free place in the line (the cap counts every accepted run until it settles).
    time.sleep(max(0.0, last + DEFAULT_REGISTRATION_GRACE + GRACE_MARGIN - real_time()))
    late = h.producer.send(CAPPED, key, 0.1, item=len(enqueues))
    assert not late.accepted, "the cap admitted a send past the registration grace: a run was dropped"
    assert _line_order(_line(h)) == line, "the line changed while nothing ran"

    h.workers.start(1)
    wait_all_completed(h.log, h.settings.run, line, timeout=60, workers=h.workers)
    h.check()
    _assert_ran_once_in_line_order(h, line)


# -- 1. sends from multiprocessing fork children -------------------------------------------------
FORK_CHILDREN = 8


def _fork_child(framework: str, settings: Settings, item: int, start_at: float, out: Connection) -> None:
    """One multiprocessing child: its own app, one send, its record to the parent, and return —
    multiprocessing then ends the child with ``os._exit`` (no atexit, no interpreter shutdown).

    Nothing is flushed or closed here: a confirm still pending when the child returns is sent by
    the library's exit hook, or never.
    """
    driver = make_driver(framework, settings)
    prepared = driver.prepare(CAPPED, "F", item, 0.1, False)
    delay = start_at - real_time()
    if delay > 0:
        time.sleep(delay)  # every child sends at once
    at, error = real_time(), None
    try:
        prepared.publish()
    except SingletonQueueFullError:
        error = "SingletonQueueFullError"
    accepted = error is None
    out.send(Enqueue(f"child{item}", 0, CAPPED, "F", prepared.run_id, 1, accepted, error, at, real_time()))
    out.close()


@pytest.mark.timeout(180)
def test_sends_from_fork_children_keep_cap_and_line(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """8 fork children each send one run of a key capped at 6 and exit the multiprocessing way:
    exactly 6 are accepted; after the registration grace they are all still in line, confirmed, and
    a 9th send is still refused; a worker started then runs each once, in registration order."""
    h = harness("fork-children", framework, broker, "postgres", threads=4, **LIBRARY_TIMINGS)
    context = multiprocessing.get_context("fork")
    start_at = real_time() + 1.0
    children, pipes = [], []
    for item in range(FORK_CHILDREN):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(
            target=_fork_child, args=(framework, h.settings, item, start_at, send), name=f"child{item}"
        )
        child.start()
        send.close()
        children.append(child)
        pipes.append(receive)
    enqueues = []
    for receive in pipes:
        assert receive.poll(60), "a child sent no record"
        enqueues.append(receive.recv())
    for child in children:
        child.join(30)
        assert child.exitcode == 0, f"{child.name} exited with {child.exitcode}"
    h.log.enqueues(h.settings.run, enqueues)
    _sends_keep_cap_and_line(h, enqueues, "F", senders="children")


# -- 2. sends from Celery prefork tasks ----------------------------------------------------------
RELAYS = 8


@pytest.mark.frameworks("celery")  # a prefork pool (billiard) process; Dramatiq's children: above
@pytest.mark.timeout(180)
def test_sends_from_prefork_tasks_keep_cap_and_line(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """8 ``relay`` tasks on a prefork worker whose pool processes exit after one task each send one
    run of a key capped at 6: exactly 6 accepted, all confirmed, still in line past the registration
    grace (a 9th send refused); a worker started then runs each once, in registration order."""
    h = harness("prefork-sends", framework, broker, "postgres", threads=4, **LIBRARY_TIMINGS)
    relay_queue = f"{h.settings.queue}_relay"
    relaying = CeleryDriver(h.settings.with_(queue=relay_queue), pool="prefork", max_tasks_per_child=1)
    relayers = Workers(relaying, h.log, h.workers.logdir, threads=4)
    try:
        relayers.start(1)
        for item in range(RELAYS):
            relaying.app.tasks[RELAY_TASK].apply_async(
                (CAPPED, "R", item, 0.1, h.settings.queue), queue=relay_queue
            )
        wait_for(
            lambda: len(h.log.load(h.settings.run).enqueues) == RELAYS,
            timeout=60,
            what=f"{RELAYS} relayed sends",
            workers=relayers,
            interval=0.2,
        )
        enqueues = list(h.log.load(h.settings.run).enqueues)
        pids = {e.producer.split("-")[1] for e in enqueues}
        assert len(pids) == RELAYS, f"relays shared pool processes: {sorted(e.producer for e in enqueues)}"
        # The pool process that sent last may still be exiting (its confirms go at its shutdown).
        _sends_keep_cap_and_line(h, enqueues, "R", senders="pool processes", settle=1.0)
    finally:
        relayers.stop_all()
        relaying.cleanup()


# -- 3. skewed workers on one queue --------------------------------------------------------------
SKEW = 900.0
SKEW_TASK = "brief"  # limit 1, lease 5 s, orphan_timeout 5 s (its task-level timings)
SKEW_WAITERS = 8
#: Each body of the line. 8 waiters behind a holder take at least 8 × 4.5 s = 36 s: the run sent
#: LATE_AFTER s after them always finds some still waiting.
SKEW_BODY = 4.5
LATE_AFTER = 35.0
#: The longest a free slot may stay idle between one body's end and the next one's start.
MAX_HANDOFF = 3.0
LEASE_LOST = ("lost its slot", "evicted orphaned holder")
#: A waiter re-checks at least every max_retry_delay + jitter (10.25 s): unseen longer, its copy
#: was parked (or lost).
PARKED = DEFAULT_MAX_RETRY_DELAY + DEFAULT_RETRY_JITTER + 2.0


def _line_moves(h: Harness, runs: list[str]) -> bool:
    """Whether every run of ``runs`` (in send order) completed; fails at once if one started before
    an earlier one, or if the key's slot has been free for over MAX_HANDOFF s with runs waiting."""
    bodies = h.log.bodies(h.settings.run)  # in start order
    firsts: dict[str, float] = {}
    for body in bodies:
        firsts.setdefault(body.run_id, body.start)
    started = [r for r in firsts if r in runs]
    assert started == runs[: len(started)], (
        f"runs started out of send order: {[runs.index(r) for r in started]}"
    )
    if len(started) < len(runs) and bodies and all(b.end is not None for b in bodies):
        idle = real_time() - max(b.end or 0.0 for b in bodies)
        assert idle <= MAX_HANDOFF, f"the slot has been free {idle:.1f}s; {len(runs) - len(started)} waiting"
    return set(runs) <= h.log.completed(h.settings.run)


def _longest_unseen(h: Harness, run_id: str) -> float:
    """The longest time the run went without a delivery between its send and its first body."""
    first = h.log.bodies(h.settings.run, run_id)[0].start
    sent = [e.at for e in h.log.load(h.settings.run).enqueues if e.run_id == run_id]
    seen = sorted(d.start for d in h.log.deliveries(h.settings.run, run_id) if d.start < first)
    return max(b - a for a, b in itertools.pairwise([*sent, *seen, first]))


@pytest.mark.frameworks("dramatiq")  # Celery's ETAs do not follow the runner's clock shift
@pytest.mark.timeout(240)
def test_skewed_workers_hand_the_line_on_at_each_release(
    harness: Callable[..., Harness], framework: str, broker: str
) -> None:
    """Workers at +900 s and −900 s on one queue: a holder and 8 waiters of one key run one after
    the other in send order, each starting within MAX_HANDOFF s of the previous one's end, and a run
    sent 35 s later runs last. The Redis store: its rules (Lua) hand the line on and its TIME
    decides every deadline.

    Dramatiq only: the runner shifts ``time.time``, which Dramatiq stamps ETAs with; Celery stamps
    them with ``datetime.now`` and its worker times them with kombu's own ``time`` (both real here),
    so its deferred copies are never parked and the scenario would prove nothing scenario 7 does not.
    """
    h = harness("skew-line", framework, broker, "redis", threads=4, **LIBRARY_TIMINGS)
    skewed = {shift: h.workers.start(1, wait=False, clock_shift=shift)[0] for shift in (SKEW, -SKEW)}
    h.workers.wait_ready(list(skewed.values()))
    line = [h.producer.send(SKEW_TASK, "L", SKEW_BODY, item=i) for i in range(1 + SKEW_WAITERS)]
    assert all(r.accepted for r in line)
    runs = [r.run_id for r in line]
    late_at = line[-1].at + LATE_AFTER
    wait_for(
        lambda: _line_moves(h, runs) or real_time() >= late_at,
        timeout=LATE_AFTER + 10,
        what="the late run's time",
        workers=h.workers,
        interval=0.25,
    )
    waiting = [r for r in runs if not h.log.bodies(h.settings.run, r)]
    assert waiting, "the line was done before the late run was sent: nothing to overtake"
    late = h.producer.send(SKEW_TASK, "L", 0.1, item=99)
    assert late.accepted
    runs.append(late.run_id)
    wait_for(lambda: _line_moves(h, runs), timeout=60, what="the line to finish", workers=h.workers)
    h.check()

    bodies = sorted(h.log.bodies(h.settings.run), key=lambda b: b.start)
    pairs = itertools.pairwise(bodies)
    gaps = [after.start - before.end for before, after in pairs if before.end is not None]
    assert len(gaps) == len(bodies) - 1, "a body never ended"
    slow = [f"{gap:.1f}s before body {i + 1}" for i, gap in enumerate(gaps) if gap > MAX_HANDOFF]
    assert not slow, f"a free slot stayed idle: {slow} (gaps {[round(g, 2) for g in gaps]})"
    if broker == "rabbitmq":
        # Item 3 happened: some waiter's copies went unseen far longer than its re-check delay,
        # parked by the worker whose clock is behind. (RedisBroker: that worker's heartbeat looks
        # dead to the other one, whose maintenance keeps requeueing the copies it holds.)
        unseen = max(_longest_unseen(h, run_id) for run_id in runs[1:-1])
        assert unseen > PARKED, f"no deferred copy was parked (waiters unseen {unseen:.1f}s at most)"
    for shift, worker in skewed.items():
        text = worker.text()
        for lost in LEASE_LOST:
            assert lost not in text, f"{worker.name}: {lost!r}\n{text[-3000:]}"
        # The shift took effect: the worker saw it against the store's clock.
        assert ("ahead of" if shift > 0 else "behind") in text, f"{worker.name} logged no clock skew"
