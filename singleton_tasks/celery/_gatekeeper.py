"""Each Celery app's :class:`~singleton_tasks.runtime.Gatekeeper`, built at first use from its settings.

:func:`~singleton_tasks.celery.install` records the settings; without it the store comes from
``app.conf.singleton_store``, then ``SINGLETON_TASKS_STORE``, then the embedded default.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from celery import Celery

from ..runtime import Gatekeeper

_APP_GATEKEEPER = "_singleton_gatekeeper"
_APP_SETTINGS = "_singleton_settings"
_gatekeeper_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`~singleton_tasks.celery.install` was given for an app."""

    #: A store URL or object; None: ``app.conf.singleton_store``, then the environment, then the default.
    store: Any
    #: Isolates applications sharing one store server.
    namespace: str
    #: The worker timings, as :class:`~singleton_tasks.runtime.WorkerOptions` takes them.
    options: dict[str, Any]


def configure(app: Celery, settings: Settings) -> None:
    """Give ``app`` new settings; its gatekeeper is rebuilt from them at first use."""
    with _gatekeeper_lock:
        previous: Gatekeeper | None = getattr(app, _APP_GATEKEEPER, None)
        setattr(app, _APP_SETTINGS, settings)
        setattr(app, _APP_GATEKEEPER, None)  # built at first use, so app.conf may still change
    if previous is not None:
        previous.close()


def gatekeeper_for(app: Celery) -> Gatekeeper:
    """The app's :class:`Gatekeeper`, created at first use from :func:`install` or ``app.conf``."""
    gatekeeper: Gatekeeper | None = getattr(app, _APP_GATEKEEPER, None)
    if gatekeeper is not None:
        return gatekeeper
    with _gatekeeper_lock:
        gatekeeper = getattr(app, _APP_GATEKEEPER, None)
        if gatekeeper is None:
            settings: Settings = getattr(app, _APP_SETTINGS, None) or Settings(None, "default", {})
            store = settings.store if settings.store is not None else app.conf.get("singleton_store")
            gatekeeper = Gatekeeper(store, namespace=settings.namespace, **settings.options)
            setattr(app, _APP_GATEKEEPER, gatekeeper)
    return gatekeeper
