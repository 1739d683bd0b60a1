"""The one store protocol every backend implements, and the base of the rule-driven stores."""

from __future__ import annotations

import abc
import contextlib
import re
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import urlsplit, urlunsplit

from .. import gate
from ..errors import SingletonConfigError
from ..gate import KeyMeta, KeyTransaction, RunRecord, Timings
from ..outcomes import (
    ClaimOutcome,
    HolderRef,
    HolderView,
    KeySnapshot,
    RegisterOutcome,
    ReleaseOutcome,
    RunSpec,
    RunState,
    WaiterView,
    Wake,
)

SCHEMA_VERSION = 1


_LOOSE_USERINFO = re.compile(r":[^:@/\s]*@")  # ":password@" in a string that is no URL (a typo)
_QUERY_PASSWORD = re.compile(r"(?i)([?&;]pass(?:word|wd)?=)[^&;#]*")  # libpq's ?password=


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (SPEC §8)."""
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<unparseable store url>"
    if password is None:
        return url if "://" in url else _LOOSE_USERINFO.sub(":***@", url)
    # Keep everything after the userinfo verbatim (an invalid port must not raise here).
    host_and_port = parts.netloc.rpartition("@")[2]
    netloc = f"{parts.username or ''}:***@{host_and_port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not namespace or any(c in namespace for c in "{}:\n"):
        raise SingletonConfigError(
            f"store namespace must be a non-empty str without braces, colons or newlines, got {namespace!r}"
        )
    return namespace


class Store(abc.ABC):
    """Where runs, slots and tokens live. Every method is one atomic store operation.

    ``now`` is always passed in by the caller (the library's clock): stores never read a clock.
    """

    schemes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, url: str, *, namespace: str = "default", timings: Timings | None = None) -> None:
        self.url = redact_url(url)
        self.namespace = check_namespace(namespace)
        self.timings = timings or Timings()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} namespace={self.namespace!r}>"

    @abc.abstractmethod
    def register(self, spec: RunSpec, *, now: float, confirmed: bool = True) -> RegisterOutcome:
        """Register a pending waiter with the backlog cap, or report it exists / the key is full."""

    @abc.abstractmethod
    def confirm(self, scope: str, key: str, run_id: str, *, now: float) -> bool:
        """Confirm a registration once its message was published."""

    @abc.abstractmethod
    def unregister(self, scope: str, key: str, run_id: str, *, now: float) -> bool:
        """Undo a registration whose message could not be published."""

    @abc.abstractmethod
    def park(self, scope: str, key: str, run_id: str, payload: bytes, *, now: float) -> tuple[Wake, ...]:
        """A registration published held back waits gated with ``payload``; returns the wakes."""

    @abc.abstractmethod
    def claim(
        self, spec: RunSpec, generation: int, payload: bytes | None = None, *, now: float
    ) -> ClaimOutcome:
        """Decide a delivery of generation ``generation``; ``payload`` is kept to wake it later."""

    @abc.abstractmethod
    def suspend(self, scope: str, key: str, run_id: str, token: int, *, now: float, delay: float) -> bool:
        """A holder waits ``delay`` s for its retry and keeps its slot."""

    @abc.abstractmethod
    def release(
        self,
        scope: str,
        key: str,
        run_id: str,
        *,
        token: int | None,
        generation: int | None = None,
        now: float,
    ) -> ReleaseOutcome:
        """Settle a run and name the waiters to wake."""

    @abc.abstractmethod
    def heartbeat(self, holders: Sequence[HolderRef], *, now: float) -> list[str]:
        """Extend the leases of running holders in one call; returns run ids that lost their slot."""

    @abc.abstractmethod
    def snapshot(self, *, now: float, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
        """Every key with holders or waiters (optionally one scope / key), for inspection."""

    def operator_release(self, run_id: str, *, now: float) -> ReleaseOutcome | None:
        """Free a run's slot or place by run id alone (operator override); None if unknown."""
        for snap in self.snapshot(now=now):
            if any(h.run_id == run_id for h in snap.holders) or any(w.run_id == run_id for w in snap.waiters):
                return self.release(snap.scope, snap.key, run_id, token=None, now=now)
        return None

    @abc.abstractmethod
    def schema_version(self) -> int | None:
        """The schema version recorded in the store (None: not created yet)."""

    def migrate(self) -> None:
        """Create or upgrade the store's schema to :data:`SCHEMA_VERSION`."""

    def check_schema(self) -> None:
        """Refuse to work against an incompatible schema (SPEC §8)."""
        from ..errors import SchemaVersionError

        found = self.schema_version()
        if found != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self!r}: schema version {found} found, {SCHEMA_VERSION} required; "
                f"run `singleton-tasks migrate --store URL` (drain singleton runs first)"
            )

    def close(self) -> None:
        """Release connections."""


