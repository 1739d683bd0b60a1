"""The gate's rules, written once over a locked per-key transaction (docs/concepts.md).

A store that keeps its data in rows or dicts implements :class:`KeyTransaction` (a handful
of reads and writes of one key's records, under that key's lock) and gets every rule from
here. The Redis store runs the same rules as Lua scripts; the contract suite and the model
test keep the two identical.

Names of the three parts that decide a delivery, used the same way across the package:

- *the gate*: the decision every delivery of a singleton task passes before its body runs;
  *the rules* are this module (``singleton_tasks.gate``), run by every store.
- *the gatekeeper*: :class:`singleton_tasks.runtime.Gatekeeper`, one worker process's side of
  the gate (its store, options and heartbeat thread), shared by both adapters.
- *the gate hook*: where an adapter hands a delivery to the gatekeeper (Dramatiq:
  ``SingletonMiddleware.before_process_message``; Celery: ``SingletonTask.before_start``).

Glossary (docs/concepts.md has the user's account of each):

- *holder*: a run that owns one of the key's ``limit`` slots; *waiter*: any other registered run
  (*pending*: registered, never delivered; *gated*: delivered and deferred; *woken*: gated, and
  a wake copy of it was published).
- *copy*: one message of a run; every copy the library publishes carries a *generation*, and a
  run's record lists its *live* generations. A delivery of a generation that is not live is a
  *stale copy*: dropped, never run, unless the store issued it in a write it has since lost
  (:func:`issued_in_a_lost_write`): that copy is the run's, and it is live.
- *wake*: the copy published when a waiter's turn comes (a slot freed ahead of it): its stored
  payload, live as a new generation (:class:`~singleton_tasks.outcomes.Wake`).
- *held back*: a message published with a delay (Dramatiq's ``delay``, Celery's ``countdown`` /
  ``eta``); its registration is *parked* (:func:`park`): it waits gated with its payload, so its
  turn wakes it even before the delay is up.
- *first sight*: a delivery of a run the store does not know (Celery's ``send_task``, a task
  declared only where its workers run, a settled run re-driven): it is registered at its own
  claim.
- *seen*: a live copy of a run (or its registration) reached the store. A waiter unseen for
  its orphan timeout plus its longest re-check delay (an unpublished registration: for the
  registration grace) is *passed over*: it owns no slot and does not count against the backlog
  cap until it is seen again. Passed over for ``retention`` more, it is *removed*.
- *ghost*: a registration whose message was never published (the producer died between
  registering and publishing): unconfirmed, it is passed over after the registration grace.
- *takeover*: an admission over a holder whose lease lapsed while it was running (its worker
  died or hung): the new holder gets a higher fencing token, the old one loses its slot.
- *now*: always the store's clock (:meth:`KeyTransaction.now`), never a worker's.
- Tokens and generations are drawn from the store's clock in microseconds combined with a
  counter (``max(previous + 1, now in µs)``): tokens keep increasing after a key's state
  expired, and a generation tells when its copy was issued.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import DEFAULT_LEASE, DEFAULT_MAX_RETRY_DELAY, DEFAULT_ORPHAN_TIMEOUT, DEFAULT_RETRY_JITTER
from .outcomes import (
    ClaimOutcome,
    Decision,
    Registered,
    RegisterOutcome,
    ReleaseOutcome,
    RunSpec,
    RunState,
    Wake,
)

#: An unpublished registration is passed over after this many seconds (a producer died between
#: registering and publishing: its message never comes).
DEFAULT_REGISTRATION_GRACE = 10.0
#: How long a store remembers a settled run and an idle key (seconds): one day.
DEFAULT_RETENTION = 86_400.0


@dataclass
class KeyMeta:
    """Per scope+key counters; ``seq`` restarts when the key has no runs."""

    token: int = 0
    seq: int = 0
    limit: int = 1
    #: The key has no runs: after this time it is forgotten (None while it has runs).
    idle_until: float | None = None


@dataclass
class RunRecord:
    """One registered run of a key."""

    run_id: str
    seq: int
    state: RunState
    created_at: float
    confirmed: bool
    generation: int  # highest generation allocated to this run's copies
    live: list[int] = field(default_factory=list)  # generations whose delivery may act
    payload: bytes | None = None  # the message to publish when woken
    token: int = 0
    holder_generation: int = 0
    admitted_at: float = 0.0
    heartbeat_at: float = 0.0
    lease_expires_at: float = 0.0
    executing: bool = False
    lease: float = DEFAULT_LEASE
    orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT
    recheck: float = DEFAULT_MAX_RETRY_DELAY + DEFAULT_RETRY_JITTER
    seen_at: float = 0.0  # when a live copy (or the registration) last reached the store
    passed_over_at: float | None = None  # a waiter unseen until then is passed over (None: never)

    def copy(self) -> RunRecord:
        return dataclasses.replace(self, live=list(self.live))


#: RunRecord's fields in their declared order, the order of :func:`encode_run` and
#: :func:`decode_run`. The SQL schema (stores/sql/) and the Lua (stores/lua/) name them again:
#: the contract suite checks every store against these rules.
RUN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunRecord))


def encode_run(run: RunRecord) -> dict[str, object]:
    """A run's stored values by field name: ``state`` as its value, ``live`` as ``"1,2"``, the
    rest as they are."""
    values: dict[str, object] = {name: getattr(run, name) for name in RUN_FIELDS}
    values["state"] = run.state.value
    values["live"] = ",".join(str(g) for g in run.live)
    return values


def _optional_float(value: object) -> float | None:
    return None if value is None or value == b"" or value == "" else float(value)  # type: ignore[arg-type]


def decode_run(run_id: str, values: Sequence[Any]) -> RunRecord:
    """A run from its stored values in :data:`RUN_FIELDS` order after ``run_id``, as a driver
    returns them: numbers as numbers, text or bytes; booleans as 0/1; ``None`` or empty for none."""
    (
        seq,
        state,
        created_at,
        confirmed,
        generation,
        live,
        payload,
        token,
        holder_generation,
        admitted_at,
        heartbeat_at,
        lease_expires_at,
        executing,
        lease,
        orphan_timeout,
        recheck,
        seen_at,
        passed_over_at,
    ) = values
    if isinstance(live, bytes):
        live = live.decode()
    return RunRecord(
        run_id=run_id,
        seq=int(seq),
        state=RunState(state.decode() if isinstance(state, bytes) else state),
        created_at=float(created_at),
        confirmed=bool(int(confirmed)),
        generation=int(generation),
        live=[int(g) for g in live.split(",") if g] if live else [],
        payload=None if payload is None else bytes(payload),
        token=int(token),
        holder_generation=int(holder_generation),
        admitted_at=float(admitted_at),
        heartbeat_at=float(heartbeat_at),
        lease_expires_at=float(lease_expires_at),
        executing=bool(int(executing)),
        lease=float(lease),
        orphan_timeout=_optional_float(orphan_timeout),
        recheck=float(recheck),
        seen_at=float(seen_at),
        passed_over_at=_optional_float(passed_over_at),
    )


class KeyTransaction(abc.ABC):
    """One key's records, read and written while that key is locked by the store."""

    @abc.abstractmethod
    def now(self) -> float:
        """The store's clock (epoch seconds), read while the key is locked."""

    @abc.abstractmethod
    def meta(self) -> KeyMeta | None:
        """The key's counters as stored, or None if there are none (never used, or forgotten)."""

    @abc.abstractmethod
    def save_meta(self, meta: KeyMeta) -> None:
        """Create or update the key's counters.

        With ``meta.idle_until`` set the key has no runs left: the store may delete everything
        of it after that time (its settled markers expire by then too).
        """

    @abc.abstractmethod
    def get_run(self, run_id: str) -> RunRecord | None:
        """The run's record under this key."""

    @abc.abstractmethod
    def save_run(self, run: RunRecord) -> None:
        """Insert or update a run's record."""

    @abc.abstractmethod
    def delete_run(self, run_id: str) -> None:
        """Remove a run's record."""

    @abc.abstractmethod
    def holders(self) -> list[RunRecord]:
        """The runs holding a slot (at most ``limit`` of them)."""

    @abc.abstractmethod
    def count_runs(self) -> int:
        """Holders plus waiters of the key."""

    @abc.abstractmethod
    def waiters_from(self, after_seq: int, count: int) -> list[RunRecord]:
        """Up to ``count`` waiters with ``seq > after_seq``, in registration order."""

    @abc.abstractmethod
    def waiters_before(self, seq: int) -> int:
        """How many waiters registered before ``seq``."""

    @abc.abstractmethod
    def count_passed_over(self, now: float) -> int:
        """How many waiters are passed over at ``now`` (``passed_over_at < now``)."""

    @abc.abstractmethod
    def passed_over_before(self, before: float) -> list[str]:
        """Run ids of the waiters with ``passed_over_at < before``."""

    @abc.abstractmethod
    def settled_generation(self, run_id: str, now: float) -> int | None:
        """The admitted generation of a recently settled run, or None."""

    @abc.abstractmethod
    def mark_settled(self, run_id: str, generation: int, expires_at: float, now: float) -> None:
        """Remember a settled run's admitted generation until ``expires_at``; drop expired ones."""

    @abc.abstractmethod
    def clear_settled(self, run_id: str) -> None:
        """Forget a settled-run marker (the run is claimed anew)."""


