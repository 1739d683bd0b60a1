"""The library's errors: one base, one class per thing that can go wrong."""

from __future__ import annotations


class SingletonError(Exception):
    """Base of every error raised by singleton-tasks."""


class SingletonConfigError(SingletonError, ValueError):
    """A singleton declaration or a store URL is invalid."""


class SingletonKeyError(SingletonError, ValueError):
    """A run's key could not be derived from its arguments."""


class SingletonPayloadError(SingletonError, TypeError):
    """A run's message cannot be encoded (an argument its serializer refuses): nothing was
    registered, nothing published."""


class StoreUnavailableError(SingletonError):
    """The store could not be reached or failed an operation; nothing was decided."""


class SchemaVersionError(SingletonError):
    """The store's schema is not the one this version of the library uses."""


class SingletonQueueFullError(SingletonError):
    """The key's backlog is at `limit + max_queue_depth`: the run was not accepted."""

    def __init__(
        self,
        *,
        task_name: str,
        scope: str,
        key: str,
        limit: int,
        max_queue_depth: int | None,
    ) -> None:
        self.task_name = task_name
        self.scope = scope
        self.key = key
        self.limit = limit
        self.max_queue_depth = max_queue_depth
        super().__init__(
            f"{task_name}: the queue of key {key!r} (scope {scope!r}) is full: "
            f"limit={limit}, max_queue_depth={max_queue_depth}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only __init__: teach pickle (Celery results, prefork) to rebuild it.
        return (_rebuild_queue_full, (type(self), self.__dict__.copy(), self.args))


def _rebuild_queue_full(
    cls: type[SingletonQueueFullError], state: dict[str, object], args: tuple[object, ...]
) -> SingletonQueueFullError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error
