"""The errors the Dramatiq adapter raises: each the library's error and a ``MiddlewareError``.

``Broker.emit_before`` swallows every exception that is not a
:class:`dramatiq.middleware.MiddlewareError` (and the message is published anyway), so an error
meant for the caller of ``.send()``, or for the worker at boot, subclasses both. Catch them as
the library's errors (``singleton_tasks.SingletonQueueFullError`` and so on); docs/dramatiq.md
lists them.
"""

from __future__ import annotations

from dramatiq.middleware import MiddlewareError, SkipMessage

from .. import errors as core


class QueueFull(core.SingletonQueueFullError, MiddlewareError):
    """The key's backlog is full: raised by ``.send()``, nothing published (docs/concepts.md#backlog-cap)."""


class InvalidKey(core.SingletonKeyError, MiddlewareError):
    """The run's key could not be derived from its arguments: raised by ``.send()``, nothing published."""


class KeyFailed(InvalidKey, SkipMessage):
    """A delivery whose key cannot be derived: failed to the dead-letter queue, not retried."""


class PayloadError(core.SingletonPayloadError, MiddlewareError):
    """The message cannot be encoded (an argument JSON cannot carry): raised by ``.send()``,
    nothing registered or published."""


class StoreUnavailable(core.StoreUnavailableError, MiddlewareError):
    """The store failed at enqueue: raised by ``.send()``, nothing published."""


class ConfigError(core.SingletonConfigError, MiddlewareError):
    """A malformed ``singleton`` option or store URL: raised at declaration, ``.send()`` or worker boot."""


class SchemaError(core.SchemaVersionError, MiddlewareError):
    """The store's schema is missing or incompatible: the worker refuses to start, ``.send()`` raises."""


class Dropped(MiddlewareError):
    """A send dropped by ``on_full="drop"``: nothing registered or published. Raised out of
    ``before_enqueue`` to stop the publish, it never leaves the broker's ``enqueue``
    (:func:`._internals.return_dropped_sends`), which returns the message unsent instead."""


class DeferralFailed(MiddlewareError):
    """The deferred copy could not be published: the delivery fails instead of being lost."""


def for_sender(error: core.SingletonError) -> MiddlewareError:
    """The same error as a MiddlewareError, the only kind Dramatiq lets reach ``.send()``."""
    if isinstance(error, MiddlewareError):
        return error
    kinds: tuple[tuple[type[core.SingletonError], type[MiddlewareError]], ...] = (
        (core.StoreUnavailableError, StoreUnavailable),
        (core.SchemaVersionError, SchemaError),
        (core.SingletonKeyError, InvalidKey),
        (core.SingletonPayloadError, PayloadError),
        (core.SingletonConfigError, ConfigError),
    )
    for core_kind, kind in kinds:
        if isinstance(error, core_kind):
            return kind(str(error))
    return StoreUnavailable(str(error))
