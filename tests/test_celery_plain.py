"""A ``SingletonTask`` without a ``singleton`` option is a plain Celery task (issue 28).

Modelled on Celery's own tests of the same behaviour (``t/unit/worker/test_request.py``: acks
early or late; ``t/unit/app/test_app.py``: the duplicate task name warning), run with
``SingletonTask`` as the app's default task class and ``install()`` on the app. The lost-worker
half (``WorkerLostError`` by the app's settings) needs a prefork pool: it is in
``tests/workers/test_celery_workers.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery, Task
from celery.exceptions import DuplicateTaskNameWarning
from celery.local import Proxy
from celery.worker import state as worker_state
from test_celery import make_app, unique, worker

from singleton_tasks import singleton
from singleton_tasks.celery import SingletonTask, install

#: The app settings the acks options come from, as Celery's tests set them.
SETTINGS = {
    "celery defaults": {},
    "acks late": {"task_acks_late": True},
    "acks late, reject on worker lost": {"task_acks_late": True, "task_reject_on_worker_lost": True},
}


def library_app(settings: dict[str, Any], store: str = "memory://plain") -> Celery:
    """An app whose every task is a ``SingletonTask``, with ``install()``: the library in play."""
    app = make_app()
    app.task_cls = SingletonTask
    app.conf.update(settings)
    install(app, store)
    return app


def body() -> None:
    """A body for tasks whose body does not matter."""


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS)
def test_a_task_without_a_singleton_option_takes_every_option_from_the_app_as_a_plain_task(
    settings: dict[str, Any],
) -> None:
    plain = Celery(unique("plain"), set_as_current=False)
    plain.conf.update(settings)
    library = library_app(settings)
    reference = plain.task(name=unique(), shared=False)(body)
    by_default_class = library.task(name=unique(), shared=False)(body)
    by_base = library.task(base=SingletonTask, name=unique(), shared=False)(body)
    for task in (by_default_class, by_base):
        assert isinstance(task, SingletonTask)
        for option, _setting in Task.from_config:
            assert getattr(task, option) == getattr(reference, option), option


def _declared_by_base(app: Celery) -> Any:
    return app.task(base=SingletonTask, singleton={"key": "k"}, name=unique(), shared=False)(body)


def _declared_on_the_default_class(app: Celery) -> Any:
    return app.task(singleton={"key": "k"}, name=unique(), shared=False)(body)


def _declared_on_a_plain_task(app: Celery) -> Any:
    app.task_cls = Task  # before app.Task is made: adopted at install, not a SingletonTask subclass
    return app.task(singleton={"key": "k"}, name=unique(), shared=False)(body)


def _decorated_promise(app: Celery) -> Any:
    return singleton(key="k")(app.task(name=unique(), shared=False)(body))


def _decorated_finalized_task(app: Celery) -> Any:
    app.finalize()
    return singleton(key="k")(app.task(name=unique(), shared=False)(body))


def _declared_on_a_class(app: Celery) -> Any:
    class Declared(SingletonTask):
        name = unique()
        singleton = {"key": "k"}

        def run(self) -> None: ...

    return app.register_task(Declared())


DECLARATIONS = {
    "base=SingletonTask": _declared_by_base,
    "singleton= on the default SingletonTask": _declared_on_the_default_class,
    "singleton= on a plain Task (adopted)": _declared_on_a_plain_task,
    "@singleton on a promise": _decorated_promise,
    "@singleton on a finalized task": _decorated_finalized_task,
    "a class with singleton": _declared_on_a_class,
}


@pytest.mark.parametrize("declare", DECLARATIONS.values(), ids=DECLARATIONS)
@pytest.mark.parametrize("settings", [{}, {"task_acks_late": False, "task_reject_on_worker_lost": False}])
def test_only_a_task_that_declares_a_singleton_gets_the_takeover_defaults(
    declare: Any, settings: dict[str, Any]
) -> None:
    """docs/celery.md#acknowledgement-and-crashes: whatever the app's settings."""
    task = declare(library_app(settings))
    if issubclass(type(task), Proxy):  # never isinstance(): a Proxy forwards __class__
        task = task._get_current_object()
    assert isinstance(task, SingletonTask) and type(task)._singleton_bound is not None
    assert task.acks_late is True and task.reject_on_worker_lost is True


@pytest.mark.slow  # an in-process Celery worker takes about a second to stop
@pytest.mark.parametrize("acks_late", [False, True], ids=["acks early", "acks late"])
def test_a_task_without_a_singleton_option_acks_when_the_app_says(acks_late: bool) -> None:
    """Celery's ``test_on_accepted_acks_early`` / ``_late``, seen from the body on a real worker."""
    app = library_app({"task_acks_late": acks_late})
    acked_while_running: list[bool] = []

    @app.task(bind=True, name=unique(), shared=False)
    def report(self: Any) -> None:
        request = next(r for r in worker_state.active_requests if r.id == self.request.id)
        acked_while_running.append(request.acknowledged)

    with worker(app):
        report.delay().get(interval=0.01, timeout=10)
    assert acked_while_running == [not acks_late]


def _first() -> None: ...


def _second() -> None: ...


def test_celerys_duplicate_task_name_warning_points_at_the_users_code() -> None:
    """Celery 5.7's ``DuplicateTaskNameWarning`` names the file that registered the duplicate."""
    app = library_app({})
    app.finalize()
    name = unique()
    app.task(name=name, shared=False)(_first)
    with pytest.warns(DuplicateTaskNameWarning) as warned:
        app.task(name=name, shared=False)(_second)
    assert [w.filename for w in warned] == [__file__]

    promised = library_app({})  # not finalized: the duplicate is found when the promises evaluate
    promised_name = unique()
    promised.task(name=promised_name, shared=False)(_first)
    promised.task(name=promised_name, shared=False)(_second)
    with pytest.warns(DuplicateTaskNameWarning) as warned:
        promised.finalize()
    assert [w.filename for w in warned] == [__file__]


def test_only_an_explicit_base_without_a_singleton_option_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With SingletonTask as the app's default class every plain task (Celery's own built-in
    ``celery.chain`` and the like too) is made from it: that says nothing about the user's intent.
    ``base=SingletonTask`` with no ``singleton`` option does: it is the one that is logged."""
    caplog.set_level("WARNING", logger="singleton_tasks")
    app = library_app(SETTINGS["celery defaults"])
    plain_name, explicit_name = unique("plain"), unique("explicit")
    app.task(name=plain_name, shared=False)(body)
    app.task(base=SingletonTask, name=explicit_name, shared=False)(body)
    app.finalize()
    warned = [r.getMessage() for r in caplog.records if "no singleton={...} option" in r.getMessage()]
    assert warned == [
        f"{explicit_name} has base=SingletonTask but no singleton={{...}} option: it runs as a plain task"
    ]
