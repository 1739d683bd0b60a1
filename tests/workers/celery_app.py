"""A small Celery app for the worker-process tests: configured from ``SINGLETON_CELERY_*`` env vars.

Run as ``celery -A celery_app worker`` from this directory; the tests build the same app in
their own process (``build(config)``) to send tasks. Bodies append one JSON line per run to a
Redis list; a ``task_prerun`` receiver appends one line per delivery (also the deferred and
dropped ones) to another.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, fields
from typing import Any

import redis
from celery import Celery, signals

from singleton_tasks import current_admission
from singleton_tasks.celery import GENERATION_HEADER, SingletonTask, install


@dataclass(frozen=True)
class AppConfig:
    broker_url: str
    store: str
    namespace: str
    queue: str
    log_url: str
    log_key: str
    retry_delay: float = 0.3
    visibility_timeout: float = 0.0  # 0: kombu's default (Redis broker only)
    lease: float = 60.0

    def env(self) -> dict[str, str]:
        return {f"SINGLETON_CELERY_{f.name.upper()}": str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_env(cls) -> AppConfig:
        values: dict[str, Any] = {
            f.name: os.environ[f"SINGLETON_CELERY_{f.name.upper()}"] for f in fields(cls)
        }
        values["retry_delay"] = float(values["retry_delay"])
        values["visibility_timeout"] = float(values["visibility_timeout"])
        values["lease"] = float(values["lease"])
        return cls(**values)


def build(config: AppConfig) -> Celery:
    app = Celery("singleton_workers", broker=config.broker_url, backend=config.log_url, set_as_current=False)
    app.conf.task_default_queue = config.queue
    app.conf.result_expires = 600
    app.conf.worker_hijack_root_logger = True
    app.conf.broker_connection_retry_on_startup = True
    if config.visibility_timeout:
        app.conf.broker_transport_options = {
            "visibility_timeout": config.visibility_timeout,
            "unacked_restore_interval": 0.5,
            "unacked_restore_throttle": 1,
        }
    install(
        app,
        config.store,
        namespace=config.namespace,
        retry_delay=config.retry_delay,
        retry_jitter=0.05,
        lease=config.lease,
    )
    log = redis.Redis.from_url(config.log_url)

    @signals.task_prerun.connect(weak=False)
    def delivery(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        if sender is None or not sender.name.startswith("workers."):
            return
        request = sender.request
        entry = {
            "run_id": task_id,
            "gen": (request.headers or {}).get(GENERATION_HEADER, 0),
            "redelivered": bool((request.delivery_info or {}).get("redelivered")),
            "pid": os.getpid(),
            "at": time.time(),
        }
        log.rpush(config.log_key + ":deliveries", json.dumps(entry))

    @app.task(base=SingletonTask, singleton={"key": "{key}"}, name="workers.record", shared=False)
    def record(key: str, label: str, duration: float) -> str:
        admitted = current_admission()
        start = time.time()
        time.sleep(duration)
        entry = {
            "key": key,
            "label": label,
            "run_id": admitted.run_id if admitted else None,
            "token": admitted.token if admitted else None,
            "pid": os.getpid(),
            "start": start,
            "end": time.time(),
        }
        log.rpush(config.log_key, json.dumps(entry))
        return label

    return app


if os.environ.get("SINGLETON_CELERY_BROKER_URL"):  # imported by the celery CLI
    app = build(AppConfig.from_env())
