"""The gate's rules, written once over a locked per-key transaction (docs/concepts.md).

A store that keeps its data in rows or dicts implements
:class:`~singleton_tasks.records.KeyTransaction` (a handful of reads and writes of one key's
records, under that key's lock) and gets every rule from here. The Redis store runs the same
rules as Lua scripts (``stores/lua/lib.lua`` mirrors this module function by function); the
contract suite and the model test keep the two identical.

The words used here (holder, waiter, the line, pending, gated, woken, unconfirmed, issue, wake,
re-issue, abandoned, settle, due...) are defined in docs/concepts.md#glossary. Throughout:

- *now* is always the store's clock (:meth:`~singleton_tasks.records.KeyTransaction.now`), never
  a worker's.
- Tokens and generations come from :mod:`singleton_tasks.generations` (the store's clock in
  microseconds, with a counter).
- The two hardest races are drawn as timelines: a wake racing a re-check (:func:`_issue`), and a
  copy issued in a write the store lost
  (:func:`singleton_tasks.generations.issued_in_a_lost_write`, which :func:`claim` asks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import Timings
from .generations import NO_COPY_GENERATION, issued_before, issued_in_a_lost_write, next_counter
from .outcomes import (
    ClaimOutcome,
    Decision,
    DueOutcome,
    PayloadRequest,
    Registered,
    RegisterOutcome,
    ReleaseOutcome,
    RunSpec,
    RunState,
    Wake,
)
from .records import KeyMeta, KeyTransaction, RunRecord

_PAGE = 64


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _waiters(tx: KeyTransaction) -> Iterator[RunRecord]:
    after = 0
    while True:
        page = tx.waiters_from(after, _PAGE)
        yield from page
        if len(page) < _PAGE:
            return
        after = page[-1].seq


def _reissue_at(run: RunRecord, now: float, delay: float = 0.0) -> float | None:
    """When the run, owning a slot with no copy of it seen meanwhile, is issued again."""
    return None if run.orphan_timeout is None else now + delay + run.orphan_timeout + run.recheck


def _seen(run: RunRecord, now: float, delay: float = 0.0) -> None:
    """A live copy of the run (or its registration) reached the store: it is not lost.

    A run sent with a delay is not expected before its delay is up.
    """
    run.seen_at = now
    run.reissue_at = _reissue_at(run, now, delay)


def _issue(run: RunRecord, now: float, scope: str, key: str) -> Wake:
    """Give a waiter a fresh live generation, to be published from its payload.

    Every copy in flight stays live beside it: the last deferred one may never have been
    published (its claim's answer was lost, or its publish failed and the delivery was
    re-published as it was), and a producer's copy may still be queued. Admission
    (:func:`_admit`) leaves one live copy, so the run still runs once. A wake racing the
    re-check (the deferred copy) of the same run::

        t0  worker A: claim(r, 0) -> GATED; A publishes r's re-check G1, delayed   live [0, G1]
        t1  worker A acks the producer's copy                                       live [0, G1]
        t2  worker B: release(holder) -> r is issued G2; B publishes the wake   live [0, G1, G2]
        t3  worker C: claim(r, G2), the wake -> ADMITTED                            live [G2]
        t4  worker D: claim(r, G1), the re-check -> G1 is not live: STALE, dropped

    Either copy may come first (the wake queued behind other messages, or B died before
    publishing it): then the re-check is admitted at t3 and the wake is the stale one. Had t2 left
    G2 the only live copy and B died before publishing it, the re-check would be dropped as
    stale and r would wait for its re-issue (``reissue_at``).
    """
    run.generation = next_counter(run.generation, now)
    run.live = [*run.live, run.generation]
    run.state = RunState.WOKEN
    run.reissue_at = _reissue_at(run, now)  # the issued copy is expected by then
    return Wake(scope, key, run.run_id, run.generation, run.payload)


def _own_due(run: RunRecord, timings: Timings) -> float | None:
    """When a confirmed waiter that owns a slot has work of its own: its re-issue, or (with no
    payload to be issued from) its abandonment. None for an unconfirmed one: the next call on
    its key drops it, and a waiter behind it is due by its own deadline."""
    if not run.confirmed or run.reissue_at is None:
        return None
    if run.payload is not None:
        return run.reissue_at
    return max(run.reissue_at, run.seen_at + timings.retention)


def _lower_due(tx: KeyTransaction, meta: KeyMeta | None, when: float | None) -> None:
    """Make the key due by ``when`` at the latest (a hint: :func:`tick` recomputes it)."""
    if meta is None or when is None or (meta.due_at is not None and meta.due_at <= when):
        return
    meta.due_at = when
    tx.save_meta(meta)


@dataclass
class _Housekept:
    evicted: list[str] = field(default_factory=list)  # orphaned holders
    removed: list[str] = field(default_factory=list)  # abandoned waiters


def _housekeep(tx: KeyTransaction, now: float, timings: Timings, keep: str | None) -> _Housekept:
    """Evict orphaned holders and drop registrations never published; ``keep`` (the caller's
    run) stays."""
    done = _Housekept()
    for holder in tx.holders():
        timeout = holder.orphan_timeout
        if timeout is not None and holder.lease_expires_at + timeout < now and holder.run_id != keep:
            tx.delete_run(holder.run_id)
            done.evicted.append(holder.run_id)
    for run_id in tx.unconfirmed_before(now - timings.registration_grace):
        if run_id != keep:
            tx.delete_run(run_id)
    return done


def _hand_on(
    tx: KeyTransaction,
    meta: KeyMeta,
    scope: str,
    key: str,
    now: float,
    timings: Timings,
    done: _Housekept,
    skip: str | None,
) -> list[Wake]:
    """Issue the waiters that own a free slot and need a copy; set the key's ``due_at``.

    The first ``limit - holders`` waiters in line own the free slots. A gated owner is woken
    (its turn came). A confirmed owner none of whose copies reached the store by its
    ``reissue_at`` is issued again, or abandoned when nothing reached the store for
    ``retention``. Unconfirmed owners hold their place until their grace ends.
    """
    holders = tx.holders()
    free = meta.limit - len(holders)
    wakes: list[Wake] = []
    due: float | None = None
    owners = 0
    if free > 0:
        for run in _waiters(tx):
            if run.run_id != skip and run.confirmed:
                if run.state is RunState.GATED:
                    # Without a payload (Celery arguments JSON cannot carry) the wake is not
                    # published: its deferred copy re-checks it.
                    wakes.append(_issue(run, now, scope, key))
                    tx.save_run(run)
                elif run.reissue_at is not None and run.reissue_at <= now:
                    # Abandoned once issued at least once (a delay longer than retention still
                    # gets its issue) or when it cannot be issued at all (no payload).
                    if now - run.seen_at > timings.retention and (
                        run.state is RunState.WOKEN or run.payload is None
                    ):
                        tx.delete_run(run.run_id)
                        done.removed.append(run.run_id)
                        continue  # the next waiter moves up into its slot
                    if run.payload is not None:
                        wakes.append(_issue(run, now, scope, key))
                        tx.save_run(run)
            if not run.confirmed:
                due = _earliest(due, run.created_at + timings.registration_grace)
            else:
                due = _earliest(due, _own_due(run, timings))
            owners += 1
            if owners == free:
                break
    if tx.count_runs() > len(holders):  # a holder's eviction would hand its slot on
        due = _earliest(due, _eviction_due(holders))
    meta.due_at = due
    return wakes


def _eviction_due(holders: Sequence[RunRecord]) -> float | None:
    """The earliest time one of ``holders`` can be evicted (None: none can)."""
    due: float | None = None
    for holder in holders:
        if holder.orphan_timeout is not None:
            due = _earliest(due, holder.lease_expires_at + holder.orphan_timeout)
    return due


def _take_place(run: RunRecord, payload: bytes | None) -> None:
    """A delivered waiter: its message was published, and the delivered copy is the one to issue."""
    run.confirmed = True
    if payload is not None:
        run.payload = payload
    if run.state is RunState.PENDING:
        run.state = RunState.GATED


def _meta(tx: KeyTransaction, now: float) -> KeyMeta:
    """The key's counters; a key idle past its ``idle_until`` is forgotten, deleted yet or not."""
    meta = tx.meta()
    if meta is None or (meta.idle_until is not None and meta.idle_until < now):
        return KeyMeta()
    return meta


