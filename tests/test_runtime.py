"""The shared worker runtime: clock comparison, retention warnings, heartbeats paced by the leases held."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sqlite3
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from singleton_tasks import (
    SchemaVersionError,
    SingletonConfig,
    SingletonConfigError,
    SingletonQueueFullError,
    StoreUnavailableError,
    heartbeat,
    metrics,
    store_from_url,
)
from singleton_tasks.config import BoundSingleton
from singleton_tasks.outcomes import Decision, HolderRef, KeySnapshot, Registered, RunSpec
from singleton_tasks.runtime import Gatekeeper, WorkerOptions
from singleton_tasks.stores import SCHEMA_VERSION, RuleStore, Store, store_classes
from singleton_tasks.stores._sql import SQLStore
from singleton_tasks.stores.memory import MemoryStore
from singleton_tasks.testing import ManualClock


def bound(**config: object) -> BoundSingleton:
    return BoundSingleton.bind(SingletonConfig(key="k", **config), task_name="tasks.t", signature=None)  # type: ignore[arg-type]


def memory(**options: object) -> str:
    return f"memory://runtime-{uuid.uuid4().hex}"


def test_worker_start_warns_about_a_skewed_clock(caplog: pytest.LogCaptureFixture) -> None:
    store = store_from_url(memory(), clock=ManualClock(time.time() + 900))
    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        Gatekeeper(store).check()
    assert any("900" in r.getMessage() and "behind" in r.getMessage() for r in caplog.records), caplog.text
    caplog.clear()
    in_step = store_from_url(memory(), clock=ManualClock(time.time() + 0.2))
    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        Gatekeeper(in_step).check()
    assert not [r for r in caplog.records if "clock" in r.getMessage()]


def test_a_heartbeat_reports_the_store_clock_and_warns_about_skew(caplog: pytest.LogCaptureFixture) -> None:
    clock = ManualClock(time.time() - 120)
    gatekeeper = Gatekeeper(store_from_url(memory(), clock=clock))
    spec = RunSpec("s", "k", "r")
    outcome = gatekeeper.store.claim(spec, 0, None)
    gatekeeper.heartbeats.track(HolderRef("s", "k", "r", outcome.token or 0), 60.0, "tasks.t")
    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        assert gatekeeper.heartbeats.beat() == []
    assert any("ahead of" in r.getMessage() for r in caplog.records), caplog.text
    gatekeeper.close()


def test_worker_start_warns_when_retention_is_shorter_than_a_task_can_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gatekeeper = Gatekeeper(store_from_url(memory(), retention=30.0))
    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        gatekeeper.check([bound(), bound(lease=5.0, orphan_timeout=10.0)])
    warned = [r.getMessage() for r in caplog.records if "retention" in r.getMessage()]
    assert len(warned) == 1 and "660" in warned[0] and "tasks.t" in warned[0]  # lease 60 + orphan 600
    gatekeeper.close()


def test_the_heartbeat_interval_follows_the_shortest_lease_held() -> None:
    gatekeeper = Gatekeeper(store_from_url(memory()), lease=60.0)
    beats = gatekeeper.heartbeats
    assert beats.interval == 20.0
    beats.track(HolderRef("s", "a", "a", 1), 60.0, "tasks.t")
    beats.track(HolderRef("s", "b", "b", 1), 4.5, "tasks.t")
    assert beats.interval == 1.5  # three beats per the shortest lease held
    beats.untrack("b")
    assert beats.interval == 20.0
    gatekeeper.close()
    assert Gatekeeper(store_from_url(memory()), heartbeat_interval=2.0).heartbeats.interval == 2.0


@pytest.mark.parametrize("lease", [0.5, 2.9, 0, -1, "10", True])
def test_a_lease_too_short_to_heartbeat_is_refused(lease: object) -> None:
    with pytest.raises(SingletonConfigError, match=repr(lease)):
        WorkerOptions(lease=lease)  # type: ignore[arg-type]
    with pytest.raises(SingletonConfigError, match="lease"):
        SingletonConfig(key="k", lease=lease)  # type: ignore[arg-type]


@pytest.mark.parametrize("retention", [0, -5.0, "soon", float("inf"), True])
def test_a_bad_retention_is_refused(retention: object) -> None:
    with pytest.raises(SingletonConfigError, match="retention"):
        store_from_url(memory(), retention=retention)


def test_a_copy_older_than_retention_dropped_as_stale_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    gatekeeper = Gatekeeper(store_from_url(memory(), retention=60.0))
    spec = RunSpec("s", "k", "redriven")
    old_generation = int((time.time() - 3600) * 1_000_000)
    with caplog.at_level(logging.WARNING, logger="singleton_tasks"):
        outcome = gatekeeper.claim("tasks.t", spec, old_generation, None)
    assert outcome.decision.value == "stale"
    assert any("remove its singleton_gen" in r.getMessage() for r in caplog.records), caplog.text
    gatekeeper.close()


def test_a_run_released_during_a_heartbeat_is_not_reported_lost(caplog: pytest.LogCaptureFixture) -> None:
    """The heartbeat thread takes its list of holders, then the run's own thread releases it (untrack,
    then release) before the store call: the store no longer knows the run, and that is no loss."""
    gatekeeper = Gatekeeper(store_from_url(memory()))
    store = gatekeeper.store
    spec = RunSpec("s", "k", "r")
    token = store.claim(spec, 0, None).token or 0
    gatekeeper.heartbeats.track(HolderRef("s", "k", "r", token), 60.0, "tasks.t")
    beat_in_store = store.heartbeat

    def released_meanwhile(holders: object) -> object:
        gatekeeper.release("tasks.t", spec, token=token)  # the run's own thread, between list and call
        return beat_in_store(holders)  # type: ignore[arg-type]

    store.heartbeat = released_meanwhile  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="singleton_tasks"):
        assert gatekeeper.heartbeats.beat() == []
    assert not [r for r in caplog.records if "lost its slot" in r.getMessage()], caplog.text
    # A holder the store dropped while it was still tracked is lost, and said so.
    store.heartbeat = beat_in_store  # type: ignore[method-assign]
    other = RunSpec("s", "k2", "r2")
    token = store.claim(other, 0, None).token or 0
    gatekeeper.heartbeats.track(HolderRef("s", "k2", "r2", token), 60.0, "tasks.t")
    store.release("s", "k2", "r2", token=token)
    with caplog.at_level(logging.ERROR, logger="singleton_tasks"):
        assert gatekeeper.heartbeats.beat() == ["r2"]
    assert any("r2 lost its slot" in r.getMessage() for r in caplog.records), caplog.text
    gatekeeper.close()


class _ConfirmFailsOnce(MemoryStore):
    """A real memory store whose first batch of confirms fails like an outage."""

    failures = 1

    def confirm_many(self, runs: Sequence[tuple[str, str, str]]) -> list[bool]:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailableError("store down")
        return super().confirm_many(runs)


def test_confirms_are_sent_again_after_a_store_outage(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="singleton_tasks")
    store = _ConfirmFailsOnce(memory())
    gatekeeper = Gatekeeper(store)
    task = bound()
    for i in range(3):
        run = gatekeeper.spec(task, f"r{i}", (), {})
        gatekeeper.register(task, run, confirmed=False)
        gatekeeper.confirm_later(run)
    assert gatekeeper.flush_confirms(10)
    assert store.failures == 0 and "published runs not confirmed (store down); retrying" in caplog.text
    assert [w.confirmed for snap in store.snapshot() for w in snap.waiters] == [True] * 3
    gatekeeper.close()


def _sql_rows(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as db:
        tables = ("singleton_keys", "singleton_settled")
        return sum(db.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in tables)


def test_the_heartbeat_thread_sweeps_one_slice_per_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step of the heartbeat thread sweeps for about SWEEP_SLICE seconds and leaves the rest to
    the next step, which comes at once (not SWEEP_INTERVAL later): the thread beats in between, so
    a long sweep (minutes for a million expired rows) never holds a heartbeat back."""
    monkeypatch.setattr(heartbeat, "SWEEP_SLICE", 0.0)  # every slice: one transaction
    clock = ManualClock(1000.0)
    path = tmp_path / "sweep.db"
    store = store_from_url(f"sqlite:///{path}", clock=clock, retention=100.0)
    assert isinstance(store, SQLStore)
    store.migrate()
    store.sweep_batch = 1

    def leave_idle_keys(first: int) -> None:  # a key row and a settled marker each
        for i in range(first, first + 3):
            spec = RunSpec("s", f"k{i}", f"r{i}")
            store.release("s", spec.key, spec.run_id, token=store.claim(spec, 0, None).token)

    leave_idle_keys(0)
    clock.set(1200.0)
    gatekeeper = Gatekeeper(store)
    left = []
    for _ in range(4):
        gatekeeper.heartbeats.sweep()
        left.append(_sql_rows(path))
    assert left == [4, 2, 0, 0]  # a marker and a key per slice; the last slice finds nothing
    leave_idle_keys(3)
    clock.set(1400.0)
    gatekeeper.heartbeats.sweep()
    assert _sql_rows(path) == 6  # swept through: the next sweep waits for SWEEP_INTERVAL
    gatekeeper.close()
    store.close()


