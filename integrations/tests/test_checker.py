"""The checker itself, on hand-made logs: each invariant passes a clean log and fails a broken one."""

from __future__ import annotations

import io
import json

from rich.console import Console

from integrations.checker import CheckResult, check, explain_unfinished, lost_to_broker
from integrations.runlog import Body, Delivery, Enqueue, Event, RunData, Scenario
from singleton_tasks.outcomes import HolderView, KeySnapshot, RunState, WaiterView

T0 = 1000.0


def scenario(**settings: object) -> Scenario:
    return Scenario(
        "r1",
        "unit",
        "dramatiq",
        "redis",
        "memory",
        "memory://",
        "ns",
        {"orphan_timeout": 20.0, **settings},
        T0,
        T0 + 60,
    )


def enq(
    run_id: str,
    seq: int,
    *,
    scope: str = "mutex",
    key: str = "K",
    accepted: bool = True,
    at: float | None = None,
) -> Enqueue:
    limit = {"mutex": 1, "pair": 2, "capped": 1}.get(scope)
    return Enqueue(
        "p0",
        seq,
        scope,
        key,
        run_id,
        limit,
        accepted,
        None if accepted else "SingletonQueueFullError",
        T0 + seq * 0.01 if at is None else at,
    )


def body(
    run_id: str,
    start: float,
    end: float | None,
    token: int | None,
    *,
    scope: str = "mutex",
    key: str = "K",
    worker: str = "w0",
    outcome: str | None = "ok",
) -> Body:
    return Body(
        scope,
        key,
        run_id,
        token,
        1,
        worker,
        0,
        T0 + start,
        None if end is None else T0 + end,
        outcome if end is not None else None,
    )


def data(
    enqueues: list[Enqueue],
    bodies: list[Body],
    events: list[Event] | None = None,
    deliveries: list[Delivery] | None = None,
    **settings: object,
) -> RunData:
    return RunData(
        scenario(**settings), tuple(bodies), tuple(enqueues), tuple(events or ()), tuple(deliveries or ())
    )


def delivery(run_id: str, start: float, detail: str, *, end: float | None = None) -> Delivery:
    """A Celery delivery that ended as ``detail`` (``IGNORED: deferred …``, ``IGNORED: stale …``)."""
    ended = start + 0.01 if end is None else end
    return Delivery(run_id, "delivery", "w0", 1, T0 + start, T0 + ended, detail)


def received(run_id: str, at: float) -> Delivery:
    return Delivery(run_id, "received", "w0", 1, T0 + at, T0 + at, "")


def kill(at: float, worker: str = "w0") -> Event:
    return Event("kill", worker, T0 + at, "")


def clean() -> RunData:
    return data(
        [enq("a", 1), enq("b", 2), enq("c", 3), enq("x", 4, accepted=False)],
        [body("a", 1, 2, 1), body("b", 2, 3, 2), body("c", 3.5, 4, 3)],
    )


def test_clean_log_passes() -> None:
    result = check(clean(), [], now=T0 + 60)
    assert result.ok, result.failures()
    assert (result.accepted, result.completed, result.rejected) == (3, 3, 1)


def test_overlap_fails() -> None:
    d = data([enq("a", 1), enq("b", 2)], [body("a", 1, 3, 1), body("b", 2, 4, 2)])
    assert check(d, [], now=T0 + 60).overlaps


def test_limit_two_allows_two_but_not_three() -> None:
    two = data(
        [enq("a", 1, scope="pair"), enq("b", 2, scope="pair")],
        [body("a", 1, 3, 1, scope="pair"), body("b", 2, 4, 2, scope="pair")],
    )
    assert check(two, [], now=T0 + 60).ok
    three = data(
        [enq(r, i, scope="pair") for i, r in enumerate("abc")],
        [body(r, 1 + i * 0.1, 3, i + 1, scope="pair") for i, r in enumerate("abc")],
    )
    assert check(three, [], now=T0 + 60).overlaps


def test_killed_body_ends_at_the_kill() -> None:
    bodies = [body("a", 1, None, 1, worker="w0"), body("a", 5, 6, 2, worker="w1"), body("b", 6.5, 7, 3)]
    kill = Event("kill", "w0", T0 + 2, "")
    d = data([enq("a", 1), enq("b", 2)], bodies, [kill])
    result = check(d, [], now=T0 + 60)
    assert result.ok, result.failures()
    assert result.killed_bodies == 1
    # Without the kill the first body never ended: it overlaps and is reported.
    result = check(data([enq("a", 1), enq("b", 2)], bodies), [], now=T0 + 60)
    assert result.dangling and result.overlaps


