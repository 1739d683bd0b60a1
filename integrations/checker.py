"""The invariant checker: docs/concepts.md#the-life-of-a-run over one logged scenario run.

1. never more than ``limit`` bodies of a key overlap;
2. every accepted enqueue ran to completion at least once — a purged one too (the store issues a
   waiter again from its payload when its copies are lost). Excused, and reported: a run purged
   while it held its slot (a holder is evicted and never issued again: its body ran, or runs no
   more) and a run the store abandoned (re-issued and never seen for the store's ``retention``);
3. no key is left with holders or waiters when the work is done (``Store.snapshot``);
4. ``limit=1``: same-key bodies start in enqueue order. The one exception is a first-sight
   registration: a run the store dropped (abandoned, or a registration never confirmed) and
   registered anew when a copy of it arrived, at the back of the line. The log names such runs
   with an ``abandoned`` or ``unconfirmed`` event; nothing else reorders the line (a crash, a
   takeover, an eviction or a purge does not);
5. fencing tokens strictly increase per key in start order: every token is given once, a run's
   later bodies (retries, takeovers) have larger tokens, and a body never starts after a body with a
   larger token ended. With ``limit=1`` start order is admission order, so that is exact; with
   ``limit>1`` a holder's body may start a little after its admission while the other slots move
   on, so there the last rule allows :data:`ADMISSION_SLACK` seconds;
6. rejected enqueues left nothing: no body, no record in the store.

Also failed: a singleton body that ran without a token (no slot), and a body that never ended
although its worker was not killed (the log lost track of it).

By hand: ``python -m integrations.checker --run ID`` (``--list`` shows recent runs); exit status 1
when an invariant fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from singleton_tasks import store_from_url
from singleton_tasks.outcomes import KeySnapshot

from .runlog import Body, Delivery, RunData, RunLog
from .settings import LOG_URL, PLAIN_TASK, SINGLETON_TASKS

#: limit > 1: how long after its admission a holder's body may log its start (a fresh worker process
#: connects to the log first) while the key's other slots admit and finish later runs.
ADMISSION_SLACK = 1.0
#: How many messages one SIGKILL of a Celery worker can lose on kombu's Redis transport. kombu pops a
#: message with BRPOP and records it as unacked (``QoS.append``, one MULTI/EXEC) only once it has read
#: the reply; a worker killed in between loses it. A channel has at most one BRPOP in flight
#: (``MultiChannelPoller._register_BRPOP`` sends one only when none is pending), a reply carries one
#: message, and a Celery worker consumes its task queues on one channel: one message per kill. The
#: reply may wait in the socket for a long time (kombu pauses a popped reply while the worker's
#: prefetch is full), so there is no time window, only this cap. See :func:`lost_to_broker`.
BROKER_LOSS_PER_KILL = 1
#: Events naming runs the store dropped from the line (detail: a JSON list of run ids): a run
#: ``abandoned`` (issued again and again, never seen for the store's retention) or whose
#: registration was dropped ``unconfirmed`` (its publish never confirmed within the grace). A copy
#: of such a run that arrives later is registered at first sight, behind the runs in line then.
DROPPED = frozenset({"abandoned", "unconfirmed"})


@dataclass(frozen=True)
class Span:
    """A body with its end resolved: the logged end, the kill time, or unknown (``None``)."""

    body: Body
    end: float | None
    killed: bool


@dataclass
class CheckResult:
    run: str
    title: str
    duration: float
    accepted: int = 0
    rejected: int = 0
    bodies: int = 0
    completed: int = 0
    killed_bodies: int = 0
    retried_runs: int = 0  # runs with more than one body (retries, redeliveries after a crash)
    repeated_completions: int = 0  # runs whose body returned more than once (at-least-once after a crash)
    # Runs purged while they held their slot: evicted, never issued again (excused from invariant 2).
    purged: list[str] = field(default_factory=list)
    # Runs purged while they waited that ran anyway (issued again from the store: not excused).
    purged_ran: list[str] = field(default_factory=list)
    # Runs the store abandoned (removed from the line, logged at error): excused from invariant 2.
    abandoned: list[str] = field(default_factory=list)
    # Holders whose retry the broker lost before any delivery when a worker was SIGKILLed: only
    # excused for a broker documented to lose a message (kombu's Redis transport pops a message
    # before it records it as unacked); a lost waiter's message is issued again and never excused.
    broker_lost: list[str] = field(default_factory=list)
    broker_loss_cap: int = 0  # how many the kills could have lost: per kill × kills (0: none declared)
    # Unfinished runs consistent with a loss in transit, but beyond the cap: counted as lost.
    broker_loss_over_cap: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    overlaps: list[str] = field(default_factory=list)
    fifo_inversions: list[str] = field(default_factory=list)
    fifo_excused: int = 0
    token_violations: list[str] = field(default_factory=list)
    stuck_keys: list[str] = field(default_factory=list)
    rejected_leftovers: list[str] = field(default_factory=list)
    without_slot: list[str] = field(default_factory=list)
    dangling: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        named = {
            "lost (invariant 2)": self.lost,
            "overlaps (invariant 1)": self.overlaps,
            "FIFO inversions (invariant 4)": self.fifo_inversions,
            "token order (invariant 5)": self.token_violations,
            "stuck keys (invariant 3)": self.stuck_keys,
            "rejected leftovers (invariant 6)": self.rejected_leftovers,
            "bodies without a slot": self.without_slot,
            "bodies that never ended": self.dangling,
        }
        return [f"{name}: {len(items)}: {items[:10]}" for name, items in named.items() if items]

    @property
    def ok(self) -> bool:
        return not self.failures()

    def assert_ok(self) -> None:
        failures = self.failures()
        if failures:
            raise AssertionError(f"invariants failed for run {self.run}:\n  " + "\n  ".join(failures))

    @property
    def heading(self) -> str:
        return f"invariants: {self.title} (run {self.run})"

    def table(self) -> Table:
        table = Table(title=self.heading, title_justify="left", min_width=len(self.heading))
        table.add_column("check")
        table.add_column("value", justify="right")
        table.add_column("", justify="center")

        def row(name: str, value: object, good: bool | None = None) -> None:
            mark = "" if good is None else ("ok" if good else "FAIL")
            table.add_row(name, str(value), mark)

        row("runs (accepted enqueues)", self.accepted)
        row("rejected enqueues", self.rejected)
        row("bodies (attempts)", self.bodies)
        row("killed mid-body", self.killed_bodies)
        row("runs with several bodies", self.retried_runs)
        row("completed", self.completed, not self.lost)
        row("lost", len(self.lost), not self.lost)
        if self.purged:
            row("purged while holding (evicted, never issued again)", len(self.purged))
        if self.purged_ran:
            row("purged while waiting, ran anyway (issued again)", len(self.purged_ran))
        if self.abandoned:
            row("abandoned by the store (retention)", len(self.abandoned))
        if self.broker_loss_cap:
            row(
                "lost by the broker at a SIGKILL (excused, at most)",
                f"{len(self.broker_lost)} (≤ {self.broker_loss_cap})",
                len(self.broker_lost) <= self.broker_loss_cap,
            )
            if self.broker_loss_over_cap:
                row("  in transit at a kill, over the cap", len(self.broker_loss_over_cap), False)
        row("overlaps over limit", len(self.overlaps), not self.overlaps)
        row("FIFO inversions (limit 1)", len(self.fifo_inversions), not self.fifo_inversions)
        row("  excused: re-registered at first sight", self.fifo_excused)
        row("token order violations", len(self.token_violations), not self.token_violations)
        row("stuck keys", len(self.stuck_keys), not self.stuck_keys)
        row("rejected enqueues that left a trace", len(self.rejected_leftovers), not self.rejected_leftovers)
        row("singleton bodies without a token", len(self.without_slot), not self.without_slot)
        row("bodies that never ended (no kill)", len(self.dangling), not self.dangling)
        row("repeated completions (after a crash)", self.repeated_completions)
        row("duration", f"{self.duration:.1f}s")
        return table

    def print(self, console: Console | None = None) -> None:
        (console or Console(width=110)).print(self.table())


def limit_of(scope: str, logged: int | None = None) -> int | None:
    if logged is not None:
        return logged
    known = SINGLETON_TASKS.get(scope)
    return known[0] if known else None


def resolve_spans(data: RunData, now: float) -> list[Span]:
    """Give every body an end: its own, else the first kill of its worker after it started."""
    kills: dict[str, list[float]] = defaultdict(list)
    for event in data.events:
        if event.kind == "kill":
            kills[event.worker].append(event.at)
    spans = []
    for body in data.bodies:
        if body.end is not None:
            spans.append(Span(body, body.end, killed=False))
            continue
        after = [at for at in kills.get(body.worker, ()) if at >= body.start]
        spans.append(Span(body, min(after), killed=True) if after else Span(body, None, killed=False))
    return spans


def _describe(span: Span) -> str:
    b = span.body
    end = "?" if span.end is None else f"{span.end:.3f}"
    return f"{b.run_id[:8]}@{b.worker}[{b.start:.3f}-{end}]"


def check_overlaps(spans: Sequence[Span], limits: dict[tuple[str, str], int], horizon: float) -> list[str]:
    found = []
    by_key: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for span in spans:
        if (span.body.scope, span.body.key) in limits:
            by_key[(span.body.scope, span.body.key)].append(span)
    for key, items in sorted(by_key.items()):
        limit = limits[key]
        # Ends sort before starts at the same instant: back-to-back bodies do not overlap.
        points = sorted(
            [(s.body.start, 1, i) for i, s in enumerate(items)]
            + [(s.end if s.end is not None else horizon, 0, i) for i, s in enumerate(items)]
        )
        active: set[int] = set()
        for _at, kind, i in points:
            if kind == 0:
                active.discard(i)
                continue
            active.add(i)
            if len(active) > limit:
                involved = ", ".join(_describe(items[j]) for j in sorted(active))
                found.append(f"{key[0]}/{key[1]} limit {limit}: {involved}")
    return found


def check_tokens(spans: Sequence[Span], limits: dict[tuple[str, str], int]) -> list[str]:
    found = []
    by_key: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for span in spans:
        if (span.body.scope, span.body.key) in limits and span.body.token is not None:
            by_key[(span.body.scope, span.body.key)].append(span)
    for key, items in sorted(by_key.items()):
        seen: dict[int, Span] = {}
        for span in items:
            token = span.body.token
            assert token is not None
            if token in seen:
                found.append(
                    f"{key[0]}/{key[1]}: token {token} given twice: {_describe(seen[token])}, "
                    f"{_describe(span)}"
                )
            seen[token] = span
        runs: dict[str, list[Span]] = defaultdict(list)
        for span in sorted(items, key=lambda s: s.body.start):
            runs[span.body.run_id].append(span)
        for run_id, bodies in runs.items():
            tokens = [s.body.token or 0 for s in bodies]
            if tokens != sorted(set(tokens)):
                found.append(
                    f"{key[0]}/{key[1]}: run {run_id[:8]}'s bodies have tokens {tokens} in start order"
                )
        # Every body that ended before another started must have the smaller token.
        slack = 0.0 if limits[key] == 1 else ADMISSION_SLACK
        ended = sorted((s for s in items if s.end is not None), key=lambda s: s.end or 0.0)
        starts = sorted(items, key=lambda s: s.body.start)
        best: Span | None = None
        j = 0
        for span in starts:
            while j < len(ended) and (ended[j].end or 0.0) + slack <= span.body.start:
                if best is None or (ended[j].body.token or 0) > (best.body.token or 0):
                    best = ended[j]
                j += 1
            if best is not None and (best.body.token or 0) >= (span.body.token or 0):
                found.append(
                    f"{key[0]}/{key[1]}: {_describe(span)} token {span.body.token} after "
                    f"{_describe(best)} token {best.body.token}"
                )
    return found


def named_runs(data: RunData, kinds: Iterable[str]) -> dict[str, float]:
    """The runs the log's events of ``kinds`` name (detail: a JSON list of run ids): run id -> the
    first such event's time."""
    wanted = set(kinds)
    named: dict[str, float] = {}
    for event in data.events:
        if event.kind in wanted and event.detail:
            for run_id in json.loads(event.detail):
                named.setdefault(run_id, event.at)
    return named


