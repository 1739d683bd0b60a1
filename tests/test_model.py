"""Model-based test: random operation sequences on a store and on a tiny reference model.

The reference model below is written from the glossary and the rest of docs/concepts.md with naive
lists (no sequence numbers, no pages, no transactions, no due hints), and shares no code with
gate.py. Every answer of the store (decisions, tokens, generations, positions, wakes and
re-issues, evictions, abandoned waiters, heartbeat losses, what a due key did) and its snapshot
after every step must be identical to the model's.

The machine also checks the rules' promises on what it observed, apart from the model: at most
``limit`` holders per key, tokens increasing per key, every unsettled run counted, the line in
registration order, nobody admitted past an earlier waiter, no run admitted twice in one life,
and, once the due keys were ticked, no key left with work due and every slot owner whose copies
are lost issued again within its bound.
"""

from __future__ import annotations

import copy
import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from singleton_tasks import Store
from singleton_tasks.config import Timings
from singleton_tasks.outcomes import (
    ClaimOutcome,
    Decision,
    DueOutcome,
    HolderRef,
    HolderView,
    KeySnapshot,
    Registered,
    RegisterOutcome,
    ReleaseOutcome,
    RunSpec,
    RunState,
    WaiterView,
    Wake,
)
from singleton_tasks.stores.memory import MemoryStore
from singleton_tasks.testing import ManualClock

GRACE = 3.0
RETENTION = 40.0
T0 = 1_764_680_000.0


@dataclass(frozen=True)
class KeyConfig:
    limit: int
    lease: float
    orphan: float | None
    recheck: float


# Small numbers so that every rule (caps, leases, evictions, re-issues, abandonment, an
# unconfirmed registration's expiry) is reached often: k1 re-issues a lost owner after 32 s and
# abandons it at its second re-issue (64 s unseen > RETENTION), k3 after 17 s and at its third.
KEYS: dict[str, KeyConfig] = {
    "k1": KeyConfig(limit=1, lease=10.0, orphan=30.0, recheck=2.0),
    "k'2 {x}\n": KeyConfig(limit=2, lease=20.0, orphan=None, recheck=0.0),
    "k3": KeyConfig(limit=2, lease=5.0, orphan=12.0, recheck=5.0),
}
RUNS_PER_KEY = 4
BOGUS = 7777
#: Delays a run is sent with: none, shorter than its bound, longer than RETENTION.
DELAYS = [0.0, 0.0, 4.0, 45.0]


# ---------------------------------------------------------------------------- the model


def micros(now: float) -> int:
    return math.floor(now * 1_000_000)


def counter_after(previous: int, now: float) -> int:
    """Tokens and generations: above every earlier one, at least the clock in microseconds."""
    return max(previous + 1, micros(now))


@dataclass
class MRun:
    run_id: str
    state: RunState
    created_at: float
    confirmed: bool
    generation: int
    live: list[int]
    lease: float
    orphan: float | None
    recheck: float
    payload: bytes | None = None
    token: int = 0
    holder_gen: int = 0
    admitted_at: float = 0.0
    heartbeat_at: float = 0.0
    lease_expires_at: float = 0.0
    executing: bool = False
    seen_at: float = 0.0
    reissue_at: float | None = None

    def expect_a_copy(self, since: float) -> None:
        """A copy is on its way from ``since``: owning a slot and unseen past the bound after
        that, the run's copies are lost (never, without an orphan timeout)."""
        self.reissue_at = None if self.orphan is None else since + self.orphan + self.recheck

    def seen(self, now: float, delay: float = 0.0) -> None:
        """A live copy (or the registration of one sent with ``delay``) reached the store."""
        self.seen_at = now
        self.expect_a_copy(now + delay)


@dataclass
class MKey:
    limit: int = 1
    token: int = 0
    runs: list[MRun] = field(default_factory=list)  # registration order; holders stay in place
    settled: dict[str, tuple[int, float]] = field(default_factory=dict)  # run -> (generation, expires)
    idle_until: float | None = None  # no runs since: forgotten (token and limit) after this

    def find(self, run_id: str) -> MRun | None:
        return next((r for r in self.runs if r.run_id == run_id), None)

    def holders(self) -> list[MRun]:
        return [r for r in self.runs if r.state is RunState.HOLDING]

    def line(self) -> list[MRun]:
        """The waiters, in registration order."""
        return [r for r in self.runs if r.state is not RunState.HOLDING]

    def owners(self) -> list[MRun]:
        """The first waiters of the line, one per free slot."""
        return self.line()[: max(0, self.limit - len(self.holders()))]

    def remove(self, run_id: str) -> None:
        self.runs = [r for r in self.runs if r.run_id != run_id]

    def marker(self, run_id: str, now: float) -> int | None:
        found = self.settled.get(run_id)
        return found[0] if found is not None and found[1] > now else None