def purge(at: float, *run_ids: str) -> Event:
    return Event("purge", "", T0 + at, json.dumps(list(run_ids)))


def test_a_purged_waiter_must_run() -> None:
    """The store issues a purged waiter again: a purge excuses nothing that had not started."""
    d = data([enq("a", 1), enq("b", 2)], [body("a", 1, 2, 1)])
    assert check(d, [], now=T0 + 60).lost == ["b"]
    purged = check(data([enq("a", 1), enq("b", 2)], [body("a", 1, 2, 1)], [purge(3, "b")]), [], now=T0 + 60)
    assert purged.lost == ["b"] and not purged.purged
    ran = check(
        data([enq("a", 1), enq("b", 2)], [body("a", 1, 2, 1), body("b", 9, 10, 2)], [purge(3, "b")]),
        [],
        now=T0 + 60,
    )
    assert ran.ok, ran.failures()
    assert ran.purged_ran == ["b"] and "purged while waiting, ran anyway" in render(ran)


def test_a_run_purged_while_holding_is_excused() -> None:
    """A holder whose message is purged is evicted, never issued again: its body ran (or was killed)."""
    bodies = [body("a", 1, None, 1), body("b", 9, 10, 2)]
    d = data([enq("a", 1), enq("b", 2)], bodies, [kill(2), purge(3, "a")])
    result = check(d, [], now=T0 + 60)
    assert result.ok, result.failures()
    assert result.purged == ["a"] and "purged while holding" in render(result)
    # Purged before its body started: a waiter then, so it must run.
    late = data([enq("a", 1)], [body("a", 4, None, 1)], [purge(3, "a"), kill(5)])
    assert check(late, [], now=T0 + 60).lost == ["a"]


def test_purged_runs_left_in_the_store_are_stuck_keys_unless_lapsed_holders() -> None:
    d = data([enq("a", 1), enq("b", 2)], [body("a", 1, None, 1)], [kill(2), purge(3, "a", "b")])

    def left(*, lease_until: float, waiting: bool) -> KeySnapshot:
        holder = HolderView("a", 1, T0 + 1, T0 + 1, T0 + lease_until, True)
        waiters = (WaiterView("b", 1, T0, RunState.GATED, True, T0 + 2, T0 + 6),) if waiting else ()
        return KeySnapshot("mutex", "K", 1, 1, (holder,), waiters)

    # The purged holder's lease lapsed and nothing waits: evicted at the key's next operation.
    assert not check(d, [left(lease_until=4, waiting=False)], now=T0 + 60).stuck_keys
    # Its lease is live: the key is held.
    assert check(d, [left(lease_until=90, waiting=False)], now=T0 + 60).stuck_keys
    # A purged waiter left in line is stuck (and lost): it is issued again, it must run.
    waited = check(d, [left(lease_until=4, waiting=True)], now=T0 + 60)
    assert waited.stuck_keys and waited.lost == ["b"]


def test_an_abandoned_run_is_excused_an_unconfirmed_one_is_not() -> None:
    """The store removes an abandoned waiter (retention): it may never run. A registration dropped
    unconfirmed was published all the same: its message registers it again at first sight."""
    enqueues = [enq("a", 1), enq("b", 2)]
    abandoned = check(
        data(enqueues, [body("a", 1, 2, 1)], [Event("abandoned", "w0", T0 + 5, json.dumps(["b"]))]),
        [],
        now=T0 + 60,
    )
    assert abandoned.ok and abandoned.abandoned == ["b"]
    assert "abandoned by the store" in render(abandoned)
    unconfirmed = check(
        data(enqueues, [body("a", 1, 2, 1)], [Event("unconfirmed", "", T0 + 5, json.dumps(["b"]))]),
        [],
        now=T0 + 60,
    )
    assert unconfirmed.lost == ["b"]


def test_fifo_inversion_fails_after_any_crash() -> None:
    """No crash reorders the line: a kill, a SIGTERM, a store outage or a purge excuses nothing,
    however long the later run waited."""
    enqueues = [enq("a", 1), enq("b", 2)]
    bodies = [body("b", 25, 26, 1), body("a", 30, 31, 2)]  # b went first 25 s after a's enqueue
    assert check(data(enqueues, bodies), [], now=T0 + 60).fifo_inversions
    for kind in ("kill", "term", "store_down", "purge"):
        detail = json.dumps(["a"]) if kind == "purge" else ""
        crash = Event(kind, "w9", T0 + 0.5, detail)
        result = check(data(enqueues, bodies, [crash]), [], now=T0 + 60)
        assert result.fifo_inversions and result.fifo_excused == 0, kind