def _finish(tx: KeyTransaction, meta: KeyMeta, now: float, timings: Timings) -> None:
    """Save the counters; an empty key is forgotten after ``retention`` (docs/deployment.md#retention)."""
    if tx.count_runs() == 0:
        meta.seq = 0
        meta.idle_until = now + timings.retention
        meta.due_at = None
    else:
        meta.idle_until = None
    tx.save_meta(meta)


def _new_waiter(
    spec: RunSpec,
    meta: KeyMeta,
    now: float,
    *,
    confirmed: bool,
    generation: int,
    payload: bytes | None,
    delay: float = 0.0,
    seq: int | None = None,
) -> RunRecord:
    """A pending waiter at the back of the line, or at ``seq`` (the place of a run it replaces)."""
    if seq is None:
        meta.seq += 1
        seq = meta.seq
    run = RunRecord(
        run_id=spec.run_id,
        seq=seq,
        state=RunState.PENDING,
        created_at=now,
        confirmed=confirmed,
        generation=generation,
        live=[generation],
        payload=payload,
        lease=spec.lease,
        orphan_timeout=spec.orphan_timeout,
        recheck=spec.recheck,
    )
    _seen(run, now, delay)
    return run


def register(
    tx: KeyTransaction,
    spec: RunSpec,
    *,
    payload: bytes | None,
    delay: float = 0.0,
    confirmed: bool,
    timings: Timings,
) -> RegisterOutcome:
    """Register a pending waiter with its payload, atomically with the backlog cap
    (docs/concepts.md#the-life-of-a-run).

    Every registered run counts until it settles; registrations never published (unconfirmed
    past their grace) are dropped first and count no more. ``delay``: the run is sent with that
    delay (seconds): it is not issued again before the delay is up.

    Over the cap with ``spec.replace_when_full``, the run takes the place in line of the newest
    waiter, which is settled so that every copy of it is stale (REPLACED); with no waiter to
    replace (holders alone fill the cap, as after a limit was lowered) the answer is FULL.
    """
    if tx.get_run(spec.run_id) is not None:
        return RegisterOutcome(Registered.EXISTS, tx.count_runs())
    now = tx.now()
    never_published = tx.unconfirmed_before(now - timings.registration_grace)
    in_flight = tx.count_runs() - len(never_published)
    full = spec.max_queue_depth is not None and in_flight >= spec.limit + spec.max_queue_depth
    # Never-published registrations are waiters, never holders: are there others to replace?
    if full and (not spec.replace_when_full or tx.count_runs() - len(tx.holders()) <= len(never_published)):
        return RegisterOutcome(Registered.FULL, in_flight)
    for run_id in never_published:
        tx.delete_run(run_id)
    replaced = tx.newest_waiter() if full else None
    if replaced is not None:
        tx.delete_run(replaced.run_id)
        tx.mark_settled(replaced.run_id, NO_COPY_GENERATION, now + timings.retention, now)
    meta = _meta(tx, now)
    meta.limit = spec.limit
    holders = tx.holders()
    ahead = tx.count_runs() - len(holders)  # waiters before the new run (a replaced run was last)
    if ahead == 0:  # the first waiter: a holder's eviction now hands it on
        meta.due_at = _earliest(meta.due_at, _eviction_due(holders))
    tx.clear_settled(spec.run_id)
    run = _new_waiter(
        spec,
        meta,
        now,
        confirmed=confirmed,
        generation=0,
        payload=payload,
        delay=delay,
        seq=None if replaced is None else replaced.seq,
    )
    tx.save_run(run)
    meta.due_at = _earliest(meta.due_at, _own_due(run, timings))
    if not confirmed and ahead < meta.limit - len(holders):
        # An owner whose publish may never happen: dropped at its grace's end even if nothing
        # else calls the key (one tick, and none if it settles first).
        meta.due_at = _earliest(meta.due_at, now + timings.registration_grace)
    _finish(tx, meta, now, timings)
    if replaced is not None:
        return RegisterOutcome(Registered.REPLACED, in_flight, replaced=replaced.run_id)
    return RegisterOutcome(Registered.REGISTERED, in_flight + 1)


