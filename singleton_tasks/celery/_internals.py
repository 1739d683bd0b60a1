"""Every use of Celery's internals, in one place.

Checked on Celery 5.7.0 (the version CI installs); ``tests/test_framework_internals.py`` fails
when an upgrade changes one of them. Each is needed because Celery offers no public way:

1. ``celery._state``: ``get_current_worker_task`` (the task the worker runs now, to tell a chain
   step it publishes from a user's call, and to store a run sent from a body with the parent
   and root ids Celery's publish gives it), ``_task_stack`` (this thread's stack of running
   tasks: hidden while a wake or a deferral is published for another sender, or ``send_task``
   would make the running task its parent), ``_get_active_apps`` and
   ``connect_on_app_finalize`` (a ``@shared_task`` exists once per app, created when each app
   is finalized).
2. ``Celery._task_from_fun`` (an app's method that makes every task from a function, for
   ``@app.task``, its promise, ``@shared_task`` and autodiscovery) and ``Celery._tasks`` (the
   registry's dict): tasks declared a singleton without ``SingletonTask`` are adopted as made.
3. ``celery.local.Proxy`` keeps what it will call in name-mangled slots (``_Proxy__local``,
   ``_Proxy__args``, ``_Proxy__kwargs``); ``PromiseProxy.__evaluated__`` / ``__then__``: ``@singleton``
   above an ``@app.task`` of an app not finalized yet attaches when the promise evaluates.
4. ``celery.app.shared_task`` returns a proxy of a closure named ``task_by_cons`` whose free
   variables ``fun`` and ``name`` are the function and the explicit name.
5. ``Task.bind`` sets ``__bound__`` on the class and then copies unset options from the app's
   config into it: what follows that mark was not the user's choice.
6. A task's class is swapped for one that includes ``SingletonTask`` (the tracer looks hooks up
   on the class), and ``task.__trace__``, the tracer it cached, is reset.
7. ``request._protected``: the tracer marks the request of the call it makes, so a body that
   calls its own task directly gets a new request.
8. Celery 5.7 points the ``DuplicateTaskNameWarning`` that ``_task_from_fun`` raises at the first
   frame outside the ``celery`` package (``celery.app.base.caller_stacklevel``): with the
   wrapper of 2. in between, at the wrapper. The wrapper records the warnings of the call and
   issues again those that point at it from the first frame outside Celery and this library,
   the user's code. ``warnings.catch_warnings`` is process-wide for the call (not thread-safe,
   and it resets which warnings were shown once): tasks are made at import and at finalize.
9. ``Celery.create_task_cls`` makes an app's default task class (``app.Task``) as a subclass of
   ``task_cls`` whose own namespace holds ``_app`` and ``abstract = True``: a task whose class
   derives from it took ``task_cls`` by default, not by ``base=``.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from celery import Celery
from celery._state import (
    _get_active_apps,
    _task_stack,
    connect_on_app_finalize,
    get_current_task,
    get_current_worker_task,
)

__all__ = [
    "active_apps",
    "adopt_tasks_as_made",
    "app_task",
    "app_tasks",
    "current_worker_task",
    "is_app_default_task_class",
    "is_tracer_call",
    "mark_tracer_call",
    "on_app_finalize",
    "option_chosen_by_class",
    "outside_running_tasks",
    "promise_parts",
    "replace_task_class",
    "shared_task_parts",
]

#: Call ``callback(app)`` when any app is finalized, also apps made later (1.).
on_app_finalize = connect_on_app_finalize


def current_worker_task() -> Any:
    """The task the worker is executing in this thread, or None (1.)."""
    return get_current_worker_task()


@contextlib.contextmanager
def outside_running_tasks() -> Iterator[None]:
    """This thread's running tasks hidden inside: a publish there has no parent task (1.)."""
    hidden = []
    try:
        while get_current_task() is not None:
            # Looked up at each call: with USE_FAST_LOCALS the stack's pop and push are bound
            # to the calling thread's list.
            hidden.append(_task_stack.pop())
        yield
    finally:
        for task in reversed(hidden):
            _task_stack.push(task)


def active_apps() -> list[Celery]:
    """Every app alive in this process (1.)."""
    return list(_get_active_apps())


def app_tasks(app: Celery) -> list[Any]:
    """The tasks registered on ``app``, without finalizing it (2.)."""
    return list(app._tasks.values())


def app_task(app: Celery, name: str) -> Any:
    """The task registered on ``app`` as ``name``, or None, without finalizing it (2.)."""
    return app._tasks.get(name)