def test_fifo_inversion_is_excused_only_for_a_run_dropped_from_the_line() -> None:
    """A run the store dropped (abandoned, or its registration unconfirmed past the grace) comes
    back at first sight, at the back of the line: a later run may go first after the drop."""
    enqueues = [enq("a", 1), enq("b", 2), enq("c", 3)]
    bodies = [body("b", 25, 26, 1), body("c", 27, 28, 2), body("a", 30, 31, 3)]
    for kind in ("abandoned", "unconfirmed"):
        dropped = Event(kind, "", T0 + 12, json.dumps(["a"]))
        excused = check(data(enqueues, bodies, [dropped]), [], now=T0 + 60)
        assert excused.ok and excused.fifo_excused == 2, (kind, excused.failures())
    # Dropped after b started: b went first while a was still in line.
    late = Event("unconfirmed", "", T0 + 26.5, json.dumps(["a"]))
    assert check(data(enqueues, bodies, [late]), [], now=T0 + 60).fifo_inversions
    # The dropped run is the later one: the earlier run's place was never taken.
    other = Event("unconfirmed", "", T0 + 12, json.dumps(["b"]))
    assert check(data(enqueues, bodies, [other]), [], now=T0 + 60).fifo_inversions


def test_token_order() -> None:
    backwards = data([enq("a", 1), enq("b", 2)], [body("a", 1, 2, 5), body("b", 3, 4, 4)])
    assert check(backwards, [], now=T0 + 60).token_violations
    twice = data(
        [enq("a", 1, scope="pair"), enq("b", 2, scope="pair")],
        [body("a", 1, 2, 5, scope="pair"), body("b", 1.5, 4, 5, scope="pair")],
    )
    assert check(twice, [], now=T0 + 60).token_violations


def test_stuck_key_and_rejected_leftovers() -> None:
    waiter = WaiterView("x", 1, T0, RunState.PENDING, True)
    snap = KeySnapshot("mutex", "K", 1, 3, (), (waiter,))
    result = check(clean(), [snap], now=T0 + 60)
    assert result.stuck_keys and result.rejected_leftovers
    ran = data([enq("a", 1), enq("x", 2, accepted=False)], [body("a", 1, 2, 1), body("x", 3, 4, 2)])
    assert check(ran, [], now=T0 + 60).rejected_leftovers


def test_singleton_body_without_token_fails() -> None:
    d = data([enq("a", 1)], [body("a", 1, 2, None)])
    assert check(d, [], now=T0 + 60).without_slot


def retried(run_id: str, start: float, token: int = 1, *, key: str = "K") -> Body:
    """A holder's body that raised: its retry was published as it ended (0.1 s later)."""
    return body(run_id, start, start + 0.1, token, key=key, outcome="raised")


def test_broker_loss_is_excused_only_where_declared() -> None:
    """A holder's retry in transit at a kill: lost for good (the store never issues a holder again),
    excused only on a broker that loses a popped message."""
    holder = HolderView("b", 2, T0 + 0.7, T0 + 0.8, T0 + 4, False)
    snap = KeySnapshot("mutex", "K", 1, 2, (holder,), ())
    enqueues = [enq("a", 1, at=T0 + 0.5), enq("b", 2, at=T0 + 0.6)]
    bodies = [body("a", 0.55, 0.65, 1), retried("b", 0.7, 2)]
    strict = check(data(enqueues, bodies, [kill(1)]), [snap], now=T0 + 60)
    assert strict.lost == ["b"] and strict.stuck_keys
    lossy = check(data(enqueues, bodies, [kill(1)], broker_loss_per_kill=1), [snap], now=T0 + 60)
    assert lossy.ok and lossy.broker_lost == ["b"] and lossy.broker_loss_cap == 1
    # Runs logged before the cap existed said "broker_loses_on_kill": one per kill.
    legacy = check(data(enqueues, bodies, [kill(1)], broker_loses_on_kill=True), [snap], now=T0 + 60)
    assert legacy.ok and legacy.broker_lost == ["b"]


def test_a_lost_waiter_message_is_never_a_broker_loss() -> None:
    """The store issues a waiter again from its payload: a first message, a deferred copy or a wake
    lost at a kill is not excused, whatever the kills."""
    enqueues = [enq("a", 1, at=T0 + 0.5)]
    kills = [kill(1), kill(2, "w1"), kill(3, "w2")]
    never = check(data(enqueues, [], kills, broker_loss_per_kill=1), [], now=T0 + 60)
    assert never.lost == ["a"] and not never.broker_lost
    deferred = [received("a", 0.6), delivery("a", 0.7, "IGNORED: deferred 0.30s (generation 1)")]
    gated = check(data(enqueues, [], kills, deferred, broker_loss_per_kill=1), [], now=T0 + 60)
    assert gated.lost == ["a"] and not gated.broker_lost
    dropped = [*deferred, received("a", 0.75), delivery("a", 1.1, "IGNORED: stale copy dropped")]
    woken = check(data(enqueues, [], kills, dropped, broker_loss_per_kill=1), [], now=T0 + 60)
    assert woken.lost == ["a"] and not woken.broker_lost