def confirm(tx: KeyTransaction, run_id: str, *, timings: Timings) -> bool:
    """Mark a registration as published (its message is on its way)."""
    run = tx.get_run(run_id)
    if run is None or run.confirmed:
        return run is not None
    run.confirmed = True
    tx.save_run(run)
    _lower_due(tx, tx.meta(), _own_due(run, timings))
    return True


def park(tx: KeyTransaction, scope: str, key: str, run_id: str, *, timings: Timings) -> list[Wake]:
    """A registration published held back (its publish is done) waits gated with its payload.

    It is then woken like a deferred delivery; its held-back copy stays live as the fallback.
    Only a pending run is parked: one already delivered is left to its delivery. Returns the
    wakes, which include the run itself if a slot freed since it registered.
    """
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.PENDING or run.payload is None:
        return []
    now = tx.now()
    _take_place(run, None)
    _seen(run, now)
    tx.save_run(run)
    meta = _meta(tx, now)
    wakes = _hand_on(tx, meta, scope, key, now, timings, _Housekept(), skip=None)
    _finish(tx, meta, now, timings)
    return wakes


def unregister(tx: KeyTransaction, run_id: str, *, timings: Timings) -> bool:
    """Undo a registration whose publish failed; holders and delivered runs are left alone."""
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.PENDING:
        return False
    tx.delete_run(run_id)
    now = tx.now()
    meta = _meta(tx, now)
    meta.due_at = now  # the line moved: the next heartbeat recomputes what is due
    _finish(tx, meta, now, timings)
    return True


