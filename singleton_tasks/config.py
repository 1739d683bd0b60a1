"""Configuration: defaults, store Timings, a singleton's declaration, its validation and key derivation.

See docs/concepts.md#declaring-a-singleton.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .errors import SingletonConfigError, SingletonError, SingletonKeyError

#: The longest key a task may derive (characters).
MAX_KEY_LENGTH = 512

# Store-wide defaults (seconds), the rules' Timings.
#: An unconfirmed registration is dropped after this many seconds: its producer never published
#: its message (it died between registering and publishing, or the publish failed unreported).
DEFAULT_REGISTRATION_GRACE = 10.0
#: How long a store remembers a settled run and an idle key (seconds): one day. A waiter due for
#: a re-issue that no copy reached for this long is abandoned.
DEFAULT_RETENTION = 86_400.0


@dataclass(frozen=True)
class Timings:
    """Store-wide durations of the rules, in seconds."""

    #: An unconfirmed registration is dropped after this.
    registration_grace: float = DEFAULT_REGISTRATION_GRACE
    #: Settled markers and idle keys are forgotten after this; a waiter due for a re-issue that
    #: no copy reached for this long is abandoned.
    retention: float = DEFAULT_RETENTION


# Worker-side defaults (seconds), read by both adapters and the shared runtime.
#: How long a holder's slot is safe without a heartbeat; heartbeats go at least 3 times per lease.
DEFAULT_LEASE = 60.0
#: How long after its lease lapsed an unclaimed holder is evicted; a waiter that owns a slot and
#: is unseen this long (plus its longest re-check delay) is issued again.
DEFAULT_ORPHAN_TIMEOUT = 600.0
#: Delay until a denied delivery is re-checked at the head of the line (the fallback of a wake).
DEFAULT_RETRY_DELAY = 1.0
#: ± jitter of every re-check delay.
DEFAULT_RETRY_JITTER = 0.25
#: Waiters far back in the line are re-checked at most this rarely (a wake comes first).
DEFAULT_MAX_RETRY_DELAY = 10.0
#: The shortest lease a task or worker may use: heartbeats every lease / 3 must survive a store
#: call that takes a second and a stalled thread.
MIN_LEASE = 3.0

KeySpec = str | Callable[..., object]

#: What a send does when its key's line is full (docs/concepts.md#backlog-cap): ``"raise"``
#: SingletonQueueFullError, ``"drop"`` the run quietly (nothing published or registered), or
#: ``"replace"`` the newest waiter (the send takes its place in line; the replaced run never runs).
OnFull = Literal["raise", "drop", "replace"]
ON_FULL_CHOICES: tuple[OnFull, ...] = get_args(OnFull)


@dataclass(frozen=True)
class SingletonConfig:
    """How a task's runs are keyed and how many of a key may be in flight at once."""

    key: KeySpec
    limit: int = 1
    max_queue_depth: int | None = None
    scope: str | None = None
    lease: float | None = None
    orphan_timeout: float | None = field(default=None)
    # ``orphan_timeout=None`` means "the worker's default"; DISABLED turns eviction off.
    on_full: OnFull = "raise"

    def __post_init__(self) -> None:
        if not (isinstance(self.key, str) or callable(self.key)):
            raise SingletonConfigError(
                f"singleton key must be a str template or a callable, got {self.key!r}"
            )
        if isinstance(self.key, str) and not self.key:
            raise SingletonConfigError("singleton key template must not be empty")
        if isinstance(self.key, str):
            _template_fields(self.key)  # raises on a malformed template
        if not _is_int(self.limit) or self.limit < 1:
            raise SingletonConfigError(f"singleton limit must be an int >= 1, got {self.limit!r}")
        if self.max_queue_depth is not None and (
            not _is_int(self.max_queue_depth) or self.max_queue_depth < 0
        ):
            raise SingletonConfigError(
                f"singleton max_queue_depth must be None or an int >= 0, got {self.max_queue_depth!r}"
            )
        if not isinstance(self.on_full, str) or self.on_full not in ON_FULL_CHOICES:
            raise SingletonConfigError(
                f"singleton on_full must be one of {', '.join(map(repr, ON_FULL_CHOICES))}, "
                f"got {self.on_full!r}"
            )
        if self.on_full != "raise" and self.max_queue_depth is None:
            raise SingletonConfigError(
                f"singleton on_full={self.on_full!r} needs a max_queue_depth (0 or more): "
                "without one the key's line is never full"
            )
        if self.on_full == "replace" and self.max_queue_depth == 0:
            raise SingletonConfigError(
                "singleton on_full='replace' with max_queue_depth=0: there is never a waiter to "
                "replace; use on_full='drop'"
            )
        if self.scope is not None and (not isinstance(self.scope, str) or not self.scope):
            raise SingletonConfigError(f"singleton scope must be a non-empty str, got {self.scope!r}")
        if self.scope is not None:
            check_storable(self.scope, "singleton scope")
        for name in ("lease", "orphan_timeout"):
            value = getattr(self, name)
            if (
                value is not None
                and value is not DISABLED
                and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0)
            ):
                raise SingletonConfigError(f"singleton {name} must be a positive number, got {value!r}")
        if self.lease is not None:
            check_lease(self.lease, "singleton lease")

    @classmethod
    def coerce(cls, value: object, *, task_name: str) -> SingletonConfig:
        """Accept a ``SingletonConfig`` or the dict form of a framework option."""
        if isinstance(value, SingletonConfig):
            return value
        if isinstance(value, Mapping):
            unknown = set(value) - _FIELDS
            if unknown:
                raise SingletonConfigError(
                    f"{task_name}: unknown singleton option(s) {sorted(unknown)}; known: {sorted(_FIELDS)}"
                )
            if "key" not in value:
                raise SingletonConfigError(f"{task_name}: singleton option needs a 'key'")
            try:
                return cls(**dict(value))
            except SingletonConfigError as error:
                raise SingletonConfigError(f"{task_name}: {error}") from None
        raise SingletonConfigError(
            f"{task_name}: singleton option must be a dict or SingletonConfig, got {value!r}"
        )


