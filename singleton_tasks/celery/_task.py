"""The Celery task class: ``SingletonTask`` registers a run before it is published and gates each delivery.

- Enqueue: ``SingletonTask.apply_async`` registers the run (with the backlog cap) before it
  publishes and undoes the registration when publishing raises; signal receivers cannot veto
  a publish.
- Gate: ``before_start`` claims a slot; a denied delivery is re-published with the same task
  id and a generation header, then dropped with ``Ignore`` (state stays ``PENDING``).

What the gate decided for a delivery is kept on its request (:class:`Delivery`), where the
settlement receivers (:mod:`._settle`) find it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import datetime
import inspect
import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.exceptions import Ignore, Reject
from celery.utils import uuid
from celery.utils.time import maybe_iso8601

from .. import admission, clock
from ..config import BoundSingleton, SingletonConfig
from ..decorator import signature_of
from ..errors import SingletonConfigError, StoreUnavailableError
from ..outcomes import Decision, Registered, RegisterOutcome, RunSpec
from ..runtime import Gatekeeper
from ._gatekeeper import gatekeeper_for
from ._internals import (
    current_worker_task,
    is_app_default_task_class,
    is_tracer_call,
    mark_tracer_call,
    option_chosen_by_class,
    outside_running_tasks,
)
from ._payload import (
    GENERATION_HEADER,
    WOKEN_AT_HEADER,
    generation_of,
    is_republishing,
    marked_as_stored,
    payload_for_claim,
    payload_to_register,
    publish_wakes,
    republishing,
    sent_at,
    with_sent_at,
    woken_at,
)

logger = logging.getLogger("singleton_tasks")


@dataclasses.dataclass
class Delivery:
    """What the gate decided for the delivery being traced (kept on its request context)."""

    spec: RunSpec | None = None
    generation: int = 0
    token: int | None = None  # set when admitted: this delivery's body holds a slot
    context: contextvars.Token[admission.Admission | None] | None = None
    settled: bool = False


DELIVERY_ATTRIBUTE = "_singleton_delivery"


class _Deferred(Ignore):  # type: ignore[misc]
    """The delivery was deferred or dropped by the gate: ack it, store nothing, settle nothing."""


class SingletonTask(Task):  # type: ignore[misc]
    """Base of singleton tasks: ``@app.task(base=SingletonTask, singleton={"key": ...})``."""

    #: The declaration: a dict of :class:`SingletonConfig` fields or a ``SingletonConfig``.
    #: Without one the task is a plain Celery task: its options come from the app's settings.
    singleton: Any = None

    _singleton_bound: ClassVar[BoundSingleton | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_singleton_bound" in cls.__dict__:
            return  # made by @singleton, already validated
        declared = getattr(cls, "singleton", None)
        name = cls.__dict__.get("name") or getattr(cls, "name", None) or f"{cls.__module__}.{cls.__name__}"
        if declared is None:
            # A task made from the app's default class did not ask for SingletonTask: only an
            # explicit base= without the option is worth a warning.
            if cls.__dict__.get("_decorated") and not any(map(is_app_default_task_class, cls.__bases__)):
                logger.warning(
                    "%s has base=SingletonTask but no singleton={...} option: it runs as a plain task", name
                )
            cls._singleton_bound = None
            return
        config = SingletonConfig.coerce(declared, task_name=name)
        cls._singleton_bound = BoundSingleton.bind(
            config, task_name=name, signature=_class_run_signature(cls)
        )
        warn_on_unsafe_acks(name, cls.__dict__)
        for option, value in takeover_defaults(cls).items():
            setattr(cls, option, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if is_tracer_call(request):
            # The tracer's own call (a worker delivery or .apply()): before_start has gated it.
            # Run the body as the tracer does for a task without __call__ (as Celery's worker
            # does, mark the request so a body calling its own task directly gets a new one).
            mark_tracer_call(request)
            return self.run(*args, **kwargs)
        if type(self)._singleton_bound is not None:
            logger.debug("%s called directly: it bypasses the singleton gate", self.name)
        return super().__call__(*args, **kwargs)

    # -- helpers ---------------------------------------------------------------------------
    def _singleton_binding(self) -> BoundSingleton | None:
        bound = type(self)._singleton_bound
        if bound is not None and bound.config.scope is None and self.name and bound.task_name != self.name:
            # A class-based task named at registration: its scope defaults to the real name.
            bound = BoundSingleton.bind(bound.config, task_name=self.name, signature=bound.signature)
            type(self)._singleton_bound = bound
        return bound

    def _is_own_republish(self, task_id: str, options: Mapping[str, Any]) -> bool:
        """A retry of the run being executed: the framework's own publish passes through.

        See docs/concepts.md#keys-vs-run-ids.
        """
        request = self.request
        if not request.called_directly and request.id == task_id:
            return True
        # Celery sets ``retries`` only when it retries a run (Task.retry, retry_on_worker_lost).
        return bool(options.get("retries"))

    def _is_worker_dispatch(self, options: Mapping[str, Any]) -> bool:
        """A chain step or callback the tracer publishes for the task it just ran."""
        parent = options.get("parent_id")
        current = current_worker_task()
        return bool(parent) and current is not None and current.request.id == parent

    # -- enqueue (docs/concepts.md#the-life-of-a-run) -------------------------------------------------------
    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        bound = self._singleton_binding()

        def publish(run_id: str | None, **extra: Any) -> Any:
            return super(SingletonTask, self).apply_async(
                args, kwargs, run_id, producer, link, link_error, shadow, **options, **extra
            )

        if bound is None or is_republishing() or self._get_app().conf.task_always_eager:
            return publish(task_id)
        check_arguments = getattr(self, "__header__", None) if self.typing else None
        if check_arguments is not None:
            check_arguments(*(args or ()), **(kwargs or {}))  # Celery's own TypeError comes first
        run_id = task_id or uuid()
        if self._is_own_republish(run_id, options):
            return publish(run_id)  # the store knows the run; its delivery claims its own slot
        options = with_sent_at(options)  # what publish() and the stored payload send from here on
        gatekeeper = gatekeeper_for(self._get_app())
        spec = gatekeeper.spec(bound, run_id, tuple(args or ()), dict(kwargs or {}))
        dispatch = self._is_worker_dispatch(options)
        if dispatch:
            # A chain step accepted with its chain: never fail the parent over the cap or an outage.
            spec = dataclasses.replace(spec, max_queue_depth=None)
        payload = payload_to_register(self, run_id, args, kwargs, link, link_error, shadow, options)
        options = marked_as_stored(self, options, payload)
        outcome = self._register_unconfirmed(
            gatekeeper, bound, spec, dispatch=dispatch, payload=payload, delay=delay_of(options)
        )
        if outcome is None:  # registered at its first delivery (docs/concepts.md#what-other-deliveries-see)
            return publish(run_id)
        if outcome.status is Registered.FULL:
            # on_full="drop": nothing was registered or published. The caller gets the result of
            # the run last in line for the key, which runs after this send (docs/celery.md).
            return self.AsyncResult(gatekeeper.newest_run(spec) or run_id)
        if outcome.status is Registered.EXISTS:
            logger.info("%s run %s is already registered: not published again", self.name, run_id)
            return self.AsyncResult(run_id)
        # A run with `limit` others of its key ahead can only wait: publish it held back, as its
        # deferral would be, so no worker claims and defers it first (the line ahead of a wake).
        held_back = (
            payload is not None
            and outcome.in_flight > spec.limit
            and "countdown" not in options
            and "eta" not in options
        )
        result = self._publish_registered(gatekeeper, spec, publish, held_back, outcome.in_flight)
        self._after_publish(gatekeeper, spec, held_back)
        if outcome.replaced is not None:
            self._mark_replaced(outcome.replaced, run_id)
        return result

    def _register_unconfirmed(
        self,
        gatekeeper: Gatekeeper,
        bound: BoundSingleton,
        spec: RunSpec,
        *,
        dispatch: bool,
        payload: bytes | None,
        delay: float,
    ) -> RegisterOutcome | None:
        """Register the run before it is published; None: the store is down, publish it unregistered
        (a worker's dispatch of a chain step).

        Unconfirmed until published: a producer that dies before it publishes leaves a
        registration that is dropped after the registration grace. A send outside a worker's
        dispatch raises StoreUnavailableError when the store is down.
        """
        try:
            return gatekeeper.register(bound, spec, payload=payload, delay=delay, confirmed=False)
        except StoreUnavailableError:
            if not dispatch:
                if not gatekeeper.ready:
                    raise  # the store could not even be opened: nothing was written
                # The registration may have been written before the reply was lost (a timeout):
                # undo it, or a pending waiter that was never published would hold the line.
                undo_registration(gatekeeper, spec, self.name)
                raise
            logger.warning("store unavailable: publishing %s run %s unregistered", self.name, spec.run_id)
            return None

    def _publish_registered(
        self,
        gatekeeper: Gatekeeper,
        spec: RunSpec,
        publish: Callable[..., Any],
        held_back: bool,
        in_flight: int,
    ) -> Any:
        """Publish a registered run, held back if asked; a failure undoes the registration."""
        try:
            if not held_back:
                return publish(spec.run_id)
            return publish(
                spec.run_id, countdown=gatekeeper.deferral_delay(in_flight - spec.limit, spec.limit)
            )
        except BaseException:
            undo_registration(gatekeeper, spec, self.name)
            raise

    def _mark_replaced(self, replaced: str, run_id: str) -> None:
        """The run this send replaced in line never runs: its result is REVOKED, so a ``.get()``
        on it raises instead of waiting (docs/celery.md#replaced-sends). Best effort: the send
        itself is done."""
        if self.ignore_result:
            return
        try:
            self.backend.mark_as_revoked(replaced, reason=f"replaced by run {run_id} (on_full='replace')")
        except Exception:
            logger.warning(
                "%s run %s replaced run %s, whose result could not be set to REVOKED",
                self.name,
                run_id,
                replaced,
                exc_info=True,
            )

    def _after_publish(self, gatekeeper: Gatekeeper, spec: RunSpec, held_back: bool) -> None:
        """Confirm a published registration, or park one published held back."""
        if not held_back:
            # Batched off this thread; a store outage leaves it unconfirmed, and its delivery
            # confirms it (it takes its place in line).
            gatekeeper.confirm_later(spec)
            return
        try:
            publish_wakes(self._get_app(), gatekeeper.park(self.name, spec))
        except Exception:
            # Published all the same: its held-back copy claims at its countdown, as a deferral;
            # its registration is confirmed like any other, or it would be taken as never published.
            logger.warning(
                "could not park %s run %s: it waits for its countdown", self.name, spec.run_id, exc_info=True
            )
            gatekeeper.confirm_later(spec)

    # -- gate hook (docs/concepts.md#the-life-of-a-run) ----------------------------------------------------
    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        super().before_start(task_id, args, kwargs)
        bound = self._singleton_binding()
        if bound is None:
            return
        request = self.request
        if request.is_eager or request.called_directly:
            logger.debug("%s run %s is eager: it bypasses the singleton gate", self.name, task_id)
            return
        delivery = Delivery(generation=generation_of(request))
        setattr(request, DELIVERY_ATTRIBUTE, delivery)  # marks the delivery as handled here
        gatekeeper = gatekeeper_for(self._get_app())
        delivery.spec = spec = gatekeeper.spec(bound, task_id, tuple(args or ()), dict(kwargs or {}))
        try:
            outcome = gatekeeper.claim(
                self.name,
                spec,
                delivery.generation,
                payload_for_claim(self, request, delivery.generation),
                registered_at=sent_at(request),
                woken_at=woken_at(request),
            )
        except StoreUnavailableError:
            logger.warning(
                "store unavailable at the gate: %s run %s deferred", self.name, task_id, exc_info=True
            )
            self._defer(request, delivery.generation, gatekeeper.deferral_delay(None, spec.limit))
        except SingletonConfigError as error:
            # A refusal the store lifts once fixed (Store.check_health): deferred as in an outage.
            logger.error("the store refuses %s run %s at the gate (deferred): %s", self.name, task_id, error)
            self._defer(request, delivery.generation, gatekeeper.deferral_delay(None, spec.limit))
        publish_wakes(self._get_app(), outcome.wakes)
        if outcome.decision is Decision.ADMITTED:
            delivery.token = outcome.token
            delivery.context = admission.enter(
                admission.Admission(task_id, spec.scope, spec.key, outcome.token or 0)
            )
            return
        if outcome.decision is Decision.STALE:
            logger.info(
                "%s run %s: dropped a stale copy (generation %s)", self.name, task_id, delivery.generation
            )
            raise _Deferred("stale copy dropped")
        generation = outcome.generation if outcome.generation is not None else delivery.generation
        self._defer(request, generation, gatekeeper.deferral_delay(outcome.position, spec.limit))

    def _defer(self, request: Any, generation: int, delay: float) -> NoReturn:
        """Re-publish this delivery (same id, retries, links, routing) ``delay`` s later; then Ignore."""
        headers = {**(request.headers or {}), GENERATION_HEADER: generation, WOKEN_AT_HEADER: None}
        signature = self.signature_from_request(
            request, countdown=delay, retries=request.retries, headers=headers
        )
        signature.options.pop("redelivered", None)
        try:
            with republishing(), outside_running_tasks():  # its own parent, not the run itself
                signature.apply_async()
        except Exception as exc:
            logger.exception("could not defer %s run %s", self.name, request.id)
            if self.acks_late:
                raise Reject(exc, requeue=True) from exc  # the broker keeps the message
            raise
        raise _Deferred(f"deferred {delay:.2f}s (generation {generation})")


def undo_registration(gatekeeper: Gatekeeper, spec: RunSpec, task_name: str) -> None:
    """Remove a registration whose run was not published (only a pending one is removed)."""
    gatekeeper.settle_or_retry(
        lambda: gatekeeper.unregister(spec), f"undo the registration of {task_name} run {spec.run_id}"
    )


def delay_of(options: Mapping[str, Any]) -> float:
    """Seconds a run published with these options waits before its delivery (countdown / eta),
    read as Celery reads them: a countdown that is 0 leaves the eta in force, a naive eta is UTC."""
    countdown = options.get("countdown")
    if countdown and isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        return max(0.0, float(countdown))
    try:
        eta = maybe_iso8601(options.get("eta"))
    except (TypeError, ValueError):
        return 0.0
    if not isinstance(eta, datetime.datetime):
        return 0.0
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, eta.timestamp() - clock.now())


def takeover_defaults(cls: type, explicit: Mapping[str, Any] | None = None) -> dict[str, bool]:
    """``acks_late`` and ``reject_on_worker_lost`` of a task that declares a singleton: True unless
    its options or its class chose otherwise, whatever the app's settings (docs/concepts.md#takeover:
    a crashed worker's message comes back and reclaims its slot)."""
    chosen = {}
    for option in ("acks_late", "reject_on_worker_lost"):
        if explicit is not None and option in explicit:
            value = explicit[option]
        else:
            value = option_chosen_by_class(cls, option)
        chosen[option] = True if value is None else bool(value)
    return chosen


def warn_on_unsafe_acks(name: str, attributes: Mapping[str, Any]) -> None:
    """Warn when a singleton task turns off what takeover needs (docs/concepts.md#takeover)."""
    for option in ("acks_late", "reject_on_worker_lost"):
        if attributes.get(option) is False:
            warnings.warn(
                f"singleton task {name} sets {option}=False: a worker crash can now lose the run (https://github.com/singleton-tasks/singleton-tasks/blob/main/docs/concepts.md#takeover)",
                stacklevel=4,
            )


def _class_run_signature(cls: type) -> inspect.Signature | None:
    """The signature of a task class's ``run``, as its callers pass arguments (no ``self``)."""
    run = inspect.getattr_static(cls, "run", None)
    if isinstance(run, staticmethod):
        return signature_of(run.__func__)
    if callable(run):
        return signature_of(run, bound=True)
    return None