def check_fifo(
    data: RunData, first_start: dict[str, float], limits: dict[tuple[str, str], int]
) -> tuple[list[str], int]:
    """Invariant 4: every later-enqueued run of a ``limit=1`` key starts after the earlier ones,
    unless the earlier one was dropped from the line before the later one started (it came back
    at first sight, behind it)."""
    dropped = named_runs(data, DROPPED)
    found: list[str] = []
    excused = 0
    by_line: dict[tuple[str, str, str], list[tuple[int, str]]] = defaultdict(list)
    for e in data.enqueues:
        if e.accepted and limits.get((e.scope, e.key)) == 1 and e.run_id in first_start:
            # Enqueue order is only defined within one producer (its own sequence).
            by_line[(e.scope, e.key, e.producer)].append((e.seq, e.run_id))
    for (scope, key, _producer), line in sorted(by_line.items()):
        line.sort()
        for i, (_seq_a, a) in enumerate(line):
            for _seq_b, b in line[i + 1 :]:
                started = first_start[b]
                if started >= first_start[a]:
                    continue
                if a in dropped and dropped[a] < started:
                    excused += 1
                    continue
                found.append(
                    f"{scope}/{key}: {b[:8]} (enqueued later) started at {started:.3f}, "
                    f"before {a[:8]} at {first_start[a]:.3f}"
                )
    return found, excused


