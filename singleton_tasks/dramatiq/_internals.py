"""Every use of Dramatiq's internals, in one place.

Checked on Dramatiq 2.2.1 (the version CI installs); ``tests/test_framework_internals.py``
fails when an upgrade changes one of them. Each is needed because Dramatiq offers no public way:

1. The worker logs every skipped message as ``"Message %s was skipped."`` on the logger
   ``dramatiq.worker.WorkerThread``: one warning per waiter per re-check is noise, so a log
   filter drops it for the deferrals of the gate (and for nothing else).
2. ``Actor.message_with_options`` builds every message of an actor (``send``,
   ``send_with_options``, ``message``), looked up on the actor: it is replaced on the ``Actor``
   class so that a singleton actor whose broker lacks the middleware refuses to build one,
   however it was declared; an actor that passed the check once gets the original method as an
   instance attribute, which hides the class's, so its later messages skip the check.
3. ``RabbitmqBroker.channel`` connects the calling thread on first access; ``max_priority`` is
   the broker's ``x-max-priority`` setting and ``broker_priority`` the option that uses it.
4. A delivery from a delay queue (``<queue>.DQ``) carries the options ``eta`` and, on Redis,
   ``redis_message_id``: a stored copy woken at once must carry neither and go to its own queue.
5. ``Results.after_skip_message`` stores ``None`` for a skipped message unless its
   ``store_results`` option is false.
6. A worker's ``ConsumerThread`` enqueues a delayed message again when it is due (moving it
   from the delay queue): that enqueue continues accepted work and must not register anew.
7. RedisBroker's consumer (``dramatiq.brokers.redis._RedisConsumer``) sleeps between fetches
   while its queue is empty, backing off up to ``worker_timeout`` (1 s by default), and nothing
   wakes it early: a wake published meanwhile waits for its next fetch. A ``WorkerThread`` that
   publishes a wake fetches for its worker at once, as the consumer would when it wakes
   (``WorkerThread.consumers`` maps queue names to ``ConsumerThread`` objects; their ``consumer``
   has ``prefetch``, ``outstanding_message_count``, ``queued_message_ids`` and the broker's
   ``do_fetch`` script; ``ConsumerThread.handle_message`` puts a fetched message on the work
   queue, from which worker threads process and ack it through that consumer).
8. A pipeline step's message names the next step in ``options["pipe_target"]``, and a group
   member's message its completion callbacks in ``options["group_completion_callbacks"]`` (both
   message dicts with a ``message_id``): enqueued after its body, they continue accepted work.
9. ``Broker.enqueue`` publishes unless a ``before_enqueue`` hook raises a ``MiddlewareError``,
   which it re-raises to the caller. A send dropped by ``on_full="drop"`` must publish nothing
   and raise nothing, so ``enqueue`` is wrapped on the broker instance: the wrapper returns the
   message of a dropped send instead of raising (every send goes through it: ``Actor.send``,
   ``group``, ``pipeline``, a direct ``broker.enqueue``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.broker import Broker
from dramatiq.common import q_name
from dramatiq.message import Message
from dramatiq.worker import ConsumerThread, WorkerThread

if TYPE_CHECKING:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker

logger = logging.getLogger("singleton_tasks")

#: The logger and the message of the worker's "skipped" warning (1.).
WORKER_LOGGER = "dramatiq.worker.WorkerThread"
SKIPPED_MESSAGE = "Message %s was skipped."


class QuietSkips(logging.Filter):
    """Drops the worker's "skipped" warning for the messages ``is_ours(message)`` names (1.)."""

    def __init__(self, is_ours: Callable[[object], bool]) -> None:
        super().__init__()
        self._is_ours = is_ours

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != SKIPPED_MESSAGE or not isinstance(record.args, tuple) or not record.args:
            return True
        return not self._is_ours(record.args[0])

    def install(self) -> None:
        logging.getLogger(WORKER_LOGGER).addFilter(self)

    def uninstall(self) -> None:
        logging.getLogger(WORKER_LOGGER).removeFilter(self)


#: Marks the checking ``message_with_options`` (on the class) and an actor's checked copy (2.).
GUARD = "_singleton_guard"