class RuleStore(Store):
    """A store whose rules come from :mod:`singleton_tasks.gate`, over a locked key transaction."""

    @abc.abstractmethod
    def transaction(self, scope: str, key: str) -> contextlib.AbstractContextManager[KeyTransaction]:
        """Lock ``scope``+``key`` and give its records; commit on exit, roll back on error."""

    def register(self, spec: RunSpec, *, now: float, confirmed: bool = True) -> RegisterOutcome:
        with self.transaction(spec.scope, spec.key) as tx:
            return gate.register(tx, spec, now=now, confirmed=confirmed, timings=self.timings)

    def confirm(self, scope: str, key: str, run_id: str, *, now: float) -> bool:
        with self.transaction(scope, key) as tx:
            return gate.confirm(tx, run_id)

    def unregister(self, scope: str, key: str, run_id: str, *, now: float) -> bool:
        with self.transaction(scope, key) as tx:
            return gate.unregister(tx, run_id)

    def park(self, scope: str, key: str, run_id: str, payload: bytes, *, now: float) -> tuple[Wake, ...]:
        with self.transaction(scope, key) as tx:
            return tuple(gate.park(tx, scope, key, run_id, payload, now=now))

    def claim(
        self, spec: RunSpec, generation: int, payload: bytes | None = None, *, now: float
    ) -> ClaimOutcome:
        with self.transaction(spec.scope, spec.key) as tx:
            return gate.claim(tx, spec, generation, payload, now=now, timings=self.timings)

    def suspend(self, scope: str, key: str, run_id: str, token: int, *, now: float, delay: float) -> bool:
        with self.transaction(scope, key) as tx:
            return gate.suspend(tx, run_id, token, now=now, delay=delay)

    def release(
        self,
        scope: str,
        key: str,
        run_id: str,
        *,
        token: int | None,
        generation: int | None = None,
        now: float,
    ) -> ReleaseOutcome:
        with self.transaction(scope, key) as tx:
            return gate.release(
                tx, scope, key, run_id, token=token, generation=generation, now=now, timings=self.timings
            )

    def heartbeat(self, holders: Sequence[HolderRef], *, now: float) -> list[str]:
        lost = []
        for ref, alive in zip(holders, self._heartbeat_batch(holders, now), strict=True):
            if not alive:
                lost.append(ref.run_id)
        return lost

    @abc.abstractmethod
    def _heartbeat_batch(self, holders: Sequence[HolderRef], now: float) -> list[bool]:
        """Extend each holder's lease in one store call; whether each still holds its slot."""


def snapshot_of(scope: str, key: str, meta: KeyMeta, runs: Sequence[RunRecord]) -> KeySnapshot:
    """One key's records as an inspection view (shared by the rule stores)."""
    holders = sorted((r for r in runs if r.state is RunState.HOLDING), key=lambda r: r.token)
    waiters = sorted((r for r in runs if r.state is not RunState.HOLDING), key=lambda r: r.seq)
    return KeySnapshot(
        scope=scope,
        key=key,
        limit=meta.limit,
        token=meta.token,
        holders=tuple(
            HolderView(h.run_id, h.token, h.admitted_at, h.heartbeat_at, h.lease_expires_at, h.executing)
            for h in holders
        ),
        waiters=tuple(
            WaiterView(w.run_id, i + 1, w.created_at, w.state, w.confirmed) for i, w in enumerate(waiters)
        ),
    )
