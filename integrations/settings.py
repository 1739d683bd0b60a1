"""One scenario run's configuration, passed to worker processes as ``INTEGRATION_*`` env vars."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from singleton_tasks import Store, store_from_url

PREFIX = "INTEGRATION_"

LOG_URL = os.environ.get("SINGLETON_TEST_POSTGRES_URL", "postgresql://127.0.0.1:5432/test")
REDIS_URL = os.environ.get("SINGLETON_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
BROKER_REDIS_URL = os.environ.get("SINGLETON_TEST_BROKER_REDIS_URL", "redis://127.0.0.1:6379/14")
RABBITMQ_URL = os.environ.get("SINGLETON_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
BROKER_URLS = {"redis": BROKER_REDIS_URL, "rabbitmq": RABBITMQ_URL}

#: The apps' singleton tasks: name -> (limit, max_queue_depth). ``plain`` is not a singleton.
SINGLETON_TASKS: dict[str, tuple[int, int | None]] = {
    "mutex": (1, None),
    "pair": (2, None),
    "capped": (1, 5),
    "brief": (1, None),
    "narrow": (1, 2),
    "coalesced": (1, 1),
    "latest": (1, 1),
}
#: Tasks whose sends over the cap do not raise: ``coalesced`` drops them, ``latest`` replaces the
#: key's newest waiter (every other task: ``on_full="raise"``).
ON_FULL = {"coalesced": "drop", "latest": "replace"}
#: Task-level overrides of the middleware's timings: ``brief`` has a lease far shorter than the
#: middleware's (its heartbeats must follow its own lease).
TASK_TIMINGS: dict[str, dict[str, float]] = {"brief": {"lease": 5.0, "orphan_timeout": 5.0}}
PLAIN_TASK = "plain"
#: Retries of a raising body (both frameworks).
MAX_RETRIES = 3


@dataclass(frozen=True)
class Settings:
    """Everything a worker or producer of one scenario run needs; all timings in seconds."""

    run: str  # the scenario run id: every log row carries it
    broker: str  # "redis" | "rabbitmq"
    broker_url: str
    store_url: str
    namespace: str
    queue: str
    log_url: str = LOG_URL
    lease: float = 3.0
    orphan_timeout: float = 20.0
    retry_delay: float = 0.3
    retry_jitter: float = 0.1
    max_retry_delay: float = 10.0  # the longest re-check delay (the library's default)
    # > 0: the workers' heartbeat interval (their due-key ticks too); 0: the library's (lease / 3).
    heartbeat_interval: float = 0.0
    retry_backoff: float = 0.1  # delay before a raising body's retry
    # RedisBroker: a SIGKILLed worker's messages come back after this (ms); dramatiq's default is 60 s.
    heartbeat_timeout_ms: int = 4000
    # kombu Redis transport: unacked messages older than this are redelivered (also to live workers).
    visibility_timeout: float = 8.0
    # > 0: the store is built with this timeout (PostgreSQL pool/lock wait, Redis socket timeouts) so an
    # outage fails operations fast; 0: the store URL alone, with the library's defaults.
    store_timeout: float = 0.0
    worker: str = ""  # the worker instance name (set per process by the runner)
    # Seconds this process's ``time.time`` runs ahead of the host's (negative: behind): a skewed host.
    clock_shift: float = 0.0

    def env(self) -> dict[str, str]:
        return {PREFIX + f.name.upper(): str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        source = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = source.get(PREFIX + f.name.upper())
            if raw is None:
                continue
            kind = type(f.default) if f.default is not dataclasses.MISSING else str
            values[f.name] = kind(raw)
        return cls(**values)

    def with_(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def make_store(settings: Settings) -> Store | str:
    """What the apps hand to the adapter: the URL, or a store built with ``store_timeout``."""
    if settings.store_timeout <= 0:
        return settings.store_url
    options: dict[str, Any] = {}
    if settings.store_url.startswith("postgres"):
        options["timeout"] = settings.store_timeout
    elif settings.store_url.startswith("redis"):
        options["socket_timeout"] = options["socket_connect_timeout"] = settings.store_timeout
    return store_from_url(settings.store_url, namespace=settings.namespace, **options)


#: The host's real clock, kept before :func:`shift_clock` replaces ``time.time``: the run log
#: always records real times, so the checker compares bodies of every process on one clock.
real_time = time.time


def shift_clock(seconds: float) -> None:
    """Make this process's ``time.time`` run ``seconds`` ahead of the host's (negative: behind).

    A wrapper rather than freezegun: a worker needs a clock that keeps ticking in every thread, with
    ``time.monotonic`` (timeouts, the heartbeat pace) left alone, as on a host whose wall clock is
    simply set wrong. Call it after the app is imported: Dramatiq's ``current_millis`` (message
    timestamps, ETAs of delayed messages) bound ``time.time`` at its import and is re-bound here.
    Celery times ETAs with ``datetime.now``, which stays real: consistent within one process either way.
    """
    if not seconds:
        return

    def shifted() -> float:
        return real_time() + seconds

    time.time = shifted
    dramatiq_common = sys.modules.get("dramatiq.common")
    if dramatiq_common is not None:
        dramatiq_common.time = shifted  # type: ignore[attr-defined]


def configured() -> bool:
    """Whether this process was started by the runner (the apps build themselves at import then)."""
    return PREFIX + "RUN" in os.environ
