"""The one store protocol every backend implements, and the base of the rule-driven stores."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import importlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar
from urllib.parse import unquote, unquote_plus, urlsplit, urlunsplit

from .. import gate
from ..config import Timings, check_storable
from ..errors import SingletonConfigError
from ..outcomes import (
    ClaimOutcome,
    DueOutcome,
    HeartbeatOutcome,
    HolderRef,
    HolderView,
    KeySnapshot,
    PayloadRequest,
    RegisterOutcome,
    ReleaseOutcome,
    RunSpec,
    RunState,
    WaiterView,
    Wake,
)
from ..records import KeyMeta, KeyTransaction, RunRecord

#: Version 2: store-side time, ``seen_at`` / ``passed_over_at`` per run, idle keys expire.
#: Version 3: Redis lists its busy keys in an index (no change to the SQL schemas).
#: Version 4: every waiter counts until it settles and is re-issued when its copies are lost
#: (``reissue_at`` per run, ``due_at`` per key, an index of due keys).
SCHEMA_VERSION = 4

#: A zero-argument callable giving epoch seconds: the test-only ``clock=`` option of every store.
Clock = Callable[[], float]


_LOOSE_USERINFO = re.compile(r":[^:@/\s]*@")  # ":password@" in a string that is no URL (a typo)
_QUERY_PASSWORD = re.compile(r"(?i)([?&;]pass(?:word|wd)?=)[^&;#]*")  # libpq's ?password=


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (docs/deployment.md#choosing-a-store)."""
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


