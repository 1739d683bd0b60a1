"""The heartbeat thread: one per process, keeping the runs it executes alive in the store.

Each interval it heartbeats every holder in one store call, retries the settlements that failed
on a store error, does the due work of keys nobody calls (:meth:`Store.tick_due`) and publishes
its wakes, sweeps the store's expired state now and then, and has the store re-check its server.
It warns when this host's clock and the store's differ (:func:`compare_clocks`, also at worker
start).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import clock, metrics
from .errors import SingletonConfigError, StoreUnavailableError
from .outcomes import HolderRef
from .stores import Store

if TYPE_CHECKING:
    from .runtime import Gatekeeper

logger = logging.getLogger("singleton_tasks")

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


def log_lost_slot(task_name: str, run_id: str, key: str, token: int | None, when: str = "") -> None:
    """The error of a holder whose slot another owner holds now (docs/operations.md#logging);
    ``when``: where it was found (" at its heartbeat", " before its retry")."""
    logger.error(
        "%s run %s lost its slot of key %r (token %s)%s: another owner holds it; "
        "reject its writes by the fencing token",
        task_name,
        run_id,
        key,
        token,
        when,
    )


class Heartbeater:
    """One thread per process: one batched store call per interval for all running holders.

    The interval follows the holders: at most a third of the shortest lease among them (task
    overrides included), so each holder is heartbeated at least three times per its own lease.
    The same thread retries settlements that failed on a store error, sweeps the store's
    expired state now and then, and has the store check its server again each interval.
    """

    def __init__(self, gatekeeper: Gatekeeper) -> None:
        # Read through its public side only: the store (opened at first use, again after an
        # outage), the options, the adapter's publisher of wakes (set after this thread may have
        # started) and the housekeeping log the gatekeeper's own operations write.
        self._gatekeeper = gatekeeper
        options = gatekeeper.options
        self._ceiling = options.heartbeat_interval or options.lease / 3
        #: run id -> (the holder, its lease, its task's name for the logs)
        self._running: dict[str, tuple[HolderRef, float, str]] = {}
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
        shortest = min((lease for _ref, lease, _task in self._running.values()), default=None)
        return self._ceiling if shortest is None else min(self._ceiling, shortest / 3)

    def start(self) -> None:
        with self._lock:
            self._start()

    def _start(self) -> None:
        # Called with the lock held.
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._loop, name="singleton-heartbeat", daemon=True)
            self._thread.start()

    def track(self, ref: HolderRef, lease: float, task_name: str) -> None:
        """Heartbeat ``ref`` from now on; ``task_name`` names it in the logs."""
        with self._lock:
            shorter = lease / 3 < self._interval()
            self._running[ref.run_id] = (ref, lease, task_name)
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
            return [ref for ref, _lease, _task in self._running.values()]

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
                self._running.pop(ref.run_id)
                for ref in holders
                if ref.run_id in dropped and self._running.get(ref.run_id, (None,))[0] == ref
            ]
        for ref, _lease, task_name in lost:
            log_lost_slot(task_name, ref.run_id, ref.key, ref.token, " at its heartbeat")
        return [ref.run_id for ref, _lease, _task in lost]

    def tick_due(self) -> int:
        """One batch of the due work of keys nobody calls (re-issues, evictions, abandoned
        waiters), logged, counted and its wakes published; returns how many keys it did."""
        gatekeeper = self._gatekeeper
        done = gatekeeper.store.tick_due(limit=TICK_BATCH)
        for outcome in done:
            # The scope names the task unless the declaration set a scope of its own.
            gatekeeper.log_housekeeping(
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
                if gatekeeper.publish_wakes is not None:
                    gatekeeper.publish_wakes(outcome.wakes)
        return len(done)

    def tick(self) -> None:
        """The due work of keys nobody calls (:meth:`tick_due`), for at most SWEEP_SLICE.

        Only where the adapter publishes what the store issues (a worker's process, not a
        producer whose thread retries a settlement): a copy issued and not published would wait
        another bound.
        """
        if self._gatekeeper.publish_wakes is None:
            return
        until = time.monotonic() + SWEEP_SLICE
        try:
            while self.tick_due() >= TICK_BATCH and time.monotonic() < until:
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
