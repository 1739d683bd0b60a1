"""Celery adapter: :class:`SingletonTask` and :func:`install` (docs/concepts.md).

Only what is Celery-specific lives here; the rules are the store's (``gate.py``) and the
shared worker logic is :class:`singleton_tasks.runtime.Gatekeeper`'s.

- Enqueue: ``SingletonTask.apply_async`` registers the run (with the backlog cap) before it
  publishes and undoes the registration when publishing raises; signal receivers cannot veto
  a publish.
- Gate: ``before_start`` claims a slot; a denied delivery is re-published with the same task
  id and a generation header, then dropped with ``Ignore`` (state stays ``PENDING``).
- Settle: ``task_postrun`` in the executing process; ``task_revoked`` and ``task_failure`` in
  the worker's main process (revokes, expiry, hard time limits, lost workers).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, NoReturn

from .._extras import missing

try:
    import celery  # noqa: F401 - the first import of the extra names it when missing
except ImportError as error:
    raise missing("singleton_tasks.celery", "Celery", "celery", error) from error
from celery import Celery, Task, bootsteps, signals
from celery import states as celery_states
from celery.canvas import Signature
from celery.exceptions import Ignore, Reject
from celery.utils import uuid
from celery.utils.time import maybe_iso8601
from kombu.utils import json as _kombu_json

from .. import admission, clock
from ..config import (
    DEFAULT_LEASE,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_ORPHAN_TIMEOUT,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_JITTER,
    BoundSingleton,
    SingletonConfig,
)
from ..confirms import confirm_at_exit
from ..errors import SingletonConfigError, SingletonKeyError, SingletonPayloadError, StoreUnavailableError
from ..outcomes import Decision, Registered, RegisterOutcome, RunSpec, Wake
from ..runtime import GENERATION_FIELD, Gatekeeper, WorkerOptions
from ..stores.choice import check_store_argument
from ._internals import current_worker_task, is_tracer_call, mark_tracer_call

__all__ = ["GENERATION_HEADER", "SingletonTask", "gatekeeper_for", "install"]

logger = logging.getLogger("singleton_tasks")

#: Message header naming the generation of a copy the library published (absent: 0).
GENERATION_HEADER = GENERATION_FIELD
#: When a wake copy was published (the handoff-latency metric).
WOKEN_AT_HEADER = "singleton_woken_at"
_APP_GATEKEEPER = "_singleton_gatekeeper"
_APP_SETTINGS = "_singleton_settings"
_gatekeeper_lock = threading.Lock()

_json: Any = _kombu_json  # kombu is untyped; its JSON carries datetimes, UUIDs, Decimals

# Set while the library re-publishes a run it handles (a deferral, a wake): those publishes
# skip registration and the dedupe of docs/concepts.md#keys-vs-run-ids.
_republishing: contextvars.ContextVar[bool] = contextvars.ContextVar("singleton_republishing", default=False)


# -- installing ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Settings:
    store: Any
    namespace: str
    options: dict[str, Any]


def install(
    app: Celery,
    store: Any = None,
    *,
    namespace: str = "default",
    retry_delay: float = DEFAULT_RETRY_DELAY,
    retry_jitter: float = DEFAULT_RETRY_JITTER,
    lease: float = DEFAULT_LEASE,
    orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT,
    heartbeat_interval: float | None = None,
    max_retry_delay: float = DEFAULT_MAX_RETRY_DELAY,
) -> None:
    """Give ``app``'s singleton tasks a store and worker timings (docs/concepts.md#declaring-a-singleton).

    ``store`` is a URL or a :class:`~singleton_tasks.Store`; without it ``app.conf.singleton_store``,
    then ``SINGLETON_TASKS_STORE``, then the embedded SQLite default (with a warning). A URL's
    scheme and syntax are checked here (``SingletonConfigError``), without connecting: the
    store is opened lazily, once per process (after a prefork fork, again in the child), and a
    store that cannot be used then makes ``.delay()`` raise within its connect timeout.
    """
    check_store_argument(store)
    settings = _Settings(
        store,
        namespace,
        {
            "retry_delay": retry_delay,
            "retry_jitter": retry_jitter,
            "lease": lease,
            "orphan_timeout": orphan_timeout,
            "heartbeat_interval": heartbeat_interval,
            "max_retry_delay": max_retry_delay,
        },
    )
    WorkerOptions(**settings.options)  # bad timings fail here, not at the first run
    with _gatekeeper_lock:
        previous: Gatekeeper | None = getattr(app, _APP_GATEKEEPER, None)
        setattr(app, _APP_SETTINGS, settings)
        setattr(app, _APP_GATEKEEPER, None)  # built at first use, so app.conf may still change
    if previous is not None:
        previous.close()
    steps = app.steps["worker"]
    for step in (_SchemaCheck, _DueWork):
        if step not in steps:
            steps.add(step)
    _connect_signals()
    adopt_declared_tasks(app)


class _SchemaCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker start: refuse a missing or incompatible store schema, before consuming.

    See docs/deployment.md#schema-upgrades.
    """

    label = "singleton-tasks schema check"

    def start(self, worker: Any) -> None:
        gatekeeper = gatekeeper_for(worker.app)
        singletons = [
            bound
            for task in list(worker.app.tasks.values())
            if isinstance(task, SingletonTask) and (bound := task._singleton_binding()) is not None
        ]
        try:
            gatekeeper.check(singletons)  # SchemaVersionError: "Unrecoverable error", exit 1
        except StoreUnavailableError as error:
            logger.warning("singleton store unavailable at worker start (%s); gating fails closed", error)
        finally:
            gatekeeper.close()  # no client crosses the pool's fork; reopened at first use


