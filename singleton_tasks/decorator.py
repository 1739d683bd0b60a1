"""``@singleton(...)``: declare a task a singleton, whatever framework made it.

See docs/concepts.md#declaring-a-singleton.

The decorator knows tasks only through a :class:`TaskDescription`; each adapter registers a
describer that recognises its framework's task objects. The adapters make themselves known by
the entry-point group :data:`ADAPTERS`, so this module imports none of them by name.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .config import BoundSingleton, KeySpec, OnFull, SingletonConfig
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


#: The entry-point group of the adapters: each entry is named after its framework's module and
#: points at the adapter module, which calls :func:`register_describer` when imported.
ADAPTERS = "singleton_tasks.adapters"


@functools.cache
def _adapters() -> tuple[importlib.metadata.EntryPoint, ...]:
    return tuple(importlib.metadata.entry_points(group=ADAPTERS))


def _load_adapters() -> None:
    """Import the adapter of every framework already imported (a task of it may be described)."""
    for adapter in _adapters():
        if adapter.name in sys.modules and adapter.value not in sys.modules:
            adapter.load()


def describe_function(task: object) -> TaskDescription | None:
    """A plain function: wrapped so that a framework decorator applied next can adopt it.

    ``@singleton`` written under ``@dramatiq.actor`` / ``@app.task`` / ``@shared_task`` sees the
    function first; the adapter finds the config (``__singleton__``) when the task is made and
    marks it adopted. A call of a function nobody adopted warns: it runs without any gate.
    """
    if not inspect.isfunction(task):
        return None
    function: Any = task
    name = f"{function.__module__}.{function.__qualname__}"
    if getattr(function, ATTRIBUTE, None) is not None:
        raise SingletonConfigError(f"{name} is declared @singleton twice; declare it once")

    def attach(bound: BoundSingleton) -> object:
        return _declared_function(function, bound)

    return TaskDescription(name, inspect.signature(function), attach)


def _declared_function(function: Callable[..., Any], bound: BoundSingleton) -> Callable[..., Any]:
    """``function`` as it is, plus its config and a warning when it is called without being adopted."""
    state = _Adoption(bound)
    wrapper: Any
    if inspect.iscoroutinefunction(function):

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not state.adopted:
                state.warn()
            return await function(*args, **kwargs)

    else:

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not state.adopted:
                state.warn()
            return function(*args, **kwargs)

    functools.update_wrapper(wrapper, function)
    # inspect.getfullargspec (Celery's argument check) ignores __wrapped__ but honours __signature__.
    wrapper.__signature__ = inspect.signature(function)
    setattr(wrapper, ATTRIBUTE, bound)
    wrapper.__singleton_adoption__ = state
    return wrapper  # type: ignore[no-any-return]


class _Adoption:
    """Whether an adapter made the function's task a singleton; warns once if it is run otherwise."""

    def __init__(self, bound: BoundSingleton) -> None:
        self.bound = bound
        self.adopted = False
        self._warned = False

    def warn(self) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"{self.bound.task_name} is declared @singleton but no task was made a singleton from it, "
            "so this call runs without the gate. Put @singleton above or below @dramatiq.actor "
            "(with SingletonMiddleware on the broker before the actor is declared), @app.task or "
            "@shared_task (the app finalized, or singleton_tasks.celery.install(app) called first).",
            RuntimeWarning,
            stacklevel=3,
        )


def _adoption_of(function: object) -> _Adoption | None:
    """What ``@singleton`` left on ``function`` (a task's body); None if it has no mark."""
    function = getattr(function, "__func__", function)  # a bound method (Celery's bind=True)
    state = getattr(function, "__singleton_adoption__", None)
    return state if isinstance(state, _Adoption) else None


def marked_config(function: object) -> BoundSingleton | None:
    """The config ``@singleton`` put on ``function`` (a task's body), adopted or not; None if it has none."""
    state = _adoption_of(function)
    return None if state is None else state.bound


def adopt(function: object) -> BoundSingleton | None:
    """The config ``@singleton`` put on ``function`` (a task's body), now adopted; None if it has none."""
    state = _adoption_of(function)
    if state is None:
        return None
    state.adopted = True
    return state.bound


def resolve_declaration(
    task_name: str,
    *,
    marked: BoundSingleton | None = None,
    option: object = None,
    adopted: BoundSingleton | None = None,
) -> SingletonConfig | None:
    """The config a task was declared with, to bind now; None when there is nothing (more) to bind.

    A task is declared a singleton once: by ``@singleton`` written under the framework's decorator
    (``marked``, what :func:`adopt` found on its function) or by the framework's ``singleton``
    option (``option``, not bound yet). ``adopted`` is the binding the task has already; finding
    it again is a no-op, finding another declaration is an error.
    """
    if adopted is not None:
        if marked is not None and marked.config is not adopted.config:
            raise declared_twice(task_name)
        return None
    if marked is not None and option is not None:
        raise declared_twice(task_name)
    if marked is not None:
        return marked.config
    if option is not None:
        return SingletonConfig.coerce(option, task_name=task_name)
    return None


def declared_twice(task_name: str) -> SingletonConfigError:
    """The error of a task declared a singleton both by ``@singleton`` and by its option."""
    return SingletonConfigError(
        f"{task_name} is declared a singleton twice (@singleton and singleton=...); declare it once"
    )


def signature_of(function: object, *, bound: bool = False) -> inspect.Signature | None:
    """How callers pass arguments to ``function`` (without its first parameter if ``bound``: the
    task or ``self`` a framework passes); None when Python cannot tell."""
    try:
        signature = inspect.signature(function)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if bound:
        return signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


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
    on_full: OnFull = "raise",
) -> Callable[[T], T]:
    """Make the decorated task a durable FIFO mutex per key; validated at declaration.

    The options are checked when the decorator is applied, so an error names the task. Write it
    above or below ``@dramatiq.actor`` / ``@app.task`` / ``@shared_task``: below, it marks the
    function and the adapter makes the task a singleton when the framework creates it (Dramatiq:
    ``SingletonMiddleware`` must be on the broker by then; Celery: when the app is finalized, or
    at once after ``singleton_tasks.celery.install(app)``). On a function that never becomes a
    task it changes nothing but a warning when the function is called.

    ``on_full`` is what a send over ``limit + max_queue_depth`` does: ``"raise"``
    ``SingletonQueueFullError``, ``"drop"`` the run without publishing or raising, or
    ``"replace"`` the key's newest waiter, which then never runs (docs/concepts.md#backlog-cap).
    """
    options = {
        "key": key,
        "limit": limit,
        "max_queue_depth": max_queue_depth,
        "scope": scope,
        "lease": lease,
        "orphan_timeout": orphan_timeout,
        "on_full": on_full,
    }

    def decorate(task: T) -> T:
        description = describe(task)
        config = SingletonConfig.coerce(options, task_name=description.name)
        bound = BoundSingleton.bind(config, task_name=description.name, signature=description.signature)
        result: Any = description.attach(bound)
        return result  # type: ignore[no-any-return]

    return decorate
