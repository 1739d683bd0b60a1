"""The Redis store against the real server: same answers and state as the memory store, its data
layout (one hash tag per key, nothing left behind), by FCALL and by EVALSHA, errors."""

from __future__ import annotations

import gc
import os
import random
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import REDIS_URL, require_server
from redis_servers import as_written_by_version_3

from singleton_tasks.config import Timings
from singleton_tasks.errors import SingletonConfigError, StoreUnavailableError
from singleton_tasks.outcomes import (
    PAYLOAD_ON_REQUEST,
    ClaimOutcome,
    Decision,
    DueOutcome,
    HolderRef,
    Registered,
    ReleaseOutcome,
    RunSpec,
    RunState,
)
from singleton_tasks.records import _optional_float
from singleton_tasks.stores.memory import MemoryStore
from singleton_tasks.testing import ManualClock, at

redis_mod = pytest.importorskip("redis")
from singleton_tasks.stores._redis_scripts import hash_tag as _hash_tag  # noqa: E402
from singleton_tasks.stores._redis_scripts import run_record as _run_record  # noqa: E402
from singleton_tasks.stores._redis_scripts import text as _text  # noqa: E402
from singleton_tasks.stores.redis import RedisStore  # noqa: E402

pytestmark = pytest.mark.redis

WEIRD_KEYS = [
    "plain",
    "{braces}}{",
    "quotes ' \" `",
    "new\nline\r\n",
    "100% -- ; DROP",
    "emoji 😀🔒",
    "nul\0byte",
    "x" * 512,
    "*?[glob]\\",
]


@pytest.fixture
def namespace() -> Iterator[str]:
    require_server(REDIS_URL, "Redis")
    ns = f"t{uuid.uuid4().hex[:12]}"
    yield ns
    client = redis_mod.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(match=f"{ns}*", count=1000):
        client.delete(key)
    client.close()


def _redis_state(
    store: RedisStore, keys: list[tuple[str, str]], *, strays: bool = False
) -> dict[tuple[str, str], Any]:
    """The keys' counters and full run records, read straight from Redis (two pipelined reads)."""
    client = store._client
    prefixes = [store._prefix(scope, key) for scope, key in keys]
    pipe = client.pipeline(transaction=True)
    for prefix in prefixes:
        pipe.hgetall(prefix + b"meta")
        pipe.zrange(prefix + b"holders", 0, -1)
        pipe.zrange(prefix + b"waiters", 0, -1)
        pipe.zrange(prefix + b"unconfirmed", 0, -1, withscores=True)
    pipe.zrange(store._due_index_key(b""), 0, -1, withscores=True)
    *replies, due_index = pipe.execute()
    metas = replies[0::4]
    run_ids = [holders + waiters for holders, waiters in zip(replies[1::4], replies[2::4], strict=True)]
    unconfirmed = replies[3::4]
    pipe = client.pipeline(transaction=True)
    for prefix, ids in zip(prefixes, run_ids, strict=True):
        for run_id in ids:
            pipe.hgetall(prefix + b"run:" + run_id)
    fields = iter(pipe.execute())
    # The busy index lists exactly the keys with runs: none missing (inspect would lose it),
    # none left over (state would grow with every key ever used).
    busy = {prefix[len(store._ns_colon) : -1] for prefix, ids in zip(prefixes, run_ids, strict=True) if ids}
    assert client.smembers(store._index_key(b"")) == busy, "the busy index is out of step"
    # The due index lists exactly the keys with a due_at, by it.
    due = {
        prefix[len(store._ns_colon) : -1]: float(meta[b"due_at"])
        for prefix, meta in zip(prefixes, metas, strict=True)
        if meta.get(b"due_at")
    }
    assert dict(due_index) == due, "the due index is out of step"
    state: dict[tuple[str, str], Any] = {}
    for (scope, key), prefix, meta, ids, listed in zip(
        keys, prefixes, metas, run_ids, unconfirmed, strict=True
    ):
        runs = {run_id.decode("utf-8", "surrogatepass"): _run_record(run_id, next(fields)) for run_id in ids}
        # The unconfirmed index lists exactly the unconfirmed waiters, by created_at.
        assert {
            _text(r.run_id): r.created_at
            for r in runs.values()
            if not r.confirmed and r.state is not RunState.HOLDING
        } == dict(listed)
        if not runs:
            continue  # an idle key: forgotten after retention, whenever the store deletes it
        assert (meta[b"scope"], meta[b"key"]) == (_text(scope), _text(key))
        if strays:
            hashes = list(client.scan_iter(match=prefix + b"run:*", count=1000))
            assert len(hashes) == len(runs), "a run hash outside the holders/waiters indexes"
        counters = (
            int(meta[b"token"]),
            int(meta[b"seq"]),
            int(meta[b"limit"]),
            _optional_float(meta.get(b"due_at")),
        )
        state[(scope, key)] = (counters, runs)
    return state