class _DueWork(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker's heartbeat thread, in its main process once its pool is up (a prefork pool's
    processes are forked by then): it does the due work of keys no delivery touches, issuing
    again the runs whose copies were lost, and publishes those copies (docs/concepts.md#the-line).
    """

    label = "singleton-tasks due work"
    requires = ("celery.worker.components:Pool", _SchemaCheck)  # its check closes the store

    def start(self, worker: Any) -> None:
        _start_due_work(worker.app)


def _start_due_work(app: Celery) -> None:
    """Publish the copies the store issues from this process's heartbeat thread, and start it.

    Only the worker's main process does: a prefork pool's processes were forked before, and
    their heartbeat threads leave the due work alone.
    """
    gatekeeper = gatekeeper_for(app)
    gatekeeper.publish_wakes = lambda wakes: _publish_wakes(app, wakes)
    gatekeeper.heartbeats.start()


def gatekeeper_for(app: Celery) -> Gatekeeper:
    """The app's :class:`Gatekeeper`, created at first use from :func:`install` or ``app.conf``."""
    gatekeeper: Gatekeeper | None = getattr(app, _APP_GATEKEEPER, None)
    if gatekeeper is not None:
        return gatekeeper
    with _gatekeeper_lock:
        gatekeeper = getattr(app, _APP_GATEKEEPER, None)
        if gatekeeper is None:
            settings: _Settings = getattr(app, _APP_SETTINGS, None) or _Settings(None, "default", {})
            store = settings.store if settings.store is not None else app.conf.get("singleton_store")
            gatekeeper = Gatekeeper(store, namespace=settings.namespace, **settings.options)
            setattr(app, _APP_GATEKEEPER, gatekeeper)
    return gatekeeper


# -- the task class ------------------------------------------------------------------------
@dataclasses.dataclass
class _Delivery:
    """What the gate decided for the delivery being traced (kept on its request context)."""

    spec: RunSpec | None = None
    generation: int = 0
    token: int | None = None  # set when admitted: this delivery's body holds a slot
    context: contextvars.Token[admission.Admission | None] | None = None
    settled: bool = False


_DELIVERY_ATTRIBUTE = "_singleton_delivery"


class _Deferred(Ignore):  # type: ignore[misc]
    """The delivery was deferred or dropped by the gate: ack it, store nothing, settle nothing."""


class SingletonTask(Task):  # type: ignore[misc]
    """Base of singleton tasks: ``@app.task(base=SingletonTask, singleton={"key": ...})``."""

    #: The declaration: a dict of :class:`SingletonConfig` fields or a ``SingletonConfig``.
    singleton: Any = None
    # docs/concepts.md#takeover: a crashed worker's message comes back and reclaims its slot.
    acks_late = True
    reject_on_worker_lost = True

    _singleton_bound: ClassVar[BoundSingleton | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_singleton_bound" in cls.__dict__:
            return  # made by @singleton, already validated
        declared = getattr(cls, "singleton", None)
        name = cls.__dict__.get("name") or getattr(cls, "name", None) or f"{cls.__module__}.{cls.__name__}"
        if declared is None:
            if cls.__dict__.get("_decorated"):
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

        if bound is None or _republishing.get() or self._get_app().conf.task_always_eager:
            return publish(task_id)
        check_arguments = getattr(self, "__header__", None) if self.typing else None
        if check_arguments is not None:
            check_arguments(*(args or ()), **(kwargs or {}))  # Celery's own TypeError comes first
        run_id = task_id or uuid()
        if self._is_own_republish(run_id, options):
            return publish(run_id)  # the store knows the run; its delivery claims its own slot
        gatekeeper = gatekeeper_for(self._get_app())
        spec = gatekeeper.spec(bound, run_id, tuple(args or ()), dict(kwargs or {}))
        dispatch = self._is_worker_dispatch(options)
        if dispatch:
            # A chain step accepted with its chain: never fail the parent over the cap or an outage.
            spec = dataclasses.replace(spec, max_queue_depth=None)
        payload = self._payload_to_register(run_id, args, kwargs, link, link_error, shadow, options)
        outcome = self._register_unconfirmed(
            gatekeeper, bound, spec, dispatch=dispatch, payload=payload, delay=_delay_of(options)
        )
        if outcome is None:  # registered at its first delivery (docs/concepts.md#what-other-deliveries-see)
            return publish(run_id)
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
        return result

    def _payload_to_register(
        self,
        run_id: str,
        args: Any,
        kwargs: Any,
        link: Any,
        link_error: Any,
        shadow: Any,
        options: Mapping[str, Any],
    ) -> bytes | None:
        """The run as the store keeps it, encoded before anything is written (docs/concepts.md#the-line).

        JSON is what a wake publishes. A task whose serializer is JSON and whose arguments JSON
        cannot carry could not be published either: SingletonPayloadError, nothing written. Another
        serializer (pickle) may carry what JSON cannot: such a run has no payload, and only its
        own copies can run it.
        """
        payload = _encoded_payload(
            self,
            run_id,
            lambda: _signature_for(self, args, kwargs, run_id, link, link_error, shadow, options),
        )
        if payload is not None:
            return payload
        serializer = options.get("serializer") or self.serializer or self._get_app().conf.task_serializer
        if serializer == "json":
            # Another serializer (pickle) may carry what JSON cannot, and an option only the
            # producer uses (a Queue object, a connection) is never sent: only arguments fail.
            try:
                _json.dumps([args, kwargs])
            except Exception as error:
                raise SingletonPayloadError(
                    f"{self.name} run {run_id}: its arguments cannot be encoded as JSON ({error}); "
                    "nothing was sent"
                ) from error
        return None

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
                _undo_registration(gatekeeper, spec, self.name)
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
            _undo_registration(gatekeeper, spec, self.name)
            raise

    def _after_publish(self, gatekeeper: Gatekeeper, spec: RunSpec, held_back: bool) -> None:
        """Confirm a published registration, or park one published held back."""
        if not held_back:
            # Batched off this thread; a store outage leaves it unconfirmed, and its delivery
            # confirms it (it takes its place in line).
            gatekeeper.confirm_later(spec)
            return
        try:
            _publish_wakes(self._get_app(), gatekeeper.park(self.name, spec))
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
        delivery = _Delivery(generation=_generation_of(request))
        setattr(request, _DELIVERY_ATTRIBUTE, delivery)  # marks the delivery as handled here
        gatekeeper = gatekeeper_for(self._get_app())
        delivery.spec = spec = gatekeeper.spec(bound, task_id, tuple(args or ()), dict(kwargs or {}))
        try:
            outcome = gatekeeper.claim(
                self.name,
                spec,
                delivery.generation,
                _payload_of(self, request),
                woken_at=_woken_at(request),
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
        _publish_wakes(self._get_app(), outcome.wakes)
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
            with _republish():
                signature.apply_async()
        except Exception as exc:
            logger.exception("could not defer %s run %s", self.name, request.id)
            if self.acks_late:
                raise Reject(exc, requeue=True) from exc  # the broker keeps the message
            raise
        raise _Deferred(f"deferred {delay:.2f}s (generation {generation})")


# -- settlement (docs/concepts.md#the-life-of-a-run) ------------------------------------------------
def _on_postrun(
    sender: Any = None, task_id: str | None = None, retval: Any = None, state: str | None = None, **_: Any
) -> None:
    task = sender
    if not isinstance(task, SingletonTask):
        return
    delivery: _Delivery | None = getattr(task.request, _DELIVERY_ATTRIBUTE, None)
    if delivery is None or delivery.token is None or delivery.spec is None or delivery.settled:
        return  # not admitted here: deferred, dropped, failed at the gate, or eager
    delivery.settled = True
    if delivery.context is not None:
        with contextlib.suppress(ValueError):  # entered in another context: nothing to reset
            admission.leave(delivery.context)
    app = task._get_app()
    gatekeeper = gatekeeper_for(app)
    spec, token, generation = delivery.spec, delivery.token, delivery.generation
    if state == celery_states.RETRY:
        delay = _retry_delay(retval)
        gatekeeper.settle_or_retry(
            lambda: gatekeeper.suspend(spec, token, delay), f"suspend {task.name} run {task_id}"
        )
    elif state == celery_states.REJECTED and getattr(retval, "requeue", False):
        # The broker redelivers it: the copy reclaims its own slot at once.
        gatekeeper.settle_or_retry(
            lambda: gatekeeper.suspend(spec, token, 0.0), f"suspend {task.name} run {task_id}"
        )
    else:
        gatekeeper.settle_or_retry(
            lambda: _publish_wakes(
                app, gatekeeper.release(task.name, spec, token=token, generation=generation).wakes
            ),
            f"release {task.name} run {task_id} ({state})",
        )


def _undo_registration(gatekeeper: Gatekeeper, spec: RunSpec, task_name: str) -> None:
    """Remove a registration whose run was not published (only a pending one is removed)."""
    gatekeeper.settle_or_retry(
        lambda: gatekeeper.unregister(spec), f"undo the registration of {task_name} run {spec.run_id}"
    )


def _settle_elsewhere(
    task: Any, run_id: str | None, args: Any, kwargs: Any, why: str, *, copy_generation: int | None = None
) -> None:
    """Settle a run from the worker's main process, where no admission token is known.

    ``copy_generation=None``: the copy that was executing ended (terminated, hard time limit,
    worker lost), so the run is settled whatever it holds. Otherwise a copy that never started
    was discarded (revoked, expired): it settles the run only if it is a live copy, found by
    claiming first, so a stale delayed copy never frees the slot of a run executing elsewhere.
    """
    bound = task._singleton_binding()
    if bound is None or not run_id:
        return
    app = task._get_app()
    gatekeeper = gatekeeper_for(app)
    try:
        spec = gatekeeper.spec(bound, run_id, tuple(args or ()), dict(kwargs or {}))
    except SingletonKeyError:
        return  # never registered: its delivery failed at the gate

    def publish(wakes: Iterable[Wake]) -> None:
        _publish_wakes(app, wakes)

    def release() -> None:
        outcome = gatekeeper.release(task.name, spec, token=None)
        if outcome.released:
            logger.info("%s run %s settled: %s", task.name, run_id, why)
        publish(outcome.wakes)

    def settle_copy(generation: int) -> None:
        decision = gatekeeper.settle_unrun_copy(task.name, spec, generation, publish)
        logger.debug("%s run %s: %s copy claimed %s", task.name, run_id, why, decision.value)

    what = f"settle {task.name} run {run_id} ({why})"
    if copy_generation is None:
        gatekeeper.settle_or_retry(release, what)
    else:
        gatekeeper.settle_or_retry(lambda: settle_copy(copy_generation), what)


def _on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
) -> None:
    task = sender
    if not isinstance(task, SingletonTask) or request is None:
        return
    why = "expired" if expired else ("revoked and terminated" if terminated else "revoked")
    generation = None if terminated else _generation_of(request)
    _settle_elsewhere(task, request.id, request.args, request.kwargs, why, copy_generation=generation)


def _on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    task = sender
    if not isinstance(task, SingletonTask):
        return
    if getattr(task.request, _DELIVERY_ATTRIBUTE, None) is not None:
        return  # the executing process: task_postrun settles it
    # The main process: hard time limit, worker lost without requeue, Reject(requeue=False).
    _settle_elsewhere(task, task_id, args, kwargs, f"failed in the worker: {type(exception).__name__}")


_signals_connected = False


def _connect_signals() -> None:
    global _signals_connected
    if _signals_connected:
        return
    _signals_connected = True
    signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="singleton_tasks.postrun")
    signals.task_revoked.connect(_on_revoked, weak=False, dispatch_uid="singleton_tasks.revoked")
    signals.task_failure.connect(_on_failure, weak=False, dispatch_uid="singleton_tasks.failure")
    # A prefork pool process ends with os._exit inside billiard's worker loop: no atexit and no
    # multiprocessing finalizer runs there, only this signal. Sends of its tasks stay confirmed.
    # Without install() no bootstep is added: a `celery worker` command still sends worker_ready.
    signals.worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="singleton_tasks.worker_ready")
    signals.worker_process_shutdown.connect(
        _on_process_shutdown, weak=False, dispatch_uid="singleton_tasks.process_shutdown"
    )


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None and any(isinstance(task, SingletonTask) for task in list(app.tasks.values())):
        _start_due_work(app)