def scrub_secrets(text: str, url: str) -> str:
    """``text`` (a driver's message, which may quote the URL) with the URL redacted as
    :func:`redact_url` shows it and each of its passwords, as written or decoded, as ``***``."""
    text = text.replace(url, redact_url(url))
    secrets = {match.group(0)[len(match.group(1)) :] for match in _QUERY_PASSWORD.finditer(url)}
    try:
        secrets.add(urlsplit(url).password or "")
    except ValueError:
        pass
    for secret in sorted(secrets | {unquote(secret) for secret in secrets}, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


def check_retention(retention: object, what: str = "store retention") -> float:
    """``retention`` as seconds, or SingletonConfigError naming ``what`` and the value."""
    given = retention  # named as given: '0' from a URL, not 0.0
    if isinstance(retention, str):
        try:
            retention = float(retention)
        except ValueError:
            pass
    if (
        not isinstance(retention, (int, float))
        or isinstance(retention, bool)
        or not 0 < retention < float("inf")
    ):
        raise SingletonConfigError(f"{what} must be a positive number of seconds, got {given!r}")
    return float(retention)


def pop_query_option(url: str, name: str) -> tuple[str, str | None]:
    """The URL without its ``?name=`` query option, and that option's value (None: not given).

    Every other character of the URL is kept as written, for the driver that reads the rest.
    SingletonConfigError when the option is given twice.
    """
    head, question, rest = url.partition("?")
    query, hash_mark, fragment = rest.partition("#")
    found = [part for part in query.split("&") if unquote_plus(part.partition("=")[0]) == name]
    if not question or not found:
        return url, None
    if len(found) > 1:
        raise SingletonConfigError(f"store URL {redact_url(url)}: ?{name}= is given {len(found)} times")
    kept = "&".join(part for part in query.split("&") if part not in found)
    value = unquote_plus(found[0].partition("=")[2])
    return head + (question + kept if kept else "") + hash_mark + fragment, value


def url_retention(url: str) -> float | None:
    """The ``?retention=`` of a store URL (any scheme) in seconds; None: not given."""
    value = pop_query_option(url, "retention")[1]
    return None if value is None else check_retention(value, f"store URL {redact_url(url)}: ?retention=")


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not namespace or any(c in namespace for c in "{}:\n"):
        raise SingletonConfigError(
            f"store namespace must be a non-empty str without braces, colons or newlines, got {namespace!r}"
        )
    return check_storable(namespace, "store namespace")


class Store(abc.ABC):
    """Where runs, slots and tokens live. Every method is one atomic store operation.

    Every deadline is decided on the store's own clock: a server clock for the network stores, the
    host's ``time.time()`` for the one-host stores (docs/deployment.md#clocks-and-skew).
    Options every store takes:

    - ``namespace``: isolates applications sharing one server.
    - ``retention``: seconds after which an idle key and a settled run's marker are forgotten,
      and a waiter due for a re-issue that nothing reached for that long is abandoned (default
      :data:`~singleton_tasks.config.DEFAULT_RETENTION`); also ``?retention=`` in the URL of every
      scheme (given both ways, the two must agree).
    - ``clock`` (tests only): a zero-argument callable; when given the store decides at the time
      it returns instead of reading its own clock (:class:`singleton_tasks.testing.ManualClock`).
    """

    #: The URL schemes this class serves (``store_from_url`` looks them up here).
    schemes: ClassVar[tuple[str, ...]] = ()
    #: The driver modules the store needs and the extra that installs them: the store's module
    #: imports them only when installed, and :meth:`check_drivers` names the extra otherwise.
    drivers: ClassVar[tuple[str, ...]] = ()
    extra: ClassVar[str] = ""
    #: Whose clock decides: ``"server"`` (a clock shared by every host) or ``"host"`` (the clock
    #: of the one host the store serves).
    clock_source: ClassVar[str] = "host"
    #: Whether a worker or producer may create the schema when it first finds none: True for a
    #: store whose schema is its own (an embedded file, a process's memory, a Redis namespace);
    #: False where an operator runs the migrations (``singleton-tasks migrate``, a shared database).
    migrates_on_first_use: ClassVar[bool] = False

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "default",
        retention: float | None = None,
        timings: Timings | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.check_drivers()
        self.url = redact_url(url)
        self.namespace = check_namespace(namespace)
        timings = timings or Timings()
        from_url = url_retention(url)
        if from_url is not None:
            # Given both ways, they must agree (as the Redis store's own URL options must).
            if retention is not None and check_retention(retention) != from_url:
                raise SingletonConfigError(
                    f"store {self.url}: retention is given twice with different values: "
                    f"{retention!r} (keyword) and {from_url:g} (URL)"
                )
            retention = from_url
        if retention is not None:
            timings = dataclasses.replace(timings, retention=check_retention(retention))
        else:
            check_retention(timings.retention)
        self.timings = timings
        if clock is not None and not callable(clock):
            raise SingletonConfigError(f"store clock must be a callable returning seconds, got {clock!r}")
        self.clock = clock

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} namespace={self.namespace!r}>"

    @classmethod
    def check_drivers(cls, scheme: str | None = None) -> None:
        """SingletonConfigError naming the extra to install when a driver module is missing."""
        for module in cls.drivers:
            try:
                importlib.import_module(module)
            except ImportError as error:
                install = f"pip install 'singleton-tasks[{cls.extra}]'"
                raise SingletonConfigError(
                    f"the {scheme or cls.schemes[0]}:// store needs its driver: {install} ({error})"
                ) from error

    @classmethod
    def check_url(cls, url: str) -> None:
        """Check the URL's syntax without connecting: ValueError naming what is wrong.

        The default reads the port; stores of several hosts or none check their own way.
        """
        urlsplit(url).port  # noqa: B018 - raises ValueError on a port that is not a number

    @property
    def retention(self) -> float:
        return self.timings.retention

    @abc.abstractmethod
    def time(self) -> float:
        """The store's clock now (epoch seconds)."""

    @abc.abstractmethod
    def register(
        self, spec: RunSpec, *, payload: bytes | None = None, delay: float = 0.0, confirmed: bool = True
    ) -> RegisterOutcome:
        """Register a pending waiter with the backlog cap, or report it exists / the key is full.

        Arguments:
            spec: The run and its key's options.
            payload: The message the store issues the run from if its copies are lost (None: the
                run can only run from its own copies).
            delay: Seconds the run's message is delayed by (Dramatiq ``delay``, Celery
                ``countdown``): it is not issued again before then.
            confirmed: False until the message is published (:meth:`confirm`); an unconfirmed
                registration is dropped after the store's registration grace.
        """

    @abc.abstractmethod
    def confirm(self, scope: str, key: str, run_id: str) -> bool:
        """Confirm a registration once its message was published."""

    def confirm_many(self, runs: Sequence[tuple[str, str, str]]) -> list[bool]:
        """Confirm several published registrations, each ``(scope, key, run_id)``: :meth:`confirm`
        of each, in one round trip where the store can (a producer's background confirms)."""
        return [self.confirm(scope, key, run_id) for scope, key, run_id in runs]

    @abc.abstractmethod
    def unregister(self, scope: str, key: str, run_id: str) -> bool:
        """Undo a registration whose message could not be published."""

    @abc.abstractmethod
    def park(self, scope: str, key: str, run_id: str) -> tuple[Wake, ...]:
        """A registration published held back waits gated with its payload; returns the wakes."""

    @abc.abstractmethod
    def claim(
        self, spec: RunSpec, generation: int, payload: bytes | PayloadRequest | None = None
    ) -> ClaimOutcome:
        """Decide a delivery of generation ``generation``; ``payload`` is kept to wake it later.

        With ``PAYLOAD_ON_REQUEST`` the stored payload stays, and a run that has none and is not
        holding a slot gets ``PAYLOAD_NEEDED`` before anything is written.
        """

    @abc.abstractmethod
    def suspend(self, scope: str, key: str, run_id: str, token: int, *, delay: float) -> bool:
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
        waiting_only: bool = False,
    ) -> ReleaseOutcome:
        """Settle a run and name the waiters to wake (``waiting_only``: only while it holds no
        slot, :func:`singleton_tasks.gate.release`)."""

    @abc.abstractmethod
    def heartbeat(self, holders: Sequence[HolderRef]) -> HeartbeatOutcome:
        """Extend the leases of running holders in one call; names those that lost their slot."""

    @abc.abstractmethod
    def tick_due(self, *, limit: int = 64) -> list[DueOutcome]:
        """Call :func:`singleton_tasks.gate.tick` on up to ``limit`` keys whose ``due_at`` has
        passed: evictions, re-issues and abandoned waiters that no traffic on the key would
        otherwise trigger. Returns the keys where something was done. A worker's heartbeat
        thread calls it every interval and publishes the wakes."""

    @abc.abstractmethod
    def snapshot(self, *, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
        """Every key with holders or waiters (optionally one scope / key), for inspection."""

    def operator_release(self, run_id: str) -> ReleaseOutcome | None:
        """Free a run's slot or place by run id alone (operator override); None if unknown."""
        for snap in self.snapshot():
            if any(h.run_id == run_id for h in snap.holders) or any(w.run_id == run_id for w in snap.waiters):
                return self.release(snap.scope, snap.key, run_id, token=None)
        return None

    @abc.abstractmethod
    def schema_version(self) -> int | None:
        """The schema version recorded in the store (None: not created yet)."""

    def migrate(self) -> None:
        """Create or upgrade the store's schema to :data:`SCHEMA_VERSION`."""

    def check_schema(self) -> None:
        """Refuse to work against an incompatible schema (docs/deployment.md#schema-upgrades)."""
        from ..errors import SchemaVersionError

        found = self.schema_version()
        if found != SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self!r}: schema version {found} found, {SCHEMA_VERSION} required; "
                f"run `singleton-tasks migrate --store URL` (drain singleton runs first)"
            )

    def sweep(self, *, until: float | None = None) -> int:
        """Forget the namespace's expired state (settled markers, idle keys); returns how much.

        Workers call it now and then; stores whose server expires data by itself (Redis key
        TTLs) have nothing to do.

        Arguments:
            until: A :func:`time.monotonic` deadline: stop at the first chance after it (a
                store that deletes in transactions finishes the one it is in) and leave the
                rest to the next call. A worker's heartbeat thread sweeps in such slices,
                calling again while a call returns more than 0, so that its heartbeats never
                wait for a long sweep. None: sweep everything.
        """
        return 0

    def check_health(self) -> None:
        """Check again a condition of the server that the store checked before its first operation
        and that can change while it runs (the Redis store: an ``allkeys-*`` eviction policy).

        A worker's heartbeat thread calls it once per heartbeat interval; a producer that runs
        no worker is checked at first use only. A store that finds such a condition raises the
        error its first operation would have raised, and remembers it: until a later call finds
        the condition gone, every registration and claim raises that error as well (a new
        exception each time) and writes nothing, while the calls that confirm, extend or settle
        runs already admitted go on, so those runs keep their slots and finish. Keep the cost
        on the operations' path to an attribute check.

        Raises:
            SingletonConfigError: the condition found; remembered until a call finds it gone.
            StoreUnavailableError: the server did not answer; what was remembered stays.

        The default checks nothing.
        """

    def close(self) -> None:
        """Release connections."""