@dataclass(frozen=True)
class BrokerLoss:
    """Which unfinished runs a lossy broker's SIGKILLs account for (:func:`lost_to_broker`)."""

    excused: dict[str, float]  # run id -> the kill (its time) that lost its message
    over_cap: list[str]  # consistent with a loss in transit, but every kill after it is used up
    cap: int  # per kill × kills


def in_transit_since(data: RunData, run_id: str) -> float | None:
    """When the run's newest message left for the broker, if it can be lost for good and no worker
    has received it since; else None.

    Only a holder's message, or a plain task's, can be lost for good: a holder keeps its slot while
    its retry is on its way, and the store never issues a holder again (it is evicted after
    ``orphan_timeout``); nothing issues a plain run again. A waiter's lost message (its first, a
    deferred copy, a wake) is issued again from the payload the store keeps when the waiter's turn
    comes: it runs, and is never excused. A plain run with no record at all is in transit since its
    send.

    Evidence from the log: the run's newest retry left when its body raised (the body's end) or
    during a ``RETRY`` delivery (its start), and no record after that shows a worker got it: no
    body started since, and no receipt since. Celery logs each receipt (``received``: kombu
    recorded the message as unacked, so a dead worker's copy comes back after
    ``visibility_timeout``); a delivery that starts later may be of an older copy received
    before, so on Celery only receipts count. Where no receipt is logged (Dramatiq), a delivery
    that starts later counts.
    """
    deliveries = [d for d in data.deliveries if d.run_id == run_id]
    bodies = [b for b in data.bodies if b.run_id == run_id]
    if not deliveries and not bodies:
        sends = [e.at for e in data.enqueues if e.run_id == run_id and e.scope == PLAIN_TASK and e.accepted]
        return min(sends, default=None)
    left = [d.start for d in deliveries if d.kind == "delivery" and d.detail.startswith("RETRY")]
    left += [b.end for b in bodies if b.outcome == "raised" and b.end is not None]
    if not left:
        return None
    since = max(left)
    receipts = [d for d in deliveries if d.kind == "received"]
    if receipts:  # a receipt followed by a stale drop on its worker was an older copy given back
        got = [r.start for r in receipts if not _received_a_stale_copy(r, deliveries)]
    else:
        got = [d.start for d in deliveries]
    if any(at > since for at in got) or any(b.start > since for b in bodies):
        return None
    return since


