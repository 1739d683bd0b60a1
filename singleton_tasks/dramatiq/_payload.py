"""The copies the library publishes: the options that mark them, and the message a wake publishes.

Every message the library has seen carries ``options["singleton_gen"]``, its copy's generation
(absent: 0), so re-publishes of a known run pass ``before_enqueue`` untouched. A wake publishes the
delivery the store kept (``message.encode()`` at registration or claim) as that generation. Celery's
counterpart is ``singleton_tasks/celery/_payload.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import dramatiq

from .. import clock
from ..outcomes import Wake
from ..runtime import AS_STORED_FIELD, GENERATION_FIELD
from ._internals import immediate_copy, priority_options

if TYPE_CHECKING:
    from dramatiq.broker import Broker, MessageProxy

#: The generation of a copy; present on every message the library has seen (absent = 0).
GENERATION = GENERATION_FIELD
#: When a wake copy was published (the handoff-latency metric).
WOKEN_AT = "singleton_woken_at"
#: Set by the producer on a message its registration stored as it is published (see runtime).
AS_STORED = AS_STORED_FIELD
#: Generation put on a duplicate start of a registered run id: never live, so the copy is dropped.
DEAD_GENERATION = -1


def wake_message(broker: Broker, wake: Wake) -> dramatiq.Message[Any]:
    """The message that wakes a waiter: its stored delivery, live as the wake's generation.

    Used by the middleware after a release and by ``singleton-tasks release --broker``.
    """
    if wake.payload is None:
        raise ValueError(f"run {wake.run_id} has no stored delivery to wake")
    return immediate_copy(wake.payload, _wake_options(broker, wake))


def _wake_options(broker: Broker, wake: Wake) -> dict[str, Any]:
    """A wake's options; on RabbitMQ priority queues it goes ahead of everything still queued.

    The woken run's turn has come and its key's slot waits for it: queued behind a backlog, the
    handoff would take as long as the queue. ``max_priority`` is the user's broker setting
    (``RabbitmqBroker(max_priority=N)`` declares the queues with ``x-max-priority``).
    """
    return {GENERATION: wake.generation, WOKEN_AT: clock.now(), **priority_options(broker)}


def generation_of(message: MessageProxy) -> int:
    """The generation of the delivered copy (0: a copy the library never published)."""
    value = message.options.get(GENERATION, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
