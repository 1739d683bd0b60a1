"""A small Celery app for the worker-process tests: configured from ``SINGLETON_CELERY_*`` env vars.

Run as ``celery -A celery_app worker`` from this directory; the tests build the same app in
their own process (``build(config)``) to send tasks. Bodies append one JSON line per attempt to
a Redis list when they start (``:started``) and when they end; a ``task_prerun`` receiver
appends one line per delivery (also the deferred and dropped ones) to another.

The singleton tasks (key ``{key}``, limit 1): ``workers.record``, ``workers.capped``
(``max_queue_depth=2``), ``workers.flaky`` (``self.retry()``) and ``workers.auto``
(``autoretry_for``), all ``(key, label, duration, fails=0, until=None)`` and returning ``label``; and
``workers.compute(value, key, add)`` returning ``value + add`` (for chains). ``workers.send_to`` is
a plain task that sends ``workers.record`` runs (a producer inside a pool process);
``workers.plain`` is ``workers.record``'s body on ``SingletonTask`` without a ``singleton`` option.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

from singleton_tasks import current_admission
from singleton_tasks.celery import GENERATION_HEADER, SingletonTask, install

#: Seconds between a failed attempt of ``workers.flaky`` / ``workers.auto`` and its retry.
RETRY_COUNTDOWN = 0.5


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
    app_conf: str = "{}"  # JSON: more Celery settings (app.conf)
    metrics_setup: str = ""  # a file of code run in the app's module when the worker loads it

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


def go_key(config: AppConfig, name: str) -> str:
    """The Redis list a body started with ``until=name`` waits on."""
    return f"{config.log_key}:go:{name}"


def build(config: AppConfig) -> Celery:
    app = Celery("singleton_workers", broker=config.broker_url, backend=config.log_url, set_as_current=False)
    app.conf.task_default_queue = config.queue
    app.conf.result_expires = 600
    app.conf.worker_hijack_root_logger = True
    app.conf.broker_connection_retry_on_startup = True
    app.conf.update(json.loads(config.app_conf))
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
            "args": json.loads(json.dumps(list(request.args or ()), default=str)),
            "redelivered": bool((request.delivery_info or {}).get("redelivered")),
            "origin": request.origin,
            "pid": os.getpid(),
            "at": time.time(),
        }
        log.rpush(config.log_key + ":deliveries", json.dumps(entry))

    def started(key: str, label: str, attempt: int) -> float:
        start = time.time()
        entry = {"key": key, "label": label, "attempt": attempt, "start": start}
        log.rpush(config.log_key + ":started", json.dumps(entry))
        return start

    def ended(key: str, label: str, attempt: int, start: float, outcome: str = "ok") -> None:
        admitted = current_admission()
        entry = {
            "key": key,
            "label": label,
            "run_id": admitted.run_id if admitted else None,
            "token": admitted.token if admitted else None,
            "pid": os.getpid(),
            "attempt": attempt,
            "outcome": outcome,
            "start": start,
            "end": time.time(),
        }
        log.rpush(config.log_key, json.dumps(entry))

    def attempt(
        task: Any, key: str, label: str, duration: float, fails: int = 0, until: str | None = None
    ) -> str:
        """Sleeps ``duration``, or until the test says ``go(until)``; the first ``fails`` attempts
        fail (retried ``RETRY_COUNTDOWN`` s later)."""
        number = task.request.retries + 1
        start = started(key, label, number)
        if until is not None:
            log.blpop([go_key(config, until)], timeout=60)
        time.sleep(duration)
        failing = number <= fails
        ended(key, label, number, start, "raise" if failing else "ok")
        if failing:
            error = RuntimeError(f"{label}: attempt {number} fails on purpose")
            if getattr(task, "autoretry_for", ()):
                raise error
            raise task.retry(exc=error, countdown=RETRY_COUNTDOWN)
        return label

    def task(name: str, singleton: dict[str, Any], **options: Any) -> Any:
        return app.task(
            base=SingletonTask, singleton=singleton, name=name, shared=False, bind=True, **options
        )

    task("workers.record", {"key": "{key}"})(attempt)
    task("workers.capped", {"key": "{key}", "max_queue_depth": 2})(attempt)
    task("workers.flaky", {"key": "{key}"}, max_retries=2)(attempt)
    task(
        "workers.auto",
        {"key": "{key}"},
        autoretry_for=(RuntimeError,),
        retry_kwargs={"countdown": RETRY_COUNTDOWN},
        max_retries=2,
    )(attempt)

    app.task(base=SingletonTask, name="workers.plain", shared=False, bind=True)(attempt)

    @app.task(name="workers.send_to", shared=False)
    def send_to(key: str, count: int, queue: str) -> tuple[int, list[str]]:
        """Sends ``count`` runs of ``workers.record`` to ``queue``; returns this pid and their ids."""
        record = app.tasks["workers.record"]
        return os.getpid(), [record.apply_async((key, f"sent-{i}", 0), queue=queue).id for i in range(count)]

    @app.task(base=SingletonTask, singleton={"key": "{key}"}, name="workers.compute", shared=False)
    def compute(value: int, key: str, add: int) -> int:
        ended(key, f"+{add}", 1, started(key, f"+{add}", 1))
        return value + add

    return app


#: What the metrics snippet defined: kept, as Celery's signals hold their receivers weakly.
metrics_setup: dict[str, Any] = {}

if os.environ.get("SINGLETON_CELERY_BROKER_URL"):  # imported by the celery CLI
    config = AppConfig.from_env()
    app = build(config)
    if config.metrics_setup:  # the docs' metrics snippet, as written (docs/operations.md#metrics)
        exec(Path(config.metrics_setup).read_text(), metrics_setup)