def _received_a_stale_copy(receipt: Delivery, deliveries: list[Delivery]) -> bool:
    """The next delivery on ``receipt``'s worker dropped the copy as stale: an older copy (one kombu
    gave back after its first worker died), not a holder's retry, which is never stale to its run."""
    later = [
        d
        for d in deliveries
        if d.kind == "delivery" and d.worker == receipt.worker and d.start >= receipt.start
    ]
    following = min(later, key=lambda d: d.start, default=None)
    return following is not None and following.detail.startswith("IGNORED: stale")


def lost_to_broker(
    data: RunData, unfinished: Iterable[str], per_kill: int = BROKER_LOSS_PER_KILL
) -> BrokerLoss:
    """The unfinished runs a SIGKILL may have lost in transit (kombu's Redis transport), at most
    ``per_kill`` per kill.

    A run qualifies when :func:`in_transit_since` says its newest message is a holder's retry that
    never reached a worker, and a worker was SIGKILLed after that retry was published (the worker
    that popped it died before it recorded it). Each kill accounts for at most ``per_kill`` runs
    (:data:`BROKER_LOSS_PER_KILL`): runs are matched to kills, the latest-published first (they can
    use the fewest kills); a run no kill is left for is reported in ``over_cap`` and stays lost. Such
    a run holds its slot until it is evicted, ``orphan_timeout`` after its lease lapsed
    (docs/concepts.md#eviction).
    """
    kills = sorted(e.at for e in data.events if e.kind == "kill")
    since = {r: t for r in unfinished if (t := in_transit_since(data, r)) is not None}
    left = dict.fromkeys(range(len(kills)), per_kill)
    excused: dict[str, float] = {}
    over: list[str] = []
    for run_id, at in sorted(since.items(), key=lambda item: (-item[1], item[0])):
        # Any kill after the publish will do: a later-published run's kills are a subset of these.
        slot = next((i for i in range(len(kills)) if kills[i] >= at and left[i] > 0), None)
        if slot is None:
            over.append(run_id)
            continue
        left[slot] -= 1
        excused[run_id] = kills[slot]
    return BrokerLoss(excused, sorted(over), per_kill * len(kills))


