"""Tasks declared a singleton without ``base=SingletonTask``, and ``@singleton`` on Celery tasks.

Two declarations make a plain task a singleton here: ``@app.task(singleton={...})`` without
``base=SingletonTask`` (Celery keeps any extra option as a class attribute) and
``@singleton(...)`` written above or under ``@app.task`` / ``@shared_task``. Either way the task
object gets a class that includes :class:`SingletonTask`. What this needs of Celery's internals
is in :mod:`._internals`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from celery import Celery, Task
from celery.local import PromiseProxy, Proxy

from ..config import BoundSingleton
from ..decorator import TaskDescription, adopt, register_describer, resolve_declaration, signature_of
from ..errors import SingletonConfigError
from ._internals import (
    active_apps,
    adopt_tasks_as_made,
    app_task,
    app_tasks,
    on_app_finalize,
    promise_parts,
    replace_task_class,
    shared_task_parts,
)
from ._task import SingletonTask, takeover_defaults, warn_on_unsafe_acks


# -- adoption: tasks declared without SingletonTask ---------------------------------------------
def adopt_declared_tasks(app: Celery) -> None:
    """Make every task of ``app`` declared a singleton a singleton, whenever it is created.

    Tasks created from now on are adopted as they are created; tasks that exist already or that
    a promise creates at finalization, now and after finalization.
    """
    if adopt_tasks_as_made(app, _adopt):
        app.on_after_finalize.connect(_adopt_all, weak=False, dispatch_uid="singleton_tasks.adopt")
    if app.finalized:
        _adopt_all(app)


def _adopt_all(sender: Celery, **_: Any) -> None:
    for task in app_tasks(sender):
        _adopt(task)


def _adopt(task: Any) -> None:
    """Upgrade ``task`` to a singleton if it was declared one without SingletonTask."""
    cls = type(task)
    run = getattr(task, "run", None)
    marked = adopt(run) if run is not None else None
    if issubclass(cls, SingletonTask):
        config = resolve_declaration(task.name, marked=marked, adopted=cls._singleton_bound)
    else:
        config = resolve_declaration(task.name, marked=marked, option=getattr(cls, "singleton", None))
    if config is not None:
        _upgrade(task, BoundSingleton.bind(config, task_name=task.name, signature=signature_of(task.run)))


# Every app, also one that install() never saw, adopts its declared tasks once it is finalized
# (a worker always finalizes its app). Celery calls these callbacks in finalize(), before it
# evaluates the pending @app.task promises.
on_app_finalize(adopt_declared_tasks)


# -- the upgrade -------------------------------------------------------------------------------
def _upgrade(task: Any, bound: BoundSingleton, explicit: Mapping[str, Any] | None = None) -> None:
    """Give ``task`` a class that includes SingletonTask (the tracer looks hooks up on the class)."""
    cls = type(task)
    if issubclass(cls, SingletonTask) and cls._singleton_bound is not None:
        if cls.__dict__.get("_singleton_bound") is bound:
            return
        raise SingletonConfigError(f"{task.name} is already a singleton task; declare it once")
    namespace: dict[str, Any] = {
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        "_singleton_bound": bound,
        **takeover_defaults(cls, explicit),
    }
    warn_on_unsafe_acks(task.name, namespace)
    bases = (cls,) if issubclass(cls, SingletonTask) else (SingletonTask, cls)
    replace_task_class(task, type(cls.__name__, bases, namespace))


# -- @singleton on a Celery task ------------------------------------------------------------------
def _cannot(task: object, why: str) -> SingletonConfigError:
    return SingletonConfigError(
        f"@singleton cannot handle {type(task).__name__} {why}; put @singleton directly on @app.task or "
        "@shared_task, or use @app.task(base=SingletonTask, singleton={...})"
    )


def _describe_promise(proxy: Any) -> TaskDescription:
    """``@app.task`` on an app not finalized yet: attach when the proxy evaluates."""
    if proxy.__evaluated__():
        return _describe_task(proxy._get_current_object())
    parts = promise_parts(proxy)
    if parts is None:
        raise _cannot(proxy, "(a promise that is not of a Celery task)")
    app, fun, options = parts
    name = options.get("name") or app.gen_task_name(fun.__name__, fun.__module__)

    def attach(bound: BoundSingleton) -> object:
        proxy.__then__(lambda: _upgrade(proxy._get_current_object(), bound, options))
        return proxy

    return TaskDescription(name, signature_of(fun, bound=bool(options.get("bind"))), attach)


def _describe_shared(proxy: Any) -> TaskDescription:
    """``@shared_task``: every app gets its own copy, so upgrade each as it is finalized."""
    parts = shared_task_parts(proxy)
    if parts is None:
        raise _cannot(proxy, "(a proxy, not a shared task)")
    fun, explicit_name = parts

    def task_name(app: Celery) -> str:
        return explicit_name or str(app.gen_task_name(fun.__name__, fun.__module__))

    def attach(bound: BoundSingleton) -> object:
        def upgrade_in(app: Celery) -> None:
            task = app_task(app, task_name(app))
            if task is not None:
                _upgrade(task, bound)

        def on_finalize(app: Celery) -> None:
            # Finalizers run in no fixed order: upgrade after all of them created their tasks.
            app.on_after_finalize.connect(lambda sender=None, **_: upgrade_in(app), weak=False)

        on_app_finalize(on_finalize)
        for app in active_apps():
            if app.finalized:
                upgrade_in(app)
        return proxy

    name = explicit_name or f"{fun.__module__}.{fun.__name__}"
    return TaskDescription(name, signature_of(fun), attach)


def _describe_task(task: Any) -> TaskDescription:
    def attach(bound: BoundSingleton) -> object:
        _upgrade(task, bound)
        return task

    return TaskDescription(task.name, signature_of(task.run), attach)


@register_describer
def describe_celery_task(task: object) -> TaskDescription | None:
    """Teach ``@singleton`` Celery tasks, ``@app.task`` promises and ``@shared_task`` proxies."""
    kind = type(task)  # never isinstance() first: a Proxy forwards __class__ and would evaluate
    if issubclass(kind, PromiseProxy):
        return _describe_promise(task)
    if issubclass(kind, Proxy):
        return _describe_shared(task)
    if isinstance(task, type) and issubclass(task, Task):
        raise SingletonConfigError(
            f"@singleton cannot handle the task class {task.__name__}: give it a `singleton = {{...}}` "
            "attribute and SingletonTask as a base"
        )
    if isinstance(task, Task):
        return _describe_task(task)
    return None