def test_a_discarded_copy_never_frees_a_slot_another_copy_took_meanwhile() -> None:
    """A revoked waiter's discarded copy claims (gated: its run waits), then settles the run. If in
    between its holder releases and another copy of the run is admitted on another worker (one
    that had not got the revoke yet), that settlement must leave the new holder's slot alone:
    freeing it would let a second run of the key start beside a running body."""
    gatekeeper = Gatekeeper(store_from_url(memory()))
    store = gatekeeper.store
    h, w, later = RunSpec("s", "k", "h"), RunSpec("s", "k", "w"), RunSpec("s", "k", "later")
    h_token = store.claim(h, 0, None).token
    store.claim(w, 0, b"w")  # gated: w's copy 0 stays live, its deferred copy is in the broker
    interleaved = []

    def publish_wakes(wakes: Sequence[object]) -> None:
        if not interleaved:  # between the discarded copy's claim and its settlement
            wake = store.release("s", "k", "h", token=h_token).wakes[0]
            interleaved.append(store.claim(w, wake.generation, None).decision)  # another worker

    decision = gatekeeper.settle_unrun_copy("tasks.t", w, 0, publish_wakes)
    assert decision is Decision.GATED and interleaved == [Decision.ADMITTED]
    [snap] = store.snapshot()
    assert [holder.run_id for holder in snap.holders] == ["w"]  # still holds its slot
    assert store.claim(later, 0, None).decision is Decision.GATED
    gatekeeper.close()


