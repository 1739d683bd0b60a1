"""What both adapters share: one :class:`Gatekeeper` per worker or producer process.

It resolves options (task config → adapter option → default), turns framework-neutral
events into store calls, picks deferral delays, heartbeats the runs a process executes,
and logs what operators need to see. The adapters only translate framework events into
these calls. The store decides every deadline on its own clock; this process's clock only
times deferrals (what the broker needs) and metrics.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import random
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from . import clock, metrics
from .config import (
    DEFAULT_LEASE,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_ORPHAN_TIMEOUT,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_JITTER,
    DISABLED,
    BoundSingleton,
    check_lease,
)
from .errors import SingletonConfigError, SingletonQueueFullError, StoreUnavailableError
from .gate import DEFAULT_REGISTRATION_GRACE
from .generations import issued_before
from .outcomes import (
    ClaimOutcome,
    Decision,
    HolderRef,
    Registered,
    RegisterOutcome,
    ReleaseOutcome,
    RunSpec,
    Wake,
)
from .stores import Store, check_store_url, store_from_url

logger = logging.getLogger("singleton_tasks")

#: The environment variable naming the store when no ``store=`` is given (adapters and CLI).
STORE_ENV = "SINGLETON_TASKS_STORE"
#: The message option (Dramatiq) or header (Celery) in which a copy the library published
#: carries its generation; a copy without it is a new delivery of its run.
GENERATION_FIELD = "singleton_gen"
_default_warned = False


def default_store_url() -> str:
    """The embedded default: a SQLite file shared by every process of this host."""
    return f"sqlite:///{os.path.join(tempfile.gettempdir(), 'singleton-tasks.db')}"


def resolve_store_url(store: str | None) -> str:
    """``store`` → ``SINGLETON_TASKS_STORE`` → the embedded default, with a one-time warning."""
    global _default_warned
    if store:
        return store
    from_env = os.environ.get(STORE_ENV)
    if from_env:
        return from_env
    if not _default_warned:
        _default_warned = True
        warnings.warn(
            "singleton-tasks: no store configured; using the embedded SQLite default "
            f"({default_store_url()}), which serializes runs only on this host. "
            f"Pass store=... or set {STORE_ENV} (redis://… or postgresql://…) for several hosts.",
            stacklevel=3,
        )
    return default_store_url()


#: The store's clock and this process's may differ by this much before a worker warns.
CLOCK_SKEW_WARNING = 1.0
#: How often (seconds) a worker's background thread sweeps the store's expired state.
SWEEP_INTERVAL = 300.0
#: A sweep goes in slices of about this long (seconds), with the heartbeats due in between: a
#: backlog of expired rows (minutes of deletes after a million keys expire) never holds one back.
SWEEP_SLICE = 0.2
#: At most this many due keys are handled per store call of the heartbeat thread (more follow
#: at once, within SWEEP_SLICE).
TICK_BATCH = 64
#: The confirm thread waits this long (seconds) after a publish for more to batch with it.
CONFIRM_LINGER = 0.005
#: At most this many confirms are sent in one round trip.
CONFIRM_BATCH = 512
#: At close, at a fork and at process exit, pending confirms get this long (seconds) to be sent.
CONFIRM_FLUSH_TIMEOUT = 5.0
#: Every confirm thread of this process (flush_all_confirms).
_CONFIRMERS: weakref.WeakSet[_Confirmer] = weakref.WeakSet()
#: The process (pid) whose exit hook is registered, and the one whose exit hook ran.
_exit_hook_pid = 0
_exited_pid = 0


def check_store_argument(store: object) -> None:
    """Check an adapter's ``store`` argument at construction, without connecting (docs/deployment.md).

    A URL's scheme, syntax and driver are checked; without a store, the URL in
    ``SINGLETON_TASKS_STORE`` if it is set. Anything else is a :class:`SingletonConfigError`.
    """
    if isinstance(store, Store):
        return
    if store is None:
        from_env = os.environ.get(STORE_ENV)
        if from_env:
            check_store_url(from_env)
        return
    if not isinstance(store, str):
        raise SingletonConfigError(f"store must be a store URL or a Store, got {type(store).__name__}")
    check_store_url(store)


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
        self._heartbeater: _Heartbeater | None = None
        self._confirmer: _Confirmer | None = None
        self._spec_cache: dict[BoundSingleton, RunSpec] = {}
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
                self._ensure_schema(store)
            except BaseException:
                if store is not self._store_arg:
                    store.close()  # no pool left retrying in the background
                raise
            self._store, self._ready = store, True
        return store

    @staticmethod
    def _ensure_schema(store: Store) -> None:
        """Embedded stores create their schema on first use; the others must be migrated."""
        embedded = {"MemoryStore", "SQLiteStore", "RedisStore"}  # and their subclasses (Sentinel)
        if store.schema_version() is None and embedded & {cls.__name__ for cls in type(store).__mro__}:
            store.migrate()
        store.check_schema()

    def check(self, singletons: Iterable[BoundSingleton] = ()) -> None:
        """Worker start: fail against a bad store URL, a missing or incompatible schema (docs/deployment.md);
        warn about the clocks and a retention shorter than a task's lease and orphan timeout."""
        was_ready = self.ready
        store = self.store  # opening checks the schema
        if was_ready:
            self._ensure_schema(store)
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
        )

    def spec(
        self, bound: BoundSingleton, run_id: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> RunSpec:
        """Derive the run's key (SingletonKeyError) and resolve its timings: config → adapter option."""
        options = self._spec_cache.get(bound)
        if options is None:
            options = self._spec_cache[bound] = self.spec_options(bound)
        return dataclasses.replace(options, key=bound.derive_key(args, kwargs), run_id=run_id)

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
        """Enqueue: register a pending waiter or raise ``full_error`` (StoreUnavailableError passes).

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
        if outcome.status is Registered.FULL:
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

    def confirm(self, spec: RunSpec) -> None:
        self.store.confirm(spec.scope, spec.key, spec.run_id)

    def confirm_later(self, spec: RunSpec) -> None:
        """Confirm a published registration from this process's confirm thread, batched.

        The caller's publish is done: its ``.send()`` does not wait for the confirm. Until the
        confirm lands the registration is an unconfirmed one (passed over after the registration
        grace if nothing confirms it), and a delivery that comes first confirms it itself
        (docs/concepts.md#the-life-of-a-run).
        """
        self.confirms.add((spec.scope, spec.key, spec.run_id))

    @property
    def confirms(self) -> _Confirmer:
        self._after_fork()  # a forked child confirms only its own publishes
        if self._confirmer is None:
            with self._lock:
                if self._confirmer is None:
                    self._confirmer = _Confirmer(self)
        return self._confirmer

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
        payload: bytes | None,
        *,
        registered_at: float | None = None,
        woken_at: float | None = None,
    ) -> ClaimOutcome:
        """Gate: decide one delivery; the caller runs, defers or drops accordingly."""
        outcome = self.store.claim(spec, generation, payload)
        self._log_housekeeping(task_name, spec.scope, spec.key, outcome.evicted, outcome.removed)
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
                HolderRef(spec.scope, spec.key, spec.run_id, outcome.token or 0), spec.lease
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

    def suspend(self, spec: RunSpec, token: int, delay: float) -> None:
        """A holder waits for its retry: stop heartbeating it, keep its slot."""
        self.heartbeats.untrack(spec.run_id)
        if not self.store.suspend(spec.scope, spec.key, spec.run_id, token, delay=delay):
            logger.error(
                "run %s lost its slot of key %r before its retry (token %s)", spec.run_id, spec.key, token
            )

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
        self._log_housekeeping(task_name, spec.scope, spec.key, outcome.evicted, outcome.removed)
        metrics.observe_release(task_name, outcome)
        metrics.observe_woken(task_name, len(outcome.wakes))
        if outcome.lost:
            logger.error(
                "%s run %s lost its slot of key %r (token %s): another owner holds it; "
                "reject its writes by the fencing token",
                task_name,
                spec.run_id,
                spec.key,
                token,
            )
        return outcome

    @staticmethod
    def _log_housekeeping(
        task_name: str, scope: str, key: str, evicted: Sequence[str], removed: Sequence[str]
    ) -> None:
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

    def tick_due(self) -> int:
        """The heartbeat thread's call: do the due work of keys nobody calls (re-issues,
        evictions, abandoned waiters) and publish the wakes; returns how many keys it did."""
        done = self.store.tick_due(limit=TICK_BATCH)
        for outcome in done:
            # The scope names the task unless the declaration set a scope of its own.
            self._log_housekeeping(
                outcome.scope, outcome.scope, outcome.key, outcome.evicted, outcome.removed
            )
            metrics.observe_evicted(outcome.scope, len(outcome.evicted))
            if outcome.wakes:
                logger.info(
                    "key %r (scope %r): issued %s again, none of whose copies showed up in time",
                    outcome.key,
                    outcome.scope,
                    ", ".join(wake.run_id for wake in outcome.wakes),
                )
                metrics.observe_reissued(outcome.scope, len(outcome.wakes))
                if self.publish_wakes is not None:
                    self.publish_wakes(outcome.wakes)
        return len(done)

    # -- heartbeats ------------------------------------------------------------------------
    @property
    def heartbeats(self) -> _Heartbeater:
        self._after_fork()  # resets the heartbeater after a fork (never opens the store)
        if self._heartbeater is None:
            with self._lock:
                if self._heartbeater is None:
                    self._heartbeater = _Heartbeater(self)
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


def compare_clocks(store_time: float, store: Store) -> float:
    """Warn when the store's clock and this process's differ by more than CLOCK_SKEW_WARNING."""
    skew = clock.now() - store_time
    if abs(skew) > CLOCK_SKEW_WARNING:
        logger.warning(
            "this host's clock is %.1fs %s the clock of %r, which decides every lease and timeout: "
            "the mutex holds, but deferred runs are re-checked up to that much late or early "
            "(deferral delays are timed by the broker and the hosts); synchronise the clocks (NTP)",
            abs(skew),
            "ahead of" if skew > 0 else "behind",
            store,
        )
    return skew


class _Heartbeater:
    """One thread per process: one batched store call per interval for all running holders.

    The interval follows the holders: at most a third of the shortest lease among them (task
    overrides included), so each holder is heartbeated at least three times per its own lease.
    The same thread retries settlements that failed on a store error, sweeps the store's
    expired state now and then, and has the store check its server again each interval.
    """

    def __init__(self, gatekeeper: Gatekeeper) -> None:
        self._gatekeeper = gatekeeper
        options = gatekeeper.options
        self._ceiling = options.heartbeat_interval or options.lease / 3
        self._running: dict[str, tuple[HolderRef, float]] = {}
        self._retries: list[tuple[Callable[[], object], str]] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._next_sweep = 0.0
        self._sweeping = False  # a sweep found expired state: its next slice comes at once
        self._skew_warned = 0.0

    @property
    def interval(self) -> float:
        """Seconds until the next heartbeat: a third of the shortest lease held, at most."""
        with self._lock:
            return self._interval()

    def _interval(self) -> float:
        shortest = min((lease for _ref, lease in self._running.values()), default=None)
        return self._ceiling if shortest is None else min(self._ceiling, shortest / 3)

    def start(self) -> None:
        with self._lock:
            self._start()

    def _start(self) -> None:
        # Called with the lock held.
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._loop, name="singleton-heartbeat", daemon=True)
            self._thread.start()

    def track(self, ref: HolderRef, lease: float) -> None:
        with self._lock:
            shorter = lease / 3 < self._interval()
            self._running[ref.run_id] = (ref, lease)
            self._start()
            if shorter:
                self._changed.notify()  # the thread sleeps for a longer interval: wake it

    def retry_later(self, action: Callable[[], object], what: str) -> None:
        with self._lock:
            self._retries.append((action, what))
            self._start()

    def run_retries(self) -> None:
        """Try the pending settlements once; those that fail again stay queued."""
        with self._lock:
            pending, self._retries = self._retries, []
        failed = []
        for action, what in pending:
            try:
                action()
                logger.info("%s: done on retry", what)
            except Exception as error:
                logger.warning("%s: failed again (%s); retrying in %.1fs", what, error, self.interval)
                failed.append((action, what))
        with self._lock:
            self._retries[:0] = failed

    def untrack(self, run_id: str) -> None:
        with self._lock:
            self._running.pop(run_id, None)

    def running(self) -> list[HolderRef]:
        with self._lock:
            return [ref for ref, _lease in self._running.values()]

    def beat(self) -> list[str]:
        """One batched heartbeat now; returns the run ids that lost their slot."""
        holders = self.running()
        if not holders:
            return []
        store = self._gatekeeper.store
        outcome = store.heartbeat(holders)
        if time.monotonic() >= self._skew_warned:
            if abs(compare_clocks(outcome.store_time, store)) > CLOCK_SKEW_WARNING:
                self._skew_warned = time.monotonic() + 600.0  # once per ten minutes is enough
        dropped = set(outcome.lost)
        with self._lock:
            # A run whose own thread settled it during the call was untracked before its release:
            # the store forgot it, and that is no loss. Still tracked as heartbeated: lost.
            lost = [
                ref.run_id
                for ref in holders
                if ref.run_id in dropped and self._running.get(ref.run_id, (None, 0.0))[0] == ref
            ]
            for run_id in lost:
                del self._running[run_id]
        for run_id in lost:
            logger.error("heartbeat: run %s lost its slot; another owner holds it now", run_id)
        return lost

    def tick(self) -> None:
        """The due work of keys nobody calls (:meth:`Gatekeeper.tick_due`), for at most SWEEP_SLICE.

        Only where the adapter publishes what the store issues (a worker's process, not a
        producer whose thread retries a settlement): a copy issued and not published would wait
        another bound.
        """
        if self._gatekeeper.publish_wakes is None:
            return
        until = time.monotonic() + SWEEP_SLICE
        try:
            while self._gatekeeper.tick_due() >= TICK_BATCH and time.monotonic() < until:
                pass  # a full batch: more keys may be due
        except StoreUnavailableError as error:
            # An outage is the beat's and the operations' to report: not twice per interval.
            logger.debug("the due keys' work failed: %s", error)

    def sweep(self) -> None:
        """Forget a slice of the store's expired state (settled markers, idle keys).

        Every SWEEP_INTERVAL, a slice of SWEEP_SLICE; while a slice found something, the next
        one follows at once (the loop beats in between when a beat is due).
        """
        if time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + SWEEP_INTERVAL
        self._sweeping = False  # a failed slice ends the sweep until the next interval
        until = time.monotonic() + SWEEP_SLICE
        swept = self._gatekeeper.store.sweep(until=until)
        if swept:
            logger.debug("swept %d expired records from the store", swept)
        if swept and time.monotonic() >= until:  # stopped by the deadline: more may be left
            self._next_sweep, self._sweeping = 0.0, True

    def check_health(self) -> None:
        """The store's re-check of its server (:meth:`Store.check_health`), once per interval."""
        try:
            self._gatekeeper.store.check_health()
        except SingletonConfigError as error:
            # Each interval while it lasts, without a traceback: the message names the fix.
            logger.error("the store admits no new runs: %s", error)
        except StoreUnavailableError as error:
            # An outage is the beat's and the operations' to report: not twice per interval.
            logger.debug("the store's health check failed: %s", error)

    def _loop(self) -> None:
        beaten_at = time.monotonic()
        while True:
            with self._lock:
                if self._stopped:
                    return
                if not self._sweeping:
                    self._changed.wait(self._interval())
                    if self._stopped:
                        return
                    beaten_at = 0.0  # the interval passed, or a shorter lease came: beat now
            if time.monotonic() >= beaten_at + self.interval:
                steps: tuple[Callable[[], object], ...] = (
                    self.beat,
                    self.run_retries,
                    self.tick,
                    self.sweep,
                    self.check_health,
                )
                beaten_at = time.monotonic()
            else:
                steps = (self.sweep,)  # the next slice of a sweep, between two beats
            for step in steps:
                try:
                    step()
                except Exception:  # a store outage must not kill the heartbeat thread
                    logger.exception("%s failed; retrying in %.1fs", step.__name__, self.interval)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._changed.notify_all()
            dropped = [what for _action, what in self._retries]
        for what in dropped:
            logger.error("%s: given up at shutdown; freed when its lease and orphan timeout lapse", what)


def flush_all_confirms(timeout: float = CONFIRM_FLUSH_TIMEOUT) -> bool:
    """Send every confirm this process's gatekeepers still hold; False if ``timeout`` passed first.

    For a producer that closes a store object it passed to an adapter itself: the confirm
    thread must not use a store that is being closed (adapters flush when they close).
    """
    deadline = time.monotonic() + timeout
    return all(confirmer.flush(max(0.0, deadline - time.monotonic())) for confirmer in list(_CONFIRMERS))


def confirm_at_exit() -> None:
    """The process exits: send every pending confirm; one handed over later is sent inline.

    Runs at interpreter exit, at the exit of a ``multiprocessing`` or billiard child (which ends
    with ``os._exit``: no atexit), and in a Celery prefork pool process (``worker_process_shutdown``).
    After it, no confirm thread is left to rely on: a send from a later exit hook or a thread
    still running confirms on its own thread.
    """
    global _exited_pid
    _exited_pid = os.getpid()
    deadline = time.monotonic() + CONFIRM_FLUSH_TIMEOUT
    for confirmer in list(_CONFIRMERS):
        confirmer.stop(max(0.0, deadline - time.monotonic()))


def _at_child_exit(hook: Callable[[], None]) -> None:
    """Call ``hook`` when this process exits as a ``multiprocessing`` or billiard child.

    The one use of a stdlib internal (pinned by tests/test_framework_internals.py): such a child
    ends with ``os._exit``, after its ``_bootstrap`` ran ``multiprocessing.util._exit_function``,
    which calls the finalizers that this process registered with an exit priority (billiard
    shares that registry). The registry is per process: a fork child registers its own.
    """
    from multiprocessing import util

    util.Finalize(None, hook, exitpriority=100)  # first: before pools and queues are finalized


def _register_exit_hook() -> None:
    """Once per process, with its first confirm thread (a forked child's comes after the fork).

    Two threads racing here register it twice: harmless, the second call finds nothing pending.
    """
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        _at_child_exit(confirm_at_exit)


atexit.register(confirm_at_exit)  # before the daemon confirm threads stop with the interpreter
if hasattr(os, "register_at_fork"):
    # A parent may os._exit right after forking (daemonizing): its batch goes out before the fork.
    # The child's copies of the parent's confirm threads are dead; its gatekeepers make new ones.
    os.register_at_fork(before=flush_all_confirms, after_in_child=_CONFIRMERS.clear)


#: A run to confirm, ``(scope, key, run_id)``, and when (monotonic) its confirm was handed over.
_Pending = tuple[tuple[str, str, str], float]


class _Confirmer:
    """One thread per process that confirms published registrations, many per store round trip.

    A producer's ``.send()`` registers, publishes and returns; the confirm follows within
    :data:`CONFIRM_LINGER` in a batch (:meth:`Store.confirm_many`). It never precedes the
    publish, so a failed publish still leaves only an unconfirmed registration, passed over after
    the registration grace. A batch that fails on a store outage is tried again until the
    registration grace has passed (the delivery confirms the run then, as it does any
    unconfirmed one); pending confirms are sent at close, before a fork and at process exit
    (:func:`confirm_at_exit`), and inline once the exit hook has run.
    """

    def __init__(self, gatekeeper: Gatekeeper) -> None:
        self._gatekeeper = gatekeeper
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._busy = False  # a batch is being sent
        self._stopped = _exited_pid == os.getpid()  # made after the exit hook: confirms inline
        self._thread: threading.Thread | None = None
        _CONFIRMERS.add(self)
        _register_exit_hook()

    def add(self, run: tuple[str, str, str]) -> None:
        with self._lock:
            inline = self._stopped or not self._started()
            if not inline:
                self._pending.append((run, time.monotonic()))
                if len(self._pending) == 1 and not self._busy:
                    self._changed.notify_all()
        if inline:  # closed, or no thread can start (interpreter exit): on the caller's thread
            self._send([(run, time.monotonic())])

    def _started(self) -> bool:
        """Start the thread if it is not running yet (called with the lock held)."""
        if self._thread is None:
            thread = threading.Thread(target=self._loop, name="singleton-confirm", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # "can't create new thread at interpreter shutdown"
                return False
            self._thread = thread
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is pending or being sent; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._changed.notify_all()  # no lingering: send now
            while self._pending or self._busy:
                if self._thread is None or not self._thread.is_alive():
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left)
            return not (self._pending or self._busy)

    def stop(self, timeout: float) -> None:
        self.flush(timeout)
        with self._lock:
            self._stopped = True
            self._changed.notify_all()
            dropped = len(self._pending)
        if dropped:
            logger.warning("%d published runs not confirmed at close; their deliveries confirm them", dropped)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._stopped:
                    self._changed.wait()
                if self._stopped:
                    return
                self._changed.wait(CONFIRM_LINGER)  # more publishes join this batch
                batch, self._pending = self._pending[:CONFIRM_BATCH], self._pending[CONFIRM_BATCH:]
                self._busy = True
            failed = self._send(batch)
            with self._lock:
                self._busy = False
                if failed:
                    self._pending[:0] = failed
                self._changed.notify_all()
            if failed:
                time.sleep(min(1.0, CONFIRM_LINGER * 100))  # the store is out: do not spin

    def _send(self, batch: list[_Pending]) -> list[_Pending]:
        """Confirm ``batch``; returns what should be tried again."""
        try:
            self._gatekeeper.store.confirm_many([run for run, _since in batch])
            return []
        except Exception as error:
            store = self._gatekeeper._store
            grace = store.timings.registration_grace if store is not None else DEFAULT_REGISTRATION_GRACE
            now = time.monotonic()
            again = [(run, since) for run, since in batch if now - since < grace]
            logger.warning(
                "%d published runs not confirmed (%s)%s",
                len(batch),
                error,
                "; retrying" if again else "; their deliveries confirm them",
            )
            return again
