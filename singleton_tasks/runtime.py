"""What both adapters share: one :class:`Gatekeeper` per worker or producer process.

It resolves options (task config → adapter option → default), turns framework-neutral
events into store calls, picks deferral delays, and logs what operators need to see; it
owns the process's store (chosen by :mod:`singleton_tasks.stores.choice`), its heartbeat
thread (:mod:`singleton_tasks.heartbeat`) and its confirm thread
(:mod:`singleton_tasks.confirms`). The adapters only translate framework events into
these calls. The store decides every deadline on its own clock; this process's clock only
times deferrals (what the broker needs) and metrics.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import clock, metrics
from .config import (
    DEFAULT_LEASE,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_ORPHAN_TIMEOUT,
    DEFAULT_REGISTRATION_GRACE,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_JITTER,
    DISABLED,
    BoundSingleton,
    check_lease,
)
from .confirms import CONFIRM_FLUSH_TIMEOUT, Confirmer, Run
from .errors import SingletonConfigError, SingletonQueueFullError, StoreUnavailableError
from .generations import issued_before
from .heartbeat import Heartbeater, compare_clocks, log_lost_slot
from .outcomes import (
    PAYLOAD_ON_REQUEST,
    ClaimOutcome,
    Decision,
    HolderRef,
    Registered,
    RegisterOutcome,
    ReleaseOutcome,
    RunSpec,
    Wake,
)
from .stores import Store, store_from_url
from .stores.choice import check_store_argument, ensure_schema, resolve_store_url

logger = logging.getLogger("singleton_tasks")

#: Bound configs whose run options a Gatekeeper keeps (one per task in practice).
_SPEC_CACHE_SIZE = 1024

#: The message option (Dramatiq) or header (Celery) in which a copy the library published
#: carries its generation; a copy without it is a new delivery of its run.
GENERATION_FIELD = "singleton_gen"
#: The message option (Dramatiq) or header (Celery) a producer sets when the payload its
#: registration stored is the very message it publishes: the first delivery of such a message
#: claims without sending it (``PAYLOAD_ON_REQUEST``). The producer decides, since only its own
#: middleware or publish receivers can change the message after the registration.
AS_STORED_FIELD = "singleton_as_stored"


def claims_as_stored(generation: int, marked: bool, retries: int) -> bool:
    """Whether a delivery may claim with ``PAYLOAD_ON_REQUEST``: a first delivery (generation 0)
    its producer marked (``AS_STORED_FIELD``), not a retry (its retry count moved on)."""
    return generation == 0 and marked and not retries


@dataclass(frozen=True)
class WorkerOptions:
    """Worker-side timings, in seconds (docs/concepts.md#declaring-a-singleton)."""

    retry_delay: float = DEFAULT_RETRY_DELAY
    retry_jitter: float = DEFAULT_RETRY_JITTER
    lease: float = DEFAULT_LEASE
    orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT
    #: At most this long between two heartbeats (default: a third of the shortest lease held).
    heartbeat_interval: float | None = None
    max_retry_delay: float = DEFAULT_MAX_RETRY_DELAY  # far-back waiters re-check at most this rarely

    def __post_init__(self) -> None:
        check_lease(self.lease, "lease")
        for name in ("retry_delay", "retry_jitter", "max_retry_delay"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise SingletonConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
        interval = self.heartbeat_interval
        if interval is not None and (
            not isinstance(interval, (int, float)) or isinstance(interval, bool) or interval <= 0
        ):
            raise SingletonConfigError(
                f"heartbeat_interval must be a positive number of seconds, got {interval!r}"
            )

    @property
    def recheck(self) -> float:
        """The longest a denied delivery waits for its re-check."""
        return max(self.retry_delay, self.max_retry_delay) + self.retry_jitter


class Gatekeeper:
    """The store, the options and the heartbeat of one process (re-created after a fork)."""

    def __init__(
        self, store: Store | str | None = None, *, namespace: str = "default", **options: Any
    ) -> None:
        check_store_argument(store)
        self.options = WorkerOptions(**options)
        self._store_arg = store
        self._namespace = namespace
        self._store: Store | None = store if isinstance(store, Store) else None
        # The store answered its schema check in this process: from then on an operation that
        # fails may have been written (and is undone); before, nothing can have been.
        self._ready = False
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._heartbeater: Heartbeater | None = None
        self._confirmer: Confirmer | None = None
        # By identity (each task's bound config is made once): hashing a BoundSingleton hashes
        # its inspect.Signature, ten times the cost of the lookup. The bound is kept in the
        # value, so that its id is never reused by another.
        self._spec_cache: dict[int, tuple[BoundSingleton, RunSpec]] = {}
        #: Publishes the wakes of a key's own due work (the heartbeat thread's
        #: :meth:`Store.tick_due`): set by the adapter of a worker process. Without it this
        #: process's heartbeat thread leaves the due work to the workers.
        self.publish_wakes: Callable[[Sequence[Wake]], object] | None = None

    # -- the store, one per process --------------------------------------------------------
    def _after_fork(self) -> None:
        if self._pid != os.getpid():
            # Forked (prefork pool): the parent's threads did not come along, and its lock may have
            # been held at the fork. A store given as an instance is kept; a URL gets fresh clients.
            self._heartbeater, self._lock, self._pid = None, threading.Lock(), os.getpid()
            self._confirmer = None  # the parent's thread confirms the parent's publishes
            if not isinstance(self._store_arg, Store):
                self._store, self._ready = None, False

    @property
    def store(self) -> Store:
        """This process's store, opened and its schema checked at first use.

        A store that cannot be opened (a bad URL, a missing driver, an unreachable server, a
        missing schema) raises at every use until it can, within the store's connect timeout;
        a failed open leaves no client or pool behind.
        """
        if self._pid != os.getpid():
            self._after_fork()
        store = self._store
        if store is None or not self._ready:
            with self._lock:
                store = self._open()
        return store

    @property
    def ready(self) -> bool:
        """Whether the store has answered in this process (an operation may have reached it)."""
        return self._ready and self._pid == os.getpid()

    def _open(self) -> Store:
        # Called with the lock held.
        store = self._store
        if store is None:
            url = resolve_store_url(self._store_arg if isinstance(self._store_arg, str) else None)
            store = store_from_url(url, namespace=self._namespace)
        if not self._ready:
            try:
                ensure_schema(store)
            except BaseException:
                if store is not self._store_arg:
                    store.close()  # no pool left retrying in the background
                raise
            self._store, self._ready = store, True
        return store

    def check(self, singletons: Iterable[BoundSingleton] = ()) -> None:
        """Worker start: fail against a bad store URL, a missing or incompatible schema (docs/deployment.md);
        warn about the clocks and a retention shorter than a task's lease and orphan timeout."""
        was_ready = self.ready
        store = self.store  # opening checks the schema
        if was_ready:
            ensure_schema(store)
        compare_clocks(store.time(), store)
        for bound in singletons:
            spec = self.spec_options(bound)
            needed = spec.lease + (spec.orphan_timeout or 0.0)
            if store.retention < needed:
                logger.warning(
                    "%s: the store's retention (%gs) is shorter than its lease + orphan_timeout (%gs): "
                    "a waiter or settled marker may be forgotten while still needed (a late copy then "
                    "re-queues instead of being recognised)",
                    bound.task_name,
                    store.retention,
                    needed,
                )
        self.heartbeats.start()

    # -- options ---------------------------------------------------------------------------
    def spec_options(self, bound: BoundSingleton) -> RunSpec:
        """The task's resolved options (config → adapter option → default), for no run in particular."""
        config = bound.config
        orphan = self.options.orphan_timeout if config.orphan_timeout is None else config.orphan_timeout
        return RunSpec(
            scope=bound.scope,
            key="",
            run_id="",
            limit=config.limit,
            max_queue_depth=config.max_queue_depth,
            lease=config.lease if config.lease is not None else self.options.lease,
            orphan_timeout=None if orphan is None or orphan == DISABLED else float(orphan),
            recheck=self.options.recheck,
            replace_when_full=config.on_full == "replace",
        )

    def spec(
        self, bound: BoundSingleton, run_id: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> RunSpec:
        """Derive the run's key (SingletonKeyError) and resolve its timings: config → adapter option."""
        cached = self._spec_cache.get(id(bound))
        if cached is None or cached[0] is not bound:
            if len(self._spec_cache) >= _SPEC_CACHE_SIZE:
                self._spec_cache.clear()  # bounds made again and again (not by the adapters): no leak
            cached = self._spec_cache[id(bound)] = (bound, self.spec_options(bound))
        return cached[1].for_run(bound.derive_key(args, kwargs), run_id)

    def deferral_delay(self, position: int | None, limit: int = 1) -> float:
        """~retry_delay ± jitter at the head of the line; rarer re-checks further back (docs/concepts.md)."""
        base = self.options.retry_delay
        if position is not None and position > limit:
            base = max(base, min(self.options.max_retry_delay, base * (position - limit + 1)))
        jitter = self.options.retry_jitter
        return max(0.0, base + random.uniform(-jitter, jitter))

    # -- events ----------------------------------------------------------------------------
    def register(
        self,
        bound: BoundSingleton,
        spec: RunSpec,
        *,
        payload: bytes | None = None,
        delay: float = 0.0,
        confirmed: bool = True,
        full_error: type[SingletonQueueFullError] = SingletonQueueFullError,
    ) -> RegisterOutcome:
        """Enqueue: register a pending waiter; a full key raises ``full_error`` or, with
        ``on_full="drop"``, returns the FULL outcome (nothing written). With ``on_full="replace"``
        the run takes the newest waiter's place (REPLACED), or, with no waiter to replace, is
        dropped as with ``"drop"``. StoreUnavailableError passes.

        Arguments:
            bound: The task's declaration (its name goes into errors and metrics).
            spec: The run, its key and options.
            payload: The message the store issues the run from if its copies are lost, encoded
                by the caller before anything was written (docs/concepts.md#the-line).
            delay: Seconds the message is delayed by: the run is not issued again before then.
            confirmed: False until the publish is done (:meth:`confirm_later`).
            full_error: The error class raised when the key's backlog is full.
        """
        try:
            outcome = self.store.register(spec, payload=payload, delay=delay, confirmed=confirmed)
        except StoreUnavailableError as error:
            # The store's message names the server; the caller also needs the task and the key.
            raise StoreUnavailableError(
                f"{bound.task_name} run {spec.run_id} (key {spec.key!r}) not enqueued: {error}"
            ) from error
        if outcome.status is Registered.REPLACED:
            metrics.observe_replaced(bound.task_name)
            logger.info(
                "%s run %s replaced run %s in line for key %r (on_full='replace')",
                bound.task_name,
                spec.run_id,
                outcome.replaced,
                spec.key,
            )
            return outcome
        if outcome.status is Registered.FULL:
            if bound.config.on_full != "raise":  # "drop", or "replace" with no waiter to replace
                metrics.observe_dropped(bound.task_name)
                logger.info(
                    "dropped %s run %s: key %r is full (on_full=%r)",
                    bound.task_name,
                    spec.run_id,
                    spec.key,
                    bound.config.on_full,
                )
                return outcome
            metrics.observe_rejected(bound.task_name)
            logger.info("rejected %s run %s: key %r is full", bound.task_name, spec.run_id, spec.key)
            raise full_error(
                task_name=bound.task_name,
                scope=spec.scope,
                key=spec.key,
                limit=spec.limit,
                max_queue_depth=spec.max_queue_depth,
            )
        return outcome

    def newest_run(self, spec: RunSpec) -> str | None:
        """The run id last in line for the run's key (its newest waiter, else its newest holder);
        None when the key has no run, or the store cannot tell now. Read after the store answered
        FULL, it may name a run that has finished since."""
        try:
            snapshots = self.store.snapshot(scope=spec.scope, key=spec.key)
        except StoreUnavailableError as error:
            logger.warning("run %s: could not read the line of key %r: %s", spec.run_id, spec.key, error)
            return None
        for snapshot in snapshots:
            if snapshot.waiters:
                return max(snapshot.waiters, key=lambda waiter: waiter.position).run_id
            if snapshot.holders:
                return max(snapshot.holders, key=lambda holder: holder.admitted_at).run_id
        return None

    def confirm(self, spec: RunSpec) -> None:
        self.store.confirm(spec.scope, spec.key, spec.run_id)

    def confirm_later(self, spec: RunSpec) -> None:
        """Confirm a published registration from this process's confirm thread, batched.

        The caller's publish is done: its ``.send()`` does not wait for the confirm. Until the
        confirm lands the registration is an unconfirmed one (dropped after the registration
        grace if nothing confirms it), and a delivery that comes first confirms it itself
        (docs/concepts.md#the-life-of-a-run).
        """
        self.confirms.add((spec.scope, spec.key, spec.run_id))

    @property
    def confirms(self) -> Confirmer:
        self._after_fork()  # a forked child confirms only its own publishes
        if self._confirmer is None:
            with self._lock:
                if self._confirmer is None:
                    self._confirmer = Confirmer(self._confirm_many, self._registration_grace)
        return self._confirmer

    def _confirm_many(self, runs: Sequence[Run]) -> None:
        self.store.confirm_many(runs)

    def _registration_grace(self) -> float:
        """The store's registration grace once it is open; the default before (opens nothing)."""
        store = self._store
        return store.timings.registration_grace if store is not None else DEFAULT_REGISTRATION_GRACE

    def flush_confirms(self, timeout: float | None = None) -> bool:
        """Wait until every confirm handed to :meth:`confirm_later` was sent; False on timeout."""
        confirmer = self._confirmer
        return True if confirmer is None or self._pid != os.getpid() else confirmer.flush(timeout)

    def unregister(self, spec: RunSpec) -> None:
        self.store.unregister(spec.scope, spec.key, spec.run_id)

    def park(self, task_name: str, spec: RunSpec) -> tuple[Wake, ...]:
        """A run published held back waits gated with its payload; the caller publishes the wakes."""
        wakes = self.store.park(spec.scope, spec.key, spec.run_id)
        metrics.observe_woken(task_name, len(wakes))
        return wakes

    def claim(
        self,
        task_name: str,
        spec: RunSpec,
        generation: int,
        payload: bytes | Callable[[], bytes | None] | None,
        *,
        registered_at: float | None = None,
        woken_at: float | None = None,
    ) -> ClaimOutcome:
        """Gate: decide one delivery; the caller runs, defers or drops accordingly.

        ``payload``, the delivered message, is kept to issue the run from should it wait. Given as
        a function (a first delivery of the message its registration stored), it is encoded
        only if the store has no message of the run: most deliveries send none.
        """
        if callable(payload):
            outcome = self.store.claim(spec, generation, PAYLOAD_ON_REQUEST)
            if outcome.decision is Decision.PAYLOAD_NEEDED:
                outcome = self.store.claim(spec, generation, payload())
        else:
            outcome = self.store.claim(spec, generation, payload)
        self.log_housekeeping(task_name, spec.scope, spec.key, outcome.evicted, outcome.removed)
        metrics.observe_claim(
            task_name, outcome, now=clock.now(), registered_at=registered_at, woken_at=woken_at
        )
        metrics.observe_woken(task_name, len(outcome.wakes))
        if outcome.decision is Decision.ADMITTED:
            if outcome.takeover:
                logger.warning(
                    "%s run %s took its slot of key %r over from its lapsed lease (token %s)",
                    task_name,
                    spec.run_id,
                    spec.key,
                    outcome.token,
                )
            self.heartbeats.track(
                HolderRef(spec.scope, spec.key, spec.run_id, outcome.token or 0), spec.lease, task_name
            )
        if outcome.decision is Decision.STALE and issued_before(
            generation, clock.now() - self.store.retention
        ):
            logger.warning(
                "%s run %s: a copy issued more than the store's retention (%gs) ago was dropped as stale; "
                "to re-drive a dead letter that old, remove its %s or send the run anew",
                task_name,
                spec.run_id,
                self.store.retention,
                GENERATION_FIELD,
            )
        if logger.isEnabledFor(logging.DEBUG):  # every delivery passes here: build nothing when off
            logger.debug(
                "%s run %s key %r gen %s: %s%s",
                task_name,
                spec.run_id,
                spec.key,
                generation,
                outcome.decision.value,
                f" (position {outcome.position})" if outcome.position else "",
            )
        return outcome

    def suspend(self, task_name: str, spec: RunSpec, token: int, delay: float) -> None:
        """A holder waits for its retry: stop heartbeating it, keep its slot."""
        self.heartbeats.untrack(spec.run_id)
        if not self.store.suspend(spec.scope, spec.key, spec.run_id, token, delay=delay):
            log_lost_slot(task_name, spec.run_id, spec.key, token, " before its retry")

    def release(
        self,
        task_name: str,
        spec: RunSpec,
        *,
        token: int | None,
        generation: int | None = None,
        waiting_only: bool = False,
    ) -> ReleaseOutcome:
        """Settle: free the slot or the place in line; the caller publishes ``wakes``."""
        if not waiting_only:  # a waiter's settlement leaves a copy running here to its own
            self.heartbeats.untrack(spec.run_id)
        outcome = self.store.release(
            spec.scope, spec.key, spec.run_id, token=token, generation=generation, waiting_only=waiting_only
        )
        self.log_housekeeping(task_name, spec.scope, spec.key, outcome.evicted, outcome.removed)
        metrics.observe_release(task_name, outcome)
        metrics.observe_woken(task_name, len(outcome.wakes))
        if outcome.lost:
            log_lost_slot(task_name, spec.run_id, spec.key, token)
        return outcome

    @staticmethod
    def log_housekeeping(
        task_name: str, scope: str, key: str, evicted: Sequence[str], removed: Sequence[str]
    ) -> None:
        """Log what a store operation did to a key's line by itself: holders evicted, waiters abandoned."""
        if not evicted and not removed:
            return  # what nearly every operation answers
        for run_id in evicted:
            logger.warning(
                "evicted orphaned holder %s of key %r (scope %r): its lease lapsed over orphan_timeout ago",
                run_id,
                key,
                scope,
            )
        for run_id in removed:
            logger.error(
                "%s run %s of key %r (scope %r) abandoned: issued again and again, none of its copies "
                "reached the store for the store's retention (its task is on no worker, or its "
                "message cannot be published); removed from the line",
                task_name,
                run_id,
                key,
                scope,
            )
        metrics.observe_abandoned(task_name, len(removed))

    # -- heartbeats ------------------------------------------------------------------------
    @property
    def heartbeats(self) -> Heartbeater:
        self._after_fork()  # resets the heartbeater after a fork (never opens the store)
        if self._heartbeater is None:
            with self._lock:
                if self._heartbeater is None:
                    self._heartbeater = Heartbeater(self)
        return self._heartbeater

    def retry_later(self, action: Callable[[], object], what: str) -> None:
        """Run a settlement that failed on a store error again from the heartbeat thread until it succeeds.

        A release lost to a store blip would otherwise hold the key until the lease and the
        orphan timeout lapse.
        """
        self.heartbeats.retry_later(action, what)

    def settle_or_retry(self, action: Callable[[], object], what: str) -> None:
        """Run a settlement now; on a store outage, again from the heartbeat thread until it succeeds."""
        try:
            action()
        except StoreUnavailableError as error:
            logger.warning("%s failed (%s); retrying from the heartbeat thread", what, error)
            self.retry_later(action, what)

    def settle_unrun_copy(
        self,
        task_name: str,
        spec: RunSpec,
        generation: int,
        publish_wakes: Callable[[Sequence[Wake]], object],
    ) -> Decision:
        """Settle the run of a copy that ended without running (revoked, expired, skipped).

        Claiming first tells a live copy (its run is settled) from a duplicate of a run executing
        elsewhere (BUSY: left alone, it settles there) and from a stale copy (nothing to do), so a
        discarded copy never frees the slot of a run that still executes. Returns the claim's
        decision; ``publish_wakes`` gets the wakes of the claim and of the release.
        """
        outcome = self.claim(task_name, spec, generation, None)
        publish_wakes(outcome.wakes)
        if outcome.decision is Decision.ADMITTED:
            settled = self.release(task_name, spec, token=outcome.token)
        elif outcome.decision is Decision.GATED:
            # Gated now; another copy of the run may be admitted before this settles it: only
            # a waiter is settled (a holder settles where it runs).
            settled = self.release(task_name, spec, token=None, waiting_only=True)
        else:
            return outcome.decision
        publish_wakes(settled.wakes)
        return outcome.decision

    def close(self) -> None:
        if self._confirmer is not None and self._pid == os.getpid():
            self._confirmer.stop(CONFIRM_FLUSH_TIMEOUT)
            self._confirmer = None
        if self._heartbeater is not None:
            self._heartbeater.stop()
            self._heartbeater = None  # a later track() starts a fresh thread
        if self._store is not None and not isinstance(self._store_arg, Store):
            self._store.close()
            self._store = None
        self._ready = False