def _on_process_shutdown(**_: Any) -> None:
    confirm_at_exit()


_connect_signals()  # SingletonTask works without install(): the app.conf / env / default store


# -- copies the library publishes ----------------------------------------------------------
@contextlib.contextmanager
def _republish() -> Iterator[None]:
    reset = _republishing.set(True)
    try:
        yield
    finally:
        _republishing.reset(reset)


def _header(request: Any, name: str) -> Any:
    """A custom header of the delivery (Celery also copies them onto the request)."""
    return (request.headers or {}).get(name, getattr(request, name, None))


def _generation_of(request: Any) -> int:
    value = _header(request, GENERATION_HEADER)
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _woken_at(request: Any) -> float | None:
    value = _header(request, WOKEN_AT_HEADER)
    return float(value) if isinstance(value, (int, float)) else None


def _payload_of(task: SingletonTask, request: Any) -> bytes | None:
    """The delivery as a signature, so any process can re-publish it when it is woken."""

    def signature() -> Signature:
        delivered = task.signature_from_request(request, retries=request.retries)
        delivered.options.pop("redelivered", None)
        return delivered

    return _encoded_payload(task, request.id, signature)


def _signature_for(
    task: SingletonTask,
    args: Any,
    kwargs: Any,
    run_id: str,
    link: Any,
    link_error: Any,
    shadow: Any,
    options: Mapping[str, Any],
) -> Signature:
    """The run ``apply_async`` is about to publish, as ``_payload_of`` would see it delivered."""
    given = {"link": link, "link_error": link_error, "shadow": shadow}
    signature_options = {**options, **{k: v for k, v in given.items() if v is not None}}
    return task.signature(args, kwargs, **signature_options, task_id=run_id)