class _Disabled(float):
    """Marker for ``orphan_timeout=DISABLED``: never evict (docs/concepts.md#eviction)."""

    def __repr__(self) -> str:
        return "DISABLED"


DISABLED: float = _Disabled("inf")

_FIELDS = {"key", "limit", "max_queue_depth", "scope", "lease", "orphan_timeout", "on_full"}


def check_lease(lease: object, what: str) -> float:
    """``lease`` as seconds, or SingletonConfigError if it is not a number >= :data:`MIN_LEASE`."""
    if not isinstance(lease, (int, float)) or isinstance(lease, bool) or not lease >= MIN_LEASE:
        raise SingletonConfigError(
            f"{what} must be a number of seconds >= {MIN_LEASE:g} (heartbeats go every lease / 3 "
            f"and must survive a slow store call), got {lease!r}"
        )
    return float(lease)


def unencodable_at(text: str) -> int | None:
    """Where ``text`` cannot be encoded as UTF-8 (a lone surrogate); None: it can."""
    if text.isascii():  # O(1) on CPython: the common case costs nothing more
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


#: What a text that no store can hold is, and what to do instead.
_SURROGATE = (
    "a lone surrogate, as os.listdir() and sys.argv give for bytes that are not UTF-8; "
    "the stores keep text as UTF-8: key on os.fsencode(name).hex() or "
    "os.fsencode(name).decode('utf-8', 'replace')"
)


def check_storable(text: str, what: str, error: type[SingletonError] = SingletonConfigError) -> str:
    """``text``, or ``error`` naming ``what`` and the text if UTF-8 cannot encode it."""
    position = unencodable_at(text)
    if position is not None:
        raise error(f"{what} {text!r} cannot be stored: position {position} is {_SURROGATE}")
    return text


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _template_fields(template: str) -> list[str]:
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as error:
        raise SingletonConfigError(f"malformed key template {template!r}: {error}") from None
    names = []
    for _literal, field_name, _spec, _conversion in parsed:
        if field_name is None:
            continue
        root = field_name.split(".", 1)[0].split("[", 1)[0]
        if not root or root.isdigit():
            raise SingletonConfigError(
                f"key template {template!r} must name arguments, not positions ({{{field_name}}})"
            )
        names.append(root)
    return names


@dataclass(frozen=True)
class BoundSingleton:
    """A config bound to one task: resolved scope and a key function checked against its signature."""

    task_name: str
    config: SingletonConfig
    scope: str
    signature: inspect.Signature | None
    # (name, default) of each parameter if all are plain positional-or-keyword ones, else None:
    # positional arguments then bind by zipping (Signature.bind costs more than the rest of
    # the key derivation, on every delivery).
    _plain: tuple[tuple[str, Any], ...] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        params = list(self.signature.parameters.values()) if self.signature is not None else []
        plain = self.signature is not None and all(
            p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params
        )
        object.__setattr__(self, "_plain", tuple((p.name, p.default) for p in params) if plain else None)

    @classmethod
    def bind(
        cls, config: SingletonConfig, *, task_name: str, signature: inspect.Signature | None
    ) -> BoundSingleton:
        """Check ``config`` against the task's signature; raise SingletonConfigError at declaration."""
        if isinstance(config.key, str) and signature is not None:
            params = signature.parameters
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            for name in _template_fields(config.key):
                if name not in params and not takes_any:
                    raise SingletonConfigError(
                        f"{task_name}: key template {config.key!r} names {name!r}, "
                        f"which is not an argument of the task (arguments: {list(params)})"
                    )
        if config.scope is None:
            check_storable(task_name, f"{task_name}: the task's name, its singleton scope,")
        return cls(task_name, config, config.scope or task_name, signature)

    def derive_key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The run's key from the task's own arguments; SingletonKeyError if it is not a usable str."""
        spec = self.config.key
        try:
            if isinstance(spec, str):
                arguments = self._bound_arguments(args, kwargs)
                result: object = spec.format(**arguments)
            else:
                result = spec(*args, **kwargs)
        except SingletonKeyError:
            raise
        except Exception as error:
            raise SingletonKeyError(
                f"{self.task_name}: deriving the singleton key failed: {type(error).__name__}: {error}"
            ) from error
        if not isinstance(result, str):
            raise SingletonKeyError(
                f"{self.task_name}: the singleton key must be a str, "
                f"got {type(result).__name__} {result!r:.80}"
            )
        if not result:
            raise SingletonKeyError(f"{self.task_name}: the singleton key is empty ('')")
        if len(result) > MAX_KEY_LENGTH:
            raise SingletonKeyError(
                f"{self.task_name}: the singleton key has {len(result)} characters, "
                f"more than {MAX_KEY_LENGTH}: {result[:40]!r}..."
            )
        return check_storable(result, f"{self.task_name}: the singleton key", SingletonKeyError)

    def _bound_arguments(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if self.signature is None:
            return dict(kwargs)
        plain = self._plain
        if plain is not None and not kwargs and len(args) <= len(plain):
            arguments = {name: value for (name, _), value in zip(plain, args, strict=False)}
            for name, default in plain[len(args) :]:
                if default is inspect.Parameter.empty:
                    break  # a missing argument: bind below raises Signature's own TypeError
                arguments[name] = default
            else:
                return arguments
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, param in self.signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        return arguments