class Model:
    """One namespace: keys by name, all in one scope."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self.keys: dict[str, MKey] = {}

    def key(self, key: str, now: float | None = None) -> MKey:
        """The key as an operation at ``now`` finds it: forgotten if it was idle too long."""
        k = self.keys.setdefault(key, MKey())
        if now is not None and k.idle_until is not None and k.idle_until < now:
            k.token, k.limit, k.idle_until = 0, 1, None
        return k

    def finish(self, k: MKey, now: float) -> None:
        k.idle_until = None if k.runs else now + RETENTION

    # -- helpers of the rules

    @staticmethod
    def never_published(k: MKey, now: float) -> list[MRun]:
        """Unconfirmed registrations older than the registration grace."""
        return [r for r in k.line() if not r.confirmed and r.created_at < now - GRACE]

    @staticmethod
    def orphaned(k: MKey, now: float) -> list[MRun]:
        return [h for h in k.holders() if h.orphan is not None and h.lease_expires_at + h.orphan < now]

    @staticmethod
    def owners(k: MKey, now: float) -> list[MRun]:
        """The waiters that own the free slots: the first ones in line, whatever their age."""
        return k.owners()

    @staticmethod
    def reissue_due(run: MRun, now: float) -> bool:
        return run.reissue_at is not None and run.reissue_at <= now

    @staticmethod
    def abandoned(run: MRun, now: float) -> bool:
        """No copy of the run reached the store for RETENTION: its task is gone."""
        return now - run.seen_at > RETENTION

    def housekeep(self, k: MKey, now: float, keep: str | None) -> list[str]:
        """Evict orphaned holders and drop registrations never published; returns the evicted."""
        evicted = sorted(h.run_id for h in self.orphaned(k, now) if h.run_id != keep)
        dropped = [r.run_id for r in self.never_published(k, now) if r.run_id != keep]
        for run_id in evicted + dropped:
            k.remove(run_id)
        return evicted

    def issue(self, key: str, run: MRun, now: float) -> Wake:
        run.generation = counter_after(run.generation, now)
        run.live = [*run.live, run.generation]  # every copy in flight stays live too
        run.state = RunState.WOKEN
        run.expect_a_copy(now)
        return Wake(self.scope, key, run.run_id, run.generation, run.payload)

    def hand_on(self, key: str, k: MKey, now: float, skip: str | None, removed: list[str]) -> list[Wake]:
        """Issue the confirmed slot owners that need a copy: a gated one (its turn came), or one
        with a payload whose copies are lost; one unseen for RETENTION is abandoned instead and
        the next moves up."""
        out: list[Wake] = []
        while True:
            for run in self.owners(k, now):
                if run.run_id == skip or not run.confirmed:
                    continue
                if run.state is RunState.GATED:
                    # Without a payload its wake is not published: its deferred copy re-checks it.
                    event(f"a gated owner is woken{'' if run.payload else ' (no payload)'}")
                    out.append(self.issue(key, run, now))
                elif self.reissue_due(run, now):
                    # Abandoned once issued at least once, or when it has nothing to be issued from.
                    if self.abandoned(run, now) and (run.state is RunState.WOKEN or run.payload is None):
                        event(f"an owner is abandoned{'' if run.payload else ' (no payload)'}")
                        k.remove(run.run_id)
                        removed.append(run.run_id)
                        break  # the owners change: look again
                    if run.payload is not None:
                        event(f"a {run.state.value} owner is issued again")
                        out.append(self.issue(key, run, now))
            else:
                return out

    def has_work(self, key: str, now: float) -> bool:
        """Whether the key has work due strictly before ``now``: an orphaned holder with waiters
        behind it, an owner whose copies are lost (issued again), or a payload-less owner
        unseen for RETENTION (abandoned). A registration never published is dropped by the next
        call on its key, by no call of its own: alone it blocks nobody, and a waiter behind it
        is due by its own deadline."""
        k = self.keys.get(key)
        if k is None or not k.runs:
            return False
        if k.line() and self.orphaned(k, now):
            return True
        for run in self.owners(k, now):
            if not run.confirmed or run.reissue_at is None or not run.reissue_at < now:
                continue
            if run.payload is not None or now - run.seen_at > RETENTION:
                return True
        return False

    # -- the operations

    def register(
        self, spec: RunSpec, payload: bytes | None, delay: float, now: float, confirmed: bool
    ) -> RegisterOutcome:
        k = self.key(spec.key)
        if k.find(spec.run_id) is not None:
            return RegisterOutcome(Registered.EXISTS, len(k.runs))
        gone = self.never_published(k, now)
        in_flight = len(k.runs) - len(gone)
        full = spec.max_queue_depth is not None and in_flight >= spec.limit + spec.max_queue_depth
        # on_full="replace": the newest waiter that was published gives its place in line up.
        replaceable = [r for r in k.line() if r not in gone] if full and spec.replace_when_full else []
        if full and not replaceable:
            return RegisterOutcome(Registered.FULL, in_flight)
        for run in gone:
            k.remove(run.run_id)
        k = self.key(spec.key, now)
        k.limit = spec.limit
        k.settled.pop(spec.run_id, None)
        run = MRun(
            spec.run_id,
            RunState.PENDING,
            now,
            confirmed,
            0,
            [0],
            spec.lease,
            spec.orphan_timeout,
            spec.recheck,
            payload=payload,
        )
        run.seen(now, delay)
        if replaceable:
            old = replaceable[-1]
            k.runs[k.runs.index(old)] = run
            k.settled[old.run_id] = (-2, now + RETENTION)  # a generation no copy carries
            self.finish(k, now)
            return RegisterOutcome(Registered.REPLACED, in_flight, replaced=old.run_id)
        k.runs.append(run)
        self.finish(k, now)
        return RegisterOutcome(Registered.REGISTERED, in_flight + 1)

    def confirm(self, key: str, run_id: str) -> bool:
        run = self.key(key).find(run_id)
        if run is None:
            return False
        run.confirmed = True  # its message is on its way: it is not seen by that
        return True

    def unregister(self, key: str, run_id: str, now: float) -> bool:
        k = self.key(key)
        run = k.find(run_id)
        if run is None or run.state is not RunState.PENDING:
            return False
        k.remove(run_id)
        self.key(key, now)
        self.finish(k, now)
        return True

    def park(self, key: str, run_id: str, now: float) -> tuple[Wake, ...]:
        k = self.key(key)
        run = k.find(run_id)
        if run is None or run.state is not RunState.PENDING or run.payload is None:
            return ()
        run.confirmed, run.state = True, RunState.GATED
        run.seen(now)
        k = self.key(key, now)
        wakes = self.hand_on(key, k, now, None, [])  # park names no abandoned waiters
        self.finish(k, now)
        return tuple(wakes)

    def claim(self, spec: RunSpec, generation: int, payload: bytes | None, now: float) -> ClaimOutcome:
        k = self.key(spec.key, now)
        k.limit = spec.limit
        evicted = self.housekeep(k, now, spec.run_id)
        removed: list[str] = []
        decision, values = self._claim(k, spec, generation, payload, now, removed)
        self.finish(k, now)
        return ClaimOutcome(decision, evicted=tuple(evicted), removed=tuple(removed), **values)

    def _claim(
        self,
        k: MKey,
        spec: RunSpec,
        generation: int,
        payload: bytes | None,
        now: float,
        removed: list[str],
    ) -> tuple[Decision, dict[str, Any]]:
        def hand_on(skip: str | None = None) -> tuple[Wake, ...]:
            return tuple(self.hand_on(spec.key, k, now, skip, removed))

        def stale() -> tuple[Decision, dict[str, Any]]:
            return Decision.STALE, {"wakes": hand_on()}

        run = k.find(spec.run_id)
        if run is None:
            settled = k.marker(spec.run_id, now)
            if settled is not None and settled != generation:
                return stale()
            if settled is None and generation != 0 and generation < micros(now - RETENTION):
                return stale()
            k.settled.pop(spec.run_id, None)
            run = MRun(
                spec.run_id,
                RunState.PENDING,
                now,
                True,
                generation,
                [generation],
                spec.lease,
                spec.orphan_timeout,
                spec.recheck,
                payload=payload,
            )
            k.runs.append(run)
        elif generation not in run.live:
            # Newer than the record knows and issued after it was made: a write the store lost.
            if not (generation > run.generation and generation >= micros(run.created_at)):
                return stale()
            run.live = sorted({*run.live, generation})
            run.generation = generation
        run.lease, run.orphan, run.recheck = spec.lease, spec.orphan_timeout, spec.recheck
        if run.state is RunState.HOLDING:
            if run.executing and run.lease_expires_at > now:
                run.generation = counter_after(run.generation, now)
                run.live = sorted({run.holder_gen, generation, run.generation})
                return Decision.BUSY, {"generation": run.generation, "wakes": hand_on()}
            return self.admit(spec, k, run, generation, now, hand_on, takeover=run.executing)
        # A delivered waiter: its message was published, and the delivered copy is the one to issue.
        run.confirmed = True
        if payload is not None:
            run.payload = payload
        if run.state is RunState.PENDING:
            run.state = RunState.GATED
        run.seen(now)
        if run in self.owners(k, now):
            return self.admit(spec, k, run, generation, now, hand_on, takeover=False)
        run.generation = counter_after(run.generation, now)
        run.live = sorted({generation, run.generation})
        run.state = RunState.GATED
        wakes = hand_on(skip=run.run_id)
        position = k.line().index(run) + 1
        return Decision.GATED, {"generation": run.generation, "position": position, "wakes": wakes}

    def admit(
        self,
        spec: RunSpec,
        k: MKey,
        run: MRun,
        generation: int,
        now: float,
        hand_on: Callable[[], tuple[Wake, ...]],
        *,
        takeover: bool,
    ) -> tuple[Decision, dict[str, Any]]:
        k.token = counter_after(k.token, now)
        run.state = RunState.HOLDING
        run.token = k.token
        run.holder_gen = generation
        run.live = [generation]
        run.admitted_at = run.heartbeat_at = now
        run.lease_expires_at = now + spec.lease
        run.executing = True
        run.payload = None  # a holder is never issued again
        run.reissue_at = None
        return Decision.ADMITTED, {"token": run.token, "takeover": takeover, "wakes": hand_on()}

    def suspend(self, key: str, run_id: str, token: int, now: float, delay: float) -> bool:
        run = self.key(key).find(run_id)
        if run is None or run.state is not RunState.HOLDING or run.token != token:
            return False
        run.executing = False
        run.heartbeat_at = now
        run.lease_expires_at = now + delay + run.lease
        return True

    def heartbeat(self, refs: list[HolderRef], now: float) -> list[str]:
        lost = []
        for ref in refs:
            run = self.key(ref.key).find(ref.run_id)
            if run is None or run.state is not RunState.HOLDING or run.token != ref.token:
                lost.append(ref.run_id)
                continue
            run.heartbeat_at = now
            run.lease_expires_at = now + run.lease
        return sorted(lost)

    def release(
        self,
        key: str,
        run_id: str,
        token: int | None,
        generation: int | None,
        now: float,
        waiting_only: bool = False,
    ) -> ReleaseOutcome:
        k = self.key(key, now)
        evicted = tuple(self.housekeep(k, now, run_id))
        removed: list[str] = []
        run = k.find(run_id)
        if (
            run is None
            or (token is not None and (run.state is not RunState.HOLDING or run.token != token))
            or (waiting_only and run.state is RunState.HOLDING)
        ):
            lost = token is not None and (run is not None or k.marker(run_id, now) is None)
            wakes = tuple(self.hand_on(key, k, now, None, removed))
            self.finish(k, now)
            return ReleaseOutcome(
                released=False, lost=lost, wakes=wakes, evicted=evicted, removed=tuple(removed)
            )
        k.remove(run_id)
        if run.state is RunState.HOLDING:
            settled = run.holder_gen
        else:
            settled = generation if generation is not None else -1
        k.settled[run_id] = (settled, now + RETENTION)
        wakes = tuple(self.hand_on(key, k, now, None, removed))
        self.finish(k, now)
        return ReleaseOutcome(released=True, wakes=wakes, evicted=evicted, removed=tuple(removed))

    def operator_release(self, run_id: str, now: float) -> ReleaseOutcome | None:
        for key in sorted(self.keys):
            if self.keys[key].find(run_id) is not None:
                return self.release(key, run_id, None, None, now)
        return None

    def tick(self, key: str, now: float) -> DueOutcome:
        """What a call on a due key does by itself: the work :meth:`has_work` names, and any
        other eviction, expiry or wake the key has at ``now``."""
        k = self.keys.get(key)
        if k is None or (k.idle_until is not None and k.idle_until < now):
            return DueOutcome(self.scope, key)
        evicted = self.housekeep(k, now, None)
        removed: list[str] = []
        wakes = self.hand_on(key, k, now, None, removed)
        self.finish(k, now)
        return DueOutcome(self.scope, key, tuple(wakes), tuple(evicted), tuple(removed))

    def snapshot(self, only: str | None = None) -> list[KeySnapshot]:
        snaps = []
        for key in sorted(self.keys):
            k = self.keys[key]
            if not k.runs or only not in (None, key):
                continue
            holders = sorted(k.holders(), key=lambda r: r.token)
            snaps.append(
                KeySnapshot(
                    scope=self.scope,
                    key=key,
                    limit=k.limit,
                    token=k.token,
                    holders=tuple(
                        HolderView(
                            h.run_id,
                            h.token,
                            h.admitted_at,
                            h.heartbeat_at,
                            h.lease_expires_at,
                            h.executing,
                            payload_bytes=None if h.payload is None else len(h.payload),
                            live_generations=tuple(sorted(h.live)),
                        )
                        for h in holders
                    ),
                    waiters=tuple(
                        WaiterView(
                            w.run_id,
                            i + 1,
                            w.created_at,
                            w.state,
                            w.confirmed,
                            w.seen_at,
                            w.reissue_at,
                            payload_bytes=None if w.payload is None else len(w.payload),
                            live_generations=tuple(sorted(w.live)),
                        )
                        for i, w in enumerate(k.line())
                    ),
                )
            )
        return snaps


# ---------------------------------------------------------------------------- the machine


Outcome = TypeVar("Outcome", ClaimOutcome, ReleaseOutcome, DueOutcome)


def normal(outcome: Outcome) -> Outcome:
    """The outcome as the model gives it: several evictions at once come in any order, lists as
    tuples (the Redis store answers lists)."""
    return replace(
        outcome,
        evicted=tuple(sorted(outcome.evicted)),
        wakes=tuple(outcome.wakes),
        removed=tuple(outcome.removed),
    )


key_names = st.sampled_from(sorted(KEYS))
run_numbers = st.integers(min_value=1, max_value=RUNS_PER_KEY)


class GateMachine(RuleBasedStateMachine):
    """Drive a store and the model with the same calls; every answer must agree."""

    store: Store  # set by the test on a subclass
    #: tick_due leaves no key with work due alone, and every lost slot owner is issued again
    #: within its bound (off where only the comparison is under test).
    require_due_work = True

    def __init__(self) -> None:
        super().__init__()
        tag = uuid.uuid4().hex[:10]
        self.tag = tag
        self.scope = f"model-{tag}"
        self.model = Model(self.scope)
        self.now = T0
        self.step = 0
        # What the "framework" has seen: generations of copies in flight and tokens handed out.
        self.generations: dict[tuple[str, str], set[int]] = {}
        self.latest: dict[tuple[str, str], int] = {}  # the copy a broker would deliver next
        self.tokens: dict[tuple[str, str], list[int]] = {}
        # What the machine observed itself, apart from the model (the promises' checks):
        self.last_token: dict[str, int] = {}  # per key
        self.present: dict[tuple[str, str], bool] = {}  # runs in the last snapshot: True if holding
        self.registered: dict[tuple[str, str], int] = {}  # a live run's place in registration order
        self.registrations = 0
        self.replaced: list[tuple[str, str]] = []  # runs replaced in line (on_full="replace")
        self.admitted: set[tuple[str, str]] = set()  # runs admitted from the line in this life
        self.from_the_line: list[tuple[str, str]] = []  # admitted by the last step
        self.contact: dict[tuple[str, str], float] = {}  # when a copy of a waiter was due last

    def run_id(self, key: str, number: int) -> str:
        return f"{self.tag}-{sorted(KEYS).index(key)}-{number}"

    def spec(self, key: str, run_id: str, depth: int | None = None, replace: bool = False) -> RunSpec:
        config = KEYS[key]
        return RunSpec(
            self.scope, key, run_id, config.limit, depth, config.lease, config.orphan, config.recheck, replace
        )

    def a_new_life(self, key: str, run_id: str, copy_due: float) -> None:
        self.registrations += 1
        self.registered[(key, run_id)] = self.registrations
        self.contact[(key, run_id)] = copy_due

    def learn(self, key: str, run_id: str, outcome: ClaimOutcome | ReleaseOutcome) -> None:
        # Events show in --hypothesis-show-statistics: proof the rules are reached.
        if isinstance(outcome, ClaimOutcome):
            event(f"claim {outcome.decision.value}" + (" takeover" if outcome.takeover else ""))
        if outcome.evicted:
            event(f"{type(outcome).__name__} evicts")
        if outcome.removed:
            event(f"{type(outcome).__name__} removes")
        if isinstance(outcome, ClaimOutcome):
            self.learn_claim(key, run_id, outcome)
        self.learn_wakes(type(outcome).__name__, outcome.wakes)

    def learn_claim(self, key: str, run_id: str, outcome: ClaimOutcome) -> None:
        run = (key, run_id)
        holding = self.present.get(run)
        if holding is None and outcome.decision is not Decision.STALE:
            self.a_new_life(key, run_id, self.now)  # first sight: registered at its own claim
        if outcome.generation is not None:
            self.generations.setdefault(run, set()).add(outcome.generation)
            self.latest[run] = outcome.generation
        if outcome.decision is Decision.GATED:
            self.contact[run] = self.now
        if outcome.token is not None:
            self.tokens.setdefault(run, []).append(outcome.token)
            previous = self.last_token.get(key, 0)
            assert outcome.token > previous, f"{key!r}: token {outcome.token} after {previous}"
            self.last_token[key] = outcome.token
        if outcome.decision is Decision.ADMITTED:
            if holding:  # a retry of the holder, or a takeover: the same life
                assert run in self.admitted, f"{run_id} admitted as a holder it never became"
            else:
                assert run not in self.admitted, f"{run_id} admitted twice in one life"
                self.admitted.add(run)
                self.from_the_line.append(run)

    def learn_wakes(self, what: str, wakes: Sequence[Wake]) -> None:
        """A wake is a copy the broker will deliver next."""
        if wakes:
            event(f"{what} issues")
        for wake in wakes:
            run = (wake.key, wake.run_id)
            self.generations.setdefault(run, set()).add(wake.generation)
            self.latest[run] = wake.generation
            self.contact[run] = self.now

    def at(self) -> Store:
        """The store, deciding at the machine's time."""
        assert isinstance(self.store.clock, ManualClock)
        self.store.clock.set(self.now)
        return self.store

    def agree(self, what: str, got: Any, expected: Any) -> None:
        assert got == expected, f"{what}: store answered {got!r}, model {expected!r}"

    # -- rules

    @rule(
        key=key_names,
        number=run_numbers,
        depth=st.sampled_from([None, 0, 1, 2]),
        confirmed=st.booleans(),
        with_payload=st.booleans(),
        delay=st.sampled_from(DELAYS),
        replace=st.booleans(),
    )
    def register(
        self,
        key: str,
        number: int,
        depth: int | None,
        confirmed: bool,
        with_payload: bool,
        delay: float,
        replace: bool,
    ) -> None:
        spec = self.spec(key, self.run_id(key, number), depth, replace)
        self.step += 1
        payload = f"{spec.run_id}@{self.step} registered\0".encode() if with_payload else None
        got = self.at().register(spec, payload=payload, delay=delay, confirmed=confirmed)
        expected = self.model.register(spec, payload, delay, self.now, confirmed)
        self.agree(f"register {spec.run_id} depth={depth} delay={delay} replace={replace}", got, expected)
        event(f"register {got.status.value}")
        if got.status is Registered.REGISTERED:
            self.a_new_life(key, spec.run_id, self.now + delay)
        if got.status is Registered.REPLACED and got.replaced is not None:
            self.a_new_life(key, spec.run_id, self.now + delay)
            # The new run stands in the replaced run's place in line.
            self.registered[(key, spec.run_id)] = self.registered[(key, got.replaced)]
            self.replaced.append((key, got.replaced))

    def a_registered_run(self, data: st.DataObject) -> tuple[str, str]:
        runs = [(key, r.run_id) for key, k in sorted(self.model.keys.items()) for r in k.runs]
        return data.draw(st.sampled_from(runs), label="run")

    @precondition(lambda self: any(k.runs for k in self.model.keys.values()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """The common path: the broker delivers the newest copy of a registered run."""
        key, run_id = self.a_registered_run(data)
        self.claim_as(key, run_id, self.latest.get((key, run_id), 0), b"payload")

    @precondition(lambda self: any(len(k.line()) > 1 for k in self.model.keys.values()))
    @rule(data=st.data())
    def deliver_behind(self, data: st.DataObject) -> None:
        """A waiter behind others in line re-checks: its turn has not come, however old the
        waiters ahead of it are."""
        behind = [(key, r.run_id) for key, k in sorted(self.model.keys.items()) for r in k.line()[1:]]
        key, run_id = data.draw(st.sampled_from(behind), label="run")
        self.claim_as(key, run_id, self.latest.get((key, run_id), 0), b"payload")

    @precondition(lambda self: bool(self.replaced))
    @rule(data=st.data())
    def deliver_a_replaced_copy(self, data: st.DataObject) -> None:
        """A copy of a run replaced in line (``on_full="replace"``) arrives: it never runs."""
        key, run_id = data.draw(st.sampled_from(self.replaced), label="replaced run")
        generation = data.draw(st.sampled_from([0, self.latest.get((key, run_id), 0)]), label="generation")
        self.claim_as(key, run_id, generation, b"payload")

    @precondition(lambda self: any(k.runs for k in self.model.keys.values()))
    @rule(data=st.data(), with_payload=st.booleans())
    def redeliver_first_copy(self, data: st.DataObject, with_payload: bool) -> None:
        """A worker died before publishing its deferral: the broker hands out the first copy again."""
        key, run_id = self.a_registered_run(data)
        self.claim_as(key, run_id, 0, b"payload" if with_payload else None)

    @rule(key=key_names, number=run_numbers, data=st.data(), with_payload=st.booleans())
    def claim(self, key: str, number: int, data: st.DataObject, with_payload: bool) -> None:
        run_id = self.run_id(key, number)
        # Mostly the copy the broker would deliver; sometimes an older one (one issued before a
        # re-issue: copies issued twice) or one never issued.
        latest = self.latest.get((key, run_id), 0)
        # Copies issued in a write the store lost (a failover): newer than any it knows, issued
        # just after the newest known one or now.
        newest = max(latest, *self.generations.get((key, run_id), {0}))
        lost = {newest + 1, max(newest + 1, micros(self.now))}
        known = [latest] * 4 + sorted(self.generations.get((key, run_id), set()) | {0, BOGUS, *lost})
        generation = data.draw(st.sampled_from(known), label="generation")
        self.step += 1
        payload = f"{run_id}@{self.step}\0".encode() if with_payload else None
        self.claim_as(key, run_id, generation, payload)

    def claim_as(self, key: str, run_id: str, generation: int, payload: bytes | None) -> None:
        spec = self.spec(key, run_id)
        got = normal(self.at().claim(spec, generation, payload))
        expected = self.model.claim(spec, generation, payload, self.now)
        self.agree(f"claim {run_id} generation={generation}", got, expected)
        self.learn(key, run_id, got)

    @rule(key=key_names, number=run_numbers, data=st.data(), delay=st.sampled_from([1.0, 8.0]))
    def suspend(self, key: str, number: int, data: st.DataObject, delay: float) -> None:
        run_id = self.run_id(key, number)
        tokens = self.tokens.get((key, run_id), [])
        token = data.draw(st.sampled_from([*tokens[-1:] * 3, *tokens, BOGUS]), label="token")
        got = self.at().suspend(self.scope, key, run_id, token, delay=delay)
        expected = self.model.suspend(key, run_id, token, self.now, delay)
        self.agree(f"suspend {run_id} token={token}", got, expected)

    @precondition(lambda self: bool(self.tokens) and self.step % 2 == 0)
    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        known = [
            HolderRef(self.scope, key, run_id, token)
            for (key, run_id), tokens in sorted(self.tokens.items())
            for token in tokens[-2:]
        ]
        refs = data.draw(st.lists(st.sampled_from(known), max_size=4, unique=True), label="refs")
        got = sorted(self.at().heartbeat(refs).lost)
        self.agree(f"heartbeat {refs}", got, self.model.heartbeat(refs, self.now))
        event(f"heartbeat lost={len(got)}")

    @rule(key=key_names, number=run_numbers, data=st.data())
    def release(self, key: str, number: int, data: st.DataObject) -> None:
        run_id = self.run_id(key, number)
        tokens = self.tokens.get((key, run_id), [])
        token = data.draw(st.sampled_from([*tokens[-1:] * 3, None, *tokens, BOGUS]), label="token")
        generations = sorted(self.generations.get((key, run_id), set()) | {0})
        generation = data.draw(st.one_of(st.none(), st.sampled_from(generations)), label="generation")
        # A discarded copy's settlement (token None) leaves a run that holds a slot alone.
        waiting_only = token is None and data.draw(st.booleans(), label="waiting_only")
        got = normal(
            self.at().release(
                self.scope, key, run_id, token=token, generation=generation, waiting_only=waiting_only
            )
        )
        expected = self.model.release(key, run_id, token, generation, self.now, waiting_only)
        self.agree(
            f"release {run_id} token={token} generation={generation} waiting_only={waiting_only}",
            got,
            expected,
        )
        event(f"release released={got.released} lost={got.lost}")
        self.learn(key, run_id, got)

    @precondition(lambda self: any(k.holders() for k in self.model.keys.values()))
    @rule(data=st.data())
    def settle(self, data: st.DataObject) -> None:
        """The common path: a holder's body ends and it releases with its token."""
        held = [(key, h.run_id) for key, k in sorted(self.model.keys.items()) for h in k.holders()]
        key, run_id = data.draw(st.sampled_from(held), label="holder")
        token = self.tokens[(key, run_id)][-1]
        got = normal(self.at().release(self.scope, key, run_id, token=token))
        expected = self.model.release(key, run_id, token, None, self.now)
        self.agree(f"settle {run_id} token={token}", got, expected)
        event(f"settle released={got.released}")
        self.learn(key, run_id, got)

    @precondition(lambda self: any(k.holders() for k in self.model.keys.values()))
    @rule(data=st.data())
    def settle_a_discarded_copy(self, data: st.DataObject) -> None:
        """A revoked copy of a run settles it as a waiter, after another copy of it was admitted."""
        held = [(key, h.run_id) for key, k in sorted(self.model.keys.items()) for h in k.holders()]
        key, run_id = data.draw(st.sampled_from(held), label="holder")
        got = normal(self.at().release(self.scope, key, run_id, token=None, waiting_only=True))
        expected = self.model.release(key, run_id, None, None, self.now, waiting_only=True)
        self.agree(f"settle a discarded copy of {run_id}", got, expected)
        self.learn(key, run_id, got)

    @rule(key=key_names, number=run_numbers)
    def confirm(self, key: str, number: int) -> None:
        run_id = self.run_id(key, number)
        got = self.at().confirm(self.scope, key, run_id)
        self.agree(f"confirm {run_id}", got, self.model.confirm(key, run_id))

    @rule(key=key_names, number=run_numbers, data=st.data())
    def park(self, key: str, number: int, data: st.DataObject) -> None:
        """A producer published the run held back (delayed) and parks it: it waits gated."""
        pending = [
            (name, r.run_id)
            for name, k in sorted(self.model.keys.items())
            for r in k.line()
            if r.state is RunState.PENDING
        ]
        # Mostly a pending run (the producer's own); sometimes any run, parked late or twice.
        key, run_id = data.draw(st.sampled_from([*pending * 3, (key, self.run_id(key, number))]), label="run")
        run = self.model.key(key).find(run_id)
        parked = run is not None and run.state is RunState.PENDING and run.payload is not None
        got = self.at().park(self.scope, key, run_id)
        expected = self.model.park(key, run_id, self.now)
        self.agree(f"park {run_id}", got, expected)
        event(f"park parked={parked} wakes={len(got)}")
        if parked:
            self.contact[(key, run_id)] = self.now  # its held-back copy is its re-check now
        self.learn_wakes("park", got)

    @rule(key=key_names, number=run_numbers)
    def unregister(self, key: str, number: int) -> None:
        run_id = self.run_id(key, number)
        got = self.at().unregister(self.scope, key, run_id)
        self.agree(f"unregister {run_id}", got, self.model.unregister(key, run_id, self.now))

    @precondition(lambda self: self.step % 3 == 0)
    @rule(key=key_names, number=run_numbers)
    def operator_release(self, key: str, number: int) -> None:
        run_id = self.run_id(key, number)
        got = self.at().operator_release(run_id)
        expected = self.model.operator_release(run_id, self.now)
        self.agree(f"operator_release {run_id}", None if got is None else normal(got), expected)
        if got is not None:
            self.learn(key, run_id, got)

    @rule()
    def tick_due(self) -> None:
        """A heartbeat thread's call: every key with work due has it done, as the model does it.

        The store picks the keys by their ``due_at``, a hint: it may tick a key with nothing due
        and names only the keys where it did something (a wake, an eviction, an abandoned
        waiter). A key it does not name was left alone or ticked silently (a registration never
        published dropped): its snapshot tells which. A key with work due is never left alone.
        """
        due = {key for key in KEYS if self.model.has_work(key, self.now)}
        named: dict[str, DueOutcome] = {}
        for outcome in self.at().tick_due():
            if outcome.scope != self.scope:
                continue  # a key an earlier example left due (nothing of it is left)
            assert outcome.key not in named, f"tick_due at {self.now}: {outcome.key!r} named twice"
            named[outcome.key] = normal(outcome)
        ticked, agreed = set(), set()
        for key in sorted(KEYS):
            if key in named:
                got = named[key]
                self.agree(f"tick_due {key!r}", got, self.model.tick(key, self.now))
                did = [what for what in ("wakes", "evicted", "removed") if getattr(got, what)]
                event(f"tick_due {', '.join(did)}")
                self.learn_wakes("tick_due", got.wakes)
                ticked.add(key)
                continue
            before = copy.deepcopy(self.model.keys.get(key))
            if before is None or not before.runs:
                agreed.add(key)
                continue  # nothing to do on a key without runs: never due
            untouched = self.model.snapshot(key)
            silent = self.model.tick(key, self.now)
            shown = self.at().snapshot(scope=self.scope, key=key)
            if not (silent.wakes or silent.evicted or silent.removed) and shown == self.model.snapshot(key):
                if shown != untouched:
                    event("tick_due drops silently")
                ticked.add(key)  # ticked silently, or nothing of it shows
                continue
            self.model.keys[key] = before
            if shown == untouched:  # left alone
                if self.require_due_work:
                    assert key not in due, f"tick_due at {self.now - T0}: {key!r} has work due, left alone"
                agreed.add(key)
            # Otherwise the store did something the model does not: the snapshots disagree.
        left = sorted(key for key in ticked if self.model.has_work(key, self.now))
        assert not left, f"the model's tick left work due on {left}"
        if self.require_due_work:
            self.copies_of_owners_are_not_lost(ticked | agreed)

    def copies_of_owners_are_not_lost(self, keys: set[str]) -> None:
        """Once the due keys were ticked, each slot owner the store can issue (confirmed, with a
        payload) had a copy due within its bound: orphan timeout plus re-check delay."""
        for key, k in sorted(self.model.keys.items()):
            config = KEYS[key]
            if config.orphan is None or key not in keys:
                continue
            for run in k.owners():
                if run.confirmed and run.payload is not None:
                    since = self.contact[(key, run.run_id)]
                    assert since + config.orphan + config.recheck >= self.now, (
                        f"{run.run_id}: no copy due since {since - T0}, now {self.now - T0}"
                    )

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0, 6.0, 11.0, 25.0, 45.0]))
    def advance(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: any(k.runs for k in self.model.keys.values()))
    @rule(data=st.data(), past=st.sampled_from([0.0, 0.5]), then=st.sampled_from(["deliver", "tick_due"]))
    def at_a_deadline(self, data: st.DataObject, past: float, then: str) -> None:
        """Land exactly on (or just past) a run's deadline, then deliver a run of its key or tick.

        Deadlines: a lease's end, an orphan's eviction, an unconfirmed registration's expiry, a
        re-issue and an abandonment, a settled marker's expiry, an idle key's end; exact equality
        is where ``<`` and ``<=`` differ.
        """
        deadlines = []
        for key, k in sorted(self.model.keys.items()):
            for run in k.runs:
                if run.state is RunState.HOLDING:
                    deadlines.append((key, run.lease_expires_at))
                    if run.orphan is not None:
                        deadlines.append((key, run.lease_expires_at + run.orphan))
                else:
                    if not run.confirmed:
                        deadlines.append((key, run.created_at + GRACE))
                    if run.reissue_at is not None:
                        deadlines.append((key, run.reissue_at))
                        deadlines.append((key, max(run.reissue_at, run.seen_at + RETENTION)))
            deadlines += [(key, expires) for _gen, expires in k.settled.values()]
            if k.idle_until is not None:
                deadlines.append((key, k.idle_until))
        future = [(key, at) for key, at in deadlines if at >= self.now]
        if not future:
            return
        key, at = data.draw(st.sampled_from(future), label="deadline")
        self.now = at + past
        if then == "tick_due":
            self.tick_due()
            return
        runs = [r.run_id for r in self.model.key(key).runs] + [self.run_id(key, n) for n in (1, 2)]
        run_id = data.draw(st.sampled_from(runs), label="run")
        self.claim_as(key, run_id, self.latest.get((key, run_id), 0), b"payload")

    @invariant()
    def snapshots_agree(self) -> None:
        # Key by key: a whole-namespace snapshot is an operator's tool and may scan the server.
        got: list[KeySnapshot] = []
        for key in sorted(KEYS):
            got += self.at().snapshot(scope=self.scope, key=key)
        self.agree("snapshot", got, self.model.snapshot())
        self.promises_kept(got)

    def promises_kept(self, snapshots: list[KeySnapshot]) -> None:
        """What the rules promise, checked on the store's snapshot and the machine's own record."""
        by_key = {snap.key: snap for snap in snapshots}
        for snap in snapshots:
            assert len(snap.holders) <= KEYS[snap.key].limit, f"{snap.key!r}: {len(snap.holders)} holders"
            # Every unsettled run counts: the store holds each one the model does.
            assert len(snap.holders) + len(snap.waiters) == len(self.model.key(snap.key).runs)
            # The line is registration order.
            places = [self.registered[(snap.key, w.run_id)] for w in snap.waiters]
            assert places == sorted(places), f"{snap.key!r}: the line is out of registration order"
        for key, run_id in self.from_the_line:
            # Nobody is admitted past an earlier waiter: fewer earlier waiters than free slots.
            snap = by_key[key]
            earlier = [
                w.run_id
                for w in snap.waiters
                if self.registered[(key, w.run_id)] < self.registered[(key, run_id)]
            ]
            assert len(earlier) + len(snap.holders) <= KEYS[key].limit, (
                f"{run_id} admitted past {earlier} with {len(snap.holders) - 1} other holders"
            )
        self.from_the_line = []
        self.present = {
            (snap.key, run_id): holding
            for snap in snapshots
            for run_id, holding in [
                *((h.run_id, True) for h in snap.holders),
                *((w.run_id, False) for w in snap.waiters),
            ]
        }
        # A run that left the store (settled, evicted, removed, dropped) ends its life.
        self.admitted &= set(self.present)
        self.registered = {run: place for run, place in self.registered.items() if run in self.present}

    def teardown(self) -> None:
        # Leave nothing behind on the shared server for the next example.
        for snap in self.at().snapshot(scope=self.scope):
            for run_id in [h.run_id for h in snap.holders] + [w.run_id for w in snap.waiters]:
                self.at().release(self.scope, snap.key, run_id, token=None)