def _json_payload(built: Signature) -> bytes:
    """``built`` as the JSON a wake publishes (its generation header left out); raises when an
    argument or option JSON cannot carry."""
    options = built.options
    options["headers"] = {k: v for k, v in (options.get("headers") or {}).items() if k != GENERATION_HEADER}
    data: str = _json.dumps(dict(built))
    return data.encode()


def _delay_of(options: Mapping[str, Any]) -> float:
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


def _encoded_payload(task: SingletonTask, run_id: str, signature: Callable[[], Signature]) -> bytes | None:
    """``signature()`` as the JSON a wake publishes, or None when JSON cannot carry it (a release
    then cannot wake the run: its retry timer does)."""
    try:
        return _json_payload(signature())
    except Exception:
        logger.debug("%s run %s has no payload for a wake", task.name, run_id, exc_info=True)
        return None


def _publish_wakes(app: Celery, wakes: Iterable[Wake]) -> None:
    """Publish woken waiters at once; a failure leaves them to their retry timer (docs/concepts.md)."""
    for wake in wakes:
        if wake.payload is None:
            continue
        try:
            signature = Signature.from_dict(_json.loads(wake.payload), app=app)
            options = signature.options
            for timing in ("countdown", "eta"):
                options.pop(timing, None)
            options["headers"] = {
                **(options.get("headers") or {}),
                GENERATION_HEADER: wake.generation,
                WOKEN_AT_HEADER: clock.now(),
            }
            with _republish():
                signature.apply_async()
            logger.debug("woke run %s of key %r (generation %s)", wake.run_id, wake.key, wake.generation)
        except Exception:
            logger.warning(
                "could not wake run %s of key %r; its retry timer will", wake.run_id, wake.key, exc_info=True
            )