@dataclass(frozen=True)
class Timings:
    """Store-wide durations of the rules, in seconds."""

    #: An unpublished (unconfirmed) registration is passed over after this.
    registration_grace: float = DEFAULT_REGISTRATION_GRACE
    #: Settled markers, idle keys and long-passed-over waiters are forgotten after this.
    retention: float = DEFAULT_RETENTION


_PAGE = 64


def micros(now: float) -> int:
    """A store time as whole microseconds: the clock part of tokens and generations."""
    return math.floor(now * 1_000_000)


def issued_before(generation: int, moment: float) -> bool:
    """Whether a library copy of ``generation`` was issued before ``moment`` (0: the producer's copy)."""
    return generation != 0 and generation < micros(moment)


def issued_in_a_lost_write(run: RunRecord, generation: int) -> bool:
    """Whether a copy of ``run`` carries a generation the store issued after it recorded the run,
    in a write it no longer has (an asynchronous failover, an evicted Redis): newer than every
    generation the record knows, and issued after the record was created.

    Such a copy is the only one of its run left (its predecessors were acked when it was
    published): dropped as stale, the run would never run. A re-driven run's record is newer than
    every copy of the run's earlier life, so those stay stale.
    """
    return generation > run.generation and generation >= micros(run.created_at)


def _next(counter: int, now: float) -> int:
    """The next token or generation: above every earlier one, and at least the clock in µs."""
    return max(counter + 1, micros(now))


