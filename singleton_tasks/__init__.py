"""singleton-tasks: Dramatiq actors and Celery tasks as durable FIFO mutexes per key."""

from __future__ import annotations

from .admission import Admission, current_admission
from .config import DISABLED, BoundSingleton, SingletonConfig
from .decorator import singleton
from .errors import (
    SchemaVersionError,
    SingletonConfigError,
    SingletonError,
    SingletonKeyError,
    SingletonPayloadError,
    SingletonQueueFullError,
    StoreUnavailableError,
)
from .stores import Store, store_from_url

__version__ = "0.1.0"

__all__ = [
    "DISABLED",
    "Admission",
    "BoundSingleton",
    "SchemaVersionError",
    "SingletonConfig",
    "SingletonConfigError",
    "SingletonError",
    "SingletonKeyError",
    "SingletonPayloadError",
    "SingletonQueueFullError",
    "Store",
    "StoreUnavailableError",
    "current_admission",
    "singleton",
    "store_from_url",
]
