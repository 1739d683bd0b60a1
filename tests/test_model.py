"""Model-based test: random operation sequences on a store and on a tiny reference model.

The reference model below is written from docs/concepts.md as gate.py defines it, with naive
lists (no sequence numbers, no pages, no transactions), and shares no code with gate.py.
Every answer of the store — decisions, tokens, generations, positions, wakes, evictions,
heartbeat losses — and its snapshot after every step must be identical to the model's.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from singleton_tasks.gate import Timings
from singleton_tasks.outcomes import (
    ClaimOutcome,
    Decision,
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


# Small numbers so that every rule (caps, leases, evictions, passing over, removal) is reached often.
KEYS: dict[str, KeyConfig] = {
    "k1": KeyConfig(limit=1, lease=10.0, orphan=30.0, recheck=2.0),
    "k'2 {x}\n": KeyConfig(limit=2, lease=20.0, orphan=None, recheck=0.0),
    "k3": KeyConfig(limit=2, lease=5.0, orphan=12.0, recheck=5.0),
}
RUNS_PER_KEY = 4
BOGUS = 7777


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
    passed_over_at: float | None = None

    def seen(self, now: float) -> None:
        """A live copy (or the registration) reached the store."""
        self.seen_at = now
        if not self.confirmed:
            self.passed_over_at = now + GRACE
        elif self.orphan is None:
            self.passed_over_at = None
        else:
            self.passed_over_at = now + self.orphan + self.recheck


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

    def waiters(self) -> list[MRun]:
        return [r for r in self.runs if r.state is not RunState.HOLDING]

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
    def passed_over(run: MRun, now: float) -> bool:
        return (
            run.state is not RunState.HOLDING and run.passed_over_at is not None and run.passed_over_at < now
        )

    def owners(self, k: MKey, now: float) -> list[MRun]:
        free = k.limit - len(k.holders())
        if free <= 0:
            return []
        return [r for r in k.waiters() if not self.passed_over(r, now)][:free]

    def housekeep(self, k: MKey, now: float, keep: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        evicted = [
            h.run_id
            for h in k.holders()
            if h.orphan is not None and h.lease_expires_at + h.orphan < now and h.run_id != keep
        ]
        gone = [
            w
            for w in k.waiters()
            if w.passed_over_at is not None and w.passed_over_at < now - RETENTION and w.run_id != keep
        ]
        removed = [w.run_id for w in sorted(gone, key=lambda w: (w.passed_over_at, w.run_id))]
        for run_id in evicted + removed:
            k.remove(run_id)
        return tuple(sorted(evicted)), tuple(removed)

    def wakes(self, key: str, k: MKey, now: float, skip: str | None) -> list[Wake]:
        out = []
        for run in self.owners(k, now):
            if run.state is RunState.GATED and run.run_id != skip:
                run.generation = counter_after(run.generation, now)
                run.live = [*run.live, run.generation]  # every copy in flight stays live too
                run.state = RunState.WOKEN
                out.append(Wake(self.scope, key, run.run_id, run.generation, run.payload))
        return out

    # -- the operations

    def register(self, spec: RunSpec, now: float, confirmed: bool) -> RegisterOutcome:
        k = self.key(spec.key, now)
        if k.find(spec.run_id) is not None:
            return RegisterOutcome(Registered.EXISTS, len(k.runs))
        in_flight = len([r for r in k.runs if not self.passed_over(r, now)])
        if spec.max_queue_depth is not None and in_flight >= spec.limit + spec.max_queue_depth:
            return RegisterOutcome(Registered.FULL, in_flight)
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
        )
        run.seen(now)
        k.runs.append(run)
        self.finish(k, now)
        return RegisterOutcome(Registered.REGISTERED, in_flight + 1)

    def confirm(self, key: str, run_id: str, now: float) -> bool:
        run = self.key(key).find(run_id)
        if run is None:
            return False
        if not run.confirmed:
            run.confirmed = True
            run.seen(now)
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

    def park(self, key: str, run_id: str, payload: bytes, now: float) -> tuple[Wake, ...]:
        k = self.key(key, now)
        run = k.find(run_id)
        if run is None or run.state is not RunState.PENDING:
            return ()
        run.confirmed, run.payload, run.state = True, payload, RunState.GATED
        run.seen(now)
        return tuple(self.wakes(key, k, now, None))

    def claim(self, spec: RunSpec, generation: int, payload: bytes | None, now: float) -> ClaimOutcome:
        k = self.key(spec.key, now)
        k.limit = spec.limit
        evicted, removed = self.housekeep(k, now, spec.run_id)
        try:
            return self._claim(k, spec, generation, payload, now, evicted, removed)
        finally:
            self.finish(k, now)

    def _claim(
        self,
        k: MKey,
        spec: RunSpec,
        generation: int,
        payload: bytes | None,
        now: float,
        evicted: tuple[str, ...],
        removed: tuple[str, ...],
    ) -> ClaimOutcome:
        def stale() -> ClaimOutcome:
            wakes = self.wakes(spec.key, k, now, None)
            return ClaimOutcome(Decision.STALE, evicted=evicted, wakes=tuple(wakes), removed=removed)

        run = k.find(spec.run_id)
        if run is None:
            settled = k.marker(spec.run_id, now)
            if settled is not None and settled != generation:
                return stale()
            if settled is None and generation != 0 and generation < micros(now - RETENTION):
                return stale()
            k.settled.pop(spec.run_id, None)
            run = MRun(
                spec.run_id, RunState.PENDING, now, True, generation, [generation], spec.lease, None, 0.0
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
                wakes = self.wakes(spec.key, k, now, None)
                return ClaimOutcome(
                    Decision.BUSY,
                    generation=run.generation,
                    evicted=evicted,
                    wakes=tuple(wakes),
                    removed=removed,
                )
            return self.admit(spec, k, run, generation, now, evicted, removed, takeover=run.executing)
        run.confirmed = True
        run.payload = payload
        if run.state is RunState.PENDING:
            run.state = RunState.GATED
        run.seen(now)
        if run in self.owners(k, now):
            return self.admit(spec, k, run, generation, now, evicted, removed, takeover=False)
        run.generation = counter_after(run.generation, now)
        run.live = sorted({generation, run.generation})
        run.state = RunState.GATED
        wakes = self.wakes(spec.key, k, now, run.run_id)
        position = k.waiters().index(run) + 1
        return ClaimOutcome(
            Decision.GATED,
            generation=run.generation,
            position=position,
            evicted=evicted,
            wakes=tuple(wakes),
            removed=removed,
        )

    def admit(
        self,
        spec: RunSpec,
        k: MKey,
        run: MRun,
        generation: int,
        now: float,
        evicted: tuple[str, ...],
        removed: tuple[str, ...],
        *,
        takeover: bool,
    ) -> ClaimOutcome:
        k.token = counter_after(k.token, now)
        run.state = RunState.HOLDING
        run.token = k.token
        run.holder_gen = generation
        run.live = [generation]
        run.admitted_at = run.heartbeat_at = now
        run.lease_expires_at = now + spec.lease
        run.executing = True
        run.payload = None
        wakes = self.wakes(spec.key, k, now, run.run_id)
        return ClaimOutcome(
            Decision.ADMITTED,
            token=run.token,
            takeover=takeover,
            evicted=evicted,
            wakes=tuple(wakes),
            removed=removed,
        )

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
        try:
            evicted, removed = self.housekeep(k, now, run_id)
            run = k.find(run_id)
            if (
                run is None
                or (token is not None and (run.state is not RunState.HOLDING or run.token != token))
                or (waiting_only and run.state is RunState.HOLDING)
            ):
                lost = token is not None and (run is not None or k.marker(run_id, now) is None)
                wakes = self.wakes(key, k, now, None)
                return ReleaseOutcome(
                    released=False, lost=lost, wakes=tuple(wakes), evicted=evicted, removed=removed
                )
            k.remove(run_id)
            if run.state is RunState.HOLDING:
                settled = run.holder_gen
            else:
                settled = generation if generation is not None else -1
            k.settled[run_id] = (settled, now + RETENTION)
            wakes = self.wakes(key, k, now, None)
            return ReleaseOutcome(released=True, wakes=tuple(wakes), evicted=evicted, removed=removed)
        finally:
            self.finish(k, now)

    def operator_release(self, run_id: str, now: float) -> ReleaseOutcome | None:
        for key in sorted(self.keys):
            if self.keys[key].find(run_id) is not None:
                return self.release(key, run_id, None, None, now)
        return None

    def snapshot(self) -> list[KeySnapshot]:
        snaps = []
        for key in sorted(self.keys):
            k = self.keys[key]
            if not k.runs:
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
                            h.run_id, h.token, h.admitted_at, h.heartbeat_at, h.lease_expires_at, h.executing
                        )
                        for h in holders
                    ),
                    waiters=tuple(
                        WaiterView(
                            w.run_id, i + 1, w.created_at, w.state, w.confirmed, w.seen_at, w.passed_over_at
                        )
                        for i, w in enumerate(k.waiters())
                    ),
                )
            )
        return snaps


# ---------------------------------------------------------------------------- the machine


def normal_claim(outcome: ClaimOutcome) -> ClaimOutcome:
    return ClaimOutcome(
        outcome.decision,
        token=outcome.token,
        generation=outcome.generation,
        position=outcome.position,
        takeover=outcome.takeover,
        evicted=tuple(sorted(outcome.evicted)),  # several evictions at once: any order
        wakes=tuple(outcome.wakes),
        removed=tuple(outcome.removed),
    )


def normal_release(outcome: ReleaseOutcome) -> ReleaseOutcome:
    return ReleaseOutcome(
        outcome.released,
        outcome.lost,
        wakes=tuple(outcome.wakes),
        evicted=tuple(sorted(outcome.evicted)),
        removed=tuple(outcome.removed),
    )


key_names = st.sampled_from(sorted(KEYS))
run_numbers = st.integers(min_value=1, max_value=RUNS_PER_KEY)


class GateMachine(RuleBasedStateMachine):
    """Drive a store and the model with the same calls; every answer must agree."""

    store: Store  # set by the test on a subclass

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

    def run_id(self, key: str, number: int) -> str:
        return f"{self.tag}-{sorted(KEYS).index(key)}-{number}"

    def spec(self, key: str, run_id: str, depth: int | None = None) -> RunSpec:
        config = KEYS[key]
        return RunSpec(
            self.scope, key, run_id, config.limit, depth, config.lease, config.orphan, config.recheck
        )

    def learn(self, key: str, run_id: str, outcome: ClaimOutcome | ReleaseOutcome) -> None:
        # Events show in --hypothesis-show-statistics: proof the rules are reached.
        if isinstance(outcome, ClaimOutcome):
            event(f"claim {outcome.decision.value}" + (" takeover" if outcome.takeover else ""))
        if outcome.wakes:
            event(f"{type(outcome).__name__} wakes")
        if outcome.evicted:
            event(f"{type(outcome).__name__} evicts")
        if outcome.removed:
            event(f"{type(outcome).__name__} removes")
        if isinstance(outcome, ClaimOutcome):
            if outcome.generation is not None:
                self.generations.setdefault((key, run_id), set()).add(outcome.generation)
                self.latest[(key, run_id)] = outcome.generation
            if outcome.token is not None:
                self.tokens.setdefault((key, run_id), []).append(outcome.token)
        self.learn_wakes(outcome.wakes)

    def learn_wakes(self, wakes: Sequence[Wake]) -> None:
        """A wake is a copy the broker will deliver next."""
        for wake in wakes:
            self.generations.setdefault((wake.key, wake.run_id), set()).add(wake.generation)
            self.latest[(wake.key, wake.run_id)] = wake.generation

    def at(self) -> Store:
        """The store, deciding at the machine's time."""
        assert isinstance(self.store.clock, ManualClock)
        self.store.clock.set(self.now)
        return self.store

    def agree(self, what: str, got: Any, expected: Any) -> None:
        assert got == expected, f"{what}: store answered {got!r}, model {expected!r}"

    # -- rules

    @rule(key=key_names, number=run_numbers, depth=st.sampled_from([None, 0, 1, 2]), confirmed=st.booleans())
    def register(self, key: str, number: int, depth: int | None, confirmed: bool) -> None:
        spec = self.spec(key, self.run_id(key, number), depth)
        got = self.at().register(spec, confirmed=confirmed)
        expected = self.model.register(spec, self.now, confirmed)
        self.agree(f"register {spec.run_id} depth={depth}", got, expected)
        event(f"register {got.status.value}")

    def a_registered_run(self, data: st.DataObject) -> tuple[str, str]:
        runs = [(key, r.run_id) for key, k in sorted(self.model.keys.items()) for r in k.runs]
        return data.draw(st.sampled_from(runs), label="run")

    @precondition(lambda self: any(k.runs for k in self.model.keys.values()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """The common path: the broker delivers the newest copy of a registered run."""
        key, run_id = self.a_registered_run(data)
        self.claim_as(key, run_id, self.latest.get((key, run_id), 0), b"payload")

    @precondition(lambda self: any(k.runs for k in self.model.keys.values()))
    @rule(data=st.data(), with_payload=st.booleans())
    def redeliver_first_copy(self, data: st.DataObject, with_payload: bool) -> None:
        """A worker died before publishing its deferral: the broker hands out the first copy again."""
        key, run_id = self.a_registered_run(data)
        self.claim_as(key, run_id, 0, b"payload" if with_payload else None)

    @rule(key=key_names, number=run_numbers, data=st.data(), with_payload=st.booleans())
    def claim(self, key: str, number: int, data: st.DataObject, with_payload: bool) -> None:
        run_id = self.run_id(key, number)
        # Mostly the copy the broker would deliver; sometimes an older one or one never issued.
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
        got = normal_claim(self.at().claim(spec, generation, payload))
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
        got = normal_release(
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
        got = normal_release(self.at().release(self.scope, key, run_id, token=token))
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
        got = normal_release(self.at().release(self.scope, key, run_id, token=None, waiting_only=True))
        expected = self.model.release(key, run_id, None, None, self.now, waiting_only=True)
        self.agree(f"settle a discarded copy of {run_id}", got, expected)
        self.learn(key, run_id, got)

    @rule(key=key_names, number=run_numbers)
    def confirm(self, key: str, number: int) -> None:
        run_id = self.run_id(key, number)
        got = self.at().confirm(self.scope, key, run_id)
        self.agree(f"confirm {run_id}", got, self.model.confirm(key, run_id, self.now))

    @rule(key=key_names, number=run_numbers)
    def park(self, key: str, number: int) -> None:
        """A producer published the run held back (delayed) and parks it with its payload."""
        run_id = self.run_id(key, number)
        self.step += 1
        payload = f"{run_id}@{self.step} parked\0".encode()
        got = self.at().park(self.scope, key, run_id, payload)
        self.agree(f"park {run_id}", got, self.model.park(key, run_id, payload, self.now))
        event(f"park wakes={len(got)}")
        self.learn_wakes(got)

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
        self.agree(f"operator_release {run_id}", None if got is None else normal_release(got), expected)
        if got is not None:
            self.learn(key, run_id, got)

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0, 6.0, 11.0, 25.0, 45.0]))
    def tick(self, seconds: float) -> None:
        self.now += seconds

    @precondition(lambda self: any(k.runs for k in self.model.keys.values()))
    @rule(data=st.data(), past=st.sampled_from([0.0, 0.5]))
    def deliver_at_a_deadline(self, data: st.DataObject, past: float) -> None:
        """Land exactly on (or just past) a run's deadline, then deliver a run of its key.

        Deadlines: a lease's end, an orphan's eviction, a waiter's passing over and removal,
        a settled marker's expiry; exact equality is where ``<`` and ``<=`` differ.
        """
        deadlines = []
        for key, k in sorted(self.model.keys.items()):
            for run in k.runs:
                if run.state is RunState.HOLDING:
                    deadlines.append((key, run.lease_expires_at))
                    if run.orphan is not None:
                        deadlines.append((key, run.lease_expires_at + run.orphan))
                elif run.passed_over_at is not None:
                    deadlines.append((key, run.passed_over_at))
                    deadlines.append((key, run.passed_over_at + RETENTION))
            deadlines += [(key, expires) for _gen, expires in k.settled.values()]
            if k.idle_until is not None:
                deadlines.append((key, k.idle_until))
        future = [(key, at) for key, at in deadlines if at >= self.now]
        if not future:
            return
        key, at = data.draw(st.sampled_from(future), label="deadline")
        self.now = at + past
        runs = [r.run_id for r in self.model.key(key).runs] + [self.run_id(key, n) for n in (1, 2)]
        run_id = data.draw(st.sampled_from(runs), label="run")
        self.claim_as(key, run_id, self.latest.get((key, run_id), 0), b"payload")

    @invariant()
    def snapshots_agree(self) -> None:
        # Key by key: a whole-namespace snapshot is an operator's tool and may scan the server.
        got = []
        for key in sorted(KEYS):
            got += self.at().snapshot(scope=self.scope, key=key)
        self.agree("snapshot", got, self.model.snapshot())

    def teardown(self) -> None:
        # Leave nothing behind on the shared server for the next example.
        for snap in self.at().snapshot(scope=self.scope):
            for run_id in [h.run_id for h in snap.holders] + [w.run_id for w in snap.waiters]:
                self.at().release(self.scope, snap.key, run_id, token=None)


