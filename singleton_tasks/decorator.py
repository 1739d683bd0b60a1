"""``@singleton(...)``: declare a task a singleton, whatever framework made it (SPEC §2).

The decorator knows tasks only through a :class:`TaskDescription`; each adapter registers a
describer that recognises its framework's task objects.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .config import BoundSingleton, KeySpec, SingletonConfig
from .errors import SingletonConfigError

T = TypeVar("T")

ATTRIBUTE = "__singleton__"


@dataclass(frozen=True)
class TaskDescription:
    """What the decorator needs of a task: its name, its signature and how to attach the config."""

    name: str
    signature: inspect.Signature | None
    attach: Callable[[BoundSingleton], object]


Describer = Callable[[object], "TaskDescription | None"]
_describers: list[Describer] = []


def register_describer(describer: Describer) -> Describer:
    """Teach ``@singleton`` a framework's task objects (adapters call this on import)."""
    if describer not in _describers:
        _describers.append(describer)
    return describer


def _load_adapters() -> None:
    import sys

    if "dramatiq" in sys.modules:
        import singleton_tasks.dramatiq
    if "celery" in sys.modules:
        import singleton_tasks.celery  # noqa: F401


def describe_function(task: object) -> TaskDescription | None:
    """A plain function: the config is stored on it as ``__singleton__``."""
    if not inspect.isfunction(task):
        return None
    function: Any = task
    name = f"{function.__module__}.{function.__qualname__}"

    def attach(bound: BoundSingleton) -> object:
        setattr(function, ATTRIBUTE, bound)
        return function

    return TaskDescription(name, inspect.signature(function), attach)


def describe(task: object) -> TaskDescription:
    _load_adapters()
    for describer in [*_describers, describe_function]:
        description = describer(task)
        if description is not None:
            return description
    raise SingletonConfigError(
        f"@singleton cannot handle {task!r}: put it on a Dramatiq actor, a Celery task or a function"
    )


def singleton(
    key: KeySpec,
    *,
    limit: int = 1,
    max_queue_depth: int | None = None,
    scope: str | None = None,
    lease: float | None = None,
    orphan_timeout: float | None = None,
) -> Callable[[T], T]:
    """Make the decorated task a durable FIFO mutex per key; validated at declaration.

    The options are checked when the decorator is applied, so an error names the task.
    """
    options = {
        "key": key,
        "limit": limit,
        "max_queue_depth": max_queue_depth,
        "scope": scope,
        "lease": lease,
        "orphan_timeout": orphan_timeout,
    }

    def decorate(task: T) -> T:
        description = describe(task)
        config = SingletonConfig.coerce(options, task_name=description.name)
        bound = BoundSingleton.bind(config, task_name=description.name, signature=description.signature)
        result: Any = description.attach(bound)
        return result  # type: ignore[no-any-return]

    return decorate
