"""Dramatiq: ``SingletonMiddleware`` gates singleton actors (docs/concepts.md).

The rules live in the store and the shared worker logic in :class:`~singleton_tasks.runtime.Gatekeeper`;
the middleware only maps Dramatiq's hooks onto them:

- ``before_enqueue`` registers a new run (the backlog cap raises here, or drops the send),
  ``after_enqueue`` hands its confirm to the process's confirm thread (batched, off the caller's
  thread); re-publishes of a known run (retries, delay-queue moves, deferrals, wakes) carry its
  generation and pass through untouched.
- ``before_process_message`` claims a slot; a denied delivery is deferred as a delayed copy and skipped
  (acked, not failed, retries untouched, Results kept away).
- ``before_ack`` / ``before_nack`` settle: a retry of the delivery seen on this thread (Retries' enqueue
  of the same message id) keeps the slot, anything else releases it and wakes the next waiters.

The declarations are read in :mod:`._declaration`, the copies' options and wake messages made in
:mod:`._payload`, the errors ``.send()`` raises defined in :mod:`._errors` (each a ``MiddlewareError``:
``Broker.emit_before`` swallows any other), Dramatiq's internals reached in :mod:`._internals`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .._extras import missing

try:
    import dramatiq
except ImportError as error:
    raise missing("singleton_tasks.dramatiq", "Dramatiq", "dramatiq", error) from error
from dramatiq.middleware import SkipMessage

from .. import admission
from .. import errors as core
from ..config import (
    DEFAULT_LEASE,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_ORPHAN_TIMEOUT,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_JITTER,
    BoundSingleton,
)
from ..decorator import TaskDescription, register_describer
from ..outcomes import Decision, Registered, RunSpec, Wake
from ..runtime import Gatekeeper, claims_as_stored
from ..stores import Store, redact_url
from ._declaration import (
    OPTION,
    adopt_declared_actor,
    bound_for,
    bound_of,
    describe_actor,
    require_middleware,
)
from ._errors import (
    ConfigError,
    DeferralFailed,
    Dropped,
    InvalidKey,
    KeyFailed,
    PayloadError,
    QueueFull,
    SchemaError,
    StoreUnavailable,
    for_sender,
)
from ._internals import (
    QuietSkips,
    connect_publishing_thread,
    fetch_for_this_worker,
    guard_message_building,
    keep_results_away,
    names_as_continuation,
    on_consumer_thread,
    return_dropped_sends,
)
from ._payload import AS_STORED, DEAD_GENERATION, GENERATION, WOKEN_AT, generation_of, wake_message

if TYPE_CHECKING:
    import contextvars

    from dramatiq.broker import Broker, MessageProxy
    from dramatiq.message import Message
    from dramatiq.worker import Worker, WorkerThread

logger = logging.getLogger("singleton_tasks")


@dataclass
class _Delivery:
    """What this worker thread knows of the message it is processing."""

    message: MessageProxy
    bound: BoundSingleton | None
    seen: bool  # our before_process_message ran for it
    spec: RunSpec | None = None
    generation: int = 0
    token: int | None = None  # admitted: the fencing token
    retry_delay: float | None = None  # Retries re-enqueued it (seconds)
    body_done: bool = False
    settled: bool = False
    quiet: bool = False  # skipped by our gate: the worker's "was skipped" warning is noise
    context: contextvars.Token[admission.Admission | None] | None = None


class SingletonMiddleware(dramatiq.Middleware):
    """Makes actors with a ``singleton`` option durable FIFO mutexes per key.

    Parameters:
      store: a store URL or object; default ``SINGLETON_TASKS_STORE``, then the embedded SQLite file.
        The URL's scheme and syntax are checked here (``SingletonConfigError``), without
        connecting: the store is opened at first use, and a store that cannot be used then
        makes ``.send()`` raise within its connect timeout (Redis ``socket_connect_timeout``,
        PostgreSQL ``timeout``: 5 s by default), with nothing published.
      namespace: isolates applications sharing one store server.
      retry_delay, retry_jitter: seconds until a denied delivery is re-checked (the fallback of the
        wake on release), ± jitter.
      lease, orphan_timeout, heartbeat_interval, max_retry_delay: seconds; see
        docs/concepts.md#declaring-a-singleton.

    Add it to the broker before actor modules are imported: Dramatiq validates actor options when
    an actor is declared.
    """

    def __init__(
        self,
        store: Store | str | None = None,
        *,
        namespace: str = "default",
        retry_delay: float = DEFAULT_RETRY_DELAY,
        retry_jitter: float = DEFAULT_RETRY_JITTER,
        lease: float = DEFAULT_LEASE,
        orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT,
        heartbeat_interval: float | None = None,
        max_retry_delay: float = DEFAULT_MAX_RETRY_DELAY,
    ) -> None:
        self.gatekeeper = Gatekeeper(
            store,
            namespace=namespace,
            retry_delay=retry_delay,
            retry_jitter=retry_jitter,
            lease=lease,
            orphan_timeout=orphan_timeout,
            heartbeat_interval=heartbeat_interval,
            max_retry_delay=max_retry_delay,
        )
        self._local = threading.local()
        self._quiet = QuietSkips(self._is_quiet_deferral)
        #: (the broker's middleware list, its length, whether what a registration stores is what
        #: the broker publishes): see _stores_what_is_sent.
        self._sent_as_stored: tuple[list[dramatiq.Middleware], int, bool] | None = None

    def __repr__(self) -> str:
        store = self.gatekeeper._store_arg
        shown = repr(store) if isinstance(store, Store) else repr(redact_url(store) if store else None)
        return f"SingletonMiddleware(store={shown})"

    @property
    def store(self) -> Store:
        """This process's store."""
        return self.gatekeeper.store

    @property
    def actor_options(self) -> set[str]:
        return {OPTION}

    # -- declaration -----------------------------------------------------------------------
    def before_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        """Validate the ``singleton`` option now, not at the first run.

        An actor whose function ``@singleton`` marked (written under ``@dramatiq.actor``) gets
        its option here.
        """
        try:
            adopt_declared_actor(actor)
        except core.SingletonConfigError as error:
            raise ConfigError(str(error)) from error
        return_dropped_sends(broker, Dropped)  # on_full="drop": see _internals (9.)

    def after_declare_actor(self, broker: Broker, actor: dramatiq.Actor[Any, Any]) -> None:
        """Adopt a marked actor declared before this middleware was added to its broker."""
        self.before_declare_actor(broker, actor)

    # -- worker lifecycle ------------------------------------------------------------------
    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Refuse to start against a missing or incompatible store schema (docs/deployment.md)."""
        self._quiet.install()
        # The heartbeat thread publishes the copies the store issues for keys nobody calls.
        self.gatekeeper.publish_wakes = lambda wakes: self._wake(broker, wakes)
        singletons = [
            bound for actor in list(broker.actors.values()) if (bound := bound_of(actor)) is not None
        ]
        try:
            self.gatekeeper.check(singletons)
        except core.SchemaVersionError as error:
            raise SchemaError(str(error)) from error
        except core.StoreUnavailableError as error:
            logger.warning("singleton store unavailable at worker start (%s); gating fails closed", error)
        except core.SingletonError as error:
            # A MiddlewareError leaves Worker.start(): the worker process exits instead of
            # deferring every singleton message forever.
            logger.critical("singleton-tasks: the worker cannot start: %s", error)
            raise for_sender(error) from error

    def after_worker_thread_boot(self, broker: Broker, thread: WorkerThread) -> None:
        """Open this thread's broker connection now: a first wake must not wait for a connect."""
        connect_publishing_thread(broker)

    def after_worker_shutdown(self, broker: Broker, worker: Worker) -> None:
        """Stop the heartbeat thread and close this process's store clients."""
        self._quiet.uninstall()
        self.gatekeeper.close()

    # -- enqueue ---------------------------------------------------------------------------
    def before_enqueue(self, broker: Broker, message: Message[Any], delay: int) -> None:
        """Register a new singleton run atomically with the backlog cap (docs/concepts.md)."""
        if GENERATION in message.options:
            # Seen before: a retry, a delay-queue move, a deferral, a wake. The mark holds only
            # while no broker the message passes may change it after us (a move passes the
            # worker's middleware).
            if not self._stores_what_is_sent(broker):
                message.options.pop(AS_STORED, None)
            return
        bound = bound_for(broker, message.actor_name)
        if bound is None:
            return
        lenient = self._is_continuation(message)
        try:
            spec = self.gatekeeper.spec(bound, message.message_id, message.args, message.kwargs)
        except core.SingletonKeyError as error:
            if lenient:  # never raise into emit_after: the gate fails it to the dead letters
                return
            raise InvalidKey(str(error)) from error
        try:
            # Encoded before anything is written: the store issues the run from it if its
            # copies are lost, and a message that cannot be encoded leaves no trace.
            payload = message.encode()
        except Exception as error:
            if lenient:
                return  # never raise into emit_after: the publish fails the same way
            raise PayloadError(
                f"{bound.task_name} run {message.message_id}: its message cannot be encoded ({error}); "
                "nothing was sent"
            ) from error
        if lenient:
            # The framework continues work it accepted (a pipeline step, a group callback, a
            # delay-queue move): it must not be lost to the cap, which held when it was started.
            spec = replace(spec, max_queue_depth=None)
        try:
            outcome = self.gatekeeper.register(
                bound,
                spec,
                payload=payload,
                delay=(delay or 0) / 1000,
                confirmed=False,
                full_error=QueueFull,
            )
        except QueueFull:
            raise
        except core.SingletonError as error:
            # Emit_before swallows anything that is not a MiddlewareError and publishes anyway:
            # every store problem (a bad URL, an unreachable server, a missing schema) is raised
            # to the caller of .send() as one, and nothing is published.
            if lenient:
                logger.warning("%s run %s: %s; registered at delivery", bound.task_name, spec.run_id, error)
                return
            # A store that could not even be opened (not ready) has written nothing.
            if self.gatekeeper.ready and isinstance(error, core.StoreUnavailableError):
                # The registration may have been written before the reply was lost (a timeout): undo
                # it now rather than leave it in line until its grace lapses.
                self.gatekeeper.settle_or_retry(
                    lambda: self.gatekeeper.unregister(spec), f"undoing the registration of run {spec.run_id}"
                )
            raise for_sender(error) from error
        if outcome.status is Registered.FULL:
            # on_full="drop": nothing registered; the broker's enqueue returns the message unsent.
            raise Dropped(f"{bound.task_name} run {spec.run_id} dropped: key {spec.key!r} is full")
        if outcome.status is Registered.EXISTS:
            # A start of a run id that is already in line: this copy is dropped at the gate
            # (docs/concepts.md#keys-vs-run-ids).
            logger.info("%s run %s already registered: duplicate start dropped", bound.task_name, spec.run_id)
            message.options[GENERATION] = DEAD_GENERATION
            return
        message.options[GENERATION] = 0
        if self._stores_what_is_sent(broker):
            message.options[AS_STORED] = True
        self._local.pending = (message.message_id, spec)

    def after_enqueue(self, broker: Broker, message: Message[Any], delay: int) -> None:
        """Confirm a registration once published (batched, off this thread); note a retry of the
        delivery on this thread."""
        pending: tuple[str, RunSpec] | None = getattr(self._local, "pending", None)
        if pending is not None and pending[0] == message.message_id:
            self._local.pending = None
            self.gatekeeper.confirm_later(pending[1])
        delivery = self._delivery()
        if (
            delivery is not None
            and delivery.token is not None
            and not delivery.settled
            and delivery.message.message_id == message.message_id
        ):
            delivery.retry_delay = (delay or 0) / 1000

    def _is_continuation(self, message: Message[Any]) -> bool:
        """Whether this enqueue continues accepted work rather than starting new work."""
        if on_consumer_thread():
            return True  # consumer threads only move due messages from the delay queue
        delivery = self._delivery()
        if delivery is None:
            return False
        if delivery.body_done:
            return True  # after the body: pipelines, group and success/failure callbacks
        return names_as_continuation(delivery.message.options, message.message_id)

    # -- gate hook -------------------------------------------------------------------------
    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        """Claim a slot; a denied delivery is deferred and skipped, never run (docs/concepts.md)."""
        bound = bound_for(broker, message.actor_name)
        delivery = _Delivery(message, bound, seen=True)
        self._local.delivery = delivery
        if bound is None:
            return
        generation = generation_of(message)
        delivery.generation = generation
        # Re-publishes of this delivery (Retries) carry the tag, so they pass before_enqueue.
        message.options.setdefault(GENERATION, generation)
        try:
            spec = self.gatekeeper.spec(bound, message.message_id, message.args, message.kwargs)
        except core.SingletonKeyError as error:
            logger.error("%s run %s: %s; failing the message", bound.task_name, message.message_id, error)
            message.fail()
            raise KeyFailed(str(error)) from error
        delivery.spec = spec
        # The proxied message as is (copy() would only cost a replace()); encoded only if the
        # store has none when it is the message its registration stored.
        lazy = claims_as_stored(generation, AS_STORED in message.options, message.options.get("retries", 0))
        payload = message.encode if lazy else message.encode()
        try:
            outcome = self.gatekeeper.claim(
                bound.task_name,
                spec,
                generation,
                payload,
                registered_at=message.message_timestamp / 1000,
                woken_at=message.options.get(WOKEN_AT),
            )
        except Exception as error:  # fail closed: a body never runs without its slot
            log = logger.warning if isinstance(error, core.StoreUnavailableError) else logger.exception
            log("%s run %s: gate failed (%s); deferring", bound.task_name, spec.run_id, error)
            self._defer(broker, message, generation, self.gatekeeper.deferral_delay(None, spec.limit))
            delivery.quiet = True
            raise SkipMessage("singleton gate unavailable: deferred") from None
        if outcome.decision is Decision.ADMITTED:
            delivery.token = outcome.token
            delivery.context = admission.enter(
                admission.Admission(spec.run_id, spec.scope, spec.key, outcome.token or 0)
            )
            self._wake(broker, outcome.wakes)
            return
        if outcome.decision is Decision.STALE:
            self._wake(broker, outcome.wakes)
            keep_results_away(message)
            delivery.quiet = True
            raise SkipMessage("stale singleton copy dropped")
        assert outcome.generation is not None
        delay = self.gatekeeper.deferral_delay(outcome.position, spec.limit)
        self._defer(broker, message, outcome.generation, delay)
        self._wake(broker, outcome.wakes)
        delivery.quiet = True
        raise SkipMessage(f"singleton key {spec.key!r} busy: deferred")

    def _stores_what_is_sent(self, broker: Broker) -> bool:
        """Whether the message a registration stores (encoded in this before_enqueue) is the one the
        broker publishes: no middleware after this one, in this producer, has a before_enqueue of
        its own, which could add options (a trace id) that a wake of the stored message would lack."""
        middleware = broker.middleware
        known = self._sent_as_stored
        if known is not None and known[0] is middleware and known[1] == len(middleware):
            return known[2]
        later = middleware[next((i + 1 for i, m in enumerate(middleware) if m is self), 0) :]
        same = all(type(m).before_enqueue is dramatiq.Middleware.before_enqueue for m in later)
        self._sent_as_stored = (middleware, len(middleware), same)
        return same

    def _defer(self, broker: Broker, message: MessageProxy, generation: int, delay: float) -> None:
        """Publish the delayed copy that re-checks this run, then keep Results off this delivery."""
        copy = message.copy(options={GENERATION: generation, WOKEN_AT: None})
        try:
            broker.enqueue(copy, delay=max(0, round(delay * 1000)))
        except Exception as error:
            # Acking now would lose the run: fail the delivery instead (Retries re-publishes it).
            logger.error("run %s: publishing its deferred copy failed: %s", message.message_id, error)
            raise DeferralFailed(f"could not defer run {message.message_id}: {error}") from error
        keep_results_away(message)

    def _wake(self, broker: Broker, wakes: Sequence[Wake]) -> None:
        """Publish woken waiters at once, not after their timers (docs/concepts.md#handoff).

        Then fetch their queues for this worker: a RedisBroker consumer backing off on a quiet
        queue (up to ``worker_timeout``) would otherwise leave the woken run waiting.
        """
        queues: set[str] = set()
        for wake in wakes:
            if wake.payload is None:
                continue  # never delivered yet: its own message is on its way
            try:
                message = wake_message(broker, wake)
                broker.enqueue(message)
            except Exception:  # its delayed copy re-checks it anyway
                logger.exception("waking run %s of key %r failed; its timer re-checks", wake.run_id, wake.key)
                continue
            queues.add(message.queue_name)
        for queue in queues:
            try:
                fetch_for_this_worker(queue)
            except Exception as error:  # the consumer fetches it at its next poll
                logger.warning("fetching woken runs from queue %r failed: %s", queue, error)

    # -- body end and settlement -----------------------------------------------------------
    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        """Mark the body done; settlement waits for the ack, when Retries has decided."""
        self._body_done(broker, message)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        """Mark the body done (skipped by us or by another middleware such as AgeLimit)."""
        self._body_done(broker, message)

    def _body_done(self, broker: Broker, message: MessageProxy) -> None:
        delivery = self._delivery()
        if delivery is None or delivery.message is not message:
            # Our gate never saw it: an earlier middleware skipped or failed it.
            delivery = _Delivery(message, bound_for(broker, message.actor_name), seen=False)
            self._local.delivery = delivery
        delivery.body_done = True
        _leave(delivery)

    def before_ack(self, broker: Broker, message: MessageProxy) -> None:
        """Settle before the ack, so the wake is published before the broker sees the queue drained."""
        self._settle_delivery(broker, message)

    def before_nack(self, broker: Broker, message: MessageProxy) -> None:
        """Settle a failed run: terminal (retries exhausted, ``throws``, AgeLimit, a bad key)."""
        self._settle_delivery(broker, message)

    def _settle_delivery(self, broker: Broker, message: MessageProxy) -> None:
        delivery = self._delivery()
        if delivery is None or delivery.message is not message:
            return  # a delay-queue message moved by a consumer thread: nothing to settle
        self._local.delivery = None
        if delivery.settled or delivery.bound is None:
            return
        delivery.settled = True  # idempotent: interrupts can run hooks twice
        _leave(delivery)
        bound = delivery.bound
        if delivery.seen and delivery.token is None:
            return  # deferred, dropped or failed at the gate: the store knows already
        retried = delivery.retry_delay is not None
        if not delivery.seen:
            if not retried:
                self._settle_unseen(broker, bound, message)
            return
        spec = delivery.spec
        token = delivery.token
        assert spec is not None and token is not None
        if retried:
            delay = delivery.retry_delay or 0.0

            def suspend() -> None:
                self.gatekeeper.suspend(bound.task_name, spec, token, delay)

            self.gatekeeper.settle_or_retry(suspend, f"keeping the slot of run {spec.run_id} for its retry")
            return

        def release() -> None:
            outcome = self.gatekeeper.release(bound.task_name, spec, token=token)
            self._wake(broker, outcome.wakes)

        self.gatekeeper.settle_or_retry(release, f"releasing run {spec.run_id} of key {spec.key!r}")

    def _settle_unseen(self, broker: Broker, bound: BoundSingleton, message: MessageProxy) -> None:
        """Terminal end of a delivery our gate never saw: settle the run only if this copy is live.

        Claiming first tells a live copy (settle it) from a duplicate of a run executing
        elsewhere (leave it) and from a stale copy (nothing to do).
        """
        try:
            spec = self.gatekeeper.spec(bound, message.message_id, message.args, message.kwargs)
        except core.SingletonKeyError:
            return  # never registered: a key is needed for that
        generation = generation_of(message)
        self.gatekeeper.settle_or_retry(
            lambda: self.gatekeeper.settle_unrun_copy(
                bound.task_name, spec, generation, lambda wakes: self._wake(broker, wakes)
            ),
            f"settling skipped run {spec.run_id} of key {spec.key!r}",
        )

    def _is_quiet_deferral(self, message: object) -> bool:
        """Whether ``message`` is this thread's delivery, skipped by the gate (its warning is noise)."""
        delivery = self._delivery()
        return delivery is not None and delivery.quiet and delivery.message is message

    def _delivery(self) -> _Delivery | None:
        delivery: _Delivery | None = getattr(self._local, "delivery", None)
        return delivery


# -- helpers -------------------------------------------------------------------------------
def _leave(delivery: _Delivery) -> None:
    if delivery.context is not None:
        context, delivery.context = delivery.context, None
        try:
            admission.leave(context)
        except ValueError:  # another context (an interrupt re-entered a hook): nothing to restore
            pass


def _has_middleware(broker: Broker) -> bool:
    return any(isinstance(m, SingletonMiddleware) for m in broker.middleware)


@register_describer
def describe_dramatiq_actor(task: object) -> TaskDescription | None:
    """Teach ``@singleton`` Dramatiq actors (see :mod:`._declaration`)."""
    return describe_actor(task)


# Every actor's first message checks that a singleton actor's broker has the middleware.
guard_message_building(functools.partial(require_middleware, has_middleware=_has_middleware))


__all__ = [
    "GENERATION",
    "ConfigError",
    "DeferralFailed",
    "InvalidKey",
    "KeyFailed",
    "PayloadError",
    "QueueFull",
    "SchemaError",
    "SingletonMiddleware",
    "StoreUnavailable",
    "wake_message",
]