def explain_unfinished(data: RunData, unfinished: Iterable[str], snapshots: Sequence[KeySnapshot]) -> str:
    """Each unfinished run's story, for a failure message: its enqueue, every delivery and body in
    time order (seconds from the scenario's start), the kills around them, and what the store holds
    for its key now. A run that never completes in CI is diagnosed from this text alone."""
    t0 = data.scenario.started
    kills = sorted(e.at for e in data.events if e.kind == "kill")
    lines: list[str] = []
    for run_id in sorted(unfinished):
        lines.append(f"run {run_id} (in transit since: {in_transit_since(data, run_id)}):")
        story: list[tuple[float, str]] = []
        key: tuple[str, str] | None = None
        for e in data.enqueues:
            if e.run_id == run_id:
                key = (e.scope, e.key)
                story.append((e.at, f"enqueue {e.scope}/{e.key} accepted={e.accepted} by {e.producer}"))
        for d in data.deliveries:
            if d.run_id == run_id:
                story.append((d.start, f"{d.kind} on {d.worker}/{d.pid} until +{d.end - t0:.3f}: {d.detail}"))
        for b in data.bodies:
            if b.run_id == run_id:
                key = key or (b.scope, b.key)
                end = "killed/running" if b.end is None else f"+{b.end - t0:.3f}"
                story.append(
                    (
                        b.start,
                        f"body attempt {b.attempt} token {b.token} on {b.worker}/{b.pid} "
                        f"until {end}: {b.outcome}",
                    )
                )
        first = min((at for at, _ in story), default=t0)
        story += [(at, "kill") for at in kills if at >= first]
        lines += [f"  {at - t0:+10.3f} {what}" for at, what in sorted(story)]
        for snap in snapshots:
            if key == (snap.scope, snap.key):
                lines.append(f"  store now: {snap}")
    return "\n".join(lines)


def broker_loss_per_kill(settings: dict[str, object]) -> int:
    """How many messages a SIGKILL may lose on this run's broker (0: none; the scenario declares it)."""
    declared = settings.get("broker_loss_per_kill")
    if isinstance(declared, int):
        return declared
    return BROKER_LOSS_PER_KILL if settings.get("broker_loses_on_kill") else 0  # older runs


