"""The store contract suite: prove a :class:`~singleton_tasks.stores.base.Store` keeps the rules.

Every bundled store runs this suite, and so can yours (docs/custom-stores.md). Subclass
:class:`StoreContract` in a test module (the class name must start with ``Test`` for pytest to
collect it) and provide a ``store_factory`` fixture: a callable
``store_factory(namespace=None, **options) -> Store``. Every call makes a new store object on the
*same* server (so two stores of one namespace share their data); ``namespace=None`` means one
namespace unique to the running test; ``options`` are passed to the store's constructor (the
suite passes ``clock=`` and sometimes ``retention=``). The factory should create the schema
(``store.migrate()``) and close its stores when the test ends::

    # tests/test_my_store_contract.py
    import uuid

    import pytest

    from my_package import MyStore
    from singleton_tasks.testing import StoreContract


    class TestMyStore(StoreContract):
        @pytest.fixture
        def store_factory(self):
            default = f"t{uuid.uuid4().hex[:12]}"
            made = []

            def make(namespace=None, **options):
                store = MyStore("mystore://127.0.0.1:7000", namespace=namespace or default, **options)
                store.migrate()
                made.append(store)
                return store

            yield make
            for store in made:
                store.close()

The suite is deterministic and never sleeps: it gives every store a :class:`ManualClock` as its
``clock=`` option and moves it by hand, so your store must decide every deadline on that clock
when it is given (and on its own clock otherwise). A store that can pretend another library
version wrote its schema should offer ``set_schema_version_for_tests(version)``; otherwise the
schema-mismatch test is skipped. The test of a host clock under freezegun is skipped when
freezegun is not installed.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import uuid
from collections.abc import Callable, Sequence

import pytest

from . import clock
from .config import Timings
from .errors import SchemaVersionError
from .generations import micros
from .outcomes import (
    PAYLOAD_ON_REQUEST,
    ClaimOutcome,
    Decision,
    HolderRef,
    KeySnapshot,
    PayloadRequest,
    Registered,
    ReleaseOutcome,
    RunSpec,
    RunState,
    Wake,
)
from .stores.base import SCHEMA_VERSION, Store

StoreFactory = Callable[..., Store]


SCOPE = "contract.task"
KEY = "key"
T0 = 1_764_680_000.0  # a realistic epoch second; offsets below are exact binary fractions

__all__ = ["StoreContract", "StoreFactory"]


def spec(
    run_id: str,
    *,
    key: str = KEY,
    scope: str = SCOPE,
    limit: int = 1,
    depth: int | None = None,
    lease: float = 60.0,
    orphan: float | None = 600.0,
    recheck: float = 0.0,
    replace: bool = False,
) -> RunSpec:
    """A run's spec; ``recheck`` (the worker's longest re-check delay) is 0 unless a test needs it,
    so a slot owner unseen for ``orphan`` seconds is issued again."""
    return RunSpec(
        scope=scope,
        key=key,
        run_id=run_id,
        limit=limit,
        max_queue_depth=depth,
        lease=lease,
        orphan_timeout=orphan,
        recheck=recheck,
        replace_when_full=replace,
    )


class ManualClock:
    """A clock a test sets by hand: pass it as a store's ``clock=`` option (test-only).

    The store then decides every deadline at the time this returns instead of reading its own
    clock (Redis ``TIME``, PostgreSQL ``clock_timestamp()``, the host clock), so a test can land
    exactly on a deadline without sleeping.
    """

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def set(self, now: float) -> None:
        self.now = now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def at(store: Store, now: float) -> Store:
    """``store`` with its :class:`ManualClock` set to ``now``: ``at(store, T0 + 5).claim(...)``."""
    clock = store.clock
    if not isinstance(clock, ManualClock):
        raise TypeError(f"{store!r} has no ManualClock: make it with clock=ManualClock()")
    clock.set(now)
    return store


def one_key(store: Store, now: float, *, key: str = KEY, scope: str = SCOPE) -> KeySnapshot | None:
    snaps = at(store, now).snapshot(scope=scope, key=key)
    assert len(snaps) <= 1, snaps
    if snaps:
        assert (snaps[0].scope, snaps[0].key) == (scope, key)
    return snaps[0] if snaps else None


def holders(store: Store, now: float, *, key: str = KEY, scope: str = SCOPE) -> list[str]:
    snap = one_key(store, now, key=key, scope=scope)
    return [h.run_id for h in snap.holders] if snap else []


def waiters(store: Store, now: float, *, key: str = KEY, scope: str = SCOPE) -> list[str]:
    snap = one_key(store, now, key=key, scope=scope)
    if snap is None:
        return []
    assert [w.position for w in snap.waiters] == list(range(1, len(snap.waiters) + 1))
    return [w.run_id for w in snap.waiters]


def registered(
    store: Store,
    run: RunSpec,
    now: float,
    *,
    confirmed: bool = True,
    payload: bytes | None = None,
    delay: float = 0.0,
) -> None:
    outcome = at(store, now).register(run, payload=payload, delay=delay, confirmed=confirmed)
    assert outcome.status is Registered.REGISTERED, (run.run_id, outcome)


def admitted(
    store: Store, run: RunSpec, generation: int, now: float, payload: bytes | PayloadRequest | None = None
) -> int:
    """Claim and require admission; returns the fencing token."""
    outcome = at(store, now).claim(run, generation, payload)
    assert outcome.decision is Decision.ADMITTED, (run.run_id, outcome)
    assert isinstance(outcome.token, int) and outcome.token > 0
    return outcome.token


def gated(
    store: Store,
    run: RunSpec,
    generation: int,
    now: float,
    payload: bytes | None = None,
    *,
    position: int | None = None,
) -> ClaimOutcome:
    """Claim and require a gating (at ``position`` if given); the outcome has the deferral generation."""
    outcome = at(store, now).claim(run, generation, payload)
    assert outcome.decision is Decision.GATED, (run.run_id, outcome)
    assert outcome.generation is not None and outcome.generation != generation
    if position is not None:
        assert outcome.position == position, (run.run_id, outcome)
    return outcome


def stale(store: Store, run: RunSpec, generation: int, now: float) -> None:
    outcome = at(store, now).claim(run, generation, None)
    assert outcome.decision is Decision.STALE, (run.run_id, generation, outcome)
    assert outcome.token is None


def woken(wakes: Sequence[Wake]) -> list[str]:
    return [w.run_id for w in wakes]


def the_wake(wakes: Sequence[Wake], run_id: str) -> Wake:
    assert woken(wakes) == [run_id], wakes
    return wakes[0]


class _Contract:
    """The fixture every topic of the contract uses: ``make_store``, a clock given to every store."""

    @pytest.fixture
    def make_store(self, store_factory: StoreFactory) -> StoreFactory:
        """``store_factory`` with a :class:`ManualClock` for every store unless the test gives a clock."""

        def make(namespace: str | None = None, **options: object) -> Store:
            options.setdefault("clock", ManualClock())
            return store_factory(namespace, **options)

        return make


class _OrderRules(_Contract):
    """Order of admission, slots, and the backlog cap."""

    # -- order (docs/concepts.md#the-life-of-a-run) ------------------------------------------------

    @pytest.mark.parametrize("clock_kind", ["moving", "frozen"])
    def test_fifo_by_registration_order(self, make_store: StoreFactory, clock_kind: str) -> None:
        store = make_store()
        runs = [spec(f"run-{i}") for i in range(5)]
        times = [T0 + i if clock_kind == "moving" else T0 for i in range(5)]
        for run, moment in zip(runs, times, strict=True):
            registered(store, run, moment)
        now = times[-1]
        # Delivered last-registered first: each later one waits behind all earlier ones.
        generations: dict[str, int] = {}
        for i in range(4, 0, -1):
            outcome = gated(store, runs[i], 0, now, f"payload-{i}".encode(), position=i + 1)
            assert outcome.generation is not None
            generations[runs[i].run_id] = outcome.generation
        tokens = [admitted(store, runs[0], 0, now)]
        assert holders(store, now) == ["run-0"]
        assert waiters(store, now) == [f"run-{i}" for i in range(1, 5)]
        # Each release hands the slot to the next in registration order, and only to it.
        for i in range(1, 5):
            release = at(store, now).release(SCOPE, KEY, runs[i - 1].run_id, token=tokens[-1])
            assert release.released and not release.lost
            wake = the_wake(release.wakes, runs[i].run_id)
            assert wake.payload == f"payload-{i}".encode()
            assert wake.generation != generations[runs[i].run_id]
            tokens.append(admitted(store, runs[i], wake.generation, now))
        assert tokens == sorted(set(tokens))
        assert at(store, now).release(SCOPE, KEY, "run-4", token=tokens[-1]).released
        assert at(store, now).snapshot() == []

    def test_order_is_registration_order_not_clock_or_run_id(self, make_store: StoreFactory) -> None:
        store = make_store()
        zz, aa, late = spec("zz"), spec("aa"), spec("00")
        registered(store, zz, T0 + 10)
        registered(store, aa, T0 + 5)  # a producer whose clock is behind: still second in line
        aa_gen = gated(store, aa, 0, T0 + 11, b"aa", position=2).generation
        token = admitted(store, zz, 0, T0 + 12)
        # A late arrival that sorts first (run id and clock) neither displaces the holder
        # nor jumps the line.
        registered(store, late, T0 - 100)
        gated(store, late, 0, T0 + 13, b"00", position=2)
        assert holders(store, T0 + 13) == ["zz"]
        assert waiters(store, T0 + 13) == ["aa", "00"]
        release = at(store, T0 + 14).release(SCOPE, KEY, "zz", token=token)
        wake = the_wake(release.wakes, "aa")
        assert wake.generation != aa_gen
        admitted(store, aa, wake.generation, T0 + 15)

    def test_holders_keep_their_slots_and_limit_above_one(self, make_store: StoreFactory) -> None:
        store = make_store()
        a, b, c, d, e = (spec(name, limit=3) for name in "abcde")
        for i, run in enumerate((a, b, c, d, e)):
            registered(store, run, T0 + i)
        now = T0 + 10
        gated(store, e, 0, now, b"e", position=5)
        tokens = {"c": admitted(store, c, 0, now)}  # among the first three waiters
        e_gen = gated(store, e, 0, now, b"e", position=4).generation
        assert e_gen is not None
        tokens["a"] = admitted(store, a, 0, now)
        tokens["b"] = admitted(store, b, 0, now)
        d_gen = gated(store, d, 0, now, b"d", position=1).generation
        assert sorted(holders(store, now)) == ["a", "b", "c"]
        assert len(set(tokens.values())) == 3
        assert waiters(store, now) == ["d", "e"]
        release = at(store, now + 1).release(SCOPE, KEY, "c", token=tokens["c"])
        wake = the_wake(release.wakes, "d")
        assert wake.generation != d_gen and wake.payload == b"d"
        tokens["d"] = admitted(store, d, wake.generation, now + 2)
        assert tokens["d"] > max(tokens["a"], tokens["b"], tokens["c"])
        release = at(store, now + 3).release(SCOPE, KEY, "a", token=tokens["a"])
        assert the_wake(release.wakes, "e").generation != e_gen

    # -- backlog cap (docs/concepts.md#backlog-cap) ------------------------------------------------

    @pytest.mark.parametrize("depth", [0, 3])
    def test_cap_is_exactly_limit_plus_depth(self, make_store: StoreFactory, depth: int) -> None:
        store = make_store()
        runs = [spec(f"r{i}", limit=2, depth=depth) for i in range(2 + depth + 1)]
        for i, run in enumerate(runs[:-1]):
            outcome = at(store, T0 + i).register(run)
            assert (outcome.status, outcome.in_flight) == (Registered.REGISTERED, i + 1)
        before = at(store, T0 + 50).snapshot()
        rejected = at(store, T0 + 50).register(runs[-1])
        assert (rejected.status, rejected.in_flight) == (Registered.FULL, 2 + depth)
        assert at(store, T0 + 50).snapshot() == before  # nothing written
        # A run already registered is still a no-op at the cap, not a rejection.
        assert at(store, T0 + 50).register(runs[0]).status is Registered.EXISTS
        # Admitted runs count as much as waiting ones.
        token = admitted(store, runs[0], 0, T0 + 51)
        admitted(store, runs[1], 0, T0 + 51)
        assert at(store, T0 + 52).register(runs[-1]).status is Registered.FULL
        assert waiters(store, T0 + 52) == [w.run_id for w in before[0].waiters[2:]]
        # A settled run frees its place in the count.
        assert at(store, T0 + 53).release(SCOPE, KEY, "r0", token=token).released
        accepted = at(store, T0 + 54).register(runs[-1])
        assert (accepted.status, accepted.in_flight) == (Registered.REGISTERED, 2 + depth)
        assert at(store, T0 + 55).register(spec("one-more", limit=2, depth=depth)).status is Registered.FULL

    # -- on_full="replace" (docs/concepts.md#backlog-cap) ------------------------------------------

    def test_replace_takes_the_newest_waiters_place_and_its_copies_are_stale(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        h, w1, w2 = spec("h", depth=2), spec("w1", depth=2), spec("w2", depth=2)
        h_token = admitted(store, h, 0, T0)
        registered(store, w1, T0 + 1, payload=b"w1")
        gated(store, w1, 0, T0 + 1, position=1)
        registered(store, w2, T0 + 2, payload=b"w2")
        w2_deferred = gated(store, w2, 0, T0 + 3, b"w2", position=2).generation
        assert w2_deferred is not None
        new = spec("new", depth=2, replace=True)
        outcome = at(store, T0 + 4).register(new, payload=b"new", confirmed=False)
        assert (outcome.status, outcome.in_flight, outcome.replaced) == (Registered.REPLACED, 3, "w2")
        assert holders(store, T0 + 4) == ["h"]
        assert waiters(store, T0 + 4) == ["w1", "new"]  # the new run stands where w2 stood
        # Every copy of the replaced run is dropped, however late; it is settled, not lost.
        stale(store, w2, 0, T0 + 5)
        stale(store, w2, w2_deferred, T0 + 5)
        stale(store, w2, -1, T0 + 5)  # a duplicate start's copy
        assert at(store, T0 + 6).register(w1).status is Registered.EXISTS  # a start of a run in line
        assert at(store, T0 + 6).register(spec("w1", depth=2, replace=True)).status is Registered.EXISTS
        assert waiters(store, T0 + 6) == ["w1", "new"]
        # The new run keeps the order: it is woken after w1, and runs.
        assert at(store, T0 + 7).confirm(SCOPE, KEY, "new")
        new_deferred = gated(store, new, 0, T0 + 8, b"new", position=2).generation
        assert new_deferred is not None
        wake = the_wake(at(store, T0 + 9).release(SCOPE, KEY, "h", token=h_token).wakes, "w1")
        w1_token = admitted(store, w1, wake.generation, T0 + 10)
        wake = the_wake(at(store, T0 + 11).release(SCOPE, KEY, "w1", token=w1_token).wakes, "new")
        assert wake.payload == b"new"
        new_token = admitted(store, new, wake.generation, T0 + 12)
        assert at(store, T0 + 13).release(SCOPE, KEY, "new", token=new_token).released
        assert one_key(store, T0 + 13) is None

    def test_replace_twice_keeps_one_place_and_the_latest_run(self, make_store: StoreFactory) -> None:
        """``limit=1, max_queue_depth=1``: one running and one queued, with the latest arguments."""
        store = make_store()
        runs = [spec(f"r{i}", depth=1, replace=True) for i in range(5)]
        token = admitted(store, runs[0], 0, T0)
        registered(store, runs[1], T0 + 1, payload=b"1")
        for i in range(2, 5):
            outcome = at(store, T0 + i).register(runs[i], payload=str(i).encode())
            assert (outcome.status, outcome.in_flight, outcome.replaced) == (
                Registered.REPLACED,
                2,
                f"r{i - 1}",
            )
        assert (holders(store, T0 + 5), waiters(store, T0 + 5)) == (["r0"], ["r4"])
        for i in range(1, 4):
            stale(store, runs[i], 0, T0 + 6)
        gated(store, runs[4], 0, T0 + 6, position=1)  # the copy keeps the registered payload
        wake = the_wake(at(store, T0 + 7).release(SCOPE, KEY, "r0", token=token).wakes, "r4")
        assert wake.payload == b"4"
        admitted(store, runs[4], wake.generation, T0 + 8)

    def test_replace_skips_registrations_never_published(self, make_store: StoreFactory) -> None:
        store = make_store()
        admitted(store, spec("h", depth=1), 0, T0)
        registered(store, spec("w", depth=1), T0 + 1, payload=b"w")
        registered(store, spec("unpublished"), T0 + 2, confirmed=False)  # no cap: over it
        later = T0 + 2 + Timings().registration_grace + 1
        outcome = at(store, later).register(spec("new", depth=1, replace=True), payload=b"new")
        assert (outcome.status, outcome.in_flight, outcome.replaced) == (Registered.REPLACED, 2, "w")
        assert (holders(store, later), waiters(store, later)) == (["h"], ["new"])

    def test_replace_with_no_waiter_to_replace_is_full(self, make_store: StoreFactory) -> None:
        """Holders alone over the cap (the limit was lowered): nothing is written."""
        store = make_store()
        for name in ("h1", "h2", "h3"):
            admitted(store, spec(name, limit=3), 0, T0)
        before = at(store, T0 + 1).snapshot()
        outcome = at(store, T0 + 1).register(spec("new", limit=1, depth=1, replace=True), payload=b"new")
        assert (outcome.status, outcome.in_flight, outcome.replaced) == (Registered.FULL, 3, None)
        assert at(store, T0 + 1).snapshot() == before

    def test_racing_replaces_leave_exactly_limit_plus_depth_runs(self, make_store: StoreFactory) -> None:
        store = make_store()
        limit, depth, threads, rounds = 2, 2, 8, 3
        start = threading.Barrier(threads)
        outcomes: list[tuple[str, Registered, str | None]] = []
        errors: list[BaseException] = []

        def producer(index: int) -> None:
            try:
                start.wait()
                for i in range(rounds):
                    run = spec(f"t{index}-{i}", limit=limit, depth=depth, replace=True)
                    got = at(store, T0).register(run, payload=run.run_id.encode())
                    outcomes.append((run.run_id, got.status, got.replaced))
            except BaseException as error:  # reported below
                errors.append(error)

        pool = [threading.Thread(target=producer, args=(i,)) for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        assert errors == []
        statuses = [status for _, status, _ in outcomes]
        assert statuses.count(Registered.REGISTERED) == limit + depth
        assert statuses.count(Registered.REPLACED) == threads * rounds - (limit + depth)
        replaced = [old for _, status, old in outcomes if status is Registered.REPLACED]
        assert len(set(replaced)) == len(replaced)  # each run is replaced at most once
        in_line = waiters(store, T0)
        assert len(in_line) == limit + depth
        assert set(in_line) == {run_id for run_id, _, _ in outcomes} - set(replaced)

    def test_unbounded_backlog_by_default(self, make_store: StoreFactory) -> None:
        store = make_store()
        for i in range(30):
            outcome = at(store, T0).register(spec(f"r{i}"))
            assert (outcome.status, outcome.in_flight) == (Registered.REGISTERED, i + 1)


class _RegistrationRules(_Contract):
    """Registration: dedupe, confirm/unregister, unpublished registrations, first sight."""

    # -- registration (docs/concepts.md#the-life-of-a-run) -----------------------------------------

    def test_dedupe_by_run_id(self, make_store: StoreFactory) -> None:
        store = make_store()
        run = spec("r", depth=5)
        registered(store, run, T0)
        before = at(store, T0 + 1).snapshot()
        again = at(store, T0 + 1).register(run, confirmed=False)
        assert (again.status, again.in_flight) == (Registered.EXISTS, 1)
        assert at(store, T0 + 1).snapshot() == before
        generation = gated(store, spec("other", depth=5), 0, T0 + 2, position=2).generation
        assert generation is not None
        admitted(store, run, 0, T0 + 3)
        before = at(store, T0 + 4).snapshot()
        for run_id in ("r", "other"):  # holding, gated
            again = at(store, T0 + 4).register(spec(run_id, depth=5))
            assert (again.status, again.in_flight) == (Registered.EXISTS, 2)
        assert at(store, T0 + 4).snapshot() == before

    def test_confirm_and_unregister(self, make_store: StoreFactory) -> None:
        store = make_store()
        registered(store, spec("a"), T0, confirmed=False)
        registered(store, spec("b"), T0 + 1, confirmed=False)
        snap = one_key(store, T0 + 1)
        assert snap is not None and [w.confirmed for w in snap.waiters] == [False, False]
        assert [w.state for w in snap.waiters] == [RunState.PENDING, RunState.PENDING]
        assert [w.created_at for w in snap.waiters] == [T0, T0 + 1]
        assert at(store, T0 + 2).confirm(SCOPE, KEY, "a") is True
        assert at(store, T0 + 2).confirm(SCOPE, KEY, "a") is True  # idempotent
        assert at(store, T0 + 2).confirm(SCOPE, KEY, "nobody") is False
        snap = one_key(store, T0 + 2)
        assert snap is not None and [w.confirmed for w in snap.waiters] == [True, False]
        # The failed publish of b is undone: b leaves no trace.
        assert at(store, T0 + 3).unregister(SCOPE, KEY, "b") is True
        assert waiters(store, T0 + 3) == ["a"]
        assert at(store, T0 + 3).unregister(SCOPE, KEY, "b") is False
        assert at(store, T0 + 3).unregister(SCOPE, KEY, "nobody") is False
        # Delivered runs (holders, gated waiters) are not undone by a late unregister.
        token = admitted(store, spec("a"), 0, T0 + 4)
        gated(store, spec("c"), 0, T0 + 4, position=1)
        assert at(store, T0 + 5).unregister(SCOPE, KEY, "a") is False
        assert at(store, T0 + 5).unregister(SCOPE, KEY, "c") is False
        assert holders(store, T0 + 5) == ["a"] and waiters(store, T0 + 5) == ["c"]
        at(store, T0 + 6).release(SCOPE, KEY, "a", token=token)
        at(store, T0 + 6).release(SCOPE, KEY, "c", token=None)
        registered(store, spec("d"), T0 + 7)
        assert at(store, T0 + 8).unregister(SCOPE, KEY, "d") is True
        assert at(store, T0 + 8).snapshot() == []

    def test_confirm_many_is_each_runs_confirm(self, make_store: StoreFactory) -> None:
        """A batch of confirms (a producer's confirm thread) across keys: each run's :meth:`confirm`."""
        store = make_store(timings=Timings(registration_grace=5.0, retention=1000.0))
        runs = [spec(f"r{i}", key=f"k{i % 3}") for i in range(7)]
        for i, run in enumerate(runs):
            registered(store, run, T0 + i * 0.1, confirmed=False)
        admitted(store, runs[0], 0, T0 + 1)  # delivered first: its claim confirmed it already
        batch = [(SCOPE, run.key, run.run_id) for run in runs[:6]] + [(SCOPE, "k0", "nobody")]
        assert at(store, T0 + 2).confirm_many(batch) == [True] * 6 + [False]
        assert at(store, T0 + 2).confirm_many([]) == []
        confirmed = {w.run_id: w.confirmed for snap in at(store, T0 + 2).snapshot() for w in snap.waiters}
        assert confirmed == {"r1": True, "r2": True, "r3": True, "r4": True, "r5": True, "r6": False}
        # Past the grace the unconfirmed r6 counts no more (it is dropped); the confirmed r3 counts.
        assert waiters(store, T0 + 8, key="k0") == ["r3", "r6"]
        assert at(store, T0 + 8).register(spec("late", key="k0", depth=1)).status is Registered.FULL
        assert at(store, T0 + 8).register(spec("late", key="k0", depth=2)).status is Registered.REGISTERED
        assert waiters(store, T0 + 8, key="k0") == ["r3", "late"]

    def test_unpublished_registrations_are_dropped_after_grace(self, make_store: StoreFactory) -> None:
        store = make_store(timings=Timings(registration_grace=5.0, retention=1000.0))
        registered(store, spec("ghost", depth=0), T0, confirmed=False, payload=b"ghost")
        # Within the grace the registration counts: it may still be published.
        full = at(store, T0 + 1).register(spec("r", depth=0))
        assert (full.status, full.in_flight) == (Registered.FULL, 1)
        # After it, its message was never published: it is dropped, never issued, never run.
        accepted = at(store, T0 + 6).register(spec("r", depth=0))
        assert (accepted.status, accepted.in_flight) == (Registered.REGISTERED, 1)
        outcome = at(store, T0 + 6).claim(spec("r", depth=0), 0, None)
        assert outcome.decision is Decision.ADMITTED and outcome.wakes == () and outcome.removed == ()
        assert waiters(store, T0 + 6) == [] and at(store, T0 + 1e6).tick_due() == []
        # Another key: a registration within its grace holds its place in line; past it, the
        # next call on the key drops it and the line moves on.
        registered(store, spec("ghost2", key="k2"), T0, confirmed=False)
        registered(store, spec("kept", key="k2"), T0, confirmed=False)
        registered(store, spec("r2", key="k2"), T0 + 1)
        assert at(store, T0 + 2).confirm(SCOPE, "k2", "kept")
        generation = gated(store, spec("r2", key="k2"), 0, T0 + 2, position=3).generation
        assert generation is not None and waiters(store, T0 + 2, key="k2") == ["ghost2", "kept", "r2"]
        generation = gated(store, spec("r2", key="k2"), generation, T0 + 10, position=2).generation
        assert waiters(store, T0 + 10, key="k2") == ["kept", "r2"]
        admitted(store, spec("kept", key="k2"), 0, T0 + 11)

    def test_late_delivery_of_an_unconfirmed_registration_keeps_its_place(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store(timings=Timings(registration_grace=5.0))
        token = admitted(store, spec("h"), 0, T0)
        registered(store, spec("slow"), T0, confirmed=False)
        registered(store, spec("next"), T0 + 1)
        # Its message was published after all: delivered after the grace, it is no ghost.
        gated(store, spec("slow"), 0, T0 + 30, b"slow", position=1)
        assert waiters(store, T0 + 30) == ["slow", "next"]
        wake = the_wake(at(store, T0 + 31).release(SCOPE, KEY, "h", token=token).wakes, "slow")
        admitted(store, spec("slow"), wake.generation, T0 + 32)

    def test_unregistered_delivery_is_registered_at_first_sight(self, make_store: StoreFactory) -> None:
        store = make_store()
        admitted(store, spec("sent-by-name"), 0, T0)
        # A library copy the store does not know, issued within retention (a store that lost
        # its data): registered too, never dropped.
        gated(store, spec("also-by-name"), micros(T0 - 5), T0 + 1, position=1)
        assert waiters(store, T0 + 1) == ["also-by-name"]


class _HandoffRules(_Contract):
    """Wakes and copies: who is woken, which copy runs, parked registrations, stale copies."""

    # -- wakes and copies (docs/concepts.md#handoff) -----------------------------------------------

    def test_release_wakes_exactly_the_gated_slot_owners(self, make_store: StoreFactory) -> None:
        store = make_store()
        h1, h2, w1, w2, w3 = (spec(name, limit=2) for name in ("h1", "h2", "w1", "w2", "w3"))
        for i, run in enumerate((h1, h2, w1, w2, w3)):
            registered(store, run, T0 + i)
        t1 = admitted(store, h1, 0, T0 + 10)
        t2 = admitted(store, h2, 0, T0 + 10)
        payload = b"\x00w1\xff\r\n binary"
        g1 = gated(store, w1, 0, T0 + 11, payload, position=1).generation
        g3 = gated(store, w3, 0, T0 + 11, b"w3", position=3).generation
        # One slot frees: the first gated waiter owns it, with its payload and a new generation.
        release = at(store, T0 + 12).release(SCOPE, KEY, "h1", token=t1)
        assert release.released and not release.lost
        assert release.wakes == (Wake(SCOPE, KEY, "w1", release.wakes[0].generation, payload),)
        assert release.wakes[0].generation != g1
        # The second slot belongs to w2, which was never delivered: its own message will come.
        release = at(store, T0 + 13).release(SCOPE, KEY, "h2", token=t2)
        assert release.released and release.wakes == ()
        t_w2 = admitted(store, w2, 0, T0 + 14)
        # w1 was woken already; w3 owns the slot w2 frees.
        release = at(store, T0 + 15).release(SCOPE, KEY, "w2", token=t_w2)
        assert the_wake(release.wakes, "w3").generation != g3
        assert the_wake(release.wakes, "w3").payload == b"w3"

    @pytest.mark.parametrize("first", ["woken", "delayed"])
    def test_woken_copy_and_delayed_copy_run_once(self, make_store: StoreFactory, first: str) -> None:
        store = make_store()
        h, w = spec("h"), spec("w")
        registered(store, h, T0)
        registered(store, w, T0 + 1)
        token = admitted(store, h, 0, T0 + 2)
        delayed = gated(store, w, 0, T0 + 3, b"w", position=1).generation
        assert delayed is not None
        wake = the_wake(at(store, T0 + 4).release(SCOPE, KEY, "h", token=token).wakes, "w")
        assert wake.generation not in (0, delayed)
        winner, loser = (wake.generation, delayed) if first == "woken" else (delayed, wake.generation)
        w_token = admitted(store, w, winner, T0 + 5)
        stale(store, w, loser, T0 + 6)
        stale(store, w, 0, T0 + 6)  # the first delivery's copy
        assert holders(store, T0 + 6) == ["w"]
        # After settlement the other copies stay dead and leave nothing behind ...
        assert at(store, T0 + 7).release(SCOPE, KEY, "w", token=w_token).released
        for generation in (loser, 0, 12345):
            stale(store, w, generation, T0 + 8)
        assert at(store, T0 + 8).snapshot() == []
        # ... while the admitted copy coming back (a re-driven dead letter) is a new claim.
        again = admitted(store, w, winner, T0 + 9)
        assert again > w_token

    def test_a_wake_keeps_every_copy_in_flight_live(self, make_store: StoreFactory) -> None:
        # A gated claim names the generation of the copy that re-checks the run, but the worker
        # never learns it (the store applied the claim, then the answer was lost: a WAIT that
        # timed out, a dropped connection), so it re-publishes the delivery it has, with that
        # delivery's own generation. The release that wakes the run loses its answer too (no
        # wake published). The copy actually in flight must still run the run: were it dropped
        # as stale, nothing would run it and the key would wait for the run's re-issue.
        store = make_store()
        h, w = spec("h"), spec("w")
        registered(store, h, T0)
        registered(store, w, T0 + 1)
        token = admitted(store, h, 0, T0 + 2)
        in_flight = gated(store, w, 0, T0 + 3, b"w", position=1).generation
        assert in_flight is not None
        never_published = gated(store, w, in_flight, T0 + 4, b"w", position=1).generation
        assert never_published is not None
        wake = the_wake(at(store, T0 + 5).release(SCOPE, KEY, "h", token=token).wakes, "w")
        admitted(store, w, in_flight, T0 + 6)
        # Admission leaves one live copy: every other one is dropped, the run runs once.
        for generation in (never_published, wake.generation, 0):
            stale(store, w, generation, T0 + 7)
        assert holders(store, T0 + 7) == ["w"]

    @pytest.mark.parametrize("first", ["woken", "held back"])
    def test_a_parked_registration_is_woken_and_runs_once(self, make_store: StoreFactory, first: str) -> None:
        # A run published held back (delayed at enqueue, never delivered) waits gated with its
        # payload: a release wakes it like a deferred delivery, and its held-back copy stays
        # live as the fallback, so whichever copy comes first runs it, once.
        store = make_store()
        h, w, x = spec("h"), spec("w"), spec("x")
        payload = b"\x00w\xff held back"
        for i, (run, sent) in enumerate(((h, b"h"), (w, payload), (x, b"x"))):
            registered(store, run, T0 + i, confirmed=False, payload=sent)
        token = admitted(store, h, 0, T0 + 3)
        assert at(store, T0 + 4).park(SCOPE, KEY, "w") == ()
        assert at(store, T0 + 4).park(SCOPE, KEY, "x") == ()
        snap = one_key(store, T0 + 4)
        assert snap is not None and [(v.run_id, v.state) for v in snap.waiters] == [
            ("w", RunState.GATED),
            ("x", RunState.GATED),
        ]
        wake = the_wake(at(store, T0 + 5).release(SCOPE, KEY, "h", token=token).wakes, "w")
        assert wake.payload == payload and wake.generation != 0
        winner, loser = (wake.generation, 0) if first == "woken" else (0, wake.generation)
        w_token = admitted(store, w, winner, T0 + 6)
        stale(store, w, loser, T0 + 7)
        # x keeps its place behind w and is woken in turn with its own payload.
        release = at(store, T0 + 8).release(SCOPE, KEY, "w", token=w_token)
        assert the_wake(release.wakes, "x").payload == b"x"

    def test_a_parked_registration_that_owns_a_free_slot_wakes_itself(self, make_store: StoreFactory) -> None:
        # The holder settled between the registration and the park: nobody else would wake it.
        store = make_store()
        h, w = spec("h"), spec("w")
        registered(store, h, T0)
        registered(store, w, T0 + 1, confirmed=False, payload=b"w")
        token = admitted(store, h, 0, T0 + 2)
        release = at(store, T0 + 3).release(SCOPE, KEY, "h", token=token)
        assert release.released and release.wakes == ()  # w is pending: its own copy will come
        wake = the_wake(at(store, T0 + 4).park(SCOPE, KEY, "w"), "w")
        assert wake.payload == b"w"
        admitted(store, w, wake.generation, T0 + 5)
        # Parking confirmed it: it is not dropped once the grace has passed.
        assert holders(store, T0 + 600) == ["w"]

    def test_only_a_pending_registration_is_parked(self, make_store: StoreFactory) -> None:
        store = make_store()
        h, w = spec("h"), spec("w")
        registered(store, h, T0, payload=b"h")
        registered(store, w, T0 + 1, payload=b"sent")
        token = admitted(store, h, 0, T0 + 2)
        assert at(store, T0 + 3).park(SCOPE, KEY, "h") == ()  # a holder
        assert holders(store, T0 + 3) == ["h"]
        deferred = gated(store, w, 0, T0 + 3, b"delivered", position=1).generation
        assert at(store, T0 + 4).park(SCOPE, KEY, "w") == ()  # delivered already
        assert at(store, T0 + 4).park(SCOPE, KEY, "nobody") == ()
        wake = the_wake(at(store, T0 + 5).release(SCOPE, KEY, "h", token=token).wakes, "w")
        assert wake.payload == b"delivered"
        assert deferred is not None
        assert waiters(store, T0 + 6) == ["w"]
        # A failed publish is undone before any park: the park then finds nothing to park.
        x = spec("x")
        registered(store, x, T0 + 7, payload=b"x")
        assert at(store, T0 + 8).unregister(SCOPE, KEY, "x")
        assert at(store, T0 + 9).park(SCOPE, KEY, "x") == ()
        assert waiters(store, T0 + 9) == ["w"]
        # A run registered without a payload cannot be parked: only its own copy can run it.
        registered(store, spec("bare"), T0 + 10)
        assert at(store, T0 + 11).park(SCOPE, KEY, "bare") == ()

    def test_stale_copies_dropped_and_redriven_copy_queues(self, make_store: StoreFactory) -> None:
        store = make_store()
        h, w, x = spec("h"), spec("w"), spec("x")
        token = admitted(store, h, 0, T0)
        g1 = gated(store, w, 0, T0 + 1, b"w", position=1).generation
        assert g1 is not None
        g2 = gated(store, w, g1, T0 + 2, b"w", position=1).generation
        assert g2 is not None
        stale(store, w, 0, T0 + 3)  # superseded while waiting
        assert waiters(store, T0 + 3) == ["w"]
        g3 = the_wake(at(store, T0 + 4).release(SCOPE, KEY, "h", token=token).wakes, "w").generation
        w_token = admitted(store, w, g3, T0 + 5)
        for generation in (0, g1, g2):
            stale(store, w, generation, T0 + 6)
        assert at(store, T0 + 7).release(SCOPE, KEY, "w", token=w_token).released
        for generation in (0, g1, g2):
            stale(store, w, generation, T0 + 8)
        assert at(store, T0 + 8).snapshot() == []
        # The re-driven admitted copy queues like any new run behind the current holder.
        admitted(store, x, 0, T0 + 9)
        gated(store, w, g3, T0 + 10, position=1)
        assert waiters(store, T0 + 10) == ["w"]

    def test_a_copy_issued_in_a_write_the_store_lost_is_live(self, make_store: StoreFactory) -> None:
        # An asynchronous failover loses the write that gave a waiter's deferred copy its
        # generation: the promoted replica never saw it. That copy is the run's only one left
        # (the copy before it was acked when it was published): dropped as stale, the run would
        # not run, and its key would wait for the run's re-issue.
        store = make_store()
        h, w = spec("h", lease=60.0), spec("w", lease=60.0)
        token = admitted(store, h, 0, T0)
        known = gated(store, w, 0, T0 + 1, b"w", position=1).generation
        assert known is not None
        lost = known + 5_000_000  # issued at T0 + 6 in a write the store no longer has
        again = gated(store, w, lost, T0 + 7, b"w", position=1).generation  # deferred, not dropped
        assert again is not None and again > lost
        wake = the_wake(at(store, T0 + 8).release(SCOPE, KEY, "h", token=token).wakes, "w")
        w_token = admitted(store, w, wake.generation, T0 + 9)
        busy = at(store, T0 + 10).claim(w, wake.generation, b"w")  # a duplicate while it runs
        assert busy.decision is Decision.BUSY and busy.generation is not None
        assert at(store, T0 + 11).release(SCOPE, KEY, "w", token=w_token).released
        # Re-driven later (first sight), the run's record is new: a copy issued in its earlier
        # life, newer than the re-driven copy, is not mistaken for a lost one.
        admitted(store, w, wake.generation, T0 + 20)
        stale(store, w, busy.generation, T0 + 21)
        assert holders(store, T0 + 21) == ["w"]

    def test_a_waiting_only_settlement_leaves_a_holder_alone(self, make_store: StoreFactory) -> None:
        # A discarded copy (revoked, expired) of a gated run settles it with waiting_only: if
        # another copy of the run was admitted in between, its slot is not the discarded one's.
        store = make_store()
        h, w = spec("h"), spec("w")
        token = admitted(store, h, 0, T0)
        gated(store, w, 0, T0 + 1, b"w", position=1)
        wake = the_wake(at(store, T0 + 2).release(SCOPE, KEY, "h", token=token).wakes, "w")
        admitted(store, w, wake.generation, T0 + 3)
        kept = at(store, T0 + 4).release(SCOPE, KEY, "w", token=None, waiting_only=True)
        assert not kept.released and not kept.lost
        assert holders(store, T0 + 4) == ["w"]
        # A run still waiting is settled as by any release without a token.
        gated(store, spec("x"), 0, T0 + 5, position=1)
        settled = at(store, T0 + 6).release(SCOPE, KEY, "x", token=None, waiting_only=True)
        assert settled.released and waiters(store, T0 + 6) == []
        stale(store, spec("x"), 0, T0 + 7)

    def test_revoked_waiter_copies_are_stale(self, make_store: StoreFactory) -> None:
        store = make_store()
        admitted(store, spec("h"), 0, T0)
        generation = gated(store, spec("w"), 0, T0 + 1, position=1).generation
        assert generation is not None
        release = at(store, T0 + 2).release(SCOPE, KEY, "w", token=None)
        assert release.released and release.wakes == ()
        stale(store, spec("w"), generation, T0 + 3)
        stale(store, spec("w"), 0, T0 + 3)
        stale(store, spec("w"), -1, T0 + 3)  # a duplicate start of the run id (Dramatiq's dead copy)
        assert waiters(store, T0 + 3) == []


class _DeliveryRules(_Contract):
    """Other deliveries of a run: busy copies, woken copies, a suspended holder."""

    # -- other deliveries (docs/concepts.md#what-other-deliveries-see) -----------------------------

    def test_duplicate_of_an_executing_holder_is_busy(self, make_store: StoreFactory) -> None:
        store = make_store()
        h = spec("h", lease=60.0)
        token = admitted(store, h, 0, T0)
        busy = at(store, T0 + 1).claim(h, 0, b"dup")
        assert busy.decision is Decision.BUSY and busy.token is None
        assert busy.generation is not None and busy.generation != 0
        # The deferred duplicate comes back while the holder still runs: busy again.
        again = at(store, T0 + 2).claim(h, busy.generation, b"dup")
        assert again.decision is Decision.BUSY
        assert again.generation is not None and again.generation not in (0, busy.generation)
        snap = one_key(store, T0 + 2)
        assert snap is not None and [(x.run_id, x.token) for x in snap.holders] == [("h", token)]
        assert at(store, T0 + 3).release(SCOPE, KEY, "h", token=token).released
        stale(store, h, again.generation, T0 + 4)
        assert at(store, T0 + 4).snapshot() == []

    def test_a_busy_copy_stays_live_until_its_deferral_is_published(self, make_store: StoreFactory) -> None:
        # A worker defers a busy duplicate (the claim names a new generation), then dies before
        # publishing that copy: the broker redelivers the old one, which must be deferred again,
        # not dropped as stale (nothing else would ever run the run again).
        store = make_store()
        h = spec("h", lease=60.0)
        token = admitted(store, h, 0, T0)
        first = at(store, T0 + 1).claim(h, 0, b"dup")
        assert first.decision is Decision.BUSY and first.generation is not None
        lost = at(store, T0 + 2).claim(h, first.generation, b"dup")  # its copy is never published
        assert lost.decision is Decision.BUSY
        redelivered = at(store, T0 + 3).claim(h, first.generation, b"dup")
        assert redelivered.decision is Decision.BUSY
        assert redelivered.generation is not None
        # The holder's own copy keeps its slot through all of it.
        snap = one_key(store, T0 + 3)
        assert snap is not None and [(x.run_id, x.token) for x in snap.holders] == [("h", token)]
        assert at(store, T0 + 4).release(SCOPE, KEY, "h", token=token).released
        stale(store, h, redelivered.generation, T0 + 5)

    def test_a_woken_waiter_without_payload_keeps_its_undeferred_copy_live(
        self, make_store: StoreFactory
    ) -> None:
        # A waiter gated without a payload (Celery arguments JSON cannot carry) cannot be
        # published by its wake. If its deferred copy was never published (the worker died, or
        # the broker refused it), only the redelivered first copy is left to run it: a release
        # must not make that copy stale, or the run is lost and its key stuck behind it.
        store = make_store()
        h, w = spec("h"), spec("w")
        registered(store, h, T0)
        registered(store, w, T0 + 1)
        token = admitted(store, h, 0, T0 + 2)
        deferred = gated(store, w, 0, T0 + 3, None, position=1).generation  # never published
        wake = the_wake(at(store, T0 + 4).release(SCOPE, KEY, "h", token=token).wakes, "w")
        assert wake.payload is None
        w_token = admitted(store, w, 0, T0 + 5)  # the redelivered first copy
        assert holders(store, T0 + 5) == ["w"]
        assert deferred is not None
        stale(store, w, deferred, T0 + 6)
        stale(store, w, wake.generation, T0 + 6)
        assert at(store, T0 + 7).release(SCOPE, KEY, "w", token=w_token).released
        assert at(store, T0 + 7).snapshot() == []

    def test_a_woken_waiter_runs_from_whichever_live_copy_comes_first(self, make_store: StoreFactory) -> None:
        # A broker redelivers the first copy (its worker died after publishing the deferral):
        # it is still live after the wake, and whichever copy comes first runs the run, once.
        store = make_store()
        h, w = spec("h"), spec("w")
        token = admitted(store, h, 0, T0)
        deferred = gated(store, w, 0, T0 + 1, b"w", position=1).generation
        assert deferred is not None
        wake = the_wake(at(store, T0 + 2).release(SCOPE, KEY, "h", token=token).wakes, "w")
        admitted(store, w, 0, T0 + 3)
        for generation in (deferred, wake.generation):
            stale(store, w, generation, T0 + 4)

    # -- a first delivery's payload on request (gate.claim's PAYLOAD_ON_REQUEST) -------------

    def test_a_first_delivery_waits_on_the_payload_its_registration_stored(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        h, w = spec("h"), spec("w")
        registered(store, h, T0, payload=b"h")
        registered(store, w, T0 + 1, payload=b"w as sent")
        token = admitted(store, h, 0, T0 + 2, PAYLOAD_ON_REQUEST)
        outcome = at(store, T0 + 3).claim(w, 0, PAYLOAD_ON_REQUEST)
        assert outcome.decision is Decision.GATED and outcome.position == 1, outcome
        wake = the_wake(at(store, T0 + 4).release(SCOPE, KEY, "h", token=token).wakes, "w")
        assert wake.payload == b"w as sent"

    def test_a_payload_on_request_is_asked_for_before_anything_is_written(
        self, make_store: StoreFactory
    ) -> None:
        # Never registered (first sight), or registered without a payload: a waiter would have no
        # message to be issued from, so the store asks for it and writes nothing meanwhile.
        store = make_store()
        h, w, bare = spec("h"), spec("w"), spec("bare")
        token = admitted(store, h, 0, T0)
        registered(store, bare, T0 + 1)
        before = one_key(store, T0 + 2)
        for run in (w, bare):
            asked = at(store, T0 + 2).claim(run, 0, PAYLOAD_ON_REQUEST)
            assert asked == ClaimOutcome(Decision.PAYLOAD_NEEDED), asked
        assert one_key(store, T0 + 2) == before
        gated(store, w, 0, T0 + 3, b"w delivered", position=2)
        gated(store, bare, 0, T0 + 3, b"bare delivered", position=1)
        wake = the_wake(at(store, T0 + 4).release(SCOPE, KEY, "h", token=token).wakes, "bare")
        assert wake.payload == b"bare delivered"

    def test_a_holder_needs_no_payload_on_request(self, make_store: StoreFactory) -> None:
        store = make_store()
        h = spec("h", lease=60.0)
        token = admitted(store, h, 0, T0)  # an admitted run keeps no payload
        busy = at(store, T0 + 1).claim(h, 0, PAYLOAD_ON_REQUEST)  # a redelivered first copy
        assert busy.decision is Decision.BUSY, busy
        assert at(store, T0 + 2).release(SCOPE, KEY, "h", token=token).released

    def test_suspended_holder_is_readmitted_on_its_own_slot(self, make_store: StoreFactory) -> None:
        store = make_store()
        h, w = spec("h"), spec("w")
        token = admitted(store, h, 0, T0)
        generation = gated(store, w, 0, T0 + 1, position=1).generation
        assert generation is not None
        assert at(store, T0 + 2).suspend(SCOPE, KEY, "h", token + 1000, delay=30.0) is False
        assert at(store, T0 + 2).suspend(SCOPE, KEY, "w", token, delay=30.0) is False
        assert at(store, T0 + 2).suspend(SCOPE, KEY, "h", token, delay=30.0) is True
        snap = one_key(store, T0 + 2)
        assert snap is not None and len(snap.holders) == 1
        assert snap.holders[0].executing is False
        assert snap.holders[0].lease_expires_at == T0 + 2 + 30.0 + 60.0
        # The slot stays the retrying run's ...
        gated(store, w, generation, T0 + 3, position=1)
        # ... and its retry is admitted at once, well within its lease, with a new token.
        outcome = at(store, T0 + 32).claim(h, 0, None)
        assert outcome.decision is Decision.ADMITTED and outcome.takeover is False
        assert outcome.token is not None and outcome.token > token
        assert holders(store, T0 + 32) == ["h"]


class _LeaseRules(_Contract):
    """Leases: takeover, orphaned holders evicted, heartbeats, releases by token or by an operator."""

    # -- leases and eviction (docs/concepts.md#leases) --------------------------------------------

    def test_takeover_after_lease_lapse(self, make_store: StoreFactory) -> None:
        store = make_store()
        h = spec("h", lease=10.0)
        token = admitted(store, h, 0, T0)
        assert at(store, T0 + 9.5).claim(h, 0, None).decision is Decision.BUSY
        takeover = at(store, T0 + 10).claim(h, 0, None)  # the lease ends at T0 + 10
        assert takeover.decision is Decision.ADMITTED and takeover.takeover is True
        assert takeover.token is not None and takeover.token > token
        snap = one_key(store, T0 + 10)
        assert snap is not None and [(x.run_id, x.token) for x in snap.holders] == [("h", takeover.token)]
        # The presumed-dead first copy learns it lost the slot.
        assert at(store, T0 + 11).heartbeat([HolderRef(SCOPE, KEY, "h", token)]).lost == ("h",)
        lost = at(store, T0 + 12).release(SCOPE, KEY, "h", token=token)
        assert lost.released is False and lost.lost is True
        assert holders(store, T0 + 12) == ["h"]
        assert at(store, T0 + 13).release(SCOPE, KEY, "h", token=takeover.token).released

    def test_release_with_another_holders_token_is_lost(self, make_store: StoreFactory) -> None:
        store = make_store()
        ta = admitted(store, spec("a", limit=2), 0, T0)
        tb = admitted(store, spec("b", limit=2), 0, T0)
        lost = at(store, T0 + 1).release(SCOPE, KEY, "a", token=tb)
        assert lost.released is False and lost.lost is True
        assert sorted(holders(store, T0 + 1)) == ["a", "b"]
        assert at(store, T0 + 2).release(SCOPE, KEY, "a", token=ta).released

    def test_orphaned_holder_evicted_and_next_waiter_woken(self, make_store: StoreFactory) -> None:
        store = make_store()
        h = spec("h", lease=10.0, orphan=100.0)
        w1, w2 = spec("w1", lease=10.0, orphan=1000.0), spec("w2", lease=10.0, orphan=1000.0)
        token = admitted(store, h, 0, T0)
        g1 = gated(store, w1, 0, T0 + 1, b"w1", position=1).generation
        g2 = gated(store, w2, 0, T0 + 2, b"w2", position=2).generation
        assert g2 is not None
        # Lease ended at T0 + 10; orphaned only strictly after T0 + 110.
        outcome = gated(store, w2, g2, T0 + 110, b"w2", position=2)
        assert outcome.evicted == () and outcome.wakes == ()
        assert outcome.generation is not None
        outcome = gated(store, w2, outcome.generation, T0 + 110.5, b"w2", position=2)
        assert outcome.evicted == ("h",)
        wake = the_wake(outcome.wakes, "w1")
        assert wake.payload == b"w1" and wake.generation != g1
        assert holders(store, T0 + 110.5) == []
        admitted(store, w1, wake.generation, T0 + 111)
        lost = at(store, T0 + 112).release(SCOPE, KEY, "h", token=token)
        assert lost.released is False and lost.lost is True
        assert at(store, T0 + 112).heartbeat([HolderRef(SCOPE, KEY, "h", token)]).lost == ("h",)

    def test_eviction_on_release_of_another_run(self, make_store: StoreFactory) -> None:
        store = make_store()
        h = spec("h", lease=10.0, orphan=100.0)
        w1, w2 = spec("w1", orphan=1000.0), spec("w2", orphan=1000.0)
        admitted(store, h, 0, T0)
        gated(store, w1, 0, T0 + 1, b"w1", position=1)
        gated(store, w2, 0, T0 + 2, b"w2", position=2)
        release = at(store, T0 + 200).release(SCOPE, KEY, "w2", token=None)  # w2 revoked
        assert release.released and release.evicted == ("h",)
        assert the_wake(release.wakes, "w1").payload == b"w1"

    def test_eviction_by_any_call_hands_the_slot_on(self, make_store: StoreFactory) -> None:
        """A busy duplicate, a stale copy or a lost release that evicts an orphan also wakes."""
        for case in ("busy", "stale", "lost"):
            store = make_store(namespace=None)
            key = f"evict-{case}"
            orphan = spec("o", key=key, limit=2, lease=10.0, orphan=100.0)
            live = spec("l", key=key, limit=2, lease=1000.0, orphan=100.0)
            waiter = spec("w", key=key, limit=2, orphan=1000.0)
            admitted(store, orphan, 0, T0)
            live_token = admitted(store, live, 0, T0)
            gated(store, waiter, 0, T0 + 1, b"w", position=1)
            later = T0 + 200  # the orphan's lease ended at T0 + 10: evicted after T0 + 110
            outcome: ClaimOutcome | ReleaseOutcome
            if case == "busy":
                outcome = at(store, later).claim(live, 0, None)
                assert outcome.decision is Decision.BUSY
            elif case == "stale":
                gone = spec("gone", key=key, limit=2, orphan=100.0)
                at(store, T0).register(gone)
                at(store, T0 + 2).release(SCOPE, key, "gone", token=None, generation=3)
                outcome = at(store, later).claim(gone, 4, None)
                assert outcome.decision is Decision.STALE
            else:
                outcome = at(store, later).release(SCOPE, key, "l", token=live_token + 99)
                assert outcome.lost
            assert outcome.evicted == ("o",), case
            assert the_wake(outcome.wakes, "w").payload == b"w", case

    def test_orphan_timeout_none_never_evicts_nor_issues_again(self, make_store: StoreFactory) -> None:
        store = make_store()
        h = spec("h", lease=10.0, orphan=None)
        w = spec("w", lease=10.0, orphan=None)
        admitted(store, h, 0, T0)
        outcome = gated(store, w, 0, T0 + 1, position=1)
        assert outcome.generation is not None
        outcome = gated(store, w, outcome.generation, T0 + 1e6, position=1)
        assert outcome.evicted == () and holders(store, T0 + 1e6) == ["h"]
        # A waiter never delivered keeps its place forever too.
        registered(store, spec("p", key="k2", orphan=None), T0)
        gated(store, spec("q", key="k2", orphan=None), 0, T0 + 1e6, position=2)

    def test_heartbeat_is_batched_and_reports_lost_slots(self, make_store: StoreFactory) -> None:
        store = make_store()
        h1 = spec("h1", limit=2, lease=10.0)
        h3 = spec("h3", limit=2, lease=10.0)
        h2 = spec("h2", key="k2", lease=10.0)
        t1, t2, t3 = admitted(store, h1, 0, T0), admitted(store, h2, 0, T0), admitted(store, h3, 0, T0)
        assert at(store, T0 + 1).heartbeat([]).lost == ()
        refs = [
            HolderRef(SCOPE, KEY, "h1", t1),
            HolderRef(SCOPE, "k2", "h2", t2),
            HolderRef(SCOPE, KEY, "h3", t3 + 1000),  # not its token
            HolderRef(SCOPE, "k2", "nobody", t2),
        ]
        assert sorted(at(store, T0 + 8).heartbeat(refs).lost) == ["h3", "nobody"]
        snap1, snap2 = one_key(store, T0 + 8), one_key(store, T0 + 8, key="k2")
        assert snap1 is not None and snap2 is not None
        leases = {x.run_id: (x.heartbeat_at, x.lease_expires_at) for x in snap1.holders + snap2.holders}
        assert leases == {"h1": (T0 + 8, T0 + 18), "h2": (T0 + 8, T0 + 18), "h3": (T0, T0 + 10)}
        # Heartbeated holders are still executing past their first lease; h3 is taken over.
        assert at(store, T0 + 15).claim(h1, 0, None).decision is Decision.BUSY
        assert at(store, T0 + 15).claim(h2, 0, None).decision is Decision.BUSY
        takeover = at(store, T0 + 15).claim(h3, 0, None)
        assert takeover.decision is Decision.ADMITTED and takeover.takeover

    def test_operator_release(self, make_store: StoreFactory) -> None:
        store = make_store()
        admitted(store, spec("h"), 0, T0)
        gated(store, spec("w"), 0, T0 + 1, b"w", position=1)
        registered(store, spec("p", key="k2"), T0 + 2)
        outcome = at(store, T0 + 3).operator_release("h")
        assert outcome is not None and outcome.released
        assert the_wake(outcome.wakes, "w").payload == b"w"
        assert at(store, T0 + 3).operator_release("nobody") is None
        outcome = at(store, T0 + 4).operator_release("p")
        assert outcome is not None and outcome.released
        assert one_key(store, T0 + 4, key="k2") is None
        stale(store, spec("p", key="k2"), 0, T0 + 5)

    def test_release_is_idempotent(self, make_store: StoreFactory) -> None:
        store = make_store()
        token = admitted(store, spec("h"), 0, T0)
        first = at(store, T0 + 1).release(SCOPE, KEY, "h", token=token)
        assert first.released and not first.lost
        second = at(store, T0 + 2).release(SCOPE, KEY, "h", token=token)
        assert (second.released, second.lost, second.wakes) == (False, False, ())
        registered(store, spec("w"), T0 + 3)
        assert at(store, T0 + 4).release(SCOPE, KEY, "w", token=None).released
        third = at(store, T0 + 5).release(SCOPE, KEY, "w", token=None)
        assert (third.released, third.lost) == (False, False)


class _DataRules(_Contract):
    """Namespaces, scopes, keys as data, times and snapshots."""

    # -- isolation and data (docs/deployment.md#choosing-a-store) ----------------------------------

    def test_namespaces_isolate(self, make_store: StoreFactory) -> None:
        tag = uuid.uuid4().hex[:10]
        left, right = make_store(namespace=f"left{tag}"), make_store(namespace=f"right{tag}")
        registered(left, spec("a"), T0)
        registered(right, spec("a"), T0)  # same scope, key and run id: another application
        registered(right, spec("b"), T0)
        admitted(left, spec("a"), 0, T0 + 1)
        admitted(right, spec("a"), 0, T0 + 1)
        seen = [(s.key, [h.run_id for h in s.holders]) for s in at(left, T0 + 1).snapshot()]
        assert seen == [(KEY, ["a"])] and waiters(left, T0 + 1) == []
        assert waiters(right, T0 + 1) == ["b"]
        assert at(left, T0 + 2).operator_release("b") is None
        assert at(right, T0 + 2).operator_release("b") is not None
        assert at(left, T0 + 2).snapshot() != [] and waiters(right, T0 + 2) == []

    def test_same_namespace_shares(self, make_store: StoreFactory) -> None:
        named = f"shared{uuid.uuid4().hex[:10]}"
        pairs = [
            (make_store(), make_store()),
            (make_store(namespace=named), make_store(namespace=named)),
        ]
        for one, two in pairs:
            registered(one, spec("a"), T0)
            assert at(two, T0).register(spec("a")).status is Registered.EXISTS
            token = admitted(two, spec("a"), 0, T0 + 1)
            assert holders(one, T0 + 1) == ["a"]
            gated(one, spec("b"), 0, T0 + 2, position=1)
            assert the_wake(at(two, T0 + 3).release(SCOPE, KEY, "a", token=token).wakes, "b")
            at(one, T0 + 4).release(SCOPE, KEY, "b", token=None)

    def test_empty_key_leaves_nothing_but_its_token_counter(self, make_store: StoreFactory) -> None:
        store = make_store()
        token = admitted(store, spec("a"), 0, T0)
        gated(store, spec("b"), 0, T0 + 1, position=1)
        at(store, T0 + 2).release(SCOPE, KEY, "b", token=None)
        at(store, T0 + 3).release(SCOPE, KEY, "a", token=token)
        assert at(store, T0 + 3).snapshot() == []
        assert at(store, T0 + 3).snapshot(scope=SCOPE, key=KEY) == []
        stale(store, spec("b"), 0, T0 + 4)  # a dropped copy writes nothing either
        registered(store, spec("c"), T0 + 5)
        assert at(store, T0 + 6).unregister(SCOPE, KEY, "c")
        assert at(store, T0 + 6).snapshot() == []
        # After a long idle (every settled marker expired), tokens still only go up.
        later = T0 + 10 * 86400
        second = admitted(store, spec("d"), 0, later)
        assert second > token
        snap = one_key(store, later)
        assert snap is not None and snap.token == second

    def test_fencing_tokens_strictly_increase_per_key(self, make_store: StoreFactory) -> None:
        store = make_store()
        seen: dict[str, list[int]] = {KEY: [], "k2": []}
        now = T0
        for round_ in range(3):
            for key in (KEY, "k2"):
                run = spec(f"{key}-{round_}", key=key, limit=2, lease=5.0)
                token = admitted(store, run, 0, now)
                seen[key].append(token)
                assert at(store, now).suspend(SCOPE, key, run.run_id, token, delay=1.0)
                token = admitted(store, run, 0, now + 1)  # the retry
                seen[key].append(token)
                takeover = at(store, now + 7).claim(run, 0, None)  # lease lapsed: redelivered
                assert takeover.decision is Decision.ADMITTED and takeover.token is not None
                seen[key].append(takeover.token)
                assert at(store, now + 8).release(SCOPE, key, run.run_id, token=takeover.token).released
            now += 10
        for tokens in seen.values():
            assert all(a < b for a, b in itertools.pairwise(tokens)), tokens

    def test_scopes_isolate_keys_of_the_same_text(self, make_store: StoreFactory) -> None:
        store = make_store()
        pairs = [("s1", "k"), ("s2", "k"), ("a:b", "c"), ("a", "b:c"), ("a", "b"), ("a:", "b"), ("a", ":b")]
        for scope, key in pairs:
            admitted(store, spec("same-run-id", scope=scope, key=key), 0, T0)
        snaps = at(store, T0).snapshot()
        assert sorted((s.scope, s.key) for s in snaps) == sorted(pairs)
        assert all([h.run_id for h in s.holders] == ["same-run-id"] for s in snaps)
        in_a = sorted((s.scope, s.key) for s in at(store, T0).snapshot(scope="a"))
        assert in_a == sorted([("a", "b:c"), ("a", "b"), ("a", ":b")])
        assert [(s.scope, s.key) for s in at(store, T0).snapshot(scope="a", key="b")] == [("a", "b")]

    KEYS_AS_DATA: tuple[str, ...] = (
        "{braces}",
        "{store_id}",
        "}{",
        "'single'",
        '"double"',
        "line\nbreak\r\n",
        "100%",
        "%s%d%%",
        "--",
        "' ; -- ]] [[ ?",
        "a'); DROP TABLE runs; --",
        "]]..redis.call('flushall')..[[",
        "?",
        "$1",
        "\\backslash\\",
        "tab\there",
        "emoji 🦄🚀",
        "x" * 512,
        "x" * 511 + "y",
        "k",
        "k:",
        "k:1",
        " ",
        "*",
    )

    KEYS_WITH_NUL: tuple[str, ...] = ("\0", "nul\0inside", "' ; -- ]] [[ \0?", "nul\0")

    def test_keys_are_data(self, make_store: StoreFactory) -> None:
        self._keys_round_trip(make_store(), self.KEYS_AS_DATA)

    def test_keys_with_nul_are_data(self, make_store: StoreFactory) -> None:
        # A key is any str; NUL is where C strings and SQL text columns cut it short.
        self._keys_round_trip(make_store(), self.KEYS_WITH_NUL)

    def _keys_round_trip(self, store: Store, keys: Sequence[str]) -> None:
        assert len(set(keys)) == len(keys)
        tokens = {}
        for i, key in enumerate(keys):
            registered(store, spec(key, key=key), T0)  # the run id is the same text
            tokens[key] = admitted(store, spec(key, key=key), 0, T0 + 1)
            gated(store, spec(f"w{i}", key=key), 0, T0 + 2, key.encode(), position=1)
        snaps = at(store, T0 + 3).snapshot()
        assert sorted(s.key for s in snaps) == sorted(keys)
        for i, key in enumerate(keys):
            snap = one_key(store, T0 + 3, key=key)
            assert snap is not None
            assert [h.run_id for h in snap.holders] == [key]
            assert [w.run_id for w in snap.waiters] == [f"w{i}"]
        for i, key in enumerate(keys):
            release = at(store, T0 + 4).release(SCOPE, key, key, token=tokens[key])
            assert release.released
            wake = the_wake(release.wakes, f"w{i}")
            assert (wake.scope, wake.key, wake.payload) == (SCOPE, key, key.encode())
        weird_scope = "scope ' ; -- {x} \n 🦄"
        admitted(store, spec("r", scope=weird_scope, key="' ; --"), 0, T0 + 5)
        assert [(s.scope, s.key) for s in at(store, T0 + 5).snapshot(scope=weird_scope)] == [
            (weird_scope, "' ; --")
        ]

    def test_times_round_trip_exactly(self, make_store: StoreFactory) -> None:
        store = make_store()
        registered_at = 1764680000.123456  # time.time() precision survives the store
        admitted_at = registered_at + 0.000001
        registered(store, spec("a"), registered_at)
        registered(store, spec("b"), registered_at)
        admitted(store, spec("a", lease=60.0), 0, admitted_at)
        snap = one_key(store, admitted_at)
        assert snap is not None
        assert snap.waiters[0].created_at == registered_at
        holder = snap.holders[0]
        assert (holder.admitted_at, holder.heartbeat_at) == (admitted_at, admitted_at)
        assert holder.lease_expires_at == admitted_at + 60.0
        assert holder.executing is True

    def test_snapshot_filters_and_shows_limit_and_token(self, make_store: StoreFactory) -> None:
        store = make_store()
        token = admitted(store, spec("a", limit=3), 0, T0)
        registered(store, spec("b", limit=3), T0 + 1)
        admitted(store, spec("c", scope="other"), 0, T0)
        snap = one_key(store, T0 + 2)
        assert snap is not None
        assert (snap.limit, snap.token) == (3, token)
        assert [w.state for w in snap.waiters] == [RunState.PENDING]
        everything = sorted((s.scope, s.key) for s in at(store, T0 + 2).snapshot())
        assert everything == [(SCOPE, KEY), ("other", KEY)]
        assert [s.scope for s in at(store, T0 + 2).snapshot(scope="other")] == ["other"]
        assert at(store, T0 + 2).snapshot(key="missing") == []

    def test_snapshot_shows_payload_sizes_and_live_generations(self, make_store: StoreFactory) -> None:
        store = make_store()
        payload = b"\x00message\xff" * 100  # bytes, not text: measured as stored
        registered(store, spec("a"), T0, payload=b"holder's message")
        registered(store, spec("b"), T0, payload=payload)
        registered(store, spec("c"), T0)  # sent without a message to issue again
        registered(store, spec("d"), T0, payload=b"")  # an empty message is a message
        admitted(store, spec("a"), 0, T0 + 1)
        deferral = gated(store, spec("b"), 0, T0 + 2, payload).generation
        assert deferral is not None
        snap = one_key(store, T0 + 3)
        assert snap is not None
        (holder,) = snap.holders
        assert holder.payload_bytes is None  # admitted: never issued again, its message is dropped
        assert holder.live_generations == (0,)
        sizes = {w.run_id: w.payload_bytes for w in snap.waiters}
        assert sizes == {"b": len(payload), "c": None, "d": 0}
        lives = {w.run_id: w.live_generations for w in snap.waiters}
        # b: the copy delivered and the deferred copy it was replaced by, until one of them acts.
        assert lives == {"b": tuple(sorted((0, deferral))), "c": (0,), "d": (0,)}


class _TimeRules(_Contract):
    """Schema versions, the store's clock, the line at any age, re-issues, retention and tokens."""

    # -- schema and time (docs/deployment.md#clocks-and-skew) --------------------------------------

    def test_schema_version_mismatch_is_refused(self, make_store: StoreFactory) -> None:
        store = make_store()
        store.check_schema()
        assert store.schema_version() == SCHEMA_VERSION
        setter = getattr(store, "set_schema_version_for_tests", None)
        if setter is None:
            pytest.skip(f"{type(store).__name__} has no set_schema_version_for_tests(version)")
        try:
            setter(SCHEMA_VERSION + 1)
            assert store.schema_version() == SCHEMA_VERSION + 1
            with pytest.raises(SchemaVersionError, match="migrate"):
                store.check_schema()
        finally:
            setter(SCHEMA_VERSION)
        store.check_schema()

    def test_decisions_use_the_store_clock_not_the_callers(self, store_factory: StoreFactory) -> None:
        """Without a test clock a store decides on its own clock; a caller's skewed clock changes nothing.

        A one-host store's clock is the host's (``clock_source = "host"``): it follows freezegun.
        A server's clock (``"server"``) is shared by every host: callers skewed by ±900 s or
        +59 s still see a live lease as live and an unpublished registration within its grace.
        """
        freezegun = pytest.importorskip("freezegun")
        store = store_factory()  # its own clock
        if store.clock_source == "host":
            with freezegun.freeze_time("2026-12-02 12:00:00"):
                assert store.time() == clock.now()
            return
        assert store.clock_source == "server", store.clock_source
        real = store.time()
        assert abs(real - clock.now()) < 60, "this test expects the server and the test host to agree"
        h = spec("h", lease=30.0, orphan=100.0)
        ghost = spec("ghost", key="k2", depth=0)
        ignore = ["redis", "psycopg", "psycopg_pool", "hiredis"]
        for skew in (900.0, -900.0, 59.0):
            host_clock = datetime.datetime.fromtimestamp(real + skew, tz=datetime.timezone.utc)
            with freezegun.freeze_time(host_clock, tick=True, ignore=ignore):
                first = store.claim(h, 0, None)
                if skew == 900.0:
                    assert first.decision is Decision.ADMITTED
                    store.register(ghost, confirmed=False)
                else:  # the holder of the first pass still runs under its live lease
                    assert first.decision is Decision.BUSY, (skew, first)
                # A busy duplicate never takes over a live lease, whatever the caller's clock.
                assert store.claim(h, 0, None).decision is Decision.BUSY, skew
                beat = store.heartbeat([HolderRef(SCOPE, KEY, "h", first.token or 0)] if first.token else [])
                assert abs(beat.store_time - real) < 30, (skew, beat.store_time, real)
                # The unpublished registration is within its grace on the store's clock.
                assert store.register(spec("next", key="k2", depth=0)).status is Registered.FULL, skew
        snap = store.snapshot(scope=SCOPE, key=KEY)[0]
        assert abs(snap.holders[0].admitted_at - real) < 30

    # -- the line keeps every run (docs/concepts.md#the-line) -------------------------------------

    @pytest.mark.parametrize("state", ["pending", "gated"])
    def test_every_unsettled_run_counts_and_keeps_its_place_at_any_age(
        self, make_store: StoreFactory, state: str
    ) -> None:
        """A queue backlog, a long delay or a parked copy never lifts the cap nor lets a later run
        take an earlier one's turn, however long its copies take."""
        store = make_store(timings=Timings(retention=1e9))
        first, later = spec("first", orphan=100.0, recheck=10.0), spec("later", orphan=100.0, recheck=10.0)
        token = admitted(store, spec("h", orphan=None), 0, T0)
        registered(store, first, T0, payload=b"sent")
        if state == "gated":
            gated(store, first, 0, T0 + 1, b"delivered", position=1)
        month = T0 + 30 * 86_400.0
        capped = spec("capped", depth=1)  # h, first: the key is at its cap
        assert at(store, month).register(capped).status is Registered.FULL
        gated(store, later, 0, month + 1, b"later", position=2)
        wake = the_wake(at(store, month + 2).release(SCOPE, KEY, "h", token=token).wakes, "first")
        assert wake.payload == (b"sent" if state == "pending" else b"delivered")
        # The later run's re-checks never take the free slot from the run ahead of it.
        gated(store, later, 0, month + 3, position=2)
        admitted(store, first, wake.generation, month + 4)

    @pytest.mark.parametrize("state", ["pending", "woken"])
    def test_a_slot_owner_whose_copies_are_lost_is_issued_again(
        self, make_store: StoreFactory, state: str
    ) -> None:
        """A purged queue, a lost wake: the store issues the run again from its payload, once per
        bound (orphan timeout + re-check after it was last seen or issued), by any call on the
        key or by ``tick_due``; whichever copy comes first runs it, once."""
        store = make_store(timings=Timings(retention=10_000.0))
        lost = spec("lost", orphan=100.0, recheck=10.0)
        token = admitted(store, spec("h", orphan=None), 0, T0)
        registered(store, lost, T0, payload=b"sent")
        payload, since = b"sent", T0
        if state == "woken":
            gated(store, lost, 0, T0 + 1, b"delivered", position=1)  # its deferred copy is lost
            payload = b"delivered"
        release = at(store, T0 + 2).release(SCOPE, KEY, "h", token=token)
        if state == "pending":
            assert release.wakes == ()  # its own message is on its way
        else:
            assert the_wake(release.wakes, "lost").payload == payload  # and this wake is lost
            since = T0 + 2
        bound = since + 110.0
        assert at(store, bound - 0.5).tick_due() == []
        due = at(store, bound + 0.5).tick_due()
        assert [(d.scope, d.key, d.evicted, d.removed) for d in due] == [(SCOPE, KEY, (), ())]
        first = the_wake(due[0].wakes, "lost")
        assert first.payload == payload
        # Issued once per bound: neither the heartbeat nor another run's call issues it again yet.
        assert at(store, bound + 1).tick_due() == []
        other = spec("other", orphan=100.0, recheck=10.0)
        assert gated(store, other, 0, bound + 2, b"other", position=2).wakes == ()
        # Still unseen one bound later: issued again, by any call on the key.
        again = at(store, bound + 0.5 + 110.5).claim(other, 0, b"other")
        assert again.decision is Decision.GATED
        second = the_wake(again.wakes, "lost")
        assert second.generation > first.generation and second.payload == payload
        # Every copy stays live until one is admitted; the rest are stale after that.
        admitted(store, lost, first.generation, bound + 300)
        for generation in (0, second.generation):
            stale(store, lost, generation, bound + 301)

    def test_a_run_sent_with_a_delay_is_not_issued_before_its_delay_is_up(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        delayed = spec("delayed", orphan=100.0, recheck=10.0)
        registered(store, delayed, T0, payload=b"later", delay=3600.0)
        assert at(store, T0 + 3600 + 109.5).tick_due() == []
        due = at(store, T0 + 3600 + 110.5).tick_due()
        assert [woken(d.wakes) for d in due] == [["delayed"]]
        # Its own copy, delivered at last, runs it; the issued copy is then stale.
        admitted(store, delayed, 0, T0 + 3600 + 111)
        stale(store, delayed, due[0].wakes[0].generation, T0 + 3600 + 112)

    def test_a_waiter_nothing_reaches_is_abandoned_after_retention(self, make_store: StoreFactory) -> None:
        """Its task is gone from every worker, or its payload cannot be published: issued again
        and again, it is removed once nothing of it reached the store for ``retention``."""
        store = make_store(timings=Timings(retention=500.0))
        gone, later = spec("gone", orphan=100.0, recheck=10.0), spec("later", orphan=100.0, recheck=10.0)
        token = admitted(store, spec("h", orphan=None), 0, T0)
        registered(store, gone, T0, payload=b"gone")
        gated(store, later, 0, T0 + 1, b"later", position=2)
        assert at(store, T0 + 2).release(SCOPE, KEY, "h", token=token).wakes == ()
        assert [woken(d.wakes) for d in at(store, T0 + 110.5).tick_due()] == [["gone"]]
        assert [woken(d.wakes) for d in at(store, T0 + 499).tick_due()] == [["gone"]]
        due = at(store, T0 + 610).tick_due()
        assert [(d.removed, woken(d.wakes)) for d in due] == [(("gone",), ["later"])]
        assert waiters(store, T0 + 610) == ["later"]
        # A copy that still comes is a new claim at the back of the line, not lost.
        assert at(store, T0 + 611).claim(gone, 0, b"gone").decision is Decision.GATED

    def test_the_line_never_sticks_behind_a_run_that_cannot_be_issued(self, make_store: StoreFactory) -> None:
        """A lost run with no payload (Celery arguments JSON cannot carry) is abandoned after
        ``retention`` rather than holding its key forever; a run delayed longer than retention is
        issued once before it can be abandoned."""
        store = make_store(timings=Timings(retention=500.0))
        bare, behind = spec("bare", orphan=100.0, recheck=10.0), spec("behind", orphan=100.0, recheck=10.0)
        registered(store, bare, T0)  # no payload, its message lost
        gated(store, behind, 0, T0 + 1, b"behind", position=2)
        assert at(store, T0 + 499).tick_due() == []
        due = at(store, T0 + 500.5).tick_due()
        assert [(d.removed, woken(d.wakes)) for d in due] == [(("bare",), ["behind"])]
        late = spec("late", key="k2", orphan=100.0, recheck=10.0)
        registered(store, late, T0, payload=b"late", delay=1000.0)
        issued = [woken(d.wakes) for d in at(store, T0 + 1110.5).tick_due() if d.key == "k2"]
        assert issued == [["late"]]
        assert [d.removed for d in at(store, T0 + 1221).tick_due() if d.key == "k2"] == [("late",)]

    def test_a_registration_never_published_leaves_even_a_key_nobody_calls(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store(timings=Timings(registration_grace=5.0))
        registered(store, spec("ghost"), T0, confirmed=False, payload=b"ghost")
        assert at(store, T0 + 4).tick_due() == [] and waiters(store, T0 + 4) == ["ghost"]
        assert at(store, T0 + 5.5).tick_due() == []  # dropped silently: it never ran, never will
        assert at(store, T0 + 5.5).snapshot() == []

    def test_a_waiter_behind_a_dead_holder_makes_the_key_due_for_its_eviction(
        self, make_store: StoreFactory
    ) -> None:
        store = make_store()
        admitted(store, spec("dead", lease=10.0, orphan=30.0), 0, T0)
        registered(store, spec("next", orphan=100.0), T0 + 20, payload=b"next", delay=45.0)
        due = at(store, T0 + 40.5).tick_due()
        assert [(d.evicted, woken(d.wakes)) for d in due] == [(("dead",), [])]
        assert holders(store, T0 + 41) == [] and waiters(store, T0 + 41) == ["next"]

    def test_tick_due_evicts_an_orphaned_holder_and_issues_the_next(self, make_store: StoreFactory) -> None:
        """A key nobody calls still moves: its dead holder is evicted and the next run issued."""
        store = make_store()
        admitted(store, spec("dead", lease=10.0, orphan=100.0), 0, T0)
        registered(store, spec("next", orphan=100.0), T0 + 1, payload=b"next")
        assert at(store, T0 + 109).tick_due() == []
        due = at(store, T0 + 110.5).tick_due()
        assert [(d.evicted, woken(d.wakes)) for d in due] == [(("dead",), ["next"])]
        other = make_store(namespace="other" + uuid.uuid4().hex[:8])
        assert at(other, T0 + 110.5).tick_due() == []  # namespaces isolate

    # -- retention and tokens (docs/concepts.md#fencing-tokens) ------------------------------------

    def test_tokens_keep_increasing_after_the_key_is_forgotten(self, make_store: StoreFactory) -> None:
        store = make_store(timings=Timings(retention=100.0))
        first = admitted(store, spec("a"), 0, T0)
        assert at(store, T0 + 1).release(SCOPE, KEY, "a", token=first).released
        assert at(store, T0 + 1).snapshot() == []
        at(store, T0 + 102).sweep()  # the key and its settled marker are forgotten now
        again = admitted(store, spec("b"), 0, T0 + 102)
        assert again > first
        # A frozen clock: the counter part keeps tokens increasing within one microsecond.
        tokens = []
        for name in "cde":
            tokens.append(admitted(store, spec(name, key="frozen"), 0, T0 + 200))
            assert at(store, T0 + 200).release(SCOPE, "frozen", name, token=tokens[-1]).released
        assert tokens == sorted(set(tokens)) and tokens[0] > again

    def test_a_library_copy_of_a_settled_run_is_stale_however_late(self, make_store: StoreFactory) -> None:
        store = make_store(timings=Timings(retention=100.0))
        token = admitted(store, spec("h"), 0, T0)
        deferred = gated(store, spec("w"), 0, T0 + 1, b"w").generation
        assert deferred is not None
        wake = the_wake(at(store, T0 + 2).release(SCOPE, KEY, "h", token=token).wakes, "w")
        w_token = admitted(store, spec("w"), wake.generation, T0 + 3)
        assert at(store, T0 + 4).release(SCOPE, KEY, "w", token=w_token).released
        # Within retention the settled marker says it; after it, the generation's age does.
        stale(store, spec("w"), deferred, T0 + 50)
        at(store, T0 + 300).sweep()
        stale(store, spec("w"), deferred, T0 + 300)
        stale(store, spec("w"), wake.generation, T0 + 1e6)
        stale(store, spec("w"), -1, T0 + 1e6)  # a duplicate start's copy
        # The producer's own copy (generation 0) is a new claim, as a re-driven dead letter is.
        admitted(store, spec("w"), 0, T0 + 1e6)


class StoreContract(
    _OrderRules, _RegistrationRules, _HandoffRules, _DeliveryRules, _LeaseRules, _DataRules, _TimeRules
):
    """The contract every store keeps; subclass it and provide the ``store_factory`` fixture."""
