"""A small Celery application: singleton tasks of limit 1, limit 2 and a capped backlog, plus a plain one.

Workers: ``celery -A integrations.celery_app worker --pool prefork|threads -c N -Q QUEUE`` with
``INTEGRATION_*`` set (see :class:`integrations.settings.Settings`). Producers build the same app in
their own process with :func:`build`.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from celery import Celery, Task, signals

from singleton_tasks import SingletonQueueFullError, current_admission
from singleton_tasks.celery import SingletonTask, install

from .runlog import Enqueue, Flaky, RunLog, perform
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

#: A plain task that sends a singleton run from inside a worker (scenario "sends from prefork tasks").
RELAY_TASK = "relay"


def build(settings: Settings) -> Celery:
    app = Celery(f"integrations_{settings.namespace}", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=settings.queue,
        task_ignore_result=True,
        worker_hijack_root_logger=True,
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    if settings.broker == "redis":
        # A SIGKILLed worker's unacked messages (and any message unacked for longer, also on a live
        # worker) are redelivered after visibility_timeout; restore passes run every second.
        app.conf.broker_transport_options = {
            "visibility_timeout": settings.visibility_timeout,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # A worker SIGKILLed while it restores holds the restore mutex until it expires (default
            # 300 s): no worker restores anything meanwhile, so every killed worker's runs stall.
            "unacked_mutex_expire": 5,
        }
    install(
        app,
        make_store(settings),
        namespace=settings.namespace,
        retry_delay=settings.retry_delay,
        retry_jitter=settings.retry_jitter,
        max_retry_delay=settings.max_retry_delay,
        lease=settings.lease,
        orphan_timeout=settings.orphan_timeout,
        heartbeat_interval=settings.heartbeat_interval or None,
    )
    log = RunLog(settings.log_url)
    retry: dict[str, Any] = {
        "autoretry_for": (Flaky,),
        "max_retries": MAX_RETRIES,
        "default_retry_delay": settings.retry_backoff,
        "retry_backoff": False,
        "retry_jitter": False,
        "shared": False,
        "bind": True,
    }
    for name, (limit, depth) in SINGLETON_TASKS.items():

        def singleton_body(
            self: Task, key: str, item: int, duration: float, fail: bool, _scope: str = name
        ) -> None:
            admitted = current_admission()
            run_id = admitted.run_id if admitted else self.request.id
            token = admitted.token if admitted else None
            retries = int(self.request.retries or 0)
            perform(log, settings.run, _scope, key, run_id, token, settings.worker, retries, duration, fail)

        singleton_body.__name__ = name
        app.task(
            base=SingletonTask,
            singleton={
                "key": "{key}",
                "limit": limit,
                "max_queue_depth": depth,
                "on_full": ON_FULL.get(name, "raise"),
                **TASK_TIMINGS.get(name, {}),
            },
            name=name,
            **retry,
        )(singleton_body)

    def plain(self: Task, key: str, item: int, duration: float, fail: bool) -> None:
        retries = int(self.request.retries or 0)
        perform(
            log,
            settings.run,
            PLAIN_TASK,
            key,
            self.request.id,
            None,
            settings.worker,
            retries,
            duration,
            fail,
        )

    # Durable like the singleton tasks, so a SIGKILL does not lose a plain run either.
    app.task(name=PLAIN_TASK, acks_late=True, reject_on_worker_lost=True, **retry)(plain)

    def relay(task: str, key: str, item: int, duration: float, queue: str) -> None:
        """Send one run of singleton ``task`` to ``queue`` from inside a task (a prefork pool
        process) and log the attempt as producer ``relay<item>-<pid>``; nothing else after it."""
        from celery.utils import uuid as celery_uuid

        run_id = celery_uuid()
        log.execute("SELECT 1")  # connected before the send: the log row is all that follows it
        at, error = real_time(), None
        try:
            app.tasks[task].apply_async((key, item, duration, False), task_id=run_id, queue=queue)
        except SingletonQueueFullError:
            error = "SingletonQueueFullError"
        limit = SINGLETON_TASKS[task][0]
        record = Enqueue(
            f"relay{item}-{os.getpid()}", 0, task, key, run_id, limit, error is None, error, at, real_time()
        )
        log.enqueues(settings.run, [record])

    app.task(name=RELAY_TASK, shared=False)(relay)
    app.finalize()
    return app


def log_deliveries(app: Celery, settings: Settings, log: RunLog) -> None:
    """Log every delivery of the app's tasks (``integration_deliveries``); worker processes only.

    ``task_prerun`` runs before ``before_start`` (the gate) and ``task_postrun`` after everything, for
    every state: a deferred or dropped copy is ``IGNORED`` with the gate's reason as its ``retval``.
    On Redis, ``task_received`` (the consumer's main process, after kombu recorded the message as
    unacked) is logged too: the checker's evidence that a message reached a worker (see
    :func:`integrations.checker.lost_to_broker`).
    """
    names = {*SINGLETON_TASKS, PLAIN_TASK}
    local = threading.local()

    def prerun(sender: Any = None, task_id: str | None = None, **_: Any) -> None:
        if getattr(sender, "name", None) in names and task_id:
            local.__dict__[task_id] = real_time()

    def postrun(
        sender: Any = None, task_id: str | None = None, retval: Any = None, state: str | None = None, **_: Any
    ) -> None:
        if getattr(sender, "name", None) not in names or not task_id:
            return
        started = local.__dict__.pop(task_id, None)
        if started is None:
            return
        detail = str(state)
        if state in ("IGNORED", "RETRY", "REJECTED"):
            detail += f": {retval}"[:120]
        log.delivery(settings.run, task_id, "delivery", settings.worker, started, detail)

    def received(sender: Any = None, request: Any = None, **_: Any) -> None:
        if request is not None and getattr(request, "task_name", None) in names:
            log.delivery(settings.run, request.id, "received", settings.worker, real_time())

    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)
    if settings.broker == "redis":
        signals.task_received.connect(received, weak=False)


if configured():  # imported by the celery CLI in a worker process
    worker_settings = Settings.from_env()
    shift_clock(worker_settings.clock_shift)
    app = build(worker_settings)
    log_deliveries(app, worker_settings, RunLog(worker_settings.log_url))
