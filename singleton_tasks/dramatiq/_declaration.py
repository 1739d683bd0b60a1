"""Actors declared a singleton: the ``singleton`` actor option, and ``@singleton`` on Dramatiq actors.

Two declarations make an actor a singleton here: ``@dramatiq.actor(singleton={...})`` (the
option ``SingletonMiddleware`` adds to its broker) and ``@singleton(...)`` written above or under
``@dramatiq.actor``. Either way the actor's ``singleton`` option ends up a
:class:`~singleton_tasks.config.BoundSingleton`, bound once, in place. Which declaration counts
is decided by :func:`singleton_tasks.decorator.resolve_declaration`, as for Celery tasks
(``singleton_tasks/celery/_declaration.py``). What this needs of Dramatiq's internals is in
:mod:`._internals`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import dramatiq

from ..config import BoundSingleton, SingletonConfig
from ..decorator import (
    TaskDescription,
    adopt,
    declared_twice,
    marked_config,
    resolve_declaration,
    signature_of,
)
from ..errors import SingletonConfigError
from ._internals import check_again

if TYPE_CHECKING:
    from dramatiq.broker import Broker

#: The actor option that declares a singleton (``@dramatiq.actor(singleton={...})``).
OPTION = "singleton"


# -- adoption: actors declared a singleton -------------------------------------------------------
def adopt_declared_actor(actor: dramatiq.Actor[Any, Any]) -> None:
    """Bind the declaration of ``actor`` now (``SingletonConfigError`` names it), however it was declared.

    An actor whose function ``@singleton`` marked (written under ``@dramatiq.actor``) gets its
    ``singleton`` option here.
    """
    current = actor.options.get(OPTION)
    marked = adopt(actor.fn)
    if isinstance(current, BoundSingleton):
        config = resolve_declaration(actor.actor_name, marked=marked, adopted=current)
    else:
        config = resolve_declaration(actor.actor_name, marked=marked, option=current)
    if config is not None:
        _bind(actor, config)


def bound_for(broker: Broker, actor_name: str) -> BoundSingleton | None:
    """The bound config of the broker's actor ``actor_name``; None: not a singleton (or not declared here)."""
    actor = broker.actors.get(actor_name)
    if actor is None:
        return None  # declared elsewhere only: a first-sight registration at its gate
    return bound_of(actor)


def bound_of(actor: dramatiq.Actor[Any, Any]) -> BoundSingleton | None:
    """The actor's bound config; the option's dict / SingletonConfig form is bound once, in place."""
    value = actor.options.get(OPTION)
    if value is None or isinstance(value, BoundSingleton):
        return value
    return _bind(actor, SingletonConfig.coerce(value, task_name=actor.actor_name))


def _bind(actor: dramatiq.Actor[Any, Any], config: SingletonConfig) -> BoundSingleton:
    bound = BoundSingleton.bind(config, task_name=actor.actor_name, signature=signature_of(actor.fn))
    actor.options[OPTION] = bound
    return bound


# -- @singleton on a Dramatiq actor -------------------------------------------------------------
def describe_actor(task: object) -> TaskDescription | None:
    """Teach ``@singleton`` Dramatiq actors: the config goes into the actor's ``singleton`` option."""
    # type(), not isinstance(): isinstance would evaluate a Celery PromiseProxy (finalizing its app).
    if not issubclass(type(task), dramatiq.Actor):
        return None
    actor: dramatiq.Actor[Any, Any] = task  # type: ignore[assignment]

    def attach(bound: BoundSingleton) -> object:
        if actor.options.get(OPTION) is not None:
            raise declared_twice(actor.actor_name)
        actor.options[OPTION] = bound
        check_again(actor)  # a singleton now: its next message checks for the middleware
        return actor

    return TaskDescription(actor.actor_name, signature_of(actor.fn), attach)


def require_middleware(actor: dramatiq.Actor[Any, Any], *, has_middleware: Callable[[Broker], bool]) -> None:
    """Refuse to build a message of a singleton actor whose broker lacks the middleware.

    A singleton either way: its ``singleton`` option is set (the option, or ``@singleton``
    written above ``@dramatiq.actor``), or its function is marked by ``@singleton`` written
    under ``@dramatiq.actor`` (adopted only by a broker with the middleware). ``has_middleware``
    tells whether a broker gates singleton actors (has ``SingletonMiddleware``).
    """
    declared = actor.options.get(OPTION) is not None or marked_config(actor.fn) is not None
    if declared and not has_middleware(actor.broker):
        raise SingletonConfigError(
            f"{actor.actor_name} is a singleton actor but its broker has no SingletonMiddleware: "
            "add broker.add_middleware(SingletonMiddleware(...)) before importing actor modules; "
            "nothing was sent"
        )
