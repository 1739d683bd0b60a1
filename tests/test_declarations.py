"""Every way of declaring a singleton makes one, on both frameworks (issue 16).

``@singleton`` above or below ``@dramatiq.actor`` / ``@app.task`` / ``@shared_task``, and
``@app.task(singleton={...})`` without ``base=SingletonTask`` after ``install(app)``: the runs
are registered (``singleton-tasks inspect --json`` shows them) and a real in-process worker
serializes them. A declaration that cannot be honoured is refused, naming the task.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
from celery import Celery, shared_task
from click.testing import CliRunner
from dramatiq.brokers.stub import StubBroker
from test_celery import FAST, make_app, unique, worker

import singleton_tasks.decorator
from singleton_tasks import SingletonConfigError, current_admission, singleton
from singleton_tasks.celery import SingletonTask, install
from singleton_tasks.cli import cli
from singleton_tasks.dramatiq import SingletonMiddleware
from singleton_tasks.dramatiq import _internals as dramatiq_internals

WAIT = 15.0


class Bodies:
    """What the bodies did; the first run of a test holds until ``release`` is set."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[tuple[str, str, int]] = []  # (start | end, label, token)
        self.release = threading.Event()

    def body(self, account: str, label: str) -> str:
        admission = current_admission()
        assert admission is not None, "a singleton body runs with an admission"
        with self.cond:
            self.events.append(("start", label, admission.token))
            self.cond.notify_all()
        if label == "r0":
            assert self.release.wait(WAIT)
        time.sleep(0.02)
        with self.cond:
            self.events.append(("end", label, admission.token))
            self.cond.notify_all()
        return label

    def wait(self, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + WAIT
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                assert left > 0, f"timed out; events: {self.events}"
                self.cond.wait(min(left, 0.01))

    def started(self) -> list[str]:
        return [label for kind, label, _token in self.events if kind == "start"]

    def ended(self) -> list[str]:
        return [label for kind, label, _token in self.events if kind == "end"]

    def serialized(self) -> bool:
        running = 0
        for kind, _label, _token in self.events:
            running += 1 if kind == "start" else -1
            if running > 1:
                return False
        return True


def inspected(url: str, namespace: str) -> dict[str, Any]:
    """``singleton-tasks inspect --json``: holders' and waiters' run ids by key."""
    result = CliRunner().invoke(cli, ["inspect", "--json", "--store", url, "--namespace", namespace])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    return {
        key["key"]: ([h["run_id"] for h in key["holders"]], [w["run_id"] for w in key["waiters"]])
        for key in document["keys"]
    }


def check_story(
    url: str, namespace: str, bodies: Bodies, send: Callable[[str], str], results: Callable[[], list[str]]
) -> None:
    """r0 holds the key; r1 and r2 are registered behind it; then all three run one at a time."""
    first = send("r0")
    bodies.wait(lambda: bodies.started() == ["r0"])
    others = [send("r1"), send("r2")]
    holders, waiters = inspected(url, namespace)["acct:A"]
    assert holders == [first]
    assert waiters == others
    bodies.release.set()
    assert results() == ["r0", "r1", "r2"]
    bodies.wait(lambda: bodies.ended() == ["r0", "r1", "r2"])
    assert bodies.started() == ["r0", "r1", "r2"] and bodies.serialized()
    tokens = [token for kind, _label, token in bodies.events if kind == "start"]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


# -- Dramatiq -------------------------------------------------------------------------------------
DRAMATIQ_DECLARATIONS = ["singleton-above-actor", "singleton-below-actor", "below-middleware-added-later"]


@pytest.fixture
def dramatiq_env(tmp_path: Path) -> Iterator[tuple[StubBroker, str, str]]:
    broker = StubBroker()
    broker.emit_after("process_boot")
    namespace = f"decl{uuid.uuid4().hex[:8]}"
    yield broker, f"sqlite:///{tmp_path / 'decl.db'}", namespace
    broker.close()


@pytest.mark.parametrize("declaration", DRAMATIQ_DECLARATIONS)
def test_dramatiq_declarations_are_singletons(
    declaration: str, dramatiq_env: tuple[StubBroker, str, str]
) -> None:
    broker, url, namespace = dramatiq_env
    middleware = SingletonMiddleware(url, namespace=namespace, **FAST)
    if declaration != "below-middleware-added-later":
        broker.add_middleware(middleware)
    bodies = Bodies()
    name = f"decl_{uuid.uuid4().hex[:8]}"

    def statement(account: str, label: str) -> str:
        return bodies.body(account, label)

    statement.__name__ = statement.__qualname__ = name
    declare = singleton(key="acct:{account}")
    if declaration == "singleton-above-actor":
        actor = declare(dramatiq.actor(statement, broker=broker, actor_name=name))
    else:
        actor = dramatiq.actor(declare(statement), broker=broker, actor_name=name)
    if declaration == "below-middleware-added-later":
        broker.add_middleware(middleware)
    worker = dramatiq.Worker(broker, worker_timeout=20, worker_threads=3)
    worker.start()
    try:

        def results() -> list[str]:
            broker.join(actor.queue_name, timeout=int(WAIT * 1000))
            worker.join()
            return sorted(set(bodies.ended()))

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an adopted body never warns
            check_story(url, namespace, bodies, lambda label: actor.send("A", label).message_id, results)
    finally:
        worker.stop()


def declare_actor(order: str, broker: StubBroker, name: str, body: Callable[..., Any]) -> Any:
    """``@singleton`` written above (``above``) or under (``below``) ``@dramatiq.actor``."""
    body.__name__ = body.__qualname__ = name
    declare = singleton(key="acct:{account}")
    if order == "above":
        return declare(dramatiq.actor(body, broker=broker, actor_name=name))
    return dramatiq.actor(declare(body), broker=broker, actor_name=name)


@pytest.mark.parametrize("order", ["above", "below"])
def test_dramatiq_a_singleton_on_a_broker_without_the_middleware_refuses_the_first_send(order: str) -> None:
    """Either order, the middleware forgotten: ``.send()`` raises and publishes nothing (issue 28)."""
    broker = StubBroker()
    name = f"forgotten_{uuid.uuid4().hex[:8]}"
    actor = declare_actor(order, broker, name, lambda account: None)
    expected = (
        f"{name} is a singleton actor but its broker has no SingletonMiddleware: "
        "add broker.add_middleware(SingletonMiddleware(...)) before importing actor modules; "
        "nothing was sent"
    )
    sends = [
        lambda: actor.send("A"),
        lambda: actor.send_with_options(args=("A",)),
        lambda: actor.message("A"),
    ]
    for send in sends:
        with pytest.raises(SingletonConfigError) as raised:
            send()
        assert str(raised.value) == expected
    assert broker.queues[actor.queue_name].qsize() == 0
    broker.close()


@pytest.mark.parametrize("order", ["above", "below"])
def test_dramatiq_a_singleton_with_the_middleware_sends_in_either_order(order: str, tmp_path: Path) -> None:
    broker = StubBroker()
    namespace = f"sent{uuid.uuid4().hex[:8]}"
    url = f"sqlite:///{tmp_path / 'sent.db'}"
    broker.add_middleware(SingletonMiddleware(url, namespace=namespace, **FAST))
    name = f"sent_{uuid.uuid4().hex[:8]}"
    actor = declare_actor(order, broker, name, lambda account: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sent = [actor.send("A").message_id for _ in range(2)]
    assert broker.queues[actor.queue_name].qsize() == 2
    assert inspected(url, namespace) == {"acct:A": ([], sent)}
    # Checked once: the actor's own attribute, the original method, hides the checking one.
    assert getattr(actor.__dict__["message_with_options"], dramatiq_internals.GUARD)
    broker.close()


def test_dramatiq_an_actor_sent_before_it_became_a_singleton_is_checked_again() -> None:
    broker = StubBroker()
    name = f"late_{uuid.uuid4().hex[:8]}"
    actor = dramatiq.actor(lambda account: None, broker=broker, actor_name=name)
    actor.send("A")  # a plain actor: passes, and is not checked again
    singleton(key="acct:{account}")(actor)
    with pytest.raises(SingletonConfigError, match=f"{name} is a singleton actor but its broker has no"):
        actor.send("A")
    assert broker.queues[actor.queue_name].qsize() == 1
    broker.close()


def test_dramatiq_a_singleton_declared_twice_is_refused() -> None:
    broker = StubBroker()
    broker.add_middleware(SingletonMiddleware("memory://twice"))

    def twice(account: str) -> None: ...

    with pytest.raises(SingletonConfigError, match="twice"):
        dramatiq.actor(singleton(key="{account}")(twice), broker=broker, singleton={"key": "{account}"})
    with pytest.raises(SingletonConfigError, match="twice"):
        singleton(key="{account}")(dramatiq.actor(twice, broker=broker, singleton={"key": "{account}"}))
    broker.close()


# -- Celery ---------------------------------------------------------------------------------------
CELERY_DECLARATIONS = [
    "singleton-above-app-task",
    "singleton-below-app-task",
    "singleton-below-app-task-finalized",
    "singleton-above-shared-task",
    "singleton-below-shared-task",
    "option-without-base",
    "option-without-base-finalized",
]


def declare_celery(declaration: str, app: Celery, name: str, body: Callable[..., Any]) -> None:
    declare = singleton(key="acct:{account}")
    if declaration.endswith("-finalized"):
        app.finalize()  # @app.task then creates the task at once, no promise
    if declaration.startswith("singleton-above-app-task"):
        declare(app.task(name=name, shared=False)(body))
    elif declaration.startswith("singleton-below-app-task"):
        app.task(name=name, shared=False)(declare(body))
    elif declaration == "singleton-above-shared-task":
        declare(shared_task(name=name)(body))
    elif declaration == "singleton-below-shared-task":
        shared_task(name=name)(declare(body))
    else:
        app.task(name=name, shared=False, singleton={"key": "acct:{account}"})(body)


@pytest.mark.parametrize("declaration", CELERY_DECLARATIONS)
def test_celery_declarations_are_singletons_after_install(declaration: str, tmp_path: Path) -> None:
    url, namespace = f"sqlite:///{tmp_path / 'decl.db'}", f"decl{uuid.uuid4().hex[:8]}"
    app = make_app()
    install(app, url, namespace=namespace, **FAST)
    bodies = Bodies()
    name = unique("decl")

    def statement(account: str, label: str) -> str:
        return bodies.body(account, label)

    statement.__name__ = statement.__qualname__ = name.replace(".", "_")
    declare_celery(declaration, app, name, statement)
    task = app.tasks[name]
    assert isinstance(task, SingletonTask) and task.acks_late is True
    sent = []

    def send(label: str) -> str:
        result = task.delay("A", label)
        sent.append(result)
        return str(result.id)

    with worker(app), warnings.catch_warnings():
        warnings.simplefilter("error")  # an adopted body never warns
        check_story(url, namespace, bodies, send, lambda: [r.get(interval=0.01, timeout=WAIT) for r in sent])


def test_celery_option_without_base_is_adopted_at_finalize_without_install() -> None:
    app = make_app()  # no install(): the app.conf / env / default store, as SingletonTask alone
    name = unique("noinstall")

    @app.task(name=name, shared=False, singleton={"key": "{account}", "limit": 2})
    def statement(account: str) -> None: ...

    app.finalize()
    task = app.tasks[name]
    assert isinstance(task, SingletonTask)
    assert type(task)._singleton_bound is not None and type(task)._singleton_bound.config.limit == 2


def test_celery_a_bad_option_without_base_is_refused_naming_the_task() -> None:
    app = make_app("memory://refused")
    app.finalize()
    name = unique("refused")
    with pytest.raises(SingletonConfigError, match=name.replace(".", r"\.")):

        @app.task(name=name, shared=False, singleton={"key": "{nope}"})
        def statement(account: str) -> None: ...

    with pytest.raises(SingletonConfigError, match="twice"):

        @app.task(name=unique("twice"), shared=False, singleton={"key": "{account}"})
        @singleton(key="{account}")
        def twice(account: str) -> None: ...


# -- a function that never becomes a task ---------------------------------------------------------
def test_singleton_on_a_plain_function_warns_when_it_is_called() -> None:
    @singleton(key="{account}")
    def plain(account: str) -> str:
        return account * 2

    with pytest.warns(RuntimeWarning, match="no task was made a singleton from it"):
        assert plain("a") == "aa"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plain("b") == "bb"  # warned once


def test_a_marked_body_on_a_broker_without_the_middleware_warns_when_it_runs() -> None:
    broker = StubBroker()
    broker.emit_after("process_boot")
    ran = threading.Event()

    @dramatiq.actor(broker=broker, actor_name=f"lonely_{uuid.uuid4().hex[:8]}")
    @singleton(key="{x}")
    def lonely(x: int) -> None:
        ran.set()

    with pytest.warns(RuntimeWarning, match="without the gate"):
        lonely(1)  # what the worker does with the message
    assert ran.is_set()
    broker.close()


@pytest.mark.parametrize(
    ("framework", "declare"),
    [
        (
            "dramatiq",
            "import dramatiq\n"
            "from dramatiq.brokers.stub import StubBroker\n"
            "dramatiq.set_broker(StubBroker())\n"
            "@singleton(key='{x}')\n"
            "@dramatiq.actor\n"
            "def task(x): pass\n",
        ),
        (
            "celery",
            "import celery\n"
            "app = celery.Celery(broker='memory://')\n"
            "@singleton(key='{x}')\n"
            "@app.task\n"
            "def task(x): pass\n",
        ),
    ],
)
def test_an_adapter_nobody_imported_is_found_by_its_entry_point(framework: str, declare: str) -> None:
    """``@singleton`` above a task of a framework whose adapter was never imported: the adapter is
    found by the ``singleton_tasks.adapters`` entry point named after the framework, not by name."""
    code = (
        "import sys\n"
        "from singleton_tasks import singleton\n"
        "from singleton_tasks.decorator import ADAPTERS\n"
        f"assert 'singleton_tasks.{framework}' not in sys.modules\n"
        f"{declare}"
        f"print('singleton_tasks.{framework}' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    source = Path(singleton_tasks.decorator.__file__).read_text()
    assert not re.search(r"import singleton_tasks\.(dramatiq|celery)|from \.(dramatiq|celery)", source)
