"""The gate's rules, written once over a locked per-key transaction (SPEC §3–§7).

A store that keeps its data in rows or dicts implements :class:`KeyTransaction` (a handful
of reads and writes of one key's records, under that key's lock) and gets every rule from
here. The Redis store runs the same rules as Lua scripts; the contract suite keeps the two
identical.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

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


@dataclass
class KeyMeta:
    """Per scope+key counters. ``token`` outlives the key's runs; ``seq`` restarts when empty."""

    token: int = 0
    seq: int = 0
    limit: int = 1


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
    lease: float = 60.0
    orphan_timeout: float | None = 600.0

    def copy(self) -> RunRecord:
        return dataclasses.replace(self, live=list(self.live))


class KeyTransaction(abc.ABC):
    """One key's records, read and written while that key is locked by the store."""

    @abc.abstractmethod
    def meta(self) -> KeyMeta | None:
        """The key's counters, or None if the key was never used."""

    @abc.abstractmethod
    def save_meta(self, meta: KeyMeta) -> None:
        """Create or update the key's counters."""

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
    def unconfirmed_before(self, created_before: float) -> list[str]:
        """Run ids of pending, unconfirmed registrations created before the given time."""

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

    registration_grace: float = 10.0  # an unconfirmed registration is a ghost after this
    settled_ttl: float = 3600.0  # how long a settled run's generation marker lives


_PAGE = 64


def _waiters(tx: KeyTransaction) -> Iterator[RunRecord]:
    after = 0
    while True:
        page = tx.waiters_from(after, _PAGE)
        yield from page
        if len(page) < _PAGE:
            return
        after = page[-1].seq


def _passed_over(run: RunRecord, now: float) -> bool:
    """A waiter registered but never delivered within its orphan timeout (SPEC §6)."""
    return (
        run.state is RunState.PENDING
        and run.orphan_timeout is not None
        and run.created_at + run.orphan_timeout < now
    )


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


def _housekeep(tx: KeyTransaction, now: float, timings: Timings, keep: str | None) -> list[str]:
    """Evict orphaned holders and forget ghost registrations; returns the evicted run ids."""
    evicted = []
    for holder in tx.holders():
        timeout = holder.orphan_timeout
        if timeout is not None and holder.lease_expires_at + timeout < now and holder.run_id != keep:
            tx.delete_run(holder.run_id)
            evicted.append(holder.run_id)
    for ghost in tx.unconfirmed_before(now - timings.registration_grace):
        if ghost != keep:
            tx.delete_run(ghost)
    return evicted


def _wakes(
    tx: KeyTransaction, meta: KeyMeta, scope: str, key: str, now: float, skip: str | None
) -> list[Wake]:
    """Gated waiters that now own a free slot get a fresh live generation to be published."""
    free = meta.limit - len(tx.holders())
    wakes = []
    for run in _slot_owners(tx, free, now):
        if run.state is RunState.GATED and run.run_id != skip:
            run.generation += 1
            # A payload-less wake cannot be published, so every copy in flight stays live: the
            # deferred one may never have been published, leaving only the first to run it.
            kept = run.live if run.payload is None else run.live[-1:]
            run.live = [*kept, run.generation]
            run.state = RunState.WOKEN
            tx.save_run(run)
            wakes.append(Wake(scope, key, run.run_id, run.generation, run.payload))
    return wakes


def _take_place(run: RunRecord, payload: bytes | None) -> None:
    """A waiter whose message is known (delivered, or published held back) keeps it to be woken.

    A pending one becomes gated: it takes its place in line again (SPEC §6) and is woken by a release.
    """
    run.confirmed = True
    run.payload = payload
    if run.state is RunState.PENDING:
        run.state = RunState.GATED


def _finish(tx: KeyTransaction, meta: KeyMeta) -> None:
    """Save the counters; an empty key keeps nothing but its token (SPEC §8)."""
    if tx.count_runs() == 0:
        meta.seq = 0
    tx.save_meta(meta)


