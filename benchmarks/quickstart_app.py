"""The README's quickstart app for the "defaults" cases, run by the ``dramatiq`` command.

Started as ``dramatiq benchmarks.quickstart_app --processes 1 --threads 8`` with no
``dramatiq_*`` settings in the environment: Dramatiq's defaults (``worker_timeout`` 1 s,
prefetch twice the threads). ``BENCH_QS_*`` environment variables name the broker, the store
(none: plain Dramatiq), the queue and the file the bodies append their spans to.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import dramatiq

from singleton_tasks.dramatiq import SingletonMiddleware

from .common import SpanFile

ACTOR = "bench_body"
KEY = "quickstart"


@dataclass(frozen=True)
class QuickstartConfig:
    broker: str  # "redis" | "rabbitmq"
    broker_url: str
    store: str  # "" = plain Dramatiq, no middleware
    namespace: str
    queue: str
    spans: str  # the file the bodies append "index start end" lines to (perf_counter seconds)
    wake_fetch: str = "on"  # "off": the measured alternative, wakes left to the consumer's poll

    def env(self) -> dict[str, str]:
        return {f"BENCH_QS_{name.upper()}": str(value) for name, value in self.__dict__.items()}

    @classmethod
    def from_env(cls) -> QuickstartConfig:
        return cls(
            **{
                name: os.environ[f"BENCH_QS_{name.upper()}"]
                for name in cls.__annotations__
                if name != "wake_fetch"
            },
            wake_fetch=os.environ.get("BENCH_QS_WAKE_FETCH", "on"),
        )

    @property
    def release_file(self) -> str:
        """The holder (``hold=True``) ends once this file exists."""
        return self.spans + ".release"


def build(config: QuickstartConfig) -> tuple[dramatiq.Broker, dramatiq.Actor[Any, Any]]:
    """The quickstart's broker, middleware and one actor (a singleton on one key if a store is set)."""
    broker: dramatiq.Broker
    if config.broker == "redis":
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(url=config.broker_url)  # type: ignore[no-untyped-call]
    else:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        broker = RabbitmqBroker(url=config.broker_url)
    if config.store:
        broker.add_middleware(SingletonMiddleware(store=config.store, namespace=config.namespace))
    spans = SpanFile(config.spans)

    def body(index: int, seconds: float, hold: bool = False) -> None:
        start = time.perf_counter()
        if hold:
            while not os.path.exists(config.release_file):
                time.sleep(0.001)
        else:
            time.sleep(seconds)
        spans.write(index, start, time.perf_counter())

    options: dict[str, Any] = {"singleton": {"key": KEY}} if config.store else {}
    actor = dramatiq.actor(actor_name=ACTOR, broker=broker, queue_name=config.queue, **options)(body)
    return broker, actor


def without_wake_fetch() -> None:
    """The benchmark's baseline only, in the worker process only (the producer that builds the
    same app must keep its own): a release publishes its wakes and fetches nothing."""
    import singleton_tasks.dramatiq

    singleton_tasks.dramatiq.fetch_for_this_worker = lambda queue_name: 0  # type: ignore[attr-defined]


if os.environ.get("BENCH_QS_BROKER"):  # imported by the dramatiq command
    _config = QuickstartConfig.from_env()
    broker, actor = build(_config)
    dramatiq.set_broker(broker)
    if _config.wake_fetch == "off":
        without_wake_fetch()