def _waiters(tx: KeyTransaction) -> Iterator[RunRecord]:
    after = 0
    while True:
        page = tx.waiters_from(after, _PAGE)
        yield from page
        if len(page) < _PAGE:
            return
        after = page[-1].seq


def _passed_over(run: RunRecord, now: float) -> bool:
    """A waiter none of whose copies has shown up for too long (docs/concepts.md#passed-over-waiters)."""
    return run.passed_over_at is not None and run.passed_over_at < now


def _seen(run: RunRecord, now: float, timings: Timings) -> None:
    """A live copy of the run (or its registration) reached the store: it is not gone."""
    run.seen_at = now
    if not run.confirmed:
        run.passed_over_at = now + timings.registration_grace  # its message may never come
    elif run.orphan_timeout is None:
        run.passed_over_at = None
    else:
        run.passed_over_at = now + run.orphan_timeout + run.recheck


def _slot_owners(tx: KeyTransaction, free: int, now: float) -> list[RunRecord]:
    """The first ``free`` waiters in order that are not passed over: they own the free slots."""
    owners: list[RunRecord] = []
    if free <= 0:
        return owners
    for run in _waiters(tx):
        if not _passed_over(run, now):
            owners.append(run)
            if len(owners) == free:
                break
    return owners


@dataclass
class _Housekept:
    evicted: list[str] = field(default_factory=list)  # orphaned holders
    removed: list[str] = field(default_factory=list)  # waiters passed over for ``retention`` more


def _housekeep(tx: KeyTransaction, now: float, timings: Timings, keep: str | None) -> _Housekept:
    """Evict orphaned holders and remove waiters long gone; ``keep`` (the caller's run) stays."""
    done = _Housekept()
    for holder in tx.holders():
        timeout = holder.orphan_timeout
        if timeout is not None and holder.lease_expires_at + timeout < now and holder.run_id != keep:
            tx.delete_run(holder.run_id)
            done.evicted.append(holder.run_id)
    for run_id in tx.passed_over_before(now - timings.retention):
        if run_id != keep:
            tx.delete_run(run_id)
            done.removed.append(run_id)
    return done


def _wakes(
    tx: KeyTransaction, meta: KeyMeta, scope: str, key: str, now: float, skip: str | None
) -> list[Wake]:
    """Gated waiters that now own a free slot get a fresh live generation to be published."""
    free = meta.limit - len(tx.holders())
    wakes = []
    for run in _slot_owners(tx, free, now):
        if run.state is RunState.GATED and run.run_id != skip:
            run.generation = _next(run.generation, now)
            # Every copy in flight stays live beside the wake: the last deferred one may never
            # have been published (its claim's answer was lost, or its publish failed and the
            # delivery was re-published as it was), and a payload-less wake is not published
            # at all. Admission leaves one live copy, so the run still runs once.
            run.live = [*run.live, run.generation]
            run.state = RunState.WOKEN
            tx.save_run(run)
            wakes.append(Wake(scope, key, run.run_id, run.generation, run.payload))
    return wakes


