"""A small Dramatiq app for the worker-process tests: configured from ``SINGLETON_APP_*`` env vars.

Run as ``dramatiq dramatiq_app --path tests/workers``; the tests build the same app in their own
process (``build(config)``) to send messages. Bodies append one JSON line per attempt to a Redis
list (and one per start to another); a probe middleware (before SingletonMiddleware) appends one
line per delivery to a third. Results are stored in the same Redis; ``Results`` is added after
``SingletonMiddleware``, as a user appending both would.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dramatiq
import redis
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from singleton_tasks import current_admission
from singleton_tasks.dramatiq import GENERATION, SingletonMiddleware


@dataclass(frozen=True)
class AppConfig:
    broker: str  # "redis" | "rabbitmq"
    broker_url: str
    store: str
    namespace: str
    queue: str
    log_url: str
    log_key: str
    retry_delay: float = 0.3
    lease: float = 60.0
    orphan_timeout: float = 600.0
    metrics_setup: str = ""  # a file of code run with ``broker`` when the worker loads the app

    def env(self) -> dict[str, str]:
        return {f"SINGLETON_APP_{name.upper()}": str(value) for name, value in self.__dict__.items()}

    @classmethod
    def from_env(cls) -> AppConfig:
        values: dict[str, Any] = {
            name: os.environ[f"SINGLETON_APP_{name.upper()}"] for name in cls.__annotations__
        }
        values["retry_delay"] = float(values["retry_delay"])
        values["lease"] = float(values["lease"])
        values["orphan_timeout"] = float(values["orphan_timeout"])
        return cls(**values)


class DeliveryLog(dramatiq.Middleware):
    """Records every delivery, also the ones the gate defers or drops."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key = client, key

    def before_process_message(self, broker: Any, message: Any) -> None:
        entry = {"run_id": message.message_id, "gen": message.options.get(GENERATION, 0), "pid": os.getpid()}
        self.client.rpush(self.key + ":deliveries", json.dumps(entry))


# The actors every worker test can use: name -> singleton option.
SINGLETONS: dict[str, dict[str, Any]] = {
    "record": {"key": "{key}"},
    "pair": {"key": "{key}", "limit": 2},
    "capped": {"key": "{key}", "max_queue_depth": 2},
    "leased": {"key": "{key}", "lease": 3.0},  # the shortest lease: bodies can outlast it many times
}


def build(config: AppConfig) -> tuple[dramatiq.Broker, dict[str, dramatiq.Actor[Any, Any]]]:
    broker: dramatiq.Broker
    if config.broker == "redis":
        from dramatiq.brokers.redis import RedisBroker

        broker = RedisBroker(url=config.broker_url)
    else:
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        broker = RabbitmqBroker(url=config.broker_url)
    log = redis.Redis.from_url(config.log_url)
    broker.add_middleware(DeliveryLog(log, config.log_key))
    broker.add_middleware(
        SingletonMiddleware(
            config.store,
            namespace=config.namespace,
            retry_delay=config.retry_delay,
            retry_jitter=0.0,
            lease=config.lease,
            orphan_timeout=config.orphan_timeout,
        )
    )
    broker.add_middleware(Results(backend=RedisBackend(client=log, namespace=config.log_key)))

    def record(key: str, label: str, duration: float, fails: int = 0) -> str:
        """Sleeps ``duration``; raises on its first ``fails`` attempts (Retries decides what follows)."""
        admitted = current_admission()
        run_id = admitted.run_id if admitted else None
        attempt = log.incr(f"{config.log_key}:attempts:{run_id}")
        start = time.time()
        log.rpush(config.log_key + ":started", json.dumps({"key": key, "label": label, "start": start}))
        time.sleep(duration)
        entry = {
            "key": key,
            "label": label,
            "run_id": run_id,
            "token": admitted.token if admitted else None,
            "pid": os.getpid(),
            "attempt": attempt,
            "outcome": "raise" if attempt <= fails else "ok",
            "start": start,
            "end": time.time(),
        }
        log.rpush(config.log_key, json.dumps(entry))
        if attempt <= fails:
            raise RuntimeError(f"{label}: attempt {attempt} fails on purpose")
        return f"done:{label}"

    actors = {
        name: dramatiq.actor(
            record,
            actor_name=name,
            broker=broker,
            queue_name=config.queue,
            max_retries=0,
            store_results=True,
            singleton=singleton,
        )
        for name, singleton in SINGLETONS.items()
    }
    return broker, actors


if os.environ.get("SINGLETON_APP_BROKER"):  # imported by the dramatiq CLI
    config = AppConfig.from_env()
    broker, actors = build(config)
    if config.metrics_setup:  # the docs' metrics snippet, as written (docs/operations.md#metrics)
        exec(Path(config.metrics_setup).read_text(), {"broker": broker})
    dramatiq.set_broker(broker)