def _memory_state(store: MemoryStore) -> dict[tuple[str, str], Any]:
    state: dict[tuple[str, str], Any] = {}
    for (ns, scope, key), data in store._server.keys.items():
        if ns == store.namespace and data.meta is not None and data.runs:
            meta = data.meta
            state[(scope, key)] = ((meta.token, meta.seq, meta.limit, meta.due_at), dict(data.runs))
    return state


def _norm(outcome: Any) -> Any:
    """Eviction order is the stores' iteration order of holders: compare it as a set; due keys
    with the same due_at come in the order of their (scope, key) or of their hash tags."""
    if isinstance(outcome, (ClaimOutcome, ReleaseOutcome, DueOutcome)):
        return (type(outcome), {**outcome.__dict__, "evicted": sorted(outcome.evicted)})
    if isinstance(outcome, list) and all(isinstance(o, DueOutcome) for o in outcome):
        return sorted((_norm(o) for o in outcome), key=lambda n: (n[1]["scope"], n[1]["key"]))
    return outcome


class _Differential:
    def __init__(self, seed: int, namespace: str, *, functions: bool = True) -> None:
        self.rng = random.Random(seed)
        timings = Timings(
            registration_grace=self.rng.choice([0.0, 2.0, 5.0]), retention=self.rng.choice([3.0, 50.0])
        )
        self.memory = MemoryStore(
            f"memory://diff-{uuid.uuid4().hex}", namespace=namespace, timings=timings, clock=ManualClock()
        )
        self.redis = RedisStore(
            REDIS_URL, namespace=namespace, timings=timings, functions=functions, clock=ManualClock()
        )
        self.keys = [("scope", self.rng.choice(WEIRD_KEYS)), ("scope", "other"), ("sc2", "other")]
        self.runs = [f"run-{i}" for i in range(6)] + ["run {😀}\n"]
        self.generations: dict[str, set[int]] = {run: {0} for run in self.runs}
        self.tokens: dict[str, set[int]] = {run: {1} for run in self.runs}
        self.limits = {k: self.rng.choice([1, 1, 2, 3]) for k in self.keys}
        self.now = 1000.0 if seed % 2 == 0 else 1000.0 + self.rng.random()

    def spec(self, key: tuple[str, str], run: str) -> RunSpec:
        rng = self.rng
        return RunSpec(
            key[0],
            key[1],
            run,
            limit=self.limits[key],
            max_queue_depth=rng.choice([None, 0, 1, 3]),
            lease=rng.choice([1.5, 4.0, 30.0]),
            orphan_timeout=rng.choice([None, 0.5, 3.0, 20.0]),
            recheck=rng.choice([0.0, 1.0, 2.5]),
        )

    def step(self) -> tuple[str, Any, Any]:
        rng = self.rng
        # Mostly exact binary steps, so that boundaries (lease end == now, ...) are hit exactly.
        self.now += rng.choice([0.0, 0.0, 0.0, 0.5, 0.5, 1.0, 1.5, 3.0, 7.0, 0.1])
        now = self.now
        key = self.keys[0] if rng.random() < 0.6 else rng.choice(self.keys)
        run = rng.choice(self.runs)
        op = rng.choice(
            [
                "register",
                "register",
                "confirm",
                "unregister",
                "park",
                "claim",
                "claim",
                "claim",
                "claim",
                "suspend",
                "heartbeat",
                "release",
                "release",
                "operator_release",
                "snapshot",
                "tick_due",
                "tick_due",
            ]
        )
        results = []
        saved = rng.getstate()
        for store in (self.memory, self.redis):
            rng.setstate(saved)  # both stores see the same random choices
            if op == "register":
                payload = rng.choice([None, b"", b"\x00\xff registered " + run.encode()])
                results.append(
                    at(store, now).register(
                        self.spec(key, run),
                        payload=payload,
                        delay=rng.choice([0.0, 0.0, 2.5]),
                        confirmed=rng.random() < 0.6,
                    )
                )
            elif op == "confirm":
                results.append(at(store, now).confirm(*key, run))
            elif op == "unregister":
                results.append(at(store, now).unregister(*key, run))
            elif op == "park":
                results.append(at(store, now).park(*key, run))
            elif op == "claim":
                generation = rng.choice([*sorted(self.generations[run])[-3:], rng.randrange(0, 12)])
                payload = rng.choice([None, b"", b"\x00\xff payload " + run.encode(), PAYLOAD_ON_REQUEST])
                results.append(at(store, now).claim(self.spec(key, run), generation, payload))
            elif op == "suspend":
                token = rng.choice(sorted(self.tokens[run]))
                results.append(at(store, now).suspend(*key, run, token, delay=rng.choice([0.5, 5.0])))
            elif op == "heartbeat":
                refs = [
                    HolderRef(*rng.choice(self.keys), r, rng.choice(sorted(self.tokens[r])))
                    for r in rng.sample(self.runs, rng.randrange(0, 4))
                ]
                results.append(at(store, now).heartbeat(refs))
            elif op == "release":
                token = rng.choice([None, *sorted(self.tokens[run])])
                generation = rng.choice([None, *sorted(self.generations[run])])
                results.append(at(store, now).release(*key, run, token=token, generation=generation))
            elif op == "operator_release":
                results.append(at(store, now).operator_release(run))
            elif op == "tick_due":
                results.append(at(store, now).tick_due())
            else:
                results.append(at(store, now).snapshot())
        memory, redis_result = results
        self.learn(run, memory)
        return op, memory, redis_result

    def learn(self, run: str, outcome: Any) -> None:
        """Remember the generations and tokens handed out, so later steps use live and dead ones."""
        if isinstance(outcome, ClaimOutcome):
            if outcome.generation is not None:
                self.generations[run].add(outcome.generation)
            if outcome.token is not None:
                self.tokens[run].add(outcome.token)
        wakes = outcome if isinstance(outcome, tuple) else getattr(outcome, "wakes", ())  # park: the wakes
        if isinstance(outcome, list):  # tick_due
            wakes = tuple(wake for due in outcome if isinstance(due, DueOutcome) for wake in due.wakes)
        for wake in wakes:
            self.generations[wake.run_id].add(wake.generation)