def _take_place(run: RunRecord, payload: bytes | None) -> None:
    """A waiter whose message is known (delivered, or published held back) keeps it to be woken.

    A pending one becomes gated: it takes its place in line again and is woken by a release
    (docs/concepts.md#passed-over-waiters).
    """
    run.confirmed = True
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
    else:
        meta.idle_until = None
    tx.save_meta(meta)


def _new_waiter(
    spec: RunSpec, meta: KeyMeta, now: float, timings: Timings, *, confirmed: bool, generation: int
) -> RunRecord:
    meta.seq += 1
    run = RunRecord(
        run_id=spec.run_id,
        seq=meta.seq,
        state=RunState.PENDING,
        created_at=now,
        confirmed=confirmed,
        generation=generation,
        live=[generation],
        lease=spec.lease,
        orphan_timeout=spec.orphan_timeout,
        recheck=spec.recheck,
    )
    _seen(run, now, timings)
    return run


def register(tx: KeyTransaction, spec: RunSpec, *, confirmed: bool, timings: Timings) -> RegisterOutcome:
    """Register a pending waiter, atomically with the backlog cap (docs/concepts.md#the-life-of-a-run)."""
    if tx.get_run(spec.run_id) is not None:
        return RegisterOutcome(Registered.EXISTS, tx.count_runs())
    now = tx.now()
    in_flight = tx.count_runs() - tx.count_passed_over(now)
    if spec.max_queue_depth is not None and in_flight >= spec.limit + spec.max_queue_depth:
        return RegisterOutcome(Registered.FULL, in_flight)
    meta = _meta(tx, now)
    meta.limit = spec.limit
    tx.clear_settled(spec.run_id)
    tx.save_run(_new_waiter(spec, meta, now, timings, confirmed=confirmed, generation=0))
    _finish(tx, meta, now, timings)
    return RegisterOutcome(Registered.REGISTERED, in_flight + 1)


def confirm(tx: KeyTransaction, run_id: str, *, timings: Timings) -> bool:
    """Mark a registration as published (its message is on its way): it is seen now."""
    run = tx.get_run(run_id)
    if run is None or run.confirmed:
        return run is not None
    run.confirmed = True
    _seen(run, tx.now(), timings)
    tx.save_run(run)
    return True


def park(
    tx: KeyTransaction, scope: str, key: str, run_id: str, payload: bytes, *, timings: Timings
) -> list[Wake]:
    """A registration published held back (delayed at enqueue) waits gated with its payload.

    It is then woken like a deferred delivery; its held-back copy stays live as the fallback.
    Only a pending run is parked: one already delivered is left to its delivery. Returns the
    wakes, which include the run itself if a slot freed since it registered.
    """
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.PENDING:
        return []
    now = tx.now()
    _take_place(run, payload)
    _seen(run, now, timings)
    tx.save_run(run)
    return _wakes(tx, _meta(tx, now), scope, key, now, skip=None)


def unregister(tx: KeyTransaction, run_id: str, *, timings: Timings) -> bool:
    """Undo a registration whose publish failed; holders and delivered runs are left alone."""
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.PENDING:
        return False
    tx.delete_run(run_id)
    now = tx.now()
    _finish(tx, _meta(tx, now), now, timings)
    return True


