"""Settling Celery runs: the signal receivers that release, suspend or settle a run when its delivery ends.

- ``task_postrun`` in the executing process: a run admitted there is released (its next
  waiters woken), or keeps its slot for a retry or a requeue.
- ``task_revoked`` and ``task_failure`` in the worker's main process (revokes, expiry, hard time
  limits, lost workers), where no admission token is known.

See docs/concepts.md#the-life-of-a-run.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterable
from typing import Any

from celery import states as celery_states

from .. import admission, clock
from ..errors import SingletonKeyError
from ..outcomes import Wake
from ._gatekeeper import gatekeeper_for
from ._payload import generation_of, publish_wakes
from ._task import DELIVERY_ATTRIBUTE, Delivery, SingletonTask

logger = logging.getLogger("singleton_tasks")


def on_postrun(
    sender: Any = None, task_id: str | None = None, retval: Any = None, state: str | None = None, **_: Any
) -> None:
    """``task_postrun``: release the slot the delivery held, or keep it for a retry or requeue."""
    task = sender
    if not isinstance(task, SingletonTask):
        return
    delivery: Delivery | None = getattr(task.request, DELIVERY_ATTRIBUTE, None)
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
            lambda: gatekeeper.suspend(task.name, spec, token, delay), f"suspend {task.name} run {task_id}"
        )
    elif state == celery_states.REJECTED and getattr(retval, "requeue", False):
        # The broker redelivers it: the copy reclaims its own slot at once.
        gatekeeper.settle_or_retry(
            lambda: gatekeeper.suspend(task.name, spec, token, 0.0), f"suspend {task.name} run {task_id}"
        )
    else:
        gatekeeper.settle_or_retry(
            lambda: publish_wakes(
                app, gatekeeper.release(task.name, spec, token=token, generation=generation).wakes
            ),
            f"release {task.name} run {task_id} ({state})",
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
        publish_wakes(app, wakes)

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


def on_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **_: Any
) -> None:
    """``task_revoked``: settle a run revoked or expired in the worker's main process."""
    task = sender
    if not isinstance(task, SingletonTask) or request is None:
        return
    why = "expired" if expired else ("revoked and terminated" if terminated else "revoked")
    generation = None if terminated else generation_of(request)
    _settle_elsewhere(task, request.id, request.args, request.kwargs, why, copy_generation=generation)


def on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    """``task_failure``: settle a run that failed in the worker's main process, not in its body."""
    task = sender
    if not isinstance(task, SingletonTask):
        return
    if getattr(task.request, DELIVERY_ATTRIBUTE, None) is not None:
        return  # the executing process: task_postrun settles it
    # The main process: hard time limit, worker lost without requeue, Reject(requeue=False).
    _settle_elsewhere(task, task_id, args, kwargs, f"failed in the worker: {type(exception).__name__}")


def _retry_delay(retry: Any) -> float:
    """Seconds until the retry ``Task.retry`` published is due (its ``Retry.when``)."""
    when = getattr(retry, "when", None)
    if isinstance(when, datetime.datetime):
        now = datetime.datetime.fromtimestamp(clock.now(), tz=when.tzinfo or datetime.timezone.utc)
        return max(0.0, (when - now).total_seconds())
    if isinstance(when, (int, float)):
        return max(0.0, float(when))
    return 0.0
