"""A send that succeeded is never undone because its process exited (issue 26).

Child processes of ``multiprocessing`` and billiard end with ``os._exit``: no ``atexit`` handler
runs there, and the confirm thread's batch would be lost, its runs later passed over as never
published. Each child here does what a producer's ``.send()`` / ``.delay()`` does for every run
(``Gatekeeper.register`` unconfirmed, then ``confirm_later`` after the publish) and returns.
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import billiard
import pytest
from conftest import StoreFactory, backend_params

from singleton_tasks import SingletonConfig, Store, confirms, store_from_url
from singleton_tasks.config import BoundSingleton
from singleton_tasks.runtime import Gatekeeper

RUNS = 20
TASK = BoundSingleton.bind(SingletonConfig(key="k{i}"), task_name="tasks.sent", signature=None)  # type: ignore[arg-type]

real_backends = pytest.mark.parametrize("backend", backend_params(["sqlite", "redis", "postgres"]))


def send(gatekeeper: Gatekeeper, prefix: str, runs: int = RUNS) -> None:
    """The adapters' calls for each run: register unconfirmed, (publish,) hand over the confirm."""
    for i in range(runs):
        spec = gatekeeper.spec(TASK, f"{prefix}{i}", (), {"i": i})
        gatekeeper.register(TASK, spec, confirmed=False)
        gatekeeper.confirm_later(spec)


def send_and_return(url: str, namespace: str, prefix: str) -> None:
    """A child process's target: it sends and returns, without closing anything."""
    send(Gatekeeper(url, namespace=namespace), prefix)


def confirmed(store: Store) -> dict[str, bool]:
    return {w.run_id: w.confirmed for snap in store.snapshot() for w in snap.waiters}


def all_confirmed(*prefixes: str) -> dict[str, bool]:
    return {f"{prefix}{i}": True for prefix in prefixes for i in range(RUNS)}


@real_backends
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_multiprocessing_child_confirms_what_it_sent_before_it_exits(
    store_factory: StoreFactory, store_url: str, method: str
) -> None:
    store = store_factory()
    child = multiprocessing.get_context(method).Process(
        target=send_and_return, args=(store_url, store.namespace, "child-")
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert confirmed(store) == all_confirmed("child-")


@real_backends
def test_a_billiard_child_confirms_what_it_sent_before_it_exits(
    store_factory: StoreFactory, store_url: str
) -> None:
    store = store_factory()
    child = billiard.Process(target=send_and_return, args=(store_url, store.namespace, "child-"))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert confirmed(store) == all_confirmed("child-")


def send_from_a_later_exit_hook(url: str, namespace: str) -> None:
    """A child that sends once, then again from an exit hook of its own that runs after the library's."""
    gatekeeper = Gatekeeper(url, namespace=namespace)
    send(gatekeeper, "early-")
    multiprocessing.util.Finalize(None, send, args=(gatekeeper, "child-"), exitpriority=0)


@pytest.mark.parametrize("backend", backend_params(["sqlite", "redis"]))
def test_a_send_after_the_exit_hook_confirms_inline(store_factory: StoreFactory, store_url: str) -> None:
    store = store_factory()
    child = multiprocessing.get_context("fork").Process(
        target=send_from_a_later_exit_hook, args=(store_url, store.namespace)
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert confirmed(store) == all_confirmed("early-", "child-")


@pytest.mark.slow  # a prefork pool process
@pytest.mark.parametrize("backend", backend_params(["sqlite", "redis"]))
def test_a_celery_pool_process_confirms_when_it_shuts_down(
    store_factory: StoreFactory, store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefork pool process ends with ``os._exit`` inside billiard's worker loop, where no
    finalizer runs; Celery's ``worker_process_shutdown`` does, and the adapter's receiver sends the
    pending confirms there: a receiver connected after it sees them in the store."""
    from billiard.pool import Pool
    from celery import signals
    from celery.concurrency.prefork import process_destructor

    import singleton_tasks.celery  # noqa: F401 - connects the adapter's receivers

    monkeypatch.setattr(confirms, "CONFIRM_LINGER", 60.0)  # the confirm thread sends only when flushed
    store = store_factory()
    seen = tmp_path / "seen"

    def later(**_: Any) -> None:
        in_child = store_from_url(store_url, namespace=store.namespace)
        try:
            seen.write_text(json.dumps(confirmed(in_child)))
        finally:
            in_child.close()

    signals.worker_process_shutdown.connect(later, weak=False)
    try:
        pool = Pool(1, on_process_exit=process_destructor, maxtasksperchild=1)
        try:
            pool.apply_async(send_and_return, (store_url, store.namespace, "child-")).get(timeout=30)
        finally:
            pool.close()
            pool.join()
    finally:
        signals.worker_process_shutdown.disconnect(later)
    assert json.loads(seen.read_text()) == all_confirmed("child-")


class _RecordsConfirms:
    """Mixed into a real store class: every batch of confirms is logged with the sender's pid."""

    log: Path

    def confirm_many(self, runs: Sequence[tuple[str, str, str]]) -> list[bool]:
        with self.log.open("a") as log:
            log.write("".join(f"{os.getpid()} {run_id}\n" for _scope, _key, run_id in runs))
        return super().confirm_many(runs)  # type: ignore[misc, no-any-return]


def recording(store: Store, log: Path) -> Store:
    cls: Any = type(f"Recording{type(store).__name__}", (_RecordsConfirms, type(store)), {"log": log})
    made: Store = cls(store.url, namespace=store.namespace)
    return made


def send_when_told(gatekeeper: Gatekeeper, go: Any) -> None:
    go.wait(30)
    send(gatekeeper, "child-")


@real_backends
def test_a_fork_leaves_the_parents_pending_confirms_to_the_parent(
    store_factory: StoreFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Confirms pending at a fork are sent by the parent before it forks (a daemonizing parent may
    ``os._exit`` right after); the child, which inherits the gatekeeper, sends only its own."""
    monkeypatch.setattr(confirms, "CONFIRM_LINGER", 60.0)  # the confirm thread sends only when flushed
    store = store_factory()
    log = tmp_path / "confirms.log"
    gatekeeper = Gatekeeper(recording(store, log))
    try:
        send(gatekeeper, "parent-")
        context = multiprocessing.get_context("fork")
        go = context.Event()
        child = context.Process(target=send_when_told, args=(gatekeeper, go))
        child.start()
        try:
            assert confirmed(store) == all_confirmed("parent-")  # before the child did anything
        finally:
            go.set()
            child.join(60)
        assert child.exitcode == 0
        assert confirmed(store) == all_confirmed("parent-", "child-")
        senders: dict[int, set[str]] = {}
        for line in log.read_text().splitlines():
            pid, run_id = line.split()
            senders.setdefault(int(pid), set()).add(run_id)
        assert senders == {
            os.getpid(): set(all_confirmed("parent-")),
            child.pid: set(all_confirmed("child-")),
        }
    finally:
        gatekeeper.close()
