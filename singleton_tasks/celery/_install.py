"""Wiring the Celery adapter in: :func:`install`, the worker's bootsteps and the signal connections.

``install`` records an app's store and timings and adds two worker bootsteps: the schema check
before consuming, and the heartbeat thread that does the due work once the pool is up. The
signal receivers are connected once per process, with or without ``install``.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, bootsteps, signals

from ..config import (
    DEFAULT_LEASE,
    DEFAULT_MAX_RETRY_DELAY,
    DEFAULT_ORPHAN_TIMEOUT,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_JITTER,
)
from ..confirms import confirm_at_exit
from ..errors import StoreUnavailableError
from ..runtime import WorkerOptions
from ..stores.choice import check_store_argument
from ._declaration import adopt_declared_tasks
from ._gatekeeper import Settings, configure, gatekeeper_for
from ._payload import publish_wakes
from ._settle import on_failure, on_postrun, on_revoked
from ._task import SingletonTask

logger = logging.getLogger("singleton_tasks")


def install(
    app: Celery,
    store: Any = None,
    *,
    namespace: str = "default",
    retry_delay: float = DEFAULT_RETRY_DELAY,
    retry_jitter: float = DEFAULT_RETRY_JITTER,
    lease: float = DEFAULT_LEASE,
    orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT,
    heartbeat_interval: float | None = None,
    max_retry_delay: float = DEFAULT_MAX_RETRY_DELAY,
) -> None:
    """Give ``app``'s singleton tasks a store and worker timings (docs/concepts.md#declaring-a-singleton).

    ``store`` is a URL or a :class:`~singleton_tasks.Store`; without it ``app.conf.singleton_store``,
    then ``SINGLETON_TASKS_STORE``, then the embedded SQLite default (with a warning). A URL's
    scheme and syntax are checked here (``SingletonConfigError``), without connecting: the
    store is opened lazily, once per process (after a prefork fork, again in the child), and a
    store that cannot be used then makes ``.delay()`` raise within its connect timeout.
    """
    check_store_argument(store)
    settings = Settings(
        store,
        namespace,
        {
            "retry_delay": retry_delay,
            "retry_jitter": retry_jitter,
            "lease": lease,
            "orphan_timeout": orphan_timeout,
            "heartbeat_interval": heartbeat_interval,
            "max_retry_delay": max_retry_delay,
        },
    )
    WorkerOptions(**settings.options)  # bad timings fail here, not at the first run
    configure(app, settings)
    steps = app.steps["worker"]
    for step in (_SchemaCheck, _DueWork):
        if step not in steps:
            steps.add(step)
    connect_signals()
    adopt_declared_tasks(app)


class _SchemaCheck(bootsteps.StartStopStep):  # type: ignore[misc]
    """Worker start: refuse a missing or incompatible store schema, before consuming.

    See docs/deployment.md#schema-upgrades.
    """

    label = "singleton-tasks schema check"

    def start(self, worker: Any) -> None:
        gatekeeper = gatekeeper_for(worker.app)
        singletons = [
            bound
            for task in list(worker.app.tasks.values())
            if isinstance(task, SingletonTask) and (bound := task._singleton_binding()) is not None
        ]
        try:
            gatekeeper.check(singletons)  # SchemaVersionError: "Unrecoverable error", exit 1
        except StoreUnavailableError as error:
            logger.warning("singleton store unavailable at worker start (%s); gating fails closed", error)
        finally:
            gatekeeper.close()  # no client crosses the pool's fork; reopened at first use


class _DueWork(bootsteps.StartStopStep):  # type: ignore[misc]
    """The worker's heartbeat thread, in its main process once its pool is up (a prefork pool's
    processes are forked by then): it does the due work of keys no delivery touches, issuing
    again the runs whose copies were lost, and publishes those copies (docs/concepts.md#the-line).
    """

    label = "singleton-tasks due work"
    requires = ("celery.worker.components:Pool", _SchemaCheck)  # its check closes the store

    def start(self, worker: Any) -> None:
        _start_due_work(worker.app)


def _start_due_work(app: Celery) -> None:
    """Publish the copies the store issues from this process's heartbeat thread, and start it.

    Only the worker's main process does: a prefork pool's processes were forked before, and
    their heartbeat threads leave the due work alone.
    """
    gatekeeper = gatekeeper_for(app)
    gatekeeper.publish_wakes = lambda wakes: publish_wakes(app, wakes)
    gatekeeper.heartbeats.start()


_signals_connected = False


def connect_signals() -> None:
    """Connect the settlement and worker-lifecycle receivers (once per process)."""
    global _signals_connected
    if _signals_connected:
        return
    _signals_connected = True
    signals.task_postrun.connect(on_postrun, weak=False, dispatch_uid="singleton_tasks.postrun")
    signals.task_revoked.connect(on_revoked, weak=False, dispatch_uid="singleton_tasks.revoked")
    signals.task_failure.connect(on_failure, weak=False, dispatch_uid="singleton_tasks.failure")
    # A prefork pool process ends with os._exit inside billiard's worker loop: no atexit and no
    # multiprocessing finalizer runs there, only this signal. Sends of its tasks stay confirmed.
    # Without install() no bootstep is added: a `celery worker` command still sends worker_ready.
    signals.worker_ready.connect(_on_worker_ready, weak=False, dispatch_uid="singleton_tasks.worker_ready")
    signals.worker_process_shutdown.connect(
        _on_process_shutdown, weak=False, dispatch_uid="singleton_tasks.process_shutdown"
    )


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    """Start the due work of an app with singleton tasks, also one ``install`` never saw."""
    app = getattr(sender, "app", None)
    if app is not None and any(isinstance(task, SingletonTask) for task in list(app.tasks.values())):
        _start_due_work(app)


def _on_process_shutdown(**_: Any) -> None:
    """Send this pool process's pending confirmations before it ends."""
    confirm_at_exit()
