"""The framework internals the adapters rely on still behave as their modules say.

Each test names the numbered item of ``singleton_tasks/celery/_internals.py`` or
``singleton_tasks/dramatiq/_internals.py`` it checks; one fails when a Celery or Dramatiq
upgrade changes that internal, before a user's task silently stops being a singleton. The last
check the redis-py internals of ``singleton_tasks/stores/_redis_call.py`` and the Sentinel store,
and the exit of ``multiprocessing`` and billiard children (``confirms._at_child_exit``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import multiprocessing
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import pytest
import redis
import redis.connection
import redis.sentinel
from celery import Celery, Task, shared_task
from celery.exceptions import DuplicateTaskNameWarning
from conftest import REDIS_URL, require_server
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits.backends import StubBackend as RateLimitStubBackend

from singleton_tasks.celery import _internals as celery_internals
from singleton_tasks.dramatiq import _internals as dramatiq_internals
from singleton_tasks.stores._redis_call import _resp_command


def _app() -> Celery:
    return Celery(f"internals{uuid.uuid4().hex[:8]}", set_as_current=False)


# -- Celery -----------------------------------------------------------------------------------
def test_celery_1_current_worker_task_and_active_apps() -> None:
    app = _app()
    assert celery_internals.current_worker_task() is None
    assert app in celery_internals.active_apps()


def test_celery_1_outside_running_tasks_hides_this_threads_tasks_and_restores_them() -> None:
    app = _app()
    seen: list[Any] = []

    @app.task(name="internals.inner", shared=False, bind=True)
    def inner(self: Any) -> None:
        seen.append(celery_internals.current_worker_task() is self)
        with celery_internals.outside_running_tasks():
            seen.append(celery_internals.current_worker_task())
        seen.append(celery_internals.current_worker_task() is self)

    @app.task(name="internals.outer", shared=False)
    def outer() -> None:
        inner.apply()

    outer.apply().get()
    assert seen == [True, None, True]
    assert celery_internals.current_worker_task() is None


def test_celery_2_every_task_from_a_function_goes_through_task_from_fun() -> None:
    app = _app()
    made: list[Any] = []
    assert celery_internals.adopt_tasks_as_made(app, made.append)
    assert not celery_internals.adopt_tasks_as_made(app, made.append), "wrapped twice"

    @app.task(name="eager.one")
    def one() -> None: ...

    app.finalize()  # also makes Celery's built-in tasks (celery.group, ...) from functions
    ours = [task for task in made if task.name == "eager.one"]
    assert len({id(task) for task in ours}) == 1 and len(made) > len(ours)
    assert celery_internals.app_task(app, "eager.one") is ours[0]
    assert ours[0] in celery_internals.app_tasks(app)


def test_celery_3_a_promise_exposes_its_app_function_and_options() -> None:
    app = _app()

    def body(x: int) -> int:
        return x

    promise = app.task(body, name="promised", bind=False)
    parts = celery_internals.promise_parts(promise)
    assert parts is not None
    promised_app, fun, options = parts
    assert promised_app is app and fun is body and options["name"] == "promised"
    assert not promise.__evaluated__()
    evaluated: list[str] = []
    promise.__then__(lambda: evaluated.append("then"))
    app.finalize()
    assert promise.__evaluated__() and evaluated == ["then"]


def test_celery_4_a_shared_task_proxy_exposes_its_function_and_name() -> None:
    def shared_body() -> None: ...

    named = shared_task(name="shared.named")(shared_body)
    unnamed = shared_task(shared_body)
    assert celery_internals.shared_task_parts(named) == (shared_body, "shared.named")
    assert celery_internals.shared_task_parts(unnamed) == (shared_body, None)


def test_celery_5_options_copied_from_the_config_follow_the_bound_mark() -> None:
    app = _app()
    app.conf.task_acks_late = True

    @app.task(name="chosen", acks_late=False)
    def chosen() -> None: ...

    @app.task(name="inherited")
    def inherited() -> None: ...

    app.finalize()
    assert type(app.tasks["chosen"]).acks_late is False
    assert celery_internals.option_chosen_by_class(type(app.tasks["chosen"]), "acks_late") is False
    assert type(app.tasks["inherited"]).acks_late is True  # copied from the config by Task.bind
    assert celery_internals.option_chosen_by_class(type(app.tasks["inherited"]), "acks_late") is None


def test_celery_6_the_tracer_is_cached_on_the_task_and_rebuilt_after_a_class_swap() -> None:
    app = _app()
    app.conf.task_always_eager = False

    @app.task(name="traced")
    def traced() -> str:
        return "plain"

    app.finalize()
    task = app.tasks["traced"]
    from celery.app.trace import trace_task

    trace_task(task, "id-1", (), {}, app=app)
    assert task.__trace__ is not None, "Celery no longer caches the tracer on the task"

    class Marked(type(task)):  # type: ignore[misc]
        def run(self) -> str:
            return "swapped"

    celery_internals.replace_task_class(task, Marked)
    assert type(task) is Marked and task.__trace__ is None
    retval = trace_task(task, "id-2", (), {}, app=app)
    assert retval.retval == "swapped"


def test_celery_7_the_tracer_marks_its_request_protected() -> None:
    app = _app()
    seen: list[bool] = []

    @app.task(name="protected", bind=True)
    def protected(self: Any) -> None:
        seen.append(celery_internals.is_tracer_call(self.request))

    app.finalize()
    from celery.app.trace import setup_worker_optimizations, trace_task

    setup_worker_optimizations(app)
    try:
        task = app.tasks["protected"]
        request = {"id": "r1", "called_directly": False}
        task.push_request(**request)
        assert celery_internals.is_tracer_call(task.request_stack.top)
        celery_internals.mark_tracer_call(task.request_stack.top)
        assert not celery_internals.is_tracer_call(task.request_stack.top)
        task.pop_request()
        trace_task(task, "r2", (), {}, app=app)
    finally:
        from celery.app.trace import reset_worker_optimizations

        reset_worker_optimizations(app)
    assert seen == [False], "inside the body the request is marked, so a direct call gets a new one"


def test_celery_8_the_duplicate_name_warning_blames_the_first_frame_outside_celery() -> None:
    app = _app()
    app.finalize()

    def first() -> None: ...

    def second() -> None: ...

    def register_again(name: str) -> Any:
        return app._task_from_fun(second, name=name)  # the frame blamed, not its caller's

    blamed = (__file__, register_again.__code__.co_firstlineno + 1)
    app.task(name="taken", shared=False)(first)
    with pytest.warns(DuplicateTaskNameWarning) as warned:
        register_again("taken")
    assert [(w.filename, w.lineno) for w in warned] == [blamed]
    celery_internals.adopt_tasks_as_made(app, lambda task: None)
    app.task(name="taken.too", shared=False)(first)
    with pytest.warns(DuplicateTaskNameWarning) as warned:
        register_again("taken.too")  # through the wrapper: the same frame
    assert [(w.filename, w.lineno) for w in warned] == [blamed]


def test_celery_9_a_task_made_with_the_apps_default_class_derives_from_app_task() -> None:
    app = _app()

    class Base(Task):  # type: ignore[misc]
        pass

    app.task_cls = Base

    def body() -> None: ...

    app.task(name="by.default", shared=False)(body)
    app.task(base=Base, name="by.base", shared=False)(body)
    app.finalize()
    by_default, by_base = app.tasks["by.default"], app.tasks["by.base"]
    assert [celery_internals.is_app_default_task_class(b) for b in type(by_default).__bases__] == [True]
    assert [celery_internals.is_app_default_task_class(b) for b in type(by_base).__bases__] == [False]
    assert type(by_default).__bases__ == (app.Task,) and issubclass(app.Task, Base)


# -- Dramatiq ---------------------------------------------------------------------------------
def test_dramatiq_1_the_worker_logs_skips_in_the_filtered_format(caplog: pytest.LogCaptureFixture) -> None:
    broker = StubBroker()
    broker.emit_after("process_boot")

    class Skip(dramatiq.Middleware):
        def before_process_message(self, broker: Any, message: Any) -> None:
            raise dramatiq.middleware.SkipMessage()

    broker.add_middleware(Skip())

    @dramatiq.actor(broker=broker)
    def skipped() -> None: ...

    skipped.send()
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    with caplog.at_level(logging.DEBUG, logger=dramatiq_internals.WORKER_LOGGER):
        worker.start()
        try:
            broker.join(skipped.queue_name, timeout=10_000)
            worker.join()
        finally:
            worker.stop()
    records = [r for r in caplog.records if r.name == dramatiq_internals.WORKER_LOGGER]
    assert any(r.msg == dramatiq_internals.SKIPPED_MESSAGE for r in records), [r.msg for r in records]
    quiet = dramatiq_internals.QuietSkips(lambda message: True)
    assert not quiet.filter(next(r for r in records if r.msg == dramatiq_internals.SKIPPED_MESSAGE))


def test_dramatiq_2_every_send_builds_through_message_with_options() -> None:
    """Every way to send looks the method up on the actor: an instance attribute hides the class's."""
    broker = StubBroker()

    @dramatiq.actor(broker=broker)
    def guarded(x: int) -> None: ...

    assert getattr(dramatiq.Actor.message_with_options, dramatiq_internals.GUARD, False)  # the adapter's
    calls: list[str] = []

    def refuse(**options: object) -> None:
        calls.append("check")
        raise RuntimeError("refused")

    guarded.message_with_options = refuse  # type: ignore[method-assign]
    sends = (lambda: guarded.send(1), lambda: guarded.send_with_options(args=(1,)), lambda: guarded.message())
    for send in sends:
        with pytest.raises(RuntimeError, match="refused"):
            send()
    assert calls == ["check"] * 3
    assert broker.queues[guarded.queue_name].qsize() == 0