def _coverage(op: str, outcome: Any) -> set[str]:
    """Which interesting branches of the rules one answer shows."""
    seen = set()
    if isinstance(outcome, ClaimOutcome):
        seen.add(outcome.decision.value)
        seen |= {
            name
            for name, hit in [
                ("takeover", outcome.takeover),
                ("claim-evicted", outcome.evicted),
                ("claim-wakes", outcome.wakes),
                ("behind", (outcome.position or 0) > 1),
            ]
            if hit
        }
        if outcome.removed:
            seen.add("claim-removed")
    elif isinstance(outcome, ReleaseOutcome):
        seen |= {
            name
            for name, hit in [
                ("released", outcome.released),
                ("lost", outcome.lost),
                ("release-wakes", outcome.wakes),
                ("release-evicted", outcome.evicted),
            ]
            if hit
        }
    elif op == "register":
        seen.add(outcome.status.value)
    elif op == "heartbeat" and outcome.lost:
        seen.add("heartbeat-lost")
    elif op == "park" and outcome:
        seen.add("park-wakes")
    elif op == "tick_due":
        seen |= {
            name
            for due in outcome
            for name, hit in [
                ("tick-wakes", due.wakes),
                ("tick-evicted", due.evicted),
                ("tick-removed", due.removed),
            ]
            if hit
        }
    elif op == "suspend" and outcome:
        seen.add("suspended")
    return seen


@pytest.mark.parametrize("functions", [True, False], ids=["fcall", "evalsha"])
def test_same_answers_and_state_as_memory_store(namespace: str, functions: bool) -> None:
    """Random operation sequences (same now values) on both stores: same answers, same records."""
    seen: set[str] = set()
    for seed in range(12):
        diff = _Differential(seed, f"{namespace}-{seed}", functions=functions)
        for i in range(300):
            op, memory, redis_result = diff.step()
            assert _norm(redis_result) == _norm(memory), f"seed {seed} step {i}: {op}"
            assert _redis_state(diff.redis, diff.keys) == _memory_state(diff.memory), (
                f"seed {seed} step {i}: {op}"
            )
            seen |= _coverage(op, memory)
        _redis_state(diff.redis, diff.keys, strays=True)
        diff.redis.close()
    expected = {d.value for d in Decision} | {
        "takeover",
        "claim-evicted",
        "claim-wakes",
        "behind",
        "released",
        "lost",
        "release-wakes",
        "release-evicted",
        "registered",
        "exists",
        "full",
        "heartbeat-lost",
        "suspended",
        "claim-removed",
        "park-wakes",
        "tick-wakes",
        "tick-evicted",
        "tick-removed",
    }
    assert seen >= expected, f"the sequences missed {expected - seen}"


