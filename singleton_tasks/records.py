"""A key's stored records, their codec, and the locked transaction that reads and writes them.

Every store keeps the same two records per key (:class:`KeyMeta`, :class:`RunRecord`); the
rules (:mod:`singleton_tasks.gate`) read and write them through :class:`KeyTransaction`. A run's
fields are written again in the SQL schema and migrations (``stores/sql/``), the SQL statements
(``stores/sql/queries.sql``) and the Lua (``stores/lua/lib.lua``); ``tests/test_record_shape.py``
fails when any of them disagrees with :data:`RUN_FIELDS` or :data:`KEY_META_FIELDS`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .config import DEFAULT_LEASE, DEFAULT_MAX_RETRY_DELAY, DEFAULT_ORPHAN_TIMEOUT, DEFAULT_RETRY_JITTER
from .outcomes import RunState


@dataclass
class KeyMeta:
    """Per scope+key counters; ``seq`` restarts when the key has no runs."""

    token: int = 0
    seq: int = 0
    limit: int = 1
    #: The key has no runs: after this time it is forgotten (None while it has runs).
    idle_until: float | None = None
    #: From then on a call on the key has work of its own (:func:`~singleton_tasks.gate.tick`);
    #: None: nothing due.
    due_at: float | None = None


@dataclass
class RunRecord:
    """One registered run of a key."""

    run_id: str
    seq: int
    state: RunState
    created_at: float
    confirmed: bool
    generation: int  # highest generation allocated to this run's copies
    live: list[int] = field(default_factory=list)  # generations whose delivery may act
    payload: bytes | None = None  # the message to publish when the run is issued
    token: int = 0
    holder_generation: int = 0
    admitted_at: float = 0.0
    heartbeat_at: float = 0.0
    lease_expires_at: float = 0.0
    executing: bool = False
    lease: float = DEFAULT_LEASE
    orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT
    recheck: float = DEFAULT_MAX_RETRY_DELAY + DEFAULT_RETRY_JITTER
    seen_at: float = 0.0  # when a live copy (or the registration) last reached the store
    reissue_at: float | None = None  # owning a slot and unseen by then, the run is issued again

    def copy(self) -> RunRecord:
        return dataclasses.replace(self, live=list(self.live))


#: RunRecord's fields in their declared order: the names a run's values are stored and decoded by.
RUN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunRecord))
#: KeyMeta's fields; the SQL store names ``limit`` ``slot_limit`` (a reserved word in SQL).
KEY_META_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(KeyMeta))


def encode_run(run: RunRecord) -> dict[str, object]:
    """A run's stored values by field name: ``state`` as its value, ``live`` as ``"1,2"``, the
    rest as they are."""
    values: dict[str, object] = {name: getattr(run, name) for name in RUN_FIELDS}
    values["state"] = run.state.value
    values["live"] = ",".join(str(g) for g in run.live)
    return values


def _optional_float(value: object) -> float | None:
    return None if value is None or value == b"" or value == "" else float(value)  # type: ignore[arg-type]


def decode_run(run_id: str, values: Mapping[str, Any]) -> RunRecord:
    """A run from its stored values by field name (every field of :data:`RUN_FIELDS` but
    ``run_id``; other names are ignored), as a driver returns them: numbers as numbers, text or
    bytes; booleans as 0/1; ``None`` or empty for none. A missing field raises ``KeyError``."""
    state, live, payload = values["state"], values["live"], values["payload"]
    if isinstance(live, bytes):
        live = live.decode()
    return RunRecord(
        run_id=run_id,
        seq=int(values["seq"]),
        state=RunState(state.decode() if isinstance(state, bytes) else state),
        created_at=float(values["created_at"]),
        confirmed=bool(int(values["confirmed"])),
        generation=int(values["generation"]),
        live=[int(g) for g in live.split(",") if g] if live else [],
        payload=None if payload is None else bytes(payload),
        token=int(values["token"]),
        holder_generation=int(values["holder_generation"]),
        admitted_at=float(values["admitted_at"]),
        heartbeat_at=float(values["heartbeat_at"]),
        lease_expires_at=float(values["lease_expires_at"]),
        executing=bool(int(values["executing"])),
        lease=float(values["lease"]),
        orphan_timeout=_optional_float(values["orphan_timeout"]),
        recheck=float(values["recheck"]),
        seen_at=float(values["seen_at"]),
        reissue_at=_optional_float(values["reissue_at"]),
    )


class KeyTransaction(abc.ABC):
    """One key's records, read and written while that key is locked by the store."""

    @abc.abstractmethod
    def now(self) -> float:
        """The store's clock (epoch seconds), read while the key is locked."""

    @abc.abstractmethod
    def meta(self) -> KeyMeta | None:
        """The key's counters as stored, or None if there are none (never used, or forgotten)."""

    @abc.abstractmethod
    def save_meta(self, meta: KeyMeta) -> None:
        """Create or update the key's counters.

        With ``meta.idle_until`` set the key has no runs left: the store may delete everything
        of it after that time (its settled markers expire by then too). ``meta.due_at`` must be
        findable store-wide (:meth:`singleton_tasks.stores.RuleStore.due_keys`).
        """

    @abc.abstractmethod
    def get_run(self, run_id: str) -> RunRecord | None:
        """The run's record under this key."""

    @abc.abstractmethod
    def save_run(self, run: RunRecord) -> None:
        """Insert or update a run's record."""

    @abc.abstractmethod
    def delete_run(self, run_id: str) -> None:
        """Remove a run's record."""

    @abc.abstractmethod
    def holders(self) -> list[RunRecord]:
        """The runs holding a slot (at most ``limit`` of them)."""

    @abc.abstractmethod
    def count_runs(self) -> int:
        """Holders plus waiters of the key."""

    @abc.abstractmethod
    def waiters_from(self, after_seq: int, count: int) -> list[RunRecord]:
        """Up to ``count`` waiters with ``seq > after_seq``, in registration order."""

    @abc.abstractmethod
    def newest_waiter(self) -> RunRecord | None:
        """The waiter registered last (the highest ``seq`` not holding a slot), or None."""

    @abc.abstractmethod
    def waiters_before(self, seq: int) -> int:
        """How many waiters registered before ``seq``."""

    @abc.abstractmethod
    def unconfirmed_before(self, before: float) -> list[str]:
        """Run ids of the unconfirmed waiters created before ``before`` (``created_at < before``)."""

    @abc.abstractmethod
    def settled_generation(self, run_id: str, now: float) -> int | None:
        """The admitted generation of a recently settled run, or None."""

    @abc.abstractmethod
    def mark_settled(self, run_id: str, generation: int, expires_at: float, now: float) -> None:
        """Remember a settled run's admitted generation until ``expires_at``; drop expired ones."""

    @abc.abstractmethod
    def clear_settled(self, run_id: str) -> None:
        """Forget a settled-run marker (the run is claimed anew)."""