class RuleStore(Store):
    """A store whose rules come from :mod:`singleton_tasks.gate`, over a locked key transaction."""

    @abc.abstractmethod
    def transaction(self, scope: str, key: str) -> contextlib.AbstractContextManager[KeyTransaction]:
        """Lock ``scope``+``key`` and give its records; commit on exit, roll back on error."""

    def time(self) -> float:
        return self.clock() if self.clock is not None else time.time()

    @abc.abstractmethod
    def due_keys(self, now: float, count: int) -> list[tuple[str, str]]:
        """Up to ``count`` ``(scope, key)`` whose ``due_at`` is before ``now``, earliest first."""

    def register(
        self, spec: RunSpec, *, payload: bytes | None = None, delay: float = 0.0, confirmed: bool = True
    ) -> RegisterOutcome:
        with self.transaction(spec.scope, spec.key) as tx:
            return gate.register(
                tx, spec, payload=payload, delay=delay, confirmed=confirmed, timings=self.timings
            )

    def confirm(self, scope: str, key: str, run_id: str) -> bool:
        with self.transaction(scope, key) as tx:
            return gate.confirm(tx, run_id, timings=self.timings)

    def unregister(self, scope: str, key: str, run_id: str) -> bool:
        with self.transaction(scope, key) as tx:
            return gate.unregister(tx, run_id, timings=self.timings)

    def park(self, scope: str, key: str, run_id: str) -> tuple[Wake, ...]:
        with self.transaction(scope, key) as tx:
            return tuple(gate.park(tx, scope, key, run_id, timings=self.timings))

    def tick_due(self, *, limit: int = 64) -> list[DueOutcome]:
        done = []
        for scope, key in self.due_keys(self.time(), limit):
            with self.transaction(scope, key) as tx:
                outcome = gate.tick(tx, scope, key, timings=self.timings)
            if outcome.acted:
                done.append(outcome)
        return done

    def claim(
        self, spec: RunSpec, generation: int, payload: bytes | PayloadRequest | None = None
    ) -> ClaimOutcome:
        with self.transaction(spec.scope, spec.key) as tx:
            return gate.claim(tx, spec, generation, payload, timings=self.timings)

    def suspend(self, scope: str, key: str, run_id: str, token: int, *, delay: float) -> bool:
        with self.transaction(scope, key) as tx:
            return gate.suspend(tx, run_id, token, delay=delay)

    def release(
        self,
        scope: str,
        key: str,
        run_id: str,
        *,
        token: int | None,
        generation: int | None = None,
        waiting_only: bool = False,
    ) -> ReleaseOutcome:
        with self.transaction(scope, key) as tx:
            return gate.release(
                tx,
                scope,
                key,
                run_id,
                token=token,
                generation=generation,
                timings=self.timings,
                waiting_only=waiting_only,
            )

    def heartbeat(self, holders: Sequence[HolderRef]) -> HeartbeatOutcome:
        alive, store_time = self._heartbeat_batch(holders)
        lost = tuple(ref.run_id for ref, ok in zip(holders, alive, strict=True) if not ok)
        return HeartbeatOutcome(lost, store_time)

    @abc.abstractmethod
    def _heartbeat_batch(self, holders: Sequence[HolderRef]) -> tuple[list[bool], float]:
        """Extend each holder's lease in one store call: whether each still holds, and the store time."""