def adopt_tasks_as_made(app: Celery, adopt: Callable[[Any], None]) -> bool:
    """Call ``adopt(task)`` on every task ``app`` makes from a function from now on (2.).

    Returns False if ``app`` does that already. A promise made before this point calls the
    original factory: the caller adopts those when the app is finalized.
    """
    current: Any = app._task_from_fun
    if getattr(current, "_singleton_adopting", False):
        return False

    def _task_from_fun(app: Celery, fun: Any, *args: Any, **options: Any) -> Any:
        with warnings.catch_warnings(record=True) as caught:
            task = current(fun, *args, **options)
        _warn_from_the_caller(caught)
        adopt(task)
        return task

    _task_from_fun._singleton_adopting = True  # type: ignore[attr-defined]
    app._task_from_fun = types.MethodType(_task_from_fun, app)
    return True


def _warn_from_the_caller(caught: list[warnings.WarningMessage]) -> None:
    """Issue again warnings recorded in the wrapper of 2.; those pointing at it from the user's frame (8.)."""
    for warning in caught:
        if warning.filename != __file__:  # Celery pointed it elsewhere: shown as it was
            warnings.showwarning(
                warning.message, warning.category, warning.filename, warning.lineno, warning.file
            )
            continue
        frame = _first_frame_outside(("celery", "singleton_tasks"))
        module_globals = frame.f_globals
        # As warnings.warn does with the frame its stacklevel names: that module's filters and registry.
        warnings.warn_explicit(
            warning.message,
            warning.category,
            frame.f_code.co_filename,
            frame.f_lineno,
            module=module_globals.get("__name__"),
            registry=module_globals.setdefault("__warningregistry__", {}),
            module_globals=module_globals,
        )


def _first_frame_outside(packages: tuple[str, ...]) -> types.FrameType:
    """The innermost frame of this thread's stack whose module is in none of ``packages``."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").partition(".")[0] in packages:
        frame = frame.f_back
    return frame


def _proxy_slots(proxy: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    return (
        object.__getattribute__(proxy, "_Proxy__local"),
        object.__getattribute__(proxy, "_Proxy__args"),
        object.__getattribute__(proxy, "_Proxy__kwargs"),
    )


def promise_parts(proxy: Any) -> tuple[Celery, Any, dict[str, Any]] | None:
    """``(app, fun, options)`` of an ``@app.task`` promise, or None if it is not one (3.)."""
    try:
        local, args, options = _proxy_slots(proxy)
    except AttributeError:
        return None
    app = getattr(local, "__self__", None)
    if not isinstance(app, Celery) or getattr(local, "__name__", "") != "_task_from_fun" or not args:
        return None
    return app, args[0], options


def shared_task_parts(proxy: Any) -> tuple[Any, str | None] | None:
    """``(fun, explicit name)`` of a ``@shared_task`` proxy, or None if it is not one (4.)."""
    try:
        local = object.__getattribute__(proxy, "_Proxy__local")
    except AttributeError:
        return None
    code = getattr(local, "__code__", None)
    cells = getattr(local, "__closure__", None) or ()
    free = (
        dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=False))
        if code is not None
        else {}
    )
    fun = free.get("fun")
    if getattr(local, "__name__", "") != "task_by_cons" or fun is None:
        return None
    return fun, free.get("name")


def option_chosen_by_class(cls: type, option: str) -> Any:
    """The value a task class declares for ``option``; None if only the app's config set it (5.).

    ``@app.task(acks_late=False)`` puts the option in the class namespace before ``__bound__``.
    """
    for klass in cls.__mro__:
        names = list(klass.__dict__)
        if option not in names:
            continue
        if "__bound__" in names and names.index(option) > names.index("__bound__"):
            continue  # copied from the config by Task.bind
        return klass.__dict__[option]
    return None


def replace_task_class(task: Any, cls: type) -> None:
    """Give the task object ``cls`` as its class; its tracer is rebuilt with the new hooks (6.)."""
    task.__class__ = cls
    if task.__dict__.get("__trace__") is not None:
        task.__trace__ = None


def is_tracer_call(request: Any) -> bool:
    """Whether this call of a task is the tracer's own (a delivery or ``.apply()``), not a user's (7.)."""
    return request is not None and not request.called_directly and not request._protected


def mark_tracer_call(request: Any) -> None:
    """Mark the tracer's request as Celery's worker does (7.)."""
    request._protected = 1


def is_app_default_task_class(klass: type) -> bool:
    """Whether ``klass`` is an app's default task class, ``app.Task`` (9.)."""
    return klass.__dict__.get("abstract") is True and "_app" in klass.__dict__