def _on_both(namespace: str, steps: list[Any], timings: Timings | None = None) -> list[Any]:
    """Run the same steps on a memory and a Redis store (keys of scope "s"); their answers and
    the records of key "k" (due_at among them) must be equal."""
    memory = MemoryStore(
        f"memory://both-{uuid.uuid4().hex}", namespace=namespace, timings=timings, clock=ManualClock()
    )
    redis_store = RedisStore(REDIS_URL, namespace=namespace, timings=timings, clock=ManualClock())
    answers = []
    for i, step in enumerate(steps):
        expected, got = step(memory), step(redis_store)
        assert _norm(got) == _norm(expected), f"step {i}"
        assert _redis_state(redis_store, [("s", "k")]) == _memory_state(memory), f"step {i}"
        answers.append(expected)
    redis_store.close()
    return answers


def test_boundaries_match_the_memory_store(namespace: str) -> None:
    """Exact time boundaries the random sequences rarely hit (strict vs non-strict comparisons)."""
    a, p, q = (RunSpec("s", "k", run, lease=10.0, orphan_timeout=5.0, recheck=1.0) for run in ("a", "p", "q"))
    tokens: dict[str, int] = {}

    def admitted(spec: RunSpec, generation: int, now: float) -> Any:
        def step(st: Any) -> Any:
            outcome = at(st, now).claim(spec, generation, None)
            tokens[spec.run_id] = outcome.token
            return outcome

        return step

    answers = _on_both(
        namespace,
        [
            admitted(a, 0, 0.0),
            admitted(a, 0, 10.0),  # the lease ends exactly now: lapsed, a takeover
            lambda st: at(st, 11.0).heartbeat([HolderRef("s", "k", "a", tokens["a"])]),
            lambda st: at(st, 12.0).register(p, payload=b"p"),  # issued again from 18 if it owns a slot
            lambda st: at(st, 18.0).claim(q, 0, None),  # behind p: p owns no slot while a holds it
            lambda st: at(st, 18.0).release(
                "s", "k", "a", token=tokens["a"]
            ),  # p's reissue_at is now: issued
            lambda st: at(st, 24.0).tick_due(),  # p's copy is due again at 24: not before now
            lambda st: at(st, 26.0).tick_due(),  # now it is issued again: due at 32
            lambda st: at(st, 32.0).claim(q, 0, None),  # p seen exactly retention ago: issued, kept
            lambda st: at(st, 38.0).tick_due(),  # due exactly now: not listed
            lambda st: at(st, 38.0).claim(q, 0, None),  # now p is abandoned: q is first in line
        ],
        timings=Timings(retention=20.0),
    )
    assert [answer.decision for answer in answers[:2]] == [Decision.ADMITTED, Decision.ADMITTED]
    assert answers[1].takeover
    assert answers[4].decision is Decision.GATED and answers[4].position == 2
    assert [w.run_id for w in answers[5].wakes] == ["p"] and answers[5].wakes[0].payload == b"p"
    assert answers[6] == [] and [w.run_id for d in answers[7] for w in d.wakes] == ["p"]
    assert [w.run_id for w in answers[8].wakes] == ["p"] and answers[8].removed == ()
    assert answers[9] == []
    assert answers[10].removed == ("p",) and answers[10].position == 1
    answers = _on_both(
        namespace + "e",
        [
            admitted(a, 0, 0.0),  # evicted after 10 + 5
            lambda st: at(st, 1.0).register(p, payload=b"p"),
            lambda st: at(st, 7.5).tick_due(),  # due at 7 by p's registration: recomputed to 15
            lambda st: at(st, 15.0).tick_due(),  # not before now
            lambda st: at(st, 15.5).tick_due(),  # a evicted, p issued
        ],
        timings=Timings(retention=20.0),
    )
    assert answers[2] == [] and answers[3] == []  # the state compared says when the key is due
    assert [(d.evicted, [w.run_id for w in d.wakes]) for d in answers[4]] == [(("a",), ["p"])]
    answers = _on_both(
        namespace + "b",
        [
            admitted(a, 0, 100.0),
            lambda st: at(st, 101.0).release("s", "k", "a", token=tokens["a"]),
            lambda st: at(st, 101.5).claim(a, 1, None),  # marker live, other generation: stale
            # The marker expires exactly now; generation 1 was issued long before retention: stale.
            lambda st: at(st, 102.0).claim(a, 1, None),
            lambda st: at(st, 102.0).claim(a, 101_000_000, None),  # issued exactly retention ago: a claim
            lambda st: at(st, 103.0).register(p, confirmed=False),
            lambda st: at(st, 113.0).register(q),  # p registered exactly the grace ago: still counted
            lambda st: at(st, 113.0).claim(q, 0, None),
            lambda st: at(st, 113.0).release("s", "k", "a", token=None),
            lambda st: at(st, 113.0).release("s", "k", "q", token=None),
            lambda st: at(st, 113.0).release("s", "k", "p", token=None),
            lambda st: at(st, 114.0).register(q),  # idle until exactly now: the key is remembered
            lambda st: at(st, 114.0).unregister("s", "k", "q"),
            lambda st: at(st, 115.0000001).claim(q, 0, None),  # now it is forgotten: seq and token anew
        ],
        timings=Timings(retention=1.0, registration_grace=10.0),
    )
    assert [answer.decision for answer in answers[2:5]] == [Decision.STALE, Decision.STALE, Decision.ADMITTED]
    assert answers[6].in_flight == 3
    assert answers[13].decision is Decision.ADMITTED and answers[13].token == 115_000_000


