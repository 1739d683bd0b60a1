"""The run as a payload: its signature encoded as the JSON the store keeps, and the copies published from it.

A registration stores the run's signature as kombu JSON (docs/concepts.md#the-line); a wake, or
a store that issues a run again, decodes it and publishes the copy with a generation header.
The library's own publishes (a deferral, a wake) are marked while they run, so ``apply_async``
lets them through without registering them again (docs/concepts.md#keys-vs-run-ids).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from celery import Celery, Task, signals
from celery.canvas import Signature
from celery.utils.nodenames import anon_nodename
from kombu.utils import json as _kombu_json

from .. import clock
from ..errors import SingletonPayloadError
from ..outcomes import Wake
from ..runtime import AS_STORED_FIELD, GENERATION_FIELD, claims_as_stored
from ._internals import current_worker_task, outside_running_tasks

logger = logging.getLogger("singleton_tasks")

#: Message header naming the generation of a copy the library published (absent: 0).
GENERATION_HEADER = GENERATION_FIELD
#: When a wake copy was published (the handoff-latency metric).
WOKEN_AT_HEADER = "singleton_woken_at"
#: When the run was sent (the wait-time metric); its deferrals, wakes and retries keep it.
SENT_AT_HEADER = "singleton_sent_at"
#: Set by the producer on a run whose stored signature is the message it publishes (see runtime).
AS_STORED_HEADER = AS_STORED_FIELD

_json: Any = _kombu_json  # kombu is untyped; its JSON carries datetimes, UUIDs, Decimals

# Set while the library re-publishes a run it handles (a deferral, a wake): those publishes
# skip registration and the dedupe of docs/concepts.md#keys-vs-run-ids.
_republishing: contextvars.ContextVar[bool] = contextvars.ContextVar("singleton_republishing", default=False)


# -- the library's own publishes -----------------------------------------------------------
@contextlib.contextmanager
def republishing() -> Iterator[None]:
    """Mark the publishes inside as the library's own (not new runs to register)."""
    reset = _republishing.set(True)
    try:
        yield
    finally:
        _republishing.reset(reset)


def is_republishing() -> bool:
    """Whether the current publish is one the library makes (inside :func:`republishing`)."""
    return _republishing.get()


# -- the headers a copy carries ------------------------------------------------------------
def _header(request: Any, name: str) -> Any:
    """A custom header of the delivery (Celery also copies them onto the request)."""
    return (request.headers or {}).get(name, getattr(request, name, None))


def generation_of(request: Any) -> int:
    """The generation of the delivered copy (0: a copy the library never published)."""
    value = _header(request, GENERATION_HEADER)
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def woken_at(request: Any) -> float | None:
    """When the delivered copy was published as a wake, if it was one."""
    return _epoch_header(request, WOKEN_AT_HEADER)


def sent_at(request: Any) -> float | None:
    """When the delivered run was sent through ``apply_async`` (None: sent another way, ``send_task``)."""
    return _epoch_header(request, SENT_AT_HEADER)