def _new_waiter(spec: RunSpec, meta: KeyMeta, now: float, *, confirmed: bool, generation: int) -> RunRecord:
    meta.seq += 1
    return RunRecord(
        run_id=spec.run_id,
        seq=meta.seq,
        state=RunState.PENDING,
        created_at=now,
        confirmed=confirmed,
        generation=generation,
        live=[generation],
        lease=spec.lease,
        orphan_timeout=spec.orphan_timeout,
    )


def register(
    tx: KeyTransaction, spec: RunSpec, *, now: float, confirmed: bool, timings: Timings
) -> RegisterOutcome:
    """Register a pending waiter, atomically with the backlog cap (SPEC §3.1, §5, §7)."""
    if tx.get_run(spec.run_id) is not None:
        return RegisterOutcome(Registered.EXISTS, tx.count_runs())
    ghosts = len(tx.unconfirmed_before(now - timings.registration_grace))
    in_flight = tx.count_runs() - ghosts
    if spec.max_queue_depth is not None and in_flight >= spec.limit + spec.max_queue_depth:
        return RegisterOutcome(Registered.FULL, in_flight)
    meta = tx.meta() or KeyMeta()
    meta.limit = spec.limit
    tx.clear_settled(spec.run_id)
    tx.save_run(_new_waiter(spec, meta, now, confirmed=confirmed, generation=0))
    tx.save_meta(meta)
    return RegisterOutcome(Registered.REGISTERED, in_flight + 1)


def confirm(tx: KeyTransaction, run_id: str) -> bool:
    """Mark a registration as published (Dramatiq confirms after the broker accepted it)."""
    run = tx.get_run(run_id)
    if run is None or run.confirmed:
        return run is not None
    run.confirmed = True
    tx.save_run(run)
    return True


def park(tx: KeyTransaction, scope: str, key: str, run_id: str, payload: bytes, *, now: float) -> list[Wake]:
    """A registration published held back (delayed at enqueue) waits gated with its payload.

    It is then woken like a deferred delivery; its held-back copy stays live as the fallback.
    Only a pending run is parked: one already delivered is left to its delivery. Returns the
    wakes, which include the run itself if a slot freed since it registered.
    """
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.PENDING:
        return []
    _take_place(run, payload)
    tx.save_run(run)
    return _wakes(tx, tx.meta() or KeyMeta(), scope, key, now, skip=None)


def unregister(tx: KeyTransaction, run_id: str) -> bool:
    """Undo a registration whose publish failed; holders and delivered runs are left alone."""
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.PENDING:
        return False
    tx.delete_run(run_id)
    meta = tx.meta() or KeyMeta()
    _finish(tx, meta)
    return True


def claim(
    tx: KeyTransaction,
    spec: RunSpec,
    generation: int,
    payload: bytes | None,
    *,
    now: float,
    timings: Timings,
) -> ClaimOutcome:
    """Decide one delivery: admit, gate, defer a busy duplicate, or drop a stale copy."""
    meta = tx.meta() or KeyMeta()
    meta.limit = spec.limit
    evicted = _housekeep(tx, now, timings, keep=spec.run_id)
    run = tx.get_run(spec.run_id)
    if run is None:
        settled = tx.settled_generation(spec.run_id, now)
        if settled is not None and settled != generation:
            wakes = _wakes(tx, meta, spec.scope, spec.key, now, skip=None) if evicted else []
            _finish(tx, meta)
            return ClaimOutcome(Decision.STALE, evicted=tuple(evicted), wakes=tuple(wakes))
        # Never registered (send_task, or a settled run re-driven): first sight (SPEC §4).
        tx.clear_settled(spec.run_id)
        run = _new_waiter(spec, meta, now, confirmed=True, generation=generation)
    elif generation not in run.live:
        wakes = _wakes(tx, meta, spec.scope, spec.key, now, skip=None)
        _finish(tx, meta)
        return ClaimOutcome(Decision.STALE, evicted=tuple(evicted), wakes=tuple(wakes))
    run.lease = spec.lease
    run.orphan_timeout = spec.orphan_timeout

    if run.state is RunState.HOLDING:
        if run.executing and run.lease_expires_at > now:
            run.generation += 1
            # This copy stays live until its deferred copy is published: a crash in between
            # redelivers it, and it must not be dropped as stale (the run would be lost).
            run.live = sorted({run.holder_generation, generation, run.generation})
            tx.save_run(run)
            wakes = _wakes(tx, meta, spec.scope, spec.key, now, skip=None) if evicted else []
            _finish(tx, meta)
            return ClaimOutcome(
                Decision.BUSY, generation=run.generation, evicted=tuple(evicted), wakes=tuple(wakes)
            )
        takeover = run.executing
        return _admit(tx, meta, spec, run, generation, now, evicted, takeover=takeover)

    _take_place(run, payload)
    tx.save_run(run)
    free = meta.limit - len(tx.holders())
    owners = _slot_owners(tx, free, now)
    if any(owner.run_id == run.run_id for owner in owners):
        return _admit(tx, meta, spec, run, generation, now, evicted, takeover=False)
    run.generation += 1
    run.live = sorted({generation, run.generation})
    run.state = RunState.GATED
    tx.save_run(run)
    wakes = _wakes(tx, meta, spec.scope, spec.key, now, skip=run.run_id)
    position = tx.waiters_before(run.seq) + 1
    _finish(tx, meta)
    return ClaimOutcome(
        Decision.GATED,
        generation=run.generation,
        position=position,
        evicted=tuple(evicted),
        wakes=tuple(wakes),
    )


