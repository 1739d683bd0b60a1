"""The confirm thread: one per process, confirming published registrations in batches.

Also what sends its pending confirms when they would otherwise be lost: a close
(:func:`flush_all_confirms`), a fork, the exit of the interpreter or of a ``multiprocessing``
or billiard child (:func:`confirm_at_exit`).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence

logger = logging.getLogger("singleton_tasks")

#: The confirm thread waits this long (seconds) after a publish for more to batch with it.
CONFIRM_LINGER = 0.005
#: At most this many confirms are sent in one round trip.
CONFIRM_BATCH = 512
#: At close, at a fork and at process exit, pending confirms get this long (seconds) to be sent.
CONFIRM_FLUSH_TIMEOUT = 5.0
#: Every confirm thread of this process (flush_all_confirms).
_CONFIRMERS: weakref.WeakSet[Confirmer] = weakref.WeakSet()
#: The process (pid) whose exit hook is registered, and the one whose exit hook ran.
_exit_hook_pid = 0
_exited_pid = 0


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


#: A run to confirm: ``(scope, key, run_id)``.
Run = tuple[str, str, str]
#: A run to confirm and when (monotonic) its confirm was handed over.
_Pending = tuple[Run, float]


class Confirmer:
    """One thread per process that confirms published registrations, many per store round trip.

    A producer's ``.send()`` registers, publishes and returns; the confirm follows within
    :data:`CONFIRM_LINGER` in a batch (:meth:`Store.confirm_many`). It never precedes the
    publish, so a failed publish still leaves only an unconfirmed registration, dropped after
    the registration grace. A batch that fails on a store outage is tried again until the
    registration grace has passed (the delivery confirms the run then, as it does any
    unconfirmed one); pending confirms are sent at close, before a fork and at process exit
    (:func:`confirm_at_exit`), and inline once the exit hook has run.
    """

    def __init__(
        self, confirm_many: Callable[[Sequence[Run]], object], registration_grace: Callable[[], float]
    ) -> None:
        """Give the thread its two links to the process's store.

        Arguments:
            confirm_many: Confirms a batch in the store (:meth:`Store.confirm_many` of the
                process's store, opened if it is not yet).
            registration_grace: How long (seconds) an unconfirmed registration keeps its place:
                a batch that failed is tried again until then; read without opening the store.
        """
        self._confirm_many = confirm_many
        self._registration_grace = registration_grace
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._busy = False  # a batch is being sent
        self._stopped = _exited_pid == os.getpid()  # made after the exit hook: confirms inline
        self._thread: threading.Thread | None = None
        _CONFIRMERS.add(self)
        _register_exit_hook()

    def add(self, run: Run) -> None:
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
            self._confirm_many([run for run, _since in batch])
            return []
        except Exception as error:
            grace = self._registration_grace()
            now = time.monotonic()
            again = [(run, since) for run, since in batch if now - since < grace]
            logger.warning(
                "%d published runs not confirmed (%s)%s",
                len(batch),
                error,
                "; retrying" if again else "; their deliveries confirm them",
            )
            return again