def test_broker_loss_is_capped_per_kill() -> None:
    """Two retries in transit and one kill: one is excused, the other is lost and fails the check."""
    enqueues = [enq("a", 1, at=T0 + 0.1), enq("b", 2, at=T0 + 0.2, key="L")]
    bodies = [retried("a", 0.4), retried("b", 0.5, 2, key="L")]
    one = check(data(enqueues, bodies, [kill(1)], broker_loss_per_kill=1), [], now=T0 + 60)
    assert not one.ok
    assert len(one.broker_lost) == 1 and len(one.lost) == 1 and one.broker_loss_over_cap == one.lost
    assert one.broker_loss_cap == 1
    two = check(data(enqueues, bodies, [kill(1), kill(3, "w1")], broker_loss_per_kill=1), [], now=T0 + 60)
    assert two.ok and two.broker_lost == ["a", "b"] and two.broker_loss_cap == 2
    # A kill before both retries were published accounts for neither: one kill left for two runs.
    early = check(
        data(enqueues, bodies, [kill(0.45), kill(3, "w1")], broker_loss_per_kill=1), [], now=T0 + 60
    )
    assert len(early.broker_lost) == 1 and len(early.lost) == 1


def test_broker_loss_matches_late_publishes_first() -> None:
    """a's retry can use either kill, b's only the later one: both are excused whatever the order."""
    enqueues = [enq("a", 1, at=T0 + 0.1), enq("b", 2, at=T0 + 0.2, key="L")]
    bodies = [retried("a", 0.4), retried("b", 1.9, 2, key="L")]
    loss = lost_to_broker(data(enqueues, bodies, [kill(1), kill(3, "w1")]), ["a", "b"], per_kill=1)
    assert loss.excused == {"a": T0 + 1, "b": T0 + 3} and not loss.over_cap


def test_broker_loss_needs_a_kill_after_the_publish() -> None:
    enqueues = [enq("a", 1, at=T0 + 0.1)]
    result = check(data(enqueues, [retried("a", 5)], [kill(1)], broker_loss_per_kill=1), [], now=T0 + 60)
    assert result.lost == ["a"] and not result.broker_lost


def test_a_retry_a_worker_received_is_not_a_broker_loss() -> None:
    """Received (recorded as unacked) or run by a body the kill stopped: it comes back, never excused."""
    enqueues = [enq("a", 1, at=T0 + 0.1)]
    got = check(
        data(enqueues, [retried("a", 0.4)], [kill(2)], [received("a", 0.6)], broker_loss_per_kill=1),
        [],
        now=T0 + 60,
    )
    assert got.lost == ["a"] and not got.broker_lost
    killed = check(
        data(
            enqueues,
            [retried("a", 0.4), body("a", 0.7, None, 2)],
            [kill(2)],
            [received("a", 0.6)],
            broker_loss_per_kill=1,
        ),
        [],
        now=T0 + 60,
    )
    assert killed.lost == ["a"] and not killed.broker_lost


def test_a_retry_in_transit_is_a_broker_loss() -> None:
    """A holder's body raised: its retry is published as the body ends, the RETRY delivery too."""
    enqueues = [enq("a", 1, at=T0 + 0.5)]
    raised = [retried("a", 0.7)]
    retry = check(data(enqueues, raised, [kill(0.9)], broker_loss_per_kill=1), [], now=T0 + 60)
    assert retry.ok and retry.broker_lost == ["a"]
    # The kill came before the retry was published: not this kill's loss.
    assert check(data(enqueues, raised, [kill(0.75)], broker_loss_per_kill=1), [], now=T0 + 60).lost
    marked = [received("a", 0.6), delivery("a", 0.65, "RETRY: Retry in 0.1s", end=0.85)]
    both = check(data(enqueues, raised, [kill(0.9)], marked, broker_loss_per_kill=1), [], now=T0 + 60)
    assert both.ok and both.broker_lost == ["a"]