def _admit(
    tx: KeyTransaction,
    meta: KeyMeta,
    spec: RunSpec,
    run: RunRecord,
    generation: int,
    now: float,
    evicted: list[str],
    *,
    takeover: bool,
) -> ClaimOutcome:
    meta.token += 1
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
    _finish(tx, meta)
    return ClaimOutcome(
        Decision.ADMITTED,
        token=run.token,
        takeover=takeover,
        evicted=tuple(evicted),
        wakes=tuple(wakes),
    )


def suspend(tx: KeyTransaction, run_id: str, token: int, *, now: float, delay: float) -> bool:
    """A holder waits for its retry: it keeps its slot, not executing (SPEC §3.4)."""
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.HOLDING or run.token != token:
        return False
    run.executing = False
    run.heartbeat_at = now
    run.lease_expires_at = now + delay + run.lease
    tx.save_run(run)
    return True


def heartbeat(tx: KeyTransaction, run_id: str, token: int, *, now: float) -> bool:
    """Extend a running holder's lease; False if the run lost its slot."""
    run = tx.get_run(run_id)
    if run is None or run.state is not RunState.HOLDING or run.token != token:
        return False
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
    now: float,
    timings: Timings,
) -> ReleaseOutcome:
    """Settle a run: free its slot (or its place in line) and name the waiters to wake.

    ``token=None`` settles whatever the run is (a waiter revoked, an operator release);
    with a token, a holder whose slot now has another owner is reported ``lost``.
    """
    meta = tx.meta() or KeyMeta()
    evicted = _housekeep(tx, now, timings, keep=run_id)
    run = tx.get_run(run_id)
    if run is None:
        # Settled already (idempotent: async interrupts settle twice) or taken from us.
        lost = token is not None and tx.settled_generation(run_id, now) is None
        wakes = _wakes(tx, meta, scope, key, now, skip=None) if evicted else []
        _finish(tx, meta)
        return ReleaseOutcome(released=False, lost=lost, wakes=tuple(wakes), evicted=tuple(evicted))
    if token is not None and (run.state is not RunState.HOLDING or run.token != token):
        wakes = _wakes(tx, meta, scope, key, now, skip=None) if evicted else []
        _finish(tx, meta)
        return ReleaseOutcome(released=False, lost=True, wakes=tuple(wakes), evicted=tuple(evicted))
    tx.delete_run(run_id)
    settled = (
        run.holder_generation
        if run.state is RunState.HOLDING
        else (generation if generation is not None else -1)
    )
    tx.mark_settled(run_id, settled, now + timings.settled_ttl, now)
    wakes = _wakes(tx, meta, scope, key, now, skip=None)
    _finish(tx, meta)
    return ReleaseOutcome(released=True, wakes=tuple(wakes), evicted=tuple(evicted))