def _retry_delay(retry: Any) -> float:
    when = getattr(retry, "when", None)
    if isinstance(when, datetime.datetime):
        now = datetime.datetime.fromtimestamp(clock.now(), tz=when.tzinfo or datetime.timezone.utc)
        return max(0.0, (when - now).total_seconds())
    if isinstance(when, (int, float)):
        return max(0.0, float(when))
    return 0.0


def warn_on_unsafe_acks(name: str, attributes: Mapping[str, Any]) -> None:
    for option in ("acks_late", "reject_on_worker_lost"):
        if attributes.get(option) is False:
            warnings.warn(
                f"singleton task {name} sets {option}=False: a worker crash can now lose the run (https://github.com/singleton-tasks/singleton-tasks/blob/main/docs/concepts.md#takeover)",
                stacklevel=4,
            )


def _class_run_signature(cls: type) -> inspect.Signature | None:
    run = inspect.getattr_static(cls, "run", None)
    try:
        if isinstance(run, staticmethod):
            return inspect.signature(run.__func__)
        if callable(run):
            return drop_first_parameter(inspect.signature(run))
    except (TypeError, ValueError):
        pass
    return None


def drop_first_parameter(signature: inspect.Signature) -> inspect.Signature:
    return signature.replace(parameters=list(signature.parameters.values())[1:])


# The declarations' module needs SingletonTask: it is loaded once the class exists.
from ._declaration import adopt_declared_tasks  # noqa: E402