def with_sent_at(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the send time among their headers, as Dramatiq's messages carry theirs."""
    return {**options, "headers": {**(options.get("headers") or {}), SENT_AT_HEADER: clock.now()}}


def marked_as_stored(task: Any, options: dict[str, Any], payload: bytes | None) -> dict[str, Any]:
    """``options`` marked as the message the registration stored (``payload``), unless a
    ``before_task_publish`` receiver or a wrapper of Celery's publish (sentry-sdk's) in this
    process may change it as it is published (a trace id), or the publish gives it its
    parent's priority (``task_inherit_parent_priority``): a first delivery so marked claims
    without encoding itself."""
    if payload is None or signals.before_task_publish.receivers or _publish_is_wrapped():
        return options
    if task._get_app().conf.task_inherit_parent_priority and current_worker_task() is not None:
        return options
    options["headers"] = {**options["headers"], AS_STORED_HEADER: 1}
    return options


def _publish_is_wrapped() -> bool:
    """Whether a ``functools.wraps`` wrapper replaced ``Task.apply_async`` or ``Celery.send_task``
    (a tracing integration's: sentry-sdk adds its trace headers there)."""
    return hasattr(Task.apply_async, "__wrapped__") or hasattr(Celery.send_task, "__wrapped__")


def _epoch_header(request: Any, name: str) -> float | None:
    value = _header(request, name)
    return float(value) if isinstance(value, (int, float)) else None


# -- encoding ------------------------------------------------------------------------------
def payload_to_register(
    task: Any,
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
        task,
        run_id,
        lambda: _signature_for(task, args, kwargs, run_id, link, link_error, shadow, options),
    )
    if payload is not None:
        return payload
    serializer = options.get("serializer") or task.serializer or task._get_app().conf.task_serializer
    if serializer == "json":
        # Another serializer (pickle) may carry what JSON cannot, and an option only the
        # producer uses (a Queue object, a connection) is never sent: only arguments fail.
        try:
            _json.dumps([args, kwargs])
        except Exception as error:
            raise SingletonPayloadError(
                f"{task.name} run {run_id}: its arguments cannot be encoded as JSON ({error}); "
                "nothing was sent"
            ) from error
    return None


def payload_of(task: Any, request: Any) -> bytes | None:
    """The delivery as a signature, so any process can re-publish it when it is woken."""

    def signature() -> Signature:
        delivered = task.signature_from_request(request, retries=request.retries)
        delivered.options.pop("redelivered", None)
        return delivered

    return _encoded_payload(task, request.id, signature)


def payload_for_claim(task: Any, request: Any, generation: int) -> bytes | Callable[[], bytes | None] | None:
    """The delivery as its claim keeps it; for the message its registration stored
    (docs/concepts.md#the-line), a function the claim calls only when the store has none."""
    if claims_as_stored(generation, bool(_header(request, AS_STORED_HEADER)), request.retries or 0):
        return lambda: payload_of(task, request)
    return payload_of(task, request)


def _signature_for(
    task: Any,
    args: Any,
    kwargs: Any,
    run_id: str,
    link: Any,
    link_error: Any,
    shadow: Any,
    options: Mapping[str, Any],
) -> Signature:
    """The run ``apply_async`` is about to publish, as ``payload_of`` would see it delivered."""
    given = {"link": link, "link_error": link_error, "shadow": shadow}
    signature_options = {**options, **{k: v for k, v in given.items() if v is not None}}
    signature_options.update(_added_at_the_publish(task, signature_options))
    signature: Signature = task.signature(args, kwargs, **signature_options, task_id=run_id)
    return signature


def _added_at_the_publish(task: Any, options: Mapping[str, Any]) -> dict[str, Any]:
    """What Celery's ``send_task`` adds to the message from the sender's context, fixed now.

    A copy published later from the stored signature (a wake, a re-issue) is published by
    another process: left to ``send_task`` there, its result would go to the waker's reply
    queue (``rpc://``), its parent would be the run that released the key, its origin the
    waker's node, and a relative ``expires`` would count from the wake.
    """
    app = task._get_app()
    added: dict[str, Any] = {}
    if not options.get("reply_to"):
        added["reply_to"] = app.thread_oid
    if not options.get("origin"):
        added["origin"] = anon_nodename()  # what as_task_v2 names a sender by
    parent = current_worker_task()
    if parent is not None:
        if not options.get("root_id"):
            added["root_id"] = parent.request.root_id or parent.request.id
        if not options.get("parent_id"):
            added["parent_id"] = parent.request.id
    expires = options.get("expires", task.expires)
    if isinstance(expires, (int, float)):
        added["expires"] = app.now() + datetime.timedelta(seconds=expires)
    return added


def _json_payload(built: Signature) -> bytes:
    """``built`` as the JSON a wake publishes (its generation header left out); raises when an
    argument or option JSON cannot carry."""
    options = built.options
    options["headers"] = {k: v for k, v in (options.get("headers") or {}).items() if k != GENERATION_HEADER}
    data: str = _json.dumps(dict(built))
    return data.encode()


def _encoded_payload(task: Any, run_id: str, signature: Callable[[], Signature]) -> bytes | None:
    """``signature()`` as the JSON a wake publishes, or None when JSON cannot carry it (a release
    then cannot wake the run: its retry timer does)."""
    try:
        return _json_payload(signature())
    except Exception:
        logger.debug("%s run %s has no payload for a wake", task.name, run_id, exc_info=True)
        return None


# -- decoding: the copies a wake publishes -------------------------------------------------
def publish_wakes(app: Celery, wakes: Iterable[Wake]) -> None:
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
            with republishing(), outside_running_tasks():  # published for its sender, not the waker
                signature.apply_async()
            logger.debug("woke run %s of key %r (generation %s)", wake.run_id, wake.key, wake.generation)
        except Exception:
            logger.warning(
                "could not wake run %s of key %r; its retry timer will", wake.run_id, wake.key, exc_info=True
            )