def test_dramatiq_9_a_send_refused_in_before_enqueue_is_caught_around_enqueue() -> None:
    from dramatiq.brokers.rabbitmq import RabbitmqBroker
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.middleware import MiddlewareError

    for kind in (StubBroker, RedisBroker, RabbitmqBroker):
        parameters = inspect.signature(kind.enqueue).parameters
        assert list(parameters) == ["self", "message", "delay"], kind
        assert parameters["delay"].kind is inspect.Parameter.KEYWORD_ONLY, kind

    class Refused(MiddlewareError):
        pass

    class Refuse(dramatiq.Middleware):
        def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            raise Refused("refused")

    broker = StubBroker()
    broker.add_middleware(Refuse())

    @dramatiq.actor(broker=broker)
    def refused(x: int) -> None: ...

    with pytest.raises(Refused):
        refused.send(1)  # Dramatiq lets a MiddlewareError out of enqueue
    dramatiq_internals.return_dropped_sends(broker, Refused)
    wrapped = broker.enqueue
    dramatiq_internals.return_dropped_sends(broker, Refused)
    assert broker.enqueue is wrapped  # once per broker
    message = refused.message(2)
    assert broker.enqueue(message) is message
    assert refused.send(3).args == (3,)
    assert refused.send_with_options(args=(4,), delay=10).args == (4,)
    dramatiq.group([refused.message(5)]).run()
    assert broker.queues[refused.queue_name].qsize() == 0  # nothing published
    assert broker.queues[f"{refused.queue_name}.DQ"].qsize() == 0