def test_the_heartbeat_threads_due_work_publishes_reissues_and_reports_abandoned_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Heartbeater.tick_due (the heartbeat thread's step): the wakes of keys nobody calls go to the
    adapter's publisher; an abandoned waiter is logged at error with its task, key and run id."""
    from singleton_tasks.config import Timings
    from singleton_tasks.outcomes import Wake

    clock = ManualClock()
    store = MemoryStore(f"memory://{uuid.uuid4().hex}", clock=clock, timings=Timings(retention=500.0))
    gatekeeper = Gatekeeper(store, orphan_timeout=100.0, max_retry_delay=9.0, retry_jitter=1.0)
    published: list[Wake] = []
    gatekeeper.publish_wakes = published.extend
    spec = RunSpec("tasks.sync", "store:A", "r1", orphan_timeout=100.0, recheck=10.0)
    store.register(spec, payload=b"the message")
    assert gatekeeper.heartbeats.tick_due() == 0 and published == []
    clock.advance(110.5)
    assert gatekeeper.heartbeats.tick_due() == 1
    assert [(w.run_id, w.payload) for w in published] == [("r1", b"the message")]
    clock.advance(400.0)  # issued again and again, never seen: past the store's retention
    with caplog.at_level(logging.ERROR, logger="singleton_tasks"):
        assert gatekeeper.heartbeats.tick_due() == 1
    assert len(published) == 1 and store.snapshot() == []
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert all(text in record.getMessage() for text in ("tasks.sync", "r1", "'store:A'", "abandoned"))


def test_the_stores_whose_schema_is_their_own_create_it_at_first_use() -> None:
    """``Store.migrates_on_first_use``, declared on each class (subclasses inherit it): the memory,
    SQLite and Redis stores create their schema at a process's first use; a PostgreSQL database is
    migrated by its operator (``singleton-tasks migrate``), and a custom store by default too."""
    declared = {scheme: cls.migrates_on_first_use for scheme, cls in store_classes().items()}
    assert declared == {
        "memory": True,
        "sqlite": True,
        "redis": True,
        "rediss": True,
        "redis+sentinel": True,
        "rediss+sentinel": True,
        "redis+cluster": True,
        "rediss+cluster": True,
        "postgresql": False,
        "postgres": False,
    }
    assert Store.migrates_on_first_use is False and RuleStore.migrates_on_first_use is False


def test_a_process_creates_a_missing_schema_only_where_the_store_class_allows_it() -> None:
    class MigratedByItsOperator(MemoryStore):
        migrates_on_first_use = False

    operated = MigratedByItsOperator(memory())
    operated.set_schema_version_for_tests(None)  # a server nothing has written to yet
    with pytest.raises(SchemaVersionError, match="singleton-tasks migrate"):
        Gatekeeper(operated).store  # noqa: B018 (opening checks the schema)
    assert operated.schema_version() is None  # left for its operator to migrate
    embedded = MemoryStore(memory())
    embedded.set_schema_version_for_tests(None)
    Gatekeeper(embedded).store  # noqa: B018
    assert embedded.schema_version() == SCHEMA_VERSION


def test_a_lost_slot_error_names_task_key_run_and_token(caplog: pytest.LogCaptureFixture) -> None:
    """docs/operations.md#logging: the error of a holder that lost its slot (found by its heartbeat,
    or as it waits for its retry) names its task, run id, key and token, as the release's does."""
    gatekeeper = Gatekeeper(store_from_url(memory()))
    store = gatekeeper.store
    spec = RunSpec("reports", "customer-7", "run-lost")
    outcome = gatekeeper.claim("tasks.build_report", spec, 0, None)
    token = outcome.token
    assert token is not None
    store.release("reports", "customer-7", "run-lost", token=token)  # another owner's doing
    with caplog.at_level(logging.ERROR, logger="singleton_tasks"):
        assert gatekeeper.heartbeats.beat() == ["run-lost"]
    (line,) = [r.getMessage() for r in caplog.records if "lost its slot" in r.getMessage()]
    for part in ("tasks.build_report", "'customer-7'", "run-lost", f"token {token}"):
        assert part in line, line
    # The same error when a holder's slot is gone as it waits for its retry.
    caplog.clear()
    spec = RunSpec("reports", "customer-8", "run-retried")
    token = gatekeeper.claim("tasks.build_report", spec, 0, None).token
    assert token is not None
    store.release("reports", "customer-8", "run-retried", token=token)
    with caplog.at_level(logging.ERROR, logger="singleton_tasks"):
        gatekeeper.suspend("tasks.build_report", spec, token, 5.0)
    (line,) = [r.getMessage() for r in caplog.records if "lost its slot" in r.getMessage()]
    for part in ("tasks.build_report", "'customer-8'", "run-retried", f"token {token}"):
        assert part in line, line
    gatekeeper.close()


class _SnapshotFails(MemoryStore):
    def snapshot(self, *, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
        raise StoreUnavailableError("snapshot refused on purpose")


def test_a_dropped_send_is_counted_logged_and_names_the_run_last_in_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    gatekeeper = Gatekeeper(store_from_url(memory()))
    drop = bound(max_queue_depth=1, on_full="drop")
    spec = RunSpec("tasks.t", "k", "", max_queue_depth=1)
    runs = [dataclasses.replace(spec, run_id=f"r{i}") for i in range(3)]
    for run in runs[:2]:
        assert gatekeeper.register(drop, run).status is Registered.REGISTERED
    with caplog.at_level(logging.INFO, logger="singleton_tasks"):
        assert gatekeeper.register(drop, runs[2]).status is Registered.FULL  # no error
    assert "dropped tasks.t run r2: key 'k' is full" in caplog.text
    assert gatekeeper.newest_run(runs[2]) == "r1"  # the newest waiter
    with pytest.raises(SingletonQueueFullError):
        gatekeeper.register(bound(max_queue_depth=1), runs[2])  # on_full="raise"
    assert gatekeeper.store.claim(runs[0], 0, None).decision is Decision.ADMITTED
    gatekeeper.unregister(runs[1])
    assert gatekeeper.newest_run(runs[2]) == "r0"  # no waiter: the newest holder
    gatekeeper.store.release("tasks.t", "k", "r0", token=gatekeeper.store.snapshot()[0].holders[0].token)
    assert gatekeeper.newest_run(runs[2]) is None  # the key emptied
    assert Gatekeeper(_SnapshotFails()).newest_run(runs[2]) is None  # the store cannot tell now


def test_a_replacing_send_is_counted_logged_and_drops_when_no_waiter_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = CollectorRegistry()
    saved = (metrics._active, metrics._disabled)
    metrics.install(registry)
    gatekeeper = Gatekeeper(store_from_url(memory()))
    replace = bound(max_queue_depth=1, on_full="replace")
    runs = [gatekeeper.spec(replace, f"r{i}", (), {}) for i in range(3)]
    assert all(run.replace_when_full for run in runs)  # the task's on_full reaches the store
    try:
        for run in runs[:2]:
            assert gatekeeper.register(replace, run).status is Registered.REGISTERED
        with caplog.at_level(logging.INFO, logger="singleton_tasks"):
            outcome = gatekeeper.register(replace, runs[2])
        assert (outcome.status, outcome.replaced) == (Registered.REPLACED, "r1")
        assert "tasks.t run r2 replaced run r1 in line for key 'k' (on_full='replace')" in caplog.text
        # Holders alone over the cap (a lowered limit): no waiter to replace, dropped as "drop" does.
        assert gatekeeper.store.claim(runs[0], 0, None).decision is Decision.ADMITTED
        assert gatekeeper.store.release("tasks.t", "k", "r2", token=None).released
        wider = dataclasses.replace(runs[2], run_id="wide", limit=2, max_queue_depth=None)
        assert gatekeeper.store.claim(wider, 0, None).decision is Decision.ADMITTED
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="singleton_tasks"):
            # Two holders (r0, wide) over a limit of 1, and no waiter.
            late = gatekeeper.spec(replace, "r3", (), {})
            assert gatekeeper.register(replace, late).status is Registered.FULL  # no error
        assert "dropped tasks.t run r3: key 'k' is full (on_full='replace')" in caplog.text
        replaced = registry.get_sample_value("singleton_tasks_replaced_total", {"task": "tasks.t"})
        dropped = registry.get_sample_value("singleton_tasks_dropped_total", {"task": "tasks.t"})
    finally:
        metrics._active, metrics._disabled = saved
        gatekeeper.close()
    assert (replaced, dropped) == (1, 1)


def test_run_options_follow_each_bound_config_and_are_kept_for_a_bounded_number() -> None:
    gatekeeper = Gatekeeper(memory(), lease=30.0)
    one, other = bound(limit=1), bound(limit=3, lease=5.0)
    for task, limit, lease in [(one, 1, 30.0), (other, 3, 5.0), (one, 1, 30.0)]:
        run = gatekeeper.spec(task, "r", (), {})
        assert (run.limit, run.lease) == (limit, lease)
    # Bound configs made again and again (each task's is made once by the adapters) are not all kept.
    for limit in range(1, 3000):
        assert gatekeeper.spec(bound(limit=limit), "r", (), {}).limit == limit
    assert len(gatekeeper._spec_cache) <= 1024
    gatekeeper.close()


def test_run_spec_for_run_is_replace_of_the_key_and_run_id() -> None:
    options = RunSpec("s", "", "", limit=3, max_queue_depth=7, lease=5.0, orphan_timeout=None, recheck=2.5)
    run = options.for_run("k", "r")
    assert run == dataclasses.replace(options, key="k", run_id="r")
    assert type(run) is RunSpec and hash(run) == hash(dataclasses.replace(options, key="k", run_id="r"))
    assert (options.key, options.run_id) == ("", "")  # the options are left as they were
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.key = "other"  # type: ignore[misc]