def test_hash_tag_hides_the_key_and_key_text_round_trips(namespace: str) -> None:
    store = RedisStore(REDIS_URL, namespace=namespace)
    for key in WEIRD_KEYS:
        spec = RunSpec("scope {x}", key, f"r-{key}")
        assert store.claim(spec, 0, b"\x00\x01").decision is Decision.ADMITTED
    snaps = store.snapshot()
    assert sorted(s.key for s in snaps) == sorted(WEIRD_KEYS)
    assert [s.key for s in store.snapshot(scope="scope {x}", key="nul\0byte")] == ["nul\0byte"]
    for redis_key in store._client.scan_iter(match=f"{namespace}:*"):
        if redis_key in (f"{namespace}:schema".encode(), f"{namespace}:busy".encode()):
            continue
        tag = redis_key.split(b"{", 1)[1].split(b"}", 1)[0]
        assert len(tag) == 40 and all(c in b"0123456789abcdef" for c in tag), redis_key
    # The busy index lists the keys by their hash tags only, never their text.
    busy = store._client.smembers(f"{namespace}:busy".encode())
    assert busy == {_hash_tag("scope {x}", key) for key in WEIRD_KEYS}
    store.close()


def test_an_idle_key_keeps_only_its_counters_until_retention(namespace: str) -> None:
    store = RedisStore(REDIS_URL, namespace=namespace, retention=5.0, clock=ManualClock(1.0))
    specs = [RunSpec("s", "k", f"r{i}", limit=1) for i in range(3)]
    for spec in specs:
        at(store, 1.0).register(spec, confirmed=False)
    first = at(store, 2.0).claim(specs[0], 0, b"p")
    assert first.decision is Decision.ADMITTED
    gated = at(store, 2.0).claim(specs[1], 0, b"p")
    assert gated.decision is Decision.GATED
    assert at(store, 2.0).unregister("s", "k", "r2")
    release = at(store, 3.0).release("s", "k", "r0", token=first.token)
    assert [w.run_id for w in release.wakes] == ["r1"]
    woken = at(store, 3.0).claim(specs[1], release.wakes[0].generation, None)
    assert woken.decision is Decision.ADMITTED
    assert at(store, 4.0).release("s", "k", "r1", token=woken.token).released
    names = sorted(k.split(b"}:", 1)[1] for k in store._client.scan_iter(match=f"{namespace}:{{*"))
    assert names == [b"meta", b"settled:r0", b"settled:r1"]
    prefix = store._prefix("s", "k")
    meta = store._client.hgetall(prefix + b"meta")
    assert (meta[b"seq"], meta[b"token"], meta[b"idle_until"]) == (b"0", str(woken.token).encode(), b"9")
    # Redis deletes all three after retention: nothing is left of the key.
    for name in names:
        assert 0 < store._client.pttl(prefix + name) <= 5000
    store.close()