def test_dramatiq_4_a_delayed_copy_is_woken_on_its_own_queue_without_its_delay() -> None:
    broker = StubBroker()

    @dramatiq.actor(broker=broker, queue_name="jobs")
    def delayed() -> None: ...

    enqueued = broker.enqueue(delayed.message(), delay=60_000)
    assert enqueued.queue_name == "jobs.DQ" and "eta" in enqueued.options
    woken = dramatiq_internals.immediate_copy(enqueued.encode(), {"extra": 1})
    assert woken.queue_name == "jobs" and "eta" not in woken.options and woken.options["extra"] == 1
    assert woken.message_id == enqueued.message_id


def test_dramatiq_6_due_delayed_messages_are_moved_by_consumer_threads() -> None:
    broker = StubBroker()
    broker.emit_after("process_boot")
    threads: list[bool] = []

    class Watch(dramatiq.Middleware):
        def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            threads.append(dramatiq_internals.on_consumer_thread())

    broker.add_middleware(Watch())
    done = threading.Event()

    @dramatiq.actor(broker=broker)
    def later() -> None:
        done.set()

    later.send_with_options(delay=10)
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        assert done.wait(10)
    finally:
        worker.stop()
    assert threads == [False, True], "the due message is enqueued again by a ConsumerThread"


@contextlib.contextmanager
def _backed_off_redis_worker(
    body: Callable[[], None], *, threads: int, worker_timeout: int, misses: int
) -> Iterator[tuple[dramatiq.Actor[[], None], dramatiq.Worker, Any, str]]:
    """A real RedisBroker worker (private namespace and queue) whose consumer has found its queue
    empty ``misses`` times and sleeps in its back-off: ``(actor, worker, consumer, queue)``."""
    from conftest import BROKER_REDIS_URL
    from dramatiq.brokers.redis import RedisBroker

    require_server(BROKER_REDIS_URL, "Redis")
    broker = RedisBroker(url=BROKER_REDIS_URL, namespace=f"internals-{uuid.uuid4().hex[:8]}", middleware=[])
    queue = f"q{uuid.uuid4().hex[:8]}"
    actor = dramatiq.actor(body, broker=broker, queue_name=queue, actor_name=f"job_{queue}")
    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=worker_timeout)
    worker.start()
    try:
        consumer_thread = worker.consumers[queue]
        pause = threading.Event()  # never set: wait() is a bounded sleep
        for _ in range(3000):
            if consumer_thread.consumer is not None and consumer_thread.consumer.misses >= misses:
                break
            pause.wait(0.01)
        consumer = consumer_thread.consumer
        assert consumer is not None and consumer.misses >= misses
        yield actor, worker, consumer, queue
    finally:
        worker.stop()
        leftovers = broker.client.keys(f"{broker.namespace}:*")
        if leftovers:
            broker.client.delete(*leftovers)
        broker.close()


