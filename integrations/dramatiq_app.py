"""A small Dramatiq application: singleton actors of limit 1, limit 2 and a capped backlog, plus a plain one.

Workers: ``dramatiq integrations.dramatiq_app --processes 1 --threads N`` with ``INTEGRATION_*`` set
(see :class:`integrations.settings.Settings`). Producers build the same app in their own process
with :func:`build`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import dramatiq
from dramatiq.middleware import CurrentMessage, Middleware

from singleton_tasks import current_admission
from singleton_tasks.dramatiq import GENERATION, SingletonMiddleware

from .runlog import RunLog, perform
from .settings import (
    MAX_RETRIES,
    ON_FULL,
    PLAIN_TASK,
    SINGLETON_TASKS,
    TASK_TIMINGS,
    Settings,
    configured,
    make_store,
    real_time,
    shift_clock,
)


@dataclass
class DramatiqApp:
    settings: Settings
    broker: dramatiq.Broker
    middleware: SingletonMiddleware
    actors: dict[str, dramatiq.Actor[Any, Any]]


class DeliveryLog(Middleware):
    """Logs every delivery of a message to a worker thread (a row in ``integration_deliveries``).

    Added before :class:`SingletonMiddleware`, so its ``before_process_message`` runs before the
    gate: a delivery the gate defers or drops (``SkipMessage``) is logged as ``skipped``, one that ran
    the body as ``processed``. Written when the delivery ends: a delivery killed midway has no row.
    """

    def __init__(self, log: RunLog, settings: Settings) -> None:
        self.log = log
        self.settings = settings
        self._local = threading.local()

    def _started(self) -> dict[str, float]:
        started: dict[str, float] | None = getattr(self._local, "started", None)
        if started is None:
            started = self._local.started = {}
        return started

    def before_process_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self._started()[message.message_id] = real_time()

    def _done(self, message: Any, how: str) -> None:
        started = self._started().pop(message.message_id, None)
        if started is None:
            return  # a second after_process_message (TimeLimit, Shutdown), or skipped before us
        detail = f"{how} gen={message.options.get(GENERATION)}"
        run, worker = self.settings.run, self.settings.worker
        self.log.delivery(run, message.message_id, "delivery", worker, started, detail)

    def after_process_message(
        self, broker: dramatiq.Broker, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        self._done(message, "processed" if exception is None else "processed raised")

    def after_skip_message(self, broker: dramatiq.Broker, message: Any) -> None:
        self._done(message, "skipped")


def make_broker(settings: Settings) -> dramatiq.Broker:
    if settings.broker == "redis":
        from dramatiq.brokers.redis import RedisBroker

        # A SIGKILLed worker's unacked messages come back once its heartbeat is this old and a
        # maintenance pass runs (a per-command chance): both short, or a crash stalls a key 60 s+.
        return RedisBroker(  # type: ignore[no-untyped-call]
            url=settings.broker_url,
            heartbeat_timeout=settings.heartbeat_timeout_ms,
            maintenance_chance=100_000,
        )
    if settings.broker == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=settings.broker_url)
    raise ValueError(f"unknown broker {settings.broker!r}")


def build(settings: Settings) -> DramatiqApp:
    broker = make_broker(settings)
    broker.add_middleware(CurrentMessage())
    log = RunLog(settings.log_url)
    broker.add_middleware(DeliveryLog(log, settings))  # before the gate: sees deferred copies too
    middleware = SingletonMiddleware(
        make_store(settings),
        namespace=settings.namespace,
        retry_delay=settings.retry_delay,
        retry_jitter=settings.retry_jitter,
        max_retry_delay=settings.max_retry_delay,
        lease=settings.lease,
        orphan_timeout=settings.orphan_timeout,
        heartbeat_interval=settings.heartbeat_interval or None,
    )
    broker.add_middleware(middleware)
    backoff_ms = max(1, round(settings.retry_backoff * 1000))
    options: dict[str, Any] = {
        "broker": broker,
        "queue_name": settings.queue,
        "max_retries": MAX_RETRIES,
        "min_backoff": backoff_ms // 2 or 1,  # dramatiq doubles it for the first retry
        "max_backoff": backoff_ms * 4,
    }

    def attempt() -> tuple[str, int]:
        message = CurrentMessage.get_current_message()
        assert message is not None
        return message.message_id, int(message.options.get("retries", 0))

    def singleton_body(scope: str, key: str, duration: float, fail: bool) -> None:
        admitted = current_admission()
        message_id, retries = attempt()
        run_id = admitted.run_id if admitted else message_id
        token = admitted.token if admitted else None
        perform(log, settings.run, scope, key, run_id, token, settings.worker, retries, duration, fail)

    actors: dict[str, dramatiq.Actor[Any, Any]] = {}
    for name, (limit, depth) in SINGLETON_TASKS.items():

        def fn(key: str, item: int, duration: float, fail: bool, _scope: str = name) -> None:
            singleton_body(_scope, key, duration, fail)

        fn.__name__ = name
        declare = dramatiq.actor(
            actor_name=name,
            singleton={
                "key": "{key}",
                "limit": limit,
                "max_queue_depth": depth,
                "on_full": ON_FULL.get(name, "raise"),
                **TASK_TIMINGS.get(name, {}),
            },
            **options,
        )
        actors[name] = declare(fn)

    def plain(key: str, item: int, duration: float, fail: bool) -> None:
        message_id, retries = attempt()
        perform(
            log, settings.run, PLAIN_TASK, key, message_id, None, settings.worker, retries, duration, fail
        )

    actors[PLAIN_TASK] = dramatiq.actor(actor_name=PLAIN_TASK, **options)(plain)
    return DramatiqApp(settings, broker, middleware, actors)


if configured():  # imported by the dramatiq CLI in a worker process
    worker_settings = Settings.from_env()
    shift_clock(worker_settings.clock_shift)
    app = build(worker_settings)
    dramatiq.set_broker(app.broker)
    broker = app.broker