def machine_for(store: Store, model: type[Model] = Model) -> type[GateMachine]:
    def init(self: GateMachine) -> None:
        GateMachine.__init__(self)
        self.model = model(self.scope)

    return type("GateMachineOnStore", (GateMachine,), {"store": store, "__init__": init})


@pytest.mark.timeout(900)  # only a failure takes long: Hypothesis then shrinks the sequence
def test_store_agrees_with_the_model(backend: str, store_factory: Callable[..., Store]) -> None:
    store = store_factory(
        timings=Timings(registration_grace=GRACE, retention=RETENTION), clock=ManualClock(T0)
    )
    many = backend == "memory"
    run_state_machine_as_test(
        machine_for(store),
        settings=settings(
            max_examples=200 if many else 25,
            stateful_step_count=50 if many else 30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            database=None,
        ),
    )


class ForgetfulModel(Model):
    """A model that never notifies waiters on release: the comparison must catch it."""

    def wakes(self, key: str, k: MKey, now: float, skip: str | None) -> list[Wake]:
        return []


def test_a_wrong_model_is_caught() -> None:
    store = MemoryStore(
        f"memory://model-{uuid.uuid4().hex}", timings=Timings(GRACE, RETENTION), clock=ManualClock(T0)
    )
    with pytest.raises(AssertionError, match="store answered"):
        run_state_machine_as_test(
            machine_for(store, ForgetfulModel),
            settings=settings(
                max_examples=500,
                stateful_step_count=50,
                deadline=None,
                database=None,
                phases=[Phase.generate],  # the first failure is enough; no shrinking
                suppress_health_check=list(HealthCheck),
            ),
        )