def test_dramatiq_8_pipeline_steps_and_group_callbacks_are_named_by_the_delivered_message() -> None:
    broker = StubBroker()
    broker.add_middleware(GroupCallbacks(RateLimitStubBackend()))
    enqueued: list[dramatiq.Message[Any]] = []

    class Watch(dramatiq.Middleware):
        def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            enqueued.append(message)

    broker.add_middleware(Watch())

    @dramatiq.actor(broker=broker)
    def step(x: int = 0) -> None: ...

    first, second = step.message(1), step.message(2)
    pipe = dramatiq.pipeline([first, second], broker=broker)
    assert dramatiq_internals.names_as_continuation(pipe.messages[0].options, pipe.messages[1].message_id)
    callback = step.message(3)
    members = dramatiq.group([step.message(4)], broker=broker)
    members.add_completion_callback(callback)
    members.run()
    (member,) = enqueued
    assert dramatiq_internals.names_as_continuation(member.options, callback.message_id)
    assert not dramatiq_internals.names_as_continuation(member.options, first.message_id)


@pytest.mark.redis
def test_dramatiq_7_a_worker_thread_fetches_past_a_backed_off_redis_consumer() -> None:
    ran = threading.Event()
    assert dramatiq_internals.fetch_for_this_worker("any") == 0, "not a worker thread: nothing fetched"
    # 8 misses: the consumer sleeps 0.64-1.28 s.
    with _backed_off_redis_worker(ran.set, threads=1, worker_timeout=2_000, misses=8) as (
        job,
        worker,
        consumer,
        queue,
    ):
        sent = job.send()
        assert dramatiq_internals.fetch_now(worker.consumers, queue) == 1
        assert sent.message_id in consumer.queued_message_ids  # counted as the consumer's own
        assert ran.wait(10)
        pause = threading.Event()
        for _ in range(500):  # acked through the consumer by the worker thread
            if not consumer.queued_message_ids:
                break
            pause.wait(0.01)
        assert not consumer.queued_message_ids
        assert consumer.misses >= 8, "the consumer itself never received the message"
        assert dramatiq_internals.fetch_now(worker.consumers, queue) == 0  # an empty queue
        assert dramatiq_internals.fetch_now(worker.consumers, "no-such-queue") == 0


@pytest.mark.redis
def test_dramatiq_7_worker_threads_fetching_at_once_stay_within_the_prefetch_window() -> None:
    # Several worker threads release at once (a burst of keys settling) and each fetches for
    # the same consumer: together they must not take more than its prefetch window, which is
    # what the consumer itself never exceeds (the surplus would sit in this worker's ack set
    # while other workers idle).
    bodies_may_end = threading.Event()

    def hold() -> None:
        bodies_may_end.wait(30)

    # 10 misses: the consumer sleeps 2.5-5 s, far past the fetches below.
    with _backed_off_redis_worker(hold, threads=4, worker_timeout=20_000, misses=10) as (
        job,
        worker,
        consumer,
        queue,
    ):
        try:
            for _ in range(40):
                job.send()
            threads = 8
            start = threading.Barrier(threads)
            fetched: list[int] = []

            def fetch() -> None:
                start.wait(10)
                fetched.append(dramatiq_internals.fetch_now(worker.consumers, queue))

            fetchers = [threading.Thread(target=fetch) for _ in range(threads)]
            for thread in fetchers:
                thread.start()
            for thread in fetchers:
                thread.join(10)
            assert sum(fetched) <= consumer.prefetch, fetched
            assert consumer.outstanding_message_count <= consumer.prefetch
        finally:
            bodies_may_end.set()


