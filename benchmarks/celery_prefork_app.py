"""The Celery app of case 8's prefork form, run by ``celery --app benchmarks.celery_prefork_app
worker --pool prefork``: Celery's defaults (one child process per CPU, prefetch multiplier 4).

``BENCH_CP_*`` environment variables name the broker, the variant, the queue, the store's
namespace and the file the bodies append their spans to; the benchmark process builds the same
app to send from.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery, Task, signals

from singleton_tasks.celery import SingletonTask, install

from .common import BROKER_REDIS_URL, RABBITMQ_URL, STORE_REDIS_URL, BareRoundTrips, SpanFile

TASK = "bench_prefork_noop"
#: What each variant adds to plain Celery (early acks): the floor and the singleton ack late.
VARIANTS = ("plain", "floor", "singleton")

_receivers: list[Any] = []

#: Set by ``benchmarks.where``: the path prefix each pool child writes its part timers to.
WHERE_ENV = "BENCH_CP_WHERE"


@dataclass(frozen=True)
class PreforkConfig:
    broker: str  # "redis" | "rabbitmq"
    variant: str  # one of VARIANTS
    queue: str
    namespace: str
    spans: str  # the file the bodies append "index start end" lines to (perf_counter seconds)

    def env(self) -> dict[str, str]:
        return {f"BENCH_CP_{name.upper()}": value for name, value in self.__dict__.items()}

    @classmethod
    def from_env(cls) -> PreforkConfig:
        return cls(**{name: os.environ[f"BENCH_CP_{name.upper()}"] for name in cls.__annotations__})


def build(config: PreforkConfig) -> tuple[Celery, Task[Any, Any]]:
    """The app and its one no-op task (``k:{i}`` keys for the singleton variant)."""
    url = BROKER_REDIS_URL if config.broker == "redis" else RABBITMQ_URL.rstrip("/") + "//"
    app = Celery("bench_prefork", broker=url, set_as_current=False)
    app.conf.update(
        task_ignore_result=True,
        task_default_queue=config.queue,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        task_acks_late=config.variant != "plain",
    )
    options: dict[str, Any] = {}
    if config.variant == "singleton":
        install(app, STORE_REDIS_URL, namespace=config.namespace)
        options = {"base": SingletonTask, "singleton": {"key": "k:{i}"}}
    spans = SpanFile(config.spans)

    def noop(i: int) -> None:
        start = time.perf_counter()
        spans.write(i, start, time.perf_counter())

    task = app.task(name=TASK, shared=False, **options)(noop)
    if config.variant == "floor":
        round_trips = BareRoundTrips()  # its pool reconnects in each child after the fork

        def ping(**_: Any) -> None:
            round_trips.ping()

        _receivers.append(ping)  # signals hold their receivers weakly
        signals.task_prerun.connect(ping, sender=task)
        signals.task_postrun.connect(ping, sender=task)
    return app, task


if os.environ.get("BENCH_CP_BROKER"):  # imported by the celery command
    if os.environ.get(WHERE_ENV):  # benchmarks.where: time the library's parts in the pool children
        from .where import time_pool_children

        time_pool_children(os.environ[WHERE_ENV], os.environ["BENCH_CP_VARIANT"])
    app, _task = build(PreforkConfig.from_env())