def claim(
    tx: KeyTransaction,
    spec: RunSpec,
    generation: int,
    payload: bytes | PayloadRequest | None,
    *,
    timings: Timings,
) -> ClaimOutcome:
    """Decide one delivery: admit, gate, defer a busy duplicate, or drop a stale copy.

    Every answer also names the waiters the store issues now (``wakes``): a slot may have freed
    since the last call (an eviction), or an owner's copies may be lost, and whoever touches the
    key next hands it on.

    ``PAYLOAD_ON_REQUEST`` (a first delivery of the message its registration stored): the stored
    payload stays; a run with none that could wait in line (not registered, or registered
    without one, and not holding a slot) is answered ``PAYLOAD_NEEDED`` before the run or the
    line is touched, so that no waiter is ever left without a message to be issued from.
    """
    run = tx.get_run(spec.run_id)  # housekeeping keeps the caller's run: read once, here
    if payload is PayloadRequest.ON_REQUEST:
        if run is None or (run.state is not RunState.HOLDING and run.payload is None):
            return ClaimOutcome(Decision.PAYLOAD_NEEDED)
        payload = None
    now = tx.now()
    meta = _meta(tx, now)
    meta.limit = spec.limit
    done = _housekeep(tx, now, timings, keep=spec.run_id)

    def outcome(decision: Decision, wakes: list[Wake], **values: Any) -> ClaimOutcome:
        _finish(tx, meta, now, timings)
        return ClaimOutcome(
            decision, evicted=tuple(done.evicted), wakes=tuple(wakes), removed=tuple(done.removed), **values
        )

    def stale() -> ClaimOutcome:
        return outcome(Decision.STALE, _hand_on(tx, meta, spec.scope, spec.key, now, timings, done, None))

    if run is None:
        settled = tx.settled_generation(spec.run_id, now)
        if settled is not None and settled != generation:
            return stale()  # a dead copy of a settled run
        if settled is None and issued_before(generation, now - timings.retention):
            return stale()  # issued before anything the store remembers: its run settled
        # Never registered (send_task, or a settled run re-driven): first sight
        # (docs/concepts.md#what-other-deliveries-see).
        tx.clear_settled(spec.run_id)
        run = _new_waiter(spec, meta, now, confirmed=True, generation=generation, payload=payload)
    elif generation not in run.live:
        if not issued_in_a_lost_write(run, generation):
            return stale()
        run.live = sorted({*run.live, generation})  # the store's record of the copy, restored
        run.generation = generation
    run.lease = spec.lease
    run.orphan_timeout = spec.orphan_timeout
    run.recheck = spec.recheck

    if run.state is RunState.HOLDING:
        if run.executing and run.lease_expires_at > now:
            run.generation = next_counter(run.generation, now)
            # This copy stays live until its deferred copy is published: a crash in between
            # redelivers it, and it must not be dropped as stale (the run would be lost).
            run.live = sorted({run.holder_generation, generation, run.generation})
            tx.save_run(run)
            wakes = _hand_on(tx, meta, spec.scope, spec.key, now, timings, done, None)
            return outcome(Decision.BUSY, wakes, generation=run.generation)
        takeover = run.executing
        return _admit(tx, meta, spec, run, generation, now, timings, done, takeover=takeover)

    _take_place(run, payload)
    _seen(run, now)
    tx.save_run(run)
    free = meta.limit - len(tx.holders())
    if free > 0 and tx.waiters_before(run.seq) < free:
        return _admit(tx, meta, spec, run, generation, now, timings, done, takeover=False)
    run.generation = next_counter(run.generation, now)
    run.live = sorted({generation, run.generation})
    run.state = RunState.GATED
    tx.save_run(run)
    wakes = _hand_on(tx, meta, spec.scope, spec.key, now, timings, done, run.run_id)
    position = tx.waiters_before(run.seq) + 1
    return outcome(Decision.GATED, wakes, generation=run.generation, position=position)