# -- redis-py (singleton_tasks/stores/_redis_call.py) -------------------------------------------
@pytest.mark.redis
def test_redis_py_a_pinned_connection_takes_packed_commands_and_reconnects_by_connect() -> None:
    """``_sock`` is None until connected and after ``disconnect()``; a packed command written by
    ``send_packed_command`` is answered by ``read_response``; the retry policy takes ``(call,
    failed)``; a Sentinel-managed connection has a ``connect`` of its own (the one that asks the
    sentinels), and ``send_packed_command`` reconnects by another way (the reason the module
    calls ``connect()`` itself)."""
    require_server(REDIS_URL, "Redis")
    client = redis.Redis.from_url(REDIS_URL, single_connection_client=True)
    try:
        conn = client.connection
        assert conn is not None
        conn.disconnect()
        assert conn._sock is None
        conn.connect()
        assert conn._sock is not None
        answers: list[Any] = []

        def call() -> Any:
            conn.send_packed_command([_resp_command([b"ECHO", b"a"]), _resp_command([b"ECHO", b"b"])])
            answers.append(conn.read_response())
            return conn.read_response()

        assert conn.retry.call_with_retry(call, lambda _error: conn.disconnect()) == b"b"
        assert answers == [b"a"]
    finally:
        client.close()
    sentinel_connection = redis.sentinel.SentinelManagedConnection
    assert sentinel_connection.connect is not redis.connection.Connection.connect
    packed_send = inspect.getsource(redis.connection.Connection.send_packed_command)
    assert "self.connect()" not in packed_send, "redis-py reconnects by connect() now: reason 2 is gone"


# -- redis-py's Sentinel client (singleton_tasks/stores/redis_sentinel.py) ----------------------------
def test_redis_py_sentinel_asks_its_list_in_order_and_its_pool_knows_the_primary() -> None:
    """The Sentinel store puts the sentinel that announced a failover first in
    ``Sentinel.sentinels`` (``discover_master`` asks that list in order, and moves the one that
    answered to the front itself), reads the pool's ``master_address`` (the primary its
    connections were last made to), and disconnects the pool's idle connections with
    ``disconnect(inuse_connections=False)``."""
    sentinel = redis.sentinel.Sentinel([("127.0.0.1", 1), ("127.0.0.1", 2)])
    try:
        assert isinstance(sentinel.sentinels, list)
        assert all(isinstance(client, redis.Redis) for client in sentinel.sentinels)
        discover = inspect.getsource(redis.sentinel.Sentinel.discover_master)
        assert "enumerate(self.sentinels)" in discover
        assert "self.sentinels[0], self.sentinels[sentinel_no]" in discover
        pool = sentinel.master_for("mymaster").connection_pool
        assert isinstance(pool, redis.sentinel.SentinelConnectionPool)
        assert pool.master_address is None  # no connection made yet
        assert "inuse_connections" in inspect.signature(pool.disconnect).parameters
    finally:
        sentinel.close()


# -- the standard library's multiprocessing, with billiard (singleton_tasks/confirms.py) ---------------
def _exit_hook_writes(path: str) -> None:
    from singleton_tasks import confirms

    confirms._at_child_exit(lambda: Path(path).write_text(str(os.getpid())))


@pytest.mark.parametrize("make", ["multiprocessing", "billiard"])
def test_stdlib_a_childs_exit_runs_the_finalizers_it_registered_before_os_exit(
    make: str, tmp_path: Path
) -> None:
    """``confirms._at_child_exit``: a fork child of ``multiprocessing`` or billiard ends with
    ``os._exit`` (no atexit); its ``_bootstrap`` first runs ``multiprocessing.util._exit_function``,
    which calls the finalizers with an exit priority that the child registered."""
    import billiard

    path = tmp_path / "exited"
    context: Any = multiprocessing.get_context("fork") if make == "multiprocessing" else billiard
    child = context.Process(target=_exit_hook_writes, args=(str(path),))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and path.read_text() == str(child.pid)


@pytest.mark.slow  # a prefork pool process
def test_billiard_a_prefork_pool_process_sends_worker_process_shutdown_before_it_exits(
    tmp_path: Path,
) -> None:
    """A billiard pool process ends with ``os._exit`` inside its target, so no finalizer runs; the
    one hook left is the pool's ``on_process_exit``, which Celery's prefork pool makes its
    ``worker_process_shutdown`` signal (the adapter sends pending confirms there)."""
    from billiard.pool import Pool
    from celery import signals
    from celery.concurrency.prefork import process_destructor

    path = tmp_path / "shutdown"

    def record(pid: int = 0, **_: Any) -> None:
        path.write_text(f"{pid} {os.getpid()}")

    signals.worker_process_shutdown.connect(record, weak=False)
    try:
        pool = Pool(1, on_process_exit=process_destructor, maxtasksperchild=1)
        try:
            child = pool.apply_async(os.getpid).get(timeout=30)
        finally:
            pool.close()
            pool.join()
    finally:
        signals.worker_process_shutdown.disconnect(record)
    assert path.read_text() == f"{child} {child}"  # sent by the pool process itself