def guard_message_building(check: Callable[[dramatiq.Actor[Any, Any]], None]) -> None:
    """Run ``check(actor)`` (which raises to refuse) before an actor builds its first message (2.).

    Once ``check`` passes for an actor, the actor builds its messages with the original method,
    without the check: :func:`check_again` undoes that when its declaration changes.
    """
    build = dramatiq.Actor.message_with_options
    if getattr(build, GUARD, False):
        return

    def message_with_options(
        self: dramatiq.Actor[Any, Any],
        *,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        check(self)
        # A subclass that overrides the method and calls this one keeps being checked: caching
        # the original on the instance would hide its override.
        if type(self).message_with_options is message_with_options:
            checked = functools.partial(build, self)
            setattr(checked, GUARD, True)
            self.message_with_options = checked  # type: ignore[method-assign]
        return build(self, args=args, kwargs=kwargs, **options)

    setattr(message_with_options, GUARD, True)
    functools.update_wrapper(message_with_options, build)
    dramatiq.Actor.message_with_options = message_with_options  # type: ignore[method-assign]


def check_again(actor: dramatiq.Actor[Any, Any]) -> None:
    """Make the actor's next message pass the check of :func:`guard_message_building` again (2.)."""
    if getattr(actor.__dict__.get("message_with_options"), GUARD, False):
        del actor.message_with_options


def return_dropped_sends(broker: Broker, dropped: type[Exception]) -> None:
    """Make ``broker.enqueue`` return the message of a send its hooks dropped (raised ``dropped``)
    instead of raising (9.)."""
    enqueue = broker.enqueue
    if getattr(enqueue, "_singleton_drops", False):
        return

    def enqueue_or_drop(message: Message[Any], *, delay: int | None = None) -> Message[Any]:
        try:
            return enqueue(message, delay=delay)
        except dropped:
            return message

    enqueue_or_drop._singleton_drops = True  # type: ignore[attr-defined]
    broker.enqueue = enqueue_or_drop  # type: ignore[method-assign]


def rabbitmq(broker: Broker) -> RabbitmqBroker | None:
    """The broker if it is a RabbitmqBroker (whose module is loaded if one exists), else None."""
    module = sys.modules.get("dramatiq.brokers.rabbitmq")
    return broker if module is not None and isinstance(broker, module.RabbitmqBroker) else None


def priority_options(broker: Broker) -> dict[str, Any]:
    """Options that put a message ahead of everything queued, on RabbitMQ priority queues (3.)."""
    broker_rabbitmq = rabbitmq(broker)
    if broker_rabbitmq is not None and broker_rabbitmq.max_priority:
        return {"broker_priority": broker_rabbitmq.max_priority}
    return {}


def connect_publishing_thread(broker: Broker) -> None:
    """Connect a RabbitmqBroker's channel for the calling thread now, not at its first publish (3.)."""
    broker_rabbitmq = rabbitmq(broker)
    if broker_rabbitmq is None:
        return
    try:
        broker_rabbitmq.channel  # noqa: B018 - the property connects
    except Exception as error:  # enqueue connects again when it needs to
        logger.warning("could not connect this worker thread to RabbitMQ ahead of use: %s", error)


def immediate_copy(payload: bytes, options: dict[str, Any]) -> dramatiq.Message[Any]:
    """The stored delivery ``payload`` as a message to enqueue at once, with ``options`` added (4.)."""
    message = dramatiq.Message.decode(payload)
    kept = {k: v for k, v in message.options.items() if k not in ("eta", "redis_message_id")}
    return dataclasses.replace(message, queue_name=q_name(message.queue_name), options={**kept, **options})


def keep_results_away(message: Any) -> None:
    """Make Results store nothing for this skipped delivery (5.)."""
    message.options["store_results"] = False


def on_consumer_thread() -> bool:
    """Whether the calling thread is a worker's consumer, which only moves due delayed messages (6.)."""
    return isinstance(threading.current_thread(), ConsumerThread)


def names_as_continuation(delivered_options: Mapping[str, Any], message_id: str) -> bool:
    """Whether the delivered message names ``message_id`` as its next pipeline step or a group
    completion callback (8.)."""
    target = delivered_options.get("pipe_target")
    if isinstance(target, dict) and target.get("message_id") == message_id:
        return True
    callbacks = delivered_options.get("group_completion_callbacks") or ()
    return any(isinstance(c, dict) and c.get("message_id") == message_id for c in callbacks)


def fetch_for_this_worker(queue_name: str) -> int:
    """On a worker thread of a RedisBroker worker: fetch ``queue_name`` now (7.); returns the count.

    Does what the queue's consumer does when its back-off ends: fetch up to its prefetch window,
    count the messages as its own (acked through it) and put them on the work queue. The release
    that published a wake thus hands the woken run to this worker at once, whatever its
    ``worker_timeout``; RabbitMQ pushes deliveries and needs none of it (returns 0).
    """
    thread = threading.current_thread()
    if not isinstance(thread, WorkerThread):
        return 0  # the heartbeat thread retrying a settlement: the consumer fetches in time
    return fetch_now(thread.consumers, queue_name)


#: Serializes the fetches of worker threads (7.).
_FETCHING = threading.RLock()  # re-entrant: a fetched message nacked at once runs broker hooks


def fetch_now(consumers: dict[str, ConsumerThread], queue_name: str) -> int:
    """Fetch ``queue_name`` for the worker whose consumer threads are ``consumers`` (7.)."""
    module = sys.modules.get("dramatiq.brokers.redis")
    consumer_thread = consumers.get(queue_name)
    if module is None or consumer_thread is None or consumer_thread.paused or not consumer_thread.running:
        return 0
    consumer = consumer_thread.consumer
    if not isinstance(consumer, module._RedisConsumer):
        return 0
    # One worker thread at a time: threads releasing at once would each see the same room and
    # together fetch several windows (the consumer's own fetch is not serialized with these).
    with _FETCHING:
        room = consumer.prefetch - consumer.outstanding_message_count
        if room <= 0:
            return 0  # the window is full: the consumer fetches when it has room
        fetched = consumer.broker.do_fetch(queue_name, room)
        for data in fetched:
            message = Message.decode(data)
            consumer.queued_message_ids.add(message.message_id)
            consumer_thread.handle_message(dramatiq.MessageProxy(message))
    return len(fetched)