def snapshot_of(
    scope: str,
    key: str,
    meta: KeyMeta,
    runs: Sequence[RunRecord],
    payload_sizes: Mapping[str, int | None] | None = None,
) -> KeySnapshot:
    """One key's records as an inspection view (shared by the rule stores).

    ``payload_sizes``: each run's payload size by run id, for runs read without their payload
    (Redis); by default the size of each record's payload.
    """
    holders = sorted((r for r in runs if r.state is RunState.HOLDING), key=lambda r: r.token)
    waiters = sorted((r for r in runs if r.state is not RunState.HOLDING), key=lambda r: r.seq)

    def payload_bytes(run: RunRecord) -> int | None:
        if payload_sizes is not None:
            return payload_sizes.get(run.run_id)
        return None if run.payload is None else len(run.payload)

    return KeySnapshot(
        scope=scope,
        key=key,
        limit=meta.limit,
        token=meta.token,
        holders=tuple(
            HolderView(
                h.run_id,
                h.token,
                h.admitted_at,
                h.heartbeat_at,
                h.lease_expires_at,
                h.executing,
                payload_bytes=payload_bytes(h),
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
                payload_bytes=payload_bytes(w),
                live_generations=tuple(sorted(w.live)),
            )
            for i, w in enumerate(waiters)
        ),
    )