def check(data: RunData, snapshots: Iterable[KeySnapshot], *, now: float | None = None) -> CheckResult:
    """All six invariants over the logged data and the store's final snapshot."""
    now = time.time() if now is None else now
    scenario = data.scenario
    horizon = scenario.finished or now
    result = CheckResult(
        run=scenario.run,
        title=f"{scenario.name} · {scenario.framework} · {scenario.broker} broker · {scenario.store} store",
        duration=horizon - scenario.started,
    )
    limits: dict[tuple[str, str], int] = {}
    for e in data.enqueues:
        limit = limit_of(e.scope, e.limit)
        if limit is not None:
            limits[(e.scope, e.key)] = limit
    for b in data.bodies:
        limit = limit_of(b.scope)
        if limit is not None:
            limits.setdefault((b.scope, b.key), limit)

    spans = resolve_spans(data, now)
    accepted = {e.run_id for e in data.enqueues if e.accepted}
    rejected = {e.run_id for e in data.enqueues if not e.accepted} - accepted
    purged = named_runs(data, ["purge"])
    completions: dict[str, int] = defaultdict(int)
    attempts: dict[str, int] = defaultdict(int)
    first_start: dict[str, float] = {}
    for span in spans:
        b = span.body
        attempts[b.run_id] += 1
        first_start[b.run_id] = min(first_start.get(b.run_id, b.start), b.start)
        if b.outcome == "ok":
            completions[b.run_id] += 1
        if span.killed:
            result.killed_bodies += 1
        if span.end is None:
            result.dangling.append(_describe(span))
        if b.scope != PLAIN_TASK and (b.scope, b.key) in limits and b.token is None:
            result.without_slot.append(_describe(span))

    result.accepted = len(accepted)
    result.rejected = len(rejected)
    result.bodies = len(spans)
    result.completed = len(accepted & set(completions))
    result.retried_runs = sum(1 for n in attempts.values() if n > 1)
    result.repeated_completions = sum(1 for n in completions.values() if n > 1)
    unfinished = accepted - set(completions)
    # Purged while it held its slot (its body had started): evicted, never issued again. A run
    # purged while it waited is issued again from the store: it must run like any other.
    result.purged = sorted(r for r in unfinished if r in purged and first_start.get(r, horizon) < purged[r])
    result.purged_ran = sorted(r for r in purged.keys() & set(completions) if first_start[r] > purged[r])
    abandoned = set(named_runs(data, ["abandoned"]))
    result.abandoned = sorted(unfinished & abandoned)
    lost = unfinished - set(result.purged) - abandoned
    snapshots = list(snapshots)
    per_kill = broker_loss_per_kill(scenario.settings)
    if per_kill:
        loss = lost_to_broker(data, lost, per_kill)
        result.broker_lost = sorted(loss.excused)
        result.broker_loss_over_cap = loss.over_cap
        result.broker_loss_cap = loss.cap
    result.lost = sorted(lost - set(result.broker_lost))
    result.overlaps = check_overlaps(spans, limits, horizon)
    result.token_violations = check_tokens(spans, limits)
    result.fifo_inversions, result.fifo_excused = check_fifo(data, first_start, limits)

    excused = set(result.broker_lost)
    gone = set(result.purged)
    for snap in snapshots:
        left = [h.run_id for h in snap.holders] + [w.run_id for w in snap.waiters]
        if left and all(r in excused for r in left):
            # Only holders whose retry the broker lost are left: evicted at the key's next
            # operation after their lease and orphan_timeout lapsed (docs/concepts.md#eviction).
            continue
        if not snap.waiters and left and all(r in gone for r in left) and _lapsed(snap, now):
            # Only holders purged while they held are left, their leases lapsed: nothing waits
            # behind them, and the key's next operation evicts them (docs/concepts.md#eviction).
            continue
        if snap.holders or snap.waiters:
            holders = [h.run_id[:8] for h in snap.holders]
            waiters = [f"{w.run_id[:8]}:{w.state.value}" for w in snap.waiters]
            result.stuck_keys.append(f"{snap.scope}/{snap.key}: holders={holders} waiters={waiters}")
    in_store = {h.run_id for s in snapshots for h in s.holders} | {
        w.run_id for s in snapshots for w in s.waiters
    }
    ran = {b.run_id for b in data.bodies}
    for run_id in sorted(rejected):
        if run_id in ran:
            result.rejected_leftovers.append(f"{run_id[:8]}: ran a body")
        if run_id in in_store:
            result.rejected_leftovers.append(f"{run_id[:8]}: recorded in the store")
    return result


def _lapsed(snap: KeySnapshot, now: float) -> bool:
    """No holder of the key holds a live lease."""
    return all(h.lease_expires_at <= now for h in snap.holders)


def store_snapshots(store_url: str, namespace: str) -> list[KeySnapshot]:
    """Every key of the integration scopes that still has holders or waiters."""
    store = store_from_url(store_url, namespace=namespace)
    try:
        return [snap for scope in SINGLETON_TASKS for snap in store.snapshot(scope=scope)]
    finally:
        store.close()


def check_run(
    run: str, log_url: str = LOG_URL, *, snapshots: Sequence[KeySnapshot] | None = None
) -> CheckResult:
    """Load a run from the log, snapshot its store (unless given), check."""
    log = RunLog(log_url)
    try:
        data = log.load(run)
    finally:
        log.close()
    if snapshots is None:
        snapshots = store_snapshots(data.scenario.store_url, data.scenario.namespace)
    return check(data, snapshots)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m integrations.checker", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--run", help="the scenario run id")
    parser.add_argument("--list", action="store_true", help="list recent scenario runs")
    parser.add_argument("--log-url", default=LOG_URL, help="the PostgreSQL log (default: %(default)s)")
    args = parser.parse_args(argv)
    console = Console(width=110)
    if args.list or not args.run:
        log = RunLog(args.log_url)
        table = Table(title="recent scenario runs")
        for column in ("run", "scenario", "started", "duration"):
            table.add_column(column)
        for run, name, started, finished in log.recent():
            took = f"{finished - started:.1f}s" if finished else "unfinished"
            table.add_row(run, name, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), took)
        console.print(table)
        return 0 if args.list else 2
    result = check_run(args.run, args.log_url)
    result.print(console)
    for failure in result.failures():
        console.print(f"[red]FAIL[/red] {failure}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
