"""What both adapters share: one :class:`Gatekeeper` per worker or producer process.

It resolves options (task config → adapter option → default), turns framework-neutral
events into store calls with the library's clock, picks deferral delays, heartbeats the
runs a process executes, and logs what operators need to see. The adapters only translate
framework events into these calls.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import clock, metrics
from .config import DISABLED, BoundSingleton
from .errors import SingletonConfigError, SingletonQueueFullError, StoreUnavailableError
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

STORE_ENV = "SINGLETON_TASKS_STORE"
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


def check_store_argument(store: object) -> None:
    """Check an adapter's ``store`` argument at construction, without connecting (SPEC §8).

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
    """Worker-side timings, in seconds (SPEC §2)."""

    retry_delay: float = 1.0
    retry_jitter: float = 0.25
    lease: float = 60.0
    orphan_timeout: float | None = 600.0
    heartbeat_interval: float | None = None  # default: a third of the lease
    max_retry_delay: float = 10.0  # far-back waiters re-check at most this rarely (a wake comes first)


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

    # -- the store, one per process --------------------------------------------------------
    def _after_fork(self) -> None:
        if self._pid != os.getpid():
            # Forked (prefork pool): the parent's threads did not come along, and its lock may have
            # been held at the fork. A store given as an instance is kept; a URL gets fresh clients.
            self._heartbeater, self._lock, self._pid = None, threading.Lock(), os.getpid()
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
        if store.schema_version() is None and type(store).__name__ in (
            "MemoryStore",
            "SQLiteStore",
            "RedisStore",
        ):
            store.migrate()
        store.check_schema()

    def check(self) -> None:
        """Fail at worker start against a bad store URL, a missing or incompatible schema (SPEC §8)."""
        was_ready = self.ready
        store = self.store  # opening checks the schema
        if was_ready:
            self._ensure_schema(store)

    # -- options ---------------------------------------------------------------------------
    def spec(
        self, bound: BoundSingleton, run_id: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> RunSpec:
        """Derive the run's key (SingletonKeyError) and resolve its timings: config → adapter option."""
        config = bound.config
        orphan = self.options.orphan_timeout if config.orphan_timeout is None else config.orphan_timeout
        return RunSpec(
            scope=bound.scope,
            key=bound.derive_key(args, kwargs),
            run_id=run_id,
            limit=config.limit,
            max_queue_depth=config.max_queue_depth,
            lease=config.lease if config.lease is not None else self.options.lease,
            orphan_timeout=None if orphan is None or orphan == DISABLED else float(orphan),
        )

    def deferral_delay(self, position: int | None, limit: int = 1) -> float:
        """~retry_delay ± jitter at the head of the line; rarer re-checks further back (SPEC §3)."""
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
        confirmed: bool = True,
        full_error: type[SingletonQueueFullError] = SingletonQueueFullError,
    ) -> RegisterOutcome:
        """Enqueue: register a pending waiter or raise ``full_error`` (StoreUnavailableError passes)."""
        try:
            outcome = self.store.register(spec, now=clock.now(), confirmed=confirmed)
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
        self.store.confirm(spec.scope, spec.key, spec.run_id, now=clock.now())

    def unregister(self, spec: RunSpec) -> None:
        self.store.unregister(spec.scope, spec.key, spec.run_id, now=clock.now())

    def park(self, task_name: str, spec: RunSpec, payload: bytes) -> tuple[Wake, ...]:
        """A run published held back waits gated with ``payload``; the caller publishes the wakes."""
        wakes = self.store.park(spec.scope, spec.key, spec.run_id, payload, now=clock.now())
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
        now = clock.now()
        outcome = self.store.claim(spec, generation, payload, now=now)
        self._log_evictions(outcome.evicted, spec)
        metrics.observe_claim(task_name, outcome, now=now, registered_at=registered_at, woken_at=woken_at)
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
            self.heartbeats.track(HolderRef(spec.scope, spec.key, spec.run_id, outcome.token or 0))
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
        if not self.store.suspend(spec.scope, spec.key, spec.run_id, token, now=clock.now(), delay=delay):
            logger.error(
                "run %s lost its slot of key %r before its retry (token %s)", spec.run_id, spec.key, token
            )

    def release(
        self, task_name: str, spec: RunSpec, *, token: int | None, generation: int | None = None
    ) -> ReleaseOutcome:
        """Settle: free the slot or the place in line; the caller publishes ``wakes``."""
        self.heartbeats.untrack(spec.run_id)
        outcome = self.store.release(
            spec.scope, spec.key, spec.run_id, token=token, generation=generation, now=clock.now()
        )
        self._log_evictions(outcome.evicted, spec)
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
    def _log_evictions(evicted: tuple[str, ...], spec: RunSpec) -> None:
        for run_id in evicted:
            logger.warning(
                "evicted orphaned holder %s of key %r (scope %r): its lease lapsed over orphan_timeout ago",
                run_id,
                spec.key,
                spec.scope,
            )

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

    def close(self) -> None:
        if self._heartbeater is not None:
            self._heartbeater.stop()
            self._heartbeater = None  # a later track() starts a fresh thread
        if self._store is not None and not isinstance(self._store_arg, Store):
            self._store.close()
            self._store = None
        self._ready = False


class _Heartbeater:
    """One thread per process: one batched store call per interval for all running holders."""

    def __init__(self, gatekeeper: Gatekeeper) -> None:
        self._gatekeeper = gatekeeper
        options = gatekeeper.options
        self.interval = options.heartbeat_interval or max(0.05, options.lease / 3)
        self._running: dict[str, HolderRef] = {}
        self._retries: list[tuple[Callable[[], object], str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        # Called with the lock held.
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="singleton-heartbeat", daemon=True)
            self._thread.start()

    def track(self, ref: HolderRef) -> None:
        with self._lock:
            self._running[ref.run_id] = ref
            self._start()

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
            return list(self._running.values())

    def beat(self) -> list[str]:
        """One batched heartbeat now; returns the run ids that lost their slot."""
        holders = self.running()
        if not holders:
            return []
        lost = self._gatekeeper.store.heartbeat(holders, now=clock.now())
        for run_id in lost:
            logger.error("heartbeat: run %s lost its slot; another owner holds it now", run_id)
            self.untrack(run_id)
        return lost

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception:  # a store outage must not kill the heartbeat thread
                logger.exception("heartbeat failed; retrying in %.1fs", self.interval)
            self.run_retries()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            dropped = [what for _action, what in self._retries]
        for what in dropped:
            logger.error("%s: given up at shutdown; freed when its lease and orphan timeout lapse", what)
