"""What store operations answer: plain frozen values shared by every store and adapter."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .config import DEFAULT_LEASE, DEFAULT_MAX_RETRY_DELAY, DEFAULT_ORPHAN_TIMEOUT, DEFAULT_RETRY_JITTER


@dataclass(frozen=True)
class RunSpec:
    """One run as the adapters describe it to the store."""

    scope: str
    key: str
    run_id: str
    limit: int = 1
    max_queue_depth: int | None = None
    lease: float = DEFAULT_LEASE
    orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT  # None: never evict, never re-issue
    #: The longest a live waiter's copy may take to show up again: its worker's longest
    #: re-check delay. A waiter owning a slot, unseen for ``orphan_timeout + recheck``, is issued again.
    recheck: float = DEFAULT_MAX_RETRY_DELAY + DEFAULT_RETRY_JITTER
    #: Over the cap, take the newest waiter's place instead of answering FULL (``on_full="replace"``).
    replace_when_full: bool = False

    def for_run(self, key: str, run_id: str) -> RunSpec:
        """These options for the run ``run_id`` of ``key``: ``dataclasses.replace(self, key=key,
        run_id=run_id)`` at a fifth of its cost (every send and every delivery makes one)."""
        run = object.__new__(type(self))
        run.__dict__.update(self.__dict__, key=key, run_id=run_id)
        return run


class Registered(enum.Enum):
    """Answer of ``register``."""

    REGISTERED = "registered"  # a new pending waiter
    EXISTS = "exists"  # the run id is already registered: a no-op (docs/concepts.md#keys-vs-run-ids)
    FULL = "full"  # over limit + max_queue_depth: nothing written (docs/concepts.md#backlog-cap)
    #: Over the cap, the new run took the newest waiter's place in line; that run is settled and
    #: never runs (``replace_when_full``; docs/concepts.md#backlog-cap).
    REPLACED = "replaced"


@dataclass(frozen=True)
class RegisterOutcome:
    status: Registered
    in_flight: int  # holders + waiters of the key after the call
    replaced: str | None = None  # REPLACED: the run id whose place the new run took


class Decision(enum.Enum):
    """Answer of ``claim`` for one delivery."""

    ADMITTED = "admitted"  # run the body: the run holds a slot and a fresh token
    GATED = "gated"  # defer the message with ``generation``; acked, not run
    BUSY = "busy"  # the run executes elsewhere under a live lease: defer, never run twice
    STALE = "stale"  # a dead copy: ack and drop, never run
    #: Claimed with ``PAYLOAD_ON_REQUEST`` and the store holds no message to issue the run from:
    #: claim again with the payload. The run was not recorded (nor the line changed).
    PAYLOAD_NEEDED = "payload_needed"


class PayloadRequest(enum.Enum):
    """``PAYLOAD_ON_REQUEST``: the type of the one value."""

    ON_REQUEST = "on_request"


#: ``claim``'s payload for a delivery of the very message its registration stored: the store
#: keeps that one, and answers ``PAYLOAD_NEEDED`` when it has none to issue a waiter from.
PAYLOAD_ON_REQUEST = PayloadRequest.ON_REQUEST


@dataclass(frozen=True)
class Wake:
    """A gated waiter that now owns a free slot: publish ``payload`` at once with ``generation``."""

    scope: str
    key: str
    run_id: str
    generation: int
    payload: bytes | None


@dataclass(frozen=True)
class ClaimOutcome:
    decision: Decision
    token: int | None = None  # when ADMITTED
    generation: int | None = None  # the generation to put on the deferred copy (GATED, BUSY)
    position: int | None = None  # 1-based place among waiters (GATED)
    takeover: bool = False  # ADMITTED over a holder whose lease had lapsed
    evicted: tuple[str, ...] = ()  # orphaned holders evicted by this call
    wakes: tuple[Wake, ...] = ()
    removed: tuple[str, ...] = ()  # abandoned waiters removed by this call (docs/concepts.md#glossary)


@dataclass(frozen=True)
class ReleaseOutcome:
    released: bool  # the run was removed by this call
    lost: bool = False  # another owner holds the slot now (docs/concepts.md#takeover)
    wakes: tuple[Wake, ...] = ()
    evicted: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()


@dataclass(frozen=True)
class DueOutcome:
    """What a due key did by itself (``Store.tick_due``): the caller publishes ``wakes``."""

    scope: str
    key: str
    wakes: tuple[Wake, ...] = ()
    evicted: tuple[str, ...] = ()  # orphaned holders evicted
    removed: tuple[str, ...] = ()  # abandoned waiters removed

    @property
    def acted(self) -> bool:
        """Whether the key did anything the caller publishes, logs or counts."""
        return bool(self.wakes or self.evicted or self.removed)


@dataclass(frozen=True)
class HeartbeatOutcome:
    lost: tuple[str, ...]  # run ids that no longer hold their slot
    store_time: float  # the store's clock when it extended the leases (epoch seconds)


@dataclass(frozen=True)
class HolderRef:
    """A running holder, as a worker heartbeats it."""

    scope: str
    key: str
    run_id: str
    token: int


class RunState(enum.Enum):
    PENDING = "pending"  # registered, never delivered
    GATED = "gated"  # delivered and deferred
    WOKEN = "woken"  # a copy was issued for its turn (a wake, or a re-issue)
    HOLDING = "holding"  # admitted: owns a slot


@dataclass(frozen=True)
class HolderView:
    run_id: str
    token: int
    admitted_at: float
    heartbeat_at: float
    lease_expires_at: float
    executing: bool
    phantom: bool = False  # an index entry whose run data is gone (a damaged store): evicted at once
    #: The size in bytes of the message the store keeps to issue the run again (None: it keeps none;
    #: a holder keeps none: it is never issued again).
    payload_bytes: int | None = None
    #: The generations of the run's copies the store counts as live (a delivery of one may act),
    #: in ascending order; the producer's copy is generation 0.
    live_generations: tuple[int, ...] = ()


@dataclass(frozen=True)
class WaiterView:
    run_id: str
    position: int
    created_at: float
    state: RunState
    confirmed: bool
    seen_at: float = 0.0  # the store's time when a live copy of the run was last seen
    reissue_at: float | None = None  # owning a slot and unseen by then, it is issued again (None: never)
    phantom: bool = False
    payload_bytes: int | None = None  # as HolderView's
    live_generations: tuple[int, ...] = ()  # as HolderView's


@dataclass(frozen=True)
class KeySnapshot:
    scope: str
    key: str
    limit: int
    token: int
    holders: tuple[HolderView, ...] = field(default=())
    waiters: tuple[WaiterView, ...] = field(default=())