def machine_for(
    store: Store, model: type[Model] = Model, *, require_due_work: bool = True
) -> type[GateMachine]:
    def init(self: GateMachine) -> None:
        GateMachine.__init__(self)
        self.model = model(self.scope)

    attributes = {"store": store, "__init__": init, "require_due_work": require_due_work}
    return type("GateMachineOnStore", (GateMachine,), attributes)


@pytest.mark.timeout(900)  # only a failure takes long: Hypothesis then shrinks the sequence
def test_store_agrees_with_the_model(backend: str, store_factory: Callable[..., Store]) -> None:
    store = store_factory(
        timings=Timings(registration_grace=GRACE, retention=RETENTION), clock=ManualClock(T0)
    )
    many = backend == "memory"
    run_state_machine_as_test(
        machine_for(store),
        settings=settings(
            max_examples=500 if many else 25,
            stateful_step_count=50 if many else 30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )


class ForgetfulModel(Model):
    """Never hands a slot on: no wakes, no re-issues, no abandoned waiters."""

    def hand_on(self, key: str, k: MKey, now: float, skip: str | None, removed: list[str]) -> list[Wake]:
        return []


class PassingOverModel(Model):
    """The old rule: a waiter unseen past its re-issue time is passed over (owns no slot)."""

    @staticmethod
    def owners(k: MKey, now: float) -> list[MRun]:
        free = max(0, k.limit - len(k.holders()))
        return [r for r in k.line() if r.reissue_at is None or r.reissue_at >= now][:free]


class NoReissueModel(Model):
    """Wakes gated owners but never issues again an owner whose copies are lost."""

    @staticmethod
    def reissue_due(run: MRun, now: float) -> bool:
        return False


class NoAbandonmentModel(Model):
    """Issues a lost owner again and again, however long nothing of it showed up."""

    @staticmethod
    def abandoned(run: MRun, now: float) -> bool:
        return False


class UndelayedModel(Model):
    """Forgets a run's delay: issues it again before its delayed message could come."""

    def register(
        self, spec: RunSpec, payload: bytes | None, delay: float, now: float, confirmed: bool
    ) -> RegisterOutcome:
        return super().register(spec, payload, 0.0, now, confirmed)


class EveryRegistrationStaysModel(Model):
    """Keeps unconfirmed registrations past the grace: their place and count stay."""

    @staticmethod
    def never_published(k: MKey, now: float) -> list[MRun]:
        return []


@pytest.mark.parametrize(
    "wrong",
    [
        ForgetfulModel,
        PassingOverModel,
        NoReissueModel,
        NoAbandonmentModel,
        UndelayedModel,
        EveryRegistrationStaysModel,
    ],
)
def test_a_wrong_model_is_caught(wrong: type[Model]) -> None:
    """Each rule is reached: a model without it disagrees with the store."""
    store = MemoryStore(
        f"memory://model-{uuid.uuid4().hex}", timings=Timings(GRACE, RETENTION), clock=ManualClock(T0)
    )
    # The store disagrees with it, or (for a rule has_work restates) it with itself.
    with pytest.raises(AssertionError, match=r"store answered|the model's tick left work due"):
        run_state_machine_as_test(
            machine_for(store, wrong, require_due_work=False),
            settings=settings(
                max_examples=1000,
                stateful_step_count=50,
                deadline=None,
                database=None,
                phases=[Phase.generate],  # the first failure is enough; no shrinking
                suppress_health_check=list(HealthCheck),
            ),
        )