def _admit(
    tx: KeyTransaction,
    meta: KeyMeta,
    spec: RunSpec,
    run: RunRecord,
    generation: int,
    now: float,
    timings: Timings,
    done: _Housekept,
    *,
    takeover: bool,
) -> ClaimOutcome:
    """The run takes a slot with a new token; the admitted copy becomes its only live one, so
    every other copy in flight (a wake, a re-check: :func:`_issue`) is stale."""
    meta.token = next_counter(meta.token, now)
    run.state = RunState.HOLDING
    run.token = meta.token
    run.holder_generation = generation
    run.live = [generation]
    run.admitted_at = now
    run.heartbeat_at = now
    run.lease_expires_at = now + spec.lease
    run.executing = True
    run.payload = None  # a holder is never issued again: an evicted one ran, or runs no more
    run.reissue_at = None
    tx.save_run(run)
    wakes = _hand_on(tx, meta, spec.scope, spec.key, now, timings, done, run.run_id)
    _finish(tx, meta, now, timings)
    return ClaimOutcome(
        Decision.ADMITTED,
        token=run.token,
        takeover=takeover,
        evicted=tuple(done.evicted),
        wakes=tuple(wakes),
        removed=tuple(done.removed),
    )


def suspend(tx: KeyTransaction, run_id: str, token: int, *, delay: float) -> bool:
    """A holder waits for its retry: it keeps its slot, not executing (docs/concepts.md#the-life-of-a-run)."""
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.HOLDING or run.token != token:
        return False
    now = tx.now()
    run.executing = False
    run.heartbeat_at = now
    run.lease_expires_at = now + delay + run.lease
    tx.save_run(run)
    return True


def heartbeat(tx: KeyTransaction, run_id: str, token: int) -> bool:
    """Extend a running holder's lease; False if the run lost its slot."""
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.HOLDING or run.token != token:
        return False
    now = tx.now()
    run.heartbeat_at = now
    run.lease_expires_at = now + run.lease
    tx.save_run(run)
    return True


def release(
    tx: KeyTransaction,
    scope: str,
    key: str,
    run_id: str,
    *,
    token: int | None,
    generation: int | None,
    timings: Timings,
    waiting_only: bool = False,
) -> ReleaseOutcome:
    """Settle a run: free its slot (or its place in line) and name the waiters to issue.

    ``token=None`` settles whatever the run is (a waiter revoked, an operator release);
    with a token, a holder whose slot now has another owner is reported ``lost``.
    ``waiting_only``: settle the run only while it holds no slot. A discarded copy's run was
    gated when the copy claimed; another copy of it may have been admitted since, and its slot
    is not the discarded copy's to free (it settles where it runs).
    """
    now = tx.now()
    meta = _meta(tx, now)
    done = _housekeep(tx, now, timings, keep=run_id)
    run = tx.get_run(run_id)
    lost = False
    if (
        run is None
        or (token is not None and (run.state is not RunState.HOLDING or run.token != token))
        or (waiting_only and run.state is RunState.HOLDING)
    ):
        # Settled already (idempotent: async interrupts settle twice), taken from us, or (only
        # a waiter to settle) admitted meanwhile by another copy.
        lost = token is not None and (run is not None or tx.settled_generation(run_id, now) is None)
        released = False
    else:
        tx.delete_run(run_id)
        settled = (
            run.holder_generation
            if run.state is RunState.HOLDING
            else (generation if generation is not None else NO_COPY_GENERATION)
        )
        tx.mark_settled(run_id, settled, now + timings.retention, now)
        released = True
    wakes = _hand_on(tx, meta, scope, key, now, timings, done, None)
    _finish(tx, meta, now, timings)
    return ReleaseOutcome(
        released=released,
        lost=lost,
        wakes=tuple(wakes),
        evicted=tuple(done.evicted),
        removed=tuple(done.removed),
    )


def tick(tx: KeyTransaction, scope: str, key: str, *, timings: Timings) -> DueOutcome:
    """Do what a due key has to do by itself: evict orphaned holders, drop registrations never
    published, issue owners whose copies are lost (a heartbeat thread's call on a key with no
    traffic). The caller publishes the wakes."""
    now = tx.now()
    meta = tx.meta()
    if meta is None or (meta.idle_until is not None and meta.idle_until < now):
        return DueOutcome(scope, key)
    done = _housekeep(tx, now, timings, keep=None)
    wakes = _hand_on(tx, meta, scope, key, now, timings, done, None)
    _finish(tx, meta, now, timings)
    return DueOutcome(scope, key, tuple(wakes), tuple(done.evicted), tuple(done.removed))