def test_each_thread_pins_its_own_connection_and_returns_it(namespace: str) -> None:
    store = RedisStore(REDIS_URL, namespace=namespace)
    store.register(RunSpec("s", "main", "main"))
    ids = {"main": store._thread_client().client_id()}

    both_running = threading.Barrier(2)

    def operate(name: str) -> None:
        store.register(RunSpec("s", name, name))
        ids[name] = store._thread_client().client_id()
        # A thread that ended first would hand its connection back for the other to reuse.
        both_running.wait(10)

    threads = [threading.Thread(target=operate, args=(f"t{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(ids.values())) == 3  # one server connection per thread
    gc.collect()  # the finished threads' clients hand their connections back to the pool
    assert len(store._client.connection_pool._available_connections) >= 2
    store.close()


def test_a_dropped_pinned_connection_fails_one_operation_then_reconnects(namespace: str) -> None:
    # The server closed this thread's connection (a restart, a proxy's idle timeout). The
    # operation that finds out fails as unavailable (never re-sent: a script may have run), and
    # the next one makes the connection again.
    store = RedisStore(REDIS_URL, namespace=namespace)
    store.register(RunSpec("s", "k", "first"))
    dropped = store._thread_client().client_id()
    killer = redis_mod.Redis.from_url(REDIS_URL)
    assert killer.client_kill_filter(_id=dropped) == 1
    killer.close()
    with pytest.raises(StoreUnavailableError):
        store.register(RunSpec("s", "k", "second"))
    outcome = store.register(RunSpec("s", "k", "second"))
    assert outcome.status is Registered.REGISTERED and outcome.in_flight == 2
    assert store._thread_client().client_id() != dropped
    store.close()


def test_a_forked_child_uses_its_own_connection(namespace: str) -> None:
    store = RedisStore(REDIS_URL, namespace=namespace)
    store.register(RunSpec("s", "k", "parent"))
    parent_id = store._thread_client().client_id()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 2
        try:
            store.register(RunSpec("s", "k", "child"))
            code = 0 if store._thread_client().client_id() != parent_id else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The child's exit did not break the parent's connection.
    assert store._thread_client().client_id() == parent_id
    assert [s.key for s in store.snapshot()] == ["k"]
    store.close()


def test_store_errors_are_unavailable_and_redacted() -> None:
    store = RedisStore("redis://user:hunter2@127.0.0.1:1/0", socket_connect_timeout=0.5)
    assert "hunter2" not in repr(store)
    with pytest.raises(StoreUnavailableError) as info:
        store.register(RunSpec("s", "k", "r"))
    assert "hunter2" not in str(info.value) and "***" in str(info.value)
    assert isinstance(info.value.__cause__, redis_mod.exceptions.ConnectionError)
    for call in (
        lambda: store.snapshot(),
        store.schema_version,
        lambda: store.heartbeat([HolderRef("s", "k", "r", 1)]),
    ):
        with pytest.raises(StoreUnavailableError):
            call()


def test_the_functions_option_takes_a_bool() -> None:
    with pytest.raises(SingletonConfigError, match="functions must be True or False, got 'no'"):
        RedisStore(REDIS_URL, functions="no")  # type: ignore[arg-type]


def test_decode_responses_is_refused() -> None:
    with pytest.raises(SingletonConfigError):
        RedisStore(REDIS_URL, decode_responses=True)


def test_schema_version_and_migrate(namespace: str) -> None:
    store = RedisStore(REDIS_URL, namespace=namespace)
    assert store.schema_version() is None
    store.migrate()
    store.check_schema()
    assert RedisStore(REDIS_URL, namespace=namespace + "x").schema_version() is None
    store.close()


def test_states_survive_the_round_trip(namespace: str) -> None:
    store = RedisStore(REDIS_URL, namespace=namespace, clock=ManualClock())
    now = 1234567890.1234567
    spec = RunSpec("s", "k", "r", lease=0.1)
    at(store, now).register(spec)
    outcome = at(store, now).claim(spec, 0, None)
    holder = at(store, now).snapshot()[0].holders[0]
    assert outcome.token == holder.token == 1234567890123456
    assert holder.admitted_at == now and holder.lease_expires_at == now + 0.1
    waiter = RunSpec("s", "k", "w")
    at(store, now + 0.3).register(waiter, confirmed=False)
    assert at(store, now).snapshot()[0].waiters[0].state is RunState.PENDING
    store.close()


def test_a_phantom_holder_is_evicted_shown_and_released(namespace: str) -> None:
    """A holder whose run hash is gone (an evicting or failed-over server) never sticks its key."""
    from singleton_tasks.cli.inspect import inspect_document

    store = RedisStore(REDIS_URL, namespace=namespace, clock=ManualClock(1000.0))
    ghost, waiter = RunSpec("s", "k", "ghost"), RunSpec("s", "k", "waiter")
    assert at(store, 1000.0).claim(ghost, 0, None).decision is Decision.ADMITTED
    gated = at(store, 1001.0).claim(waiter, 0, b"w")
    assert gated.decision is Decision.GATED
    store._client.delete(store._prefix("s", "k") + b"run:ghost")  # the data is lost, the index entry stays
    # The CLI shows it (it used to crash on the missing fields) and says what it is.
    [snap] = at(store, 1002.0).snapshot()
    assert [(h.run_id, h.phantom) for h in snap.holders] == [("ghost", True)]
    document = inspect_document(store, [snap], 1002.0)
    assert document["keys"][0]["holders"][0]["status"] == "phantom"
    # The next call on the key evicts it and hands the slot on.
    outcome = at(store, 1002.0).claim(waiter, gated.generation or 0, b"w")
    assert outcome.decision is Decision.ADMITTED and outcome.evicted == ("ghost",)
    # A phantom waiter is removed as soon as a call meets it, and an operator can release one.
    assert at(store, 1003.0).register(RunSpec("s", "k", "lost")).status is Registered.REGISTERED
    store._client.delete(store._prefix("s", "k") + b"run:lost")
    assert [w.run_id for w in at(store, 1003.0).snapshot()[0].waiters if w.phantom] == ["lost"]
    released = at(store, 1004.0).operator_release("lost")
    assert released is not None and released.released
    assert at(store, 1004.0).snapshot()[0].waiters == ()
    store.close()


def test_a_server_refusing_time_in_scripts_is_a_clear_error_and_nothing_is_written(namespace: str) -> None:
    """The store decides on the server's clock; a user the ACL keeps from TIME cannot use it."""
    admin = redis_mod.Redis.from_url(REDIS_URL)
    user = f"notime{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(user, enabled=True, passwords=["+secret"], keys=["*"], commands=["+@all", "-time"])
    host = REDIS_URL.split("://", 1)[1]
    store = RedisStore(f"redis://{user}:secret@{host}", namespace=namespace)
    try:
        with pytest.raises(SingletonConfigError, match="TIME") as info:
            store.register(RunSpec("s", "k", "r"))
        assert "secret" not in str(info.value)
        assert list(admin.scan_iter(match=f"{namespace}:*")) == []
    finally:
        store.close()
        admin.acl_deluser(user)
        admin.close()


def test_inspect_and_operator_release_read_the_busy_keys_only(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inspect`, `top` and `release RUN_ID` cost O(busy keys), however many idle keys the
    namespace keeps for `retention`: they read the busy-key index, never SCAN the database."""
    from singleton_tasks.stores import _redis_plumbing as redis_store_module

    commands: list[str] = []

    def count(args: Any) -> None:
        commands.append((args[0].decode() if isinstance(args[0], bytes) else str(args[0])).upper())

    class CountingConnection(redis_mod.connection.Connection):  # type: ignore[misc]
        """Every command this client sends, alone or in a pipeline (the scripts are counted apart)."""

        def send_command(self, *args: Any, **kwargs: Any) -> None:
            count(args)
            super().send_command(*args, **kwargs)

        def pack_commands(self, pipelined: Any) -> Any:
            for args in pipelined:
                count(args)
            return super().pack_commands(pipelined)

    store = RedisStore(REDIS_URL, namespace=namespace, connection_class=CountingConnection)
    for i in range(300):  # idle keys, each with its settled marker: 600 Redis keys
        spec = RunSpec("s", f"idle{i}", f"r{i}")
        outcome = store.claim(spec, 0, None)
        assert store.release("s", spec.key, spec.run_id, token=outcome.token).released
    assert store.claim(RunSpec("s", "held", "h"), 0, None).decision is Decision.ADMITTED
    assert store.claim(RunSpec("s", "held", "w"), 0, b"w").decision is Decision.GATED
    assert store.register(RunSpec("s", "queued", "q"), confirmed=False).status is Registered.REGISTERED
    assert store.operator_release("nobody") is None  # first use of every connection: handshakes

    scripts: list[bytes] = []
    real_call = redis_store_module._call_script

    def counting_call(client: Any, command: bytes, name: bytes, *args: Any) -> Any:
        scripts.append(name)
        return real_call(client, command, name, *args)

    monkeypatch.setattr(redis_store_module, "_call_script", counting_call)
    commands.clear()
    assert [(s.key, len(s.holders), len(s.waiters)) for s in store.snapshot()] == [
        ("held", 1, 1),
        ("queued", 0, 1),
    ]
    # One page of the index, then one read per busy key (two of them).
    assert commands == ["SSCAN"] and len(scripts) == 2
    commands.clear()
    scripts.clear()
    released = store.operator_release("w")
    assert released is not None and released.released
    # The index, an EXISTS + HMGET per busy key in one pipeline, then the release itself.
    assert commands == ["SSCAN", "EXISTS", "HMGET", "EXISTS", "HMGET"] and len(scripts) == 1
    store.close()


def test_migrate_from_version_2_indexes_the_busy_keys(namespace: str) -> None:
    """A namespace written before the busy index (schema 2): workers refuse it until `migrate`,
    which lists every key with runs (idle keys stay out of the index)."""
    from singleton_tasks.errors import SchemaVersionError

    store = RedisStore(REDIS_URL, namespace=namespace)
    store.migrate()
    assert store.claim(RunSpec("s", "held", "h"), 0, None).decision is Decision.ADMITTED
    assert store.register(RunSpec("s", "queued", "q")).status is Registered.REGISTERED
    idle = store.claim(RunSpec("s", "idle", "i"), 0, None)
    assert store.release("s", "idle", "i", token=idle.token).released
    # What version 2 left: the same keys, no index.
    store._client.delete(store._index_key(b""))
    store.set_schema_version_for_tests(2)
    with pytest.raises(SchemaVersionError, match="migrate"):
        store.check_schema()
    store.migrate()
    store.check_schema()
    assert store._client.smembers(store._index_key(b"")) == {
        _hash_tag("s", "held"),
        _hash_tag("s", "queued"),
    }
    assert [s.key for s in store.snapshot()] == ["held", "queued"]
    store.migrate()  # again: nothing changes
    assert [s.key for s in store.snapshot()] == ["held", "queued"]
    store.close()


def test_migrate_from_version_3_keeps_every_run_and_makes_the_busy_keys_due(namespace: str) -> None:
    """Version 4 replaces each run's passed_over_at by reissue_at (same value), indexes the
    unconfirmed waiters instead of the overdue ones, and lists every busy key as due at once:
    the first tick recomputes its due_at by the new rules."""
    from singleton_tasks.errors import SchemaVersionError

    store = RedisStore(REDIS_URL, namespace=namespace, clock=ManualClock(1000.0))
    store.migrate()
    keys = [("s", "held"), ("s", "queued"), ("s", "idle")]
    at(store, 1000.0).claim(RunSpec("s", "held", "h"), 0, None)
    at(store, 1001.0).claim(RunSpec("s", "held", "w"), 0, b"w")
    at(store, 1002.0).register(RunSpec("s", "queued", "q"), payload=b"q", confirmed=False)
    at(store, 1003.0).register(RunSpec("s", "queued", "c"), payload=b"c")
    idle = at(store, 1003.0).claim(RunSpec("s", "idle", "i"), 0, None)
    assert at(store, 1003.0).release("s", "idle", "i", token=idle.token).released
    before = {key: runs for key, (_counters, runs) in _redis_state(store, keys).items()}
    as_written_by_version_3(store)
    prefix = store._prefix("s", "queued")
    assert store._client.zrange(prefix + b"overdue", 0, -1) == [b"q", b"c"]
    store.set_schema_version_for_tests(3)
    with pytest.raises(SchemaVersionError, match="migrate"):
        store.check_schema()
    for _ in range(2):  # running it again changes nothing
        store.migrate()
        store.check_schema()
        assert not store._client.exists(prefix + b"overdue")
        state = _redis_state(store, keys)  # checks the unconfirmed and the due index too
        assert {key: runs for key, (_counters, runs) in state.items()} == before
        assert {key: counters[3] for key, (counters, _runs) in state.items()} == {
            ("s", "held"): 0.0,
            ("s", "queued"): 0.0,
        }
    assert store._client.zrange(prefix + b"unconfirmed", 0, -1) == [b"q"]
    assert at(store, 1004.0).tick_due() == []  # both keys ticked: nothing to do yet
    assert store._client.zrangebyscore(store._due_index_key(b""), "-inf", 1004.0) == []
    state = _redis_state(store, keys)
    assert all(counters[3] is not None and counters[3] > 1004.0 for counters, _runs in state.values())
    store.close()