def claim(
    tx: KeyTransaction,
    spec: RunSpec,
    generation: int,
    payload: bytes | None,
    *,
    timings: Timings,
) -> ClaimOutcome:
    """Decide one delivery: admit, gate, defer a busy duplicate, or drop a stale copy.

    Every answer also names the gated waiters that own a free slot now (``wakes``): a slot may
    have freed since the last call (an eviction, a waiter passed over), and whoever touches the
    key next hands it on.
    """
    now = tx.now()
    meta = _meta(tx, now)
    meta.limit = spec.limit
    done = _housekeep(tx, now, timings, keep=spec.run_id)
    evicted, removed = tuple(done.evicted), tuple(done.removed)

    def stale() -> ClaimOutcome:
        wakes = _wakes(tx, meta, spec.scope, spec.key, now, skip=None)
        _finish(tx, meta, now, timings)
        return ClaimOutcome(Decision.STALE, evicted=evicted, wakes=tuple(wakes), removed=removed)

    run = tx.get_run(spec.run_id)
    if run is None:
        settled = tx.settled_generation(spec.run_id, now)
        if settled is not None and settled != generation:
            return stale()  # a dead copy of a settled run
        if settled is None and issued_before(generation, now - timings.retention):
            return stale()  # issued before anything the store remembers: its run settled
        # Never registered (send_task, or a settled run re-driven): first sight
        # (docs/concepts.md#what-other-deliveries-see).
        tx.clear_settled(spec.run_id)
        run = _new_waiter(spec, meta, now, timings, confirmed=True, generation=generation)
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
            run.generation = _next(run.generation, now)
            # This copy stays live until its deferred copy is published: a crash in between
            # redelivers it, and it must not be dropped as stale (the run would be lost).
            run.live = sorted({run.holder_generation, generation, run.generation})
            tx.save_run(run)
            wakes = _wakes(tx, meta, spec.scope, spec.key, now, skip=None)
            _finish(tx, meta, now, timings)
            return ClaimOutcome(
                Decision.BUSY,
                generation=run.generation,
                evicted=evicted,
                wakes=tuple(wakes),
                removed=removed,
            )
        takeover = run.executing
        return _admit(tx, meta, spec, run, generation, now, timings, done, takeover=takeover)

    _take_place(run, payload)
    _seen(run, now, timings)
    tx.save_run(run)
    free = meta.limit - len(tx.holders())
    owners = _slot_owners(tx, free, now)
    if any(owner.run_id == run.run_id for owner in owners):
        return _admit(tx, meta, spec, run, generation, now, timings, done, takeover=False)
    run.generation = _next(run.generation, now)
    run.live = sorted({generation, run.generation})
    run.state = RunState.GATED
    tx.save_run(run)
    wakes = _wakes(tx, meta, spec.scope, spec.key, now, skip=run.run_id)
    position = tx.waiters_before(run.seq) + 1
    _finish(tx, meta, now, timings)
    return ClaimOutcome(
        Decision.GATED,
        generation=run.generation,
        position=position,
        evicted=evicted,
        wakes=tuple(wakes),
        removed=removed,
    )


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
    meta.token = _next(meta.token, now)
    run.state = RunState.HOLDING
    run.token = meta.token
    run.holder_generation = generation
    run.live = [generation]
    run.admitted_at = now
    run.heartbeat_at = now
    run.lease_expires_at = now + spec.lease
    run.executing = True
    run.payload = None
    tx.save_run(run)
    wakes = _wakes(tx, meta, spec.scope, spec.key, now, skip=run.run_id)
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
    """Settle a run: free its slot (or its place in line) and name the waiters to wake.

    ``token=None`` settles whatever the run is (a waiter revoked, an operator release);
    with a token, a holder whose slot now has another owner is reported ``lost``.
    ``waiting_only``: settle the run only while it holds no slot. A discarded copy's run was
    gated when the copy claimed; another copy of it may have been admitted since, and its slot
    is not the discarded copy's to free (it settles where it runs).
    """
    now = tx.now()
    meta = _meta(tx, now)
    done = _housekeep(tx, now, timings, keep=run_id)
    evicted, removed = tuple(done.evicted), tuple(done.removed)
    run = tx.get_run(run_id)
    if (
        run is None
        or (token is not None and (run.state is not RunState.HOLDING or run.token != token))
        or (waiting_only and run.state is RunState.HOLDING)
    ):
        # Settled already (idempotent: async interrupts settle twice), taken from us, or (only
        # a waiter to settle) admitted meanwhile by another copy.
        lost = token is not None and (run is not None or tx.settled_generation(run_id, now) is None)
        wakes = _wakes(tx, meta, scope, key, now, skip=None)
        _finish(tx, meta, now, timings)
        return ReleaseOutcome(released=False, lost=lost, wakes=tuple(wakes), evicted=evicted, removed=removed)
    tx.delete_run(run_id)
    settled = (
        run.holder_generation
        if run.state is RunState.HOLDING
        else (generation if generation is not None else -1)
    )
    tx.mark_settled(run_id, settled, now + timings.retention, now)
    wakes = _wakes(tx, meta, scope, key, now, skip=None)
    _finish(tx, meta, now, timings)
    return ReleaseOutcome(released=True, wakes=tuple(wakes), evicted=evicted, removed=removed)