def test_the_table_shows_the_broker_loss_cap() -> None:
    enqueues = [enq("a", 1, at=T0 + 0.1), enq("b", 2, at=T0 + 0.2, key="L")]
    bodies = [retried("a", 0.4), retried("b", 0.5, 2, key="L")]
    result = check(data(enqueues, bodies, [kill(1)], broker_loss_per_kill=1), [], now=T0 + 60)
    text = render(result)
    assert "lost by the broker at a SIGKILL" in text and "1 (≤ 1)" in text
    assert "in transit at a kill, over the cap" in text and "FAIL" in text


def render(result: CheckResult) -> str:
    console = Console(width=110, record=True, file=io.StringIO())
    result.print(console)
    return console.export_text()


def test_an_unfinished_run_is_explained_in_time_order_with_its_key_in_the_store() -> None:
    """What a CI failure prints for a run that never completed: its whole story, then the store."""
    logged = data(
        [enq("a", 1, at=T0 + 0.5), enq("b", 2, at=T0 + 0.6)],
        [body("a", 1.0, None, 7)],
        [kill(1.5), kill(0.1)],
        [received("a", 0.8)],
    )
    snap = KeySnapshot("mutex", "K", 1, 7, holders=(HolderView("a", 7, T0 + 1, T0 + 1, T0 + 2, True),))
    other = KeySnapshot("mutex", "other", 1, 3)
    story = explain_unfinished(logged, ["a"], [other, snap]).splitlines()
    assert story[0].startswith("run a ")
    assert [line.split()[1] for line in story[1:5]] == ["enqueue", "received", "body", "kill"]
    assert "killed/running" in story[3] and "token 7" in story[3]
    assert story[5].startswith("  store now: KeySnapshot(scope='mutex', key='K'")
    assert len(story) == 6  # b is not asked about; the kill before a's enqueue is left out


def test_a_plain_run_popped_by_a_killed_worker_is_a_broker_loss() -> None:
    """A plain task's message lost between kombu's pop and its unacked record: nothing issues a
    plain run again, so a kill after its send excuses it (within the cap); a singleton waiter in
    the same place is issued again by the store and is not."""
    plain = [enq("p", 1, scope="plain", key="plain0", at=T0 + 0.5)]
    lossy = check(data(plain, [], [kill(0.6)], broker_loss_per_kill=1), [], now=T0 + 60)
    assert lossy.ok and lossy.broker_lost == ["p"]
    assert check(data(plain, [], [kill(0.4)], broker_loss_per_kill=1), [], now=T0 + 60).lost == ["p"]
    assert check(data(plain, [], [kill(0.6)]), [], now=T0 + 60).lost == ["p"]  # a broker that keeps it
    received_first = check(
        data(plain, [], [kill(0.6)], [received("p", 0.55)], broker_loss_per_kill=1), [], now=T0 + 60
    )
    assert received_first.lost == ["p"]  # recorded as unacked: the broker gives it back
    waiter = check(data([enq("w", 1, at=T0 + 0.5)], [], [kill(0.6)], broker_loss_per_kill=1), [], now=T0 + 60)
    assert waiter.lost == ["w"] and not waiter.broker_lost


def test_an_older_copy_delivered_after_the_retry_left_is_not_its_receipt() -> None:
    """From a CI soak: two copies of a run were received; one was admitted and raised, its retry
    left, a kill came, and then the other copy (received before the retry left) was delivered and
    dropped as stale. That delivery is not the retry's receipt: the retry is still in transit."""
    enqueues = [enq("a", 1, at=T0 + 0.1)]
    deliveries = [
        received("a", 0.15),
        received("a", 0.16),
        delivery("a", 0.17, "RETRY: Retry in 0.1s", end=0.4),
        delivery("a", 0.38, "IGNORED: stale copy dropped", end=0.39),
    ]
    bodies = [body("a", 0.2, 0.3, 1, outcome="raised")]
    lossy = check(data(enqueues, bodies, [kill(0.35)], deliveries, broker_loss_per_kill=1), [], now=T0 + 60)
    assert lossy.ok and lossy.broker_lost == ["a"]
    # A receipt after the retry left is the retry's: the broker gave it back, not excused.
    again = [*deliveries, received("a", 0.5)]
    got = check(data(enqueues, bodies, [kill(0.35)], again, broker_loss_per_kill=1), [], now=T0 + 60)
    assert got.lost == ["a"] and not got.broker_lost
    # From a later CI soak: the copy received after the retry left was dropped as stale on that
    # worker: an older copy kombu gave back after its first worker died, not the retry.
    given_back = [*again, delivery("a", 0.6, "IGNORED: stale copy dropped")]
    back = check(data(enqueues, bodies, [kill(0.35)], given_back, broker_loss_per_kill=1), [], now=T0 + 60)
    assert back.ok and back.broker_lost == ["a"]
