"""``redis://`` / ``rediss://``: the gate's rules in Lua, one call per operation.

The scripts in ``lua/`` mirror :mod:`singleton_tasks.gate` branch for branch (``lua/lib.lua``
holds the shared building blocks and the data layout); the contract suite keeps the two
identical. All data of one scope+key lives under one hash tag derived from a digest of the
scope and key, so the store works on Redis Cluster and any key text round-trips unchanged.

Keys with runs (holders or waiters) are listed in an index the scripts keep in the same call
that changes them (``lib.lua``'s ``finish``): a set of their hash tags, ``<namespace>:busy``.
``inspect``, ``top`` and operator release read that set and the keys it names, so their cost
grows with the busy keys, never with the idle ones a namespace keeps for ``retention``. A
namespace written by schema version 2 or older has no index: ``migrate`` builds it (one
``SCAN`` of the database), and workers refuse an unmigrated namespace
(docs/deployment.md#schema-upgrades).

Keys with work of their own to do (a key's ``due_at``, :mod:`singleton_tasks.gate`) are listed
by the same scripts in a second index, a sorted set of their hash tags scored by ``due_at``,
``<namespace>:due``: :meth:`RedisStore.tick_due` reads the keys due by now from it.

On Redis 7 and later the scripts are loaded once as a function library and each operation is
one ``FCALL``: ``lib.lua`` then runs once per server instead of once per call (it is about two
thirds of a small operation's server time). Servers without functions, or users not allowed
to load them, get the same scripts by ``EVALSHA``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from typing import Any, NoReturn, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

try:  # the driver, when installed (Store.check_drivers names the extra otherwise)
    import redis
    import redis.connection
    import redis.exceptions
    from redis.commands.core import Script

    from ._redis_call import call_batch as _call_batch  # imports the driver too
    from ._redis_call import call_script as _call_script
except ImportError:  # pragma: no cover - the core-only install (tests/test_extras.py)
    pass

from ..errors import SingletonConfigError, StoreUnavailableError
from ..gate import Timings
from ..outcomes import (
    ClaimOutcome,
    Decision,
    DueOutcome,
    HeartbeatOutcome,
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
from ..records import RUN_FIELDS, KeyMeta, RunRecord, decode_run
from .base import SCHEMA_VERSION, Clock, Store, redact_url, snapshot_of

_OPERATIONS = (
    "register",
    "confirm",
    "unregister",
    "park",
    "claim",
    "suspend",
    "heartbeat",
    "release",
    "snapshot",
    "tick",
    "migrate",
)
#: The operations a refusal found by check_health stops: those that let a new run in.
_ADMITTING = frozenset({"register", "claim"})
_GLOB_SPECIAL = re.compile(rb"([*?\[\]\\])")
#: The store's own options in a Redis URL's query (the rest go to redis-py); ``retention`` is
#: every store's (read by the base class).
STORE_QUERY_OPTIONS = ("allow_eviction", "wait_replicas", "wait_timeout_ms", "retention")
#: How long a writing operation waits for its replicas by default (``wait_replicas`` given).
DEFAULT_WAIT_TIMEOUT_MS = 1000
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")

logger = logging.getLogger("singleton_tasks")
_TAG_PATTERN = b"{" + b"[0-9a-f]" * 40 + b"}"


# Replies as the scripts spell them (a dict lookup is cheaper than an Enum call by value).
_DECISIONS = {d.value.encode(): d for d in Decision}
_REGISTERED = {r.value.encode(): r for r in Registered}


@functools.cache
def _lua_sources() -> tuple[str, dict[str, str]]:
    """``lib.lua`` and each operation's script."""
    folder = resources.files(__package__ or "singleton_tasks.stores") / "lua"
    lib = (folder / "lib.lua").read_text(encoding="utf-8")
    return lib, {name: (folder / f"{name}.lua").read_text(encoding="utf-8") for name in _OPERATIONS}


def _load_scripts() -> dict[str, str]:
    """Each operation as a script for EVALSHA: ``lib.lua`` (shared helpers), then the operation."""
    lib, operations = _lua_sources()
    return {name: lib + "\n" + text for name, text in operations.items()}


@functools.cache
def _function_library() -> tuple[str, dict[str, bytes]]:
    """The same scripts as one Redis function library: its source and each operation's function name.

    ``lib.lua`` runs once, when the library is loaded; each operation becomes a function whose
    parameters are named ``KEYS`` and ``ARGV``, so its text is the script's, unchanged. The names
    carry a digest of the code: processes of two library versions sharing a server (a rolling
    upgrade) each call their own.
    """
    lib, operations = _lua_sources()
    digest = hashlib.sha1("\0".join([lib, *operations.values()]).encode()).hexdigest()[:12]
    library = f"singleton_tasks_{digest}"
    names = {name: f"{library}_{name}" for name in operations}
    parts = [f"#!lua name={library}", lib]
    for name, text in operations.items():
        parts.append(f"redis.register_function('{names[name]}', function(KEYS, ARGV)\n{text}\nend)")
    return "\n".join(parts), {name: fname.encode() for name, fname in names.items()}


def _no_functions(error: redis.exceptions.RedisError) -> bool:
    """The server cannot serve functions to us: older than Redis 7, or the user may not use them."""
    text = str(error).lower()
    if isinstance(error, redis.exceptions.NoPermissionError):
        return "'fcall'" in text or "'function" in text  # not a key the ACL keeps from us
    return isinstance(error, redis.exceptions.ResponseError) and text.startswith("unknown command")


def _function_missing(error: redis.exceptions.ResponseError) -> bool:
    """FCALL of a function the server does not have (a new, restarted or flushed server)."""
    return str(error).startswith("Function not found")


@functools.lru_cache(maxsize=4096)
def _hash_tag(scope: str, key: str) -> bytes:
    """``{<sha1>}``: the digest of the scope and key (bounded cache: hot keys are derived once)."""
    scope_b, key_b = _text(scope), _text(key)
    # The length prefix keeps (scope, key) pairs apart even if the scope holds a NUL.
    return b"{" + hashlib.sha1(b"%d\0%s\0%s" % (len(scope_b), scope_b, key_b)).hexdigest().encode() + b"}"


#: Every hash tag has this length (braces around a SHA-1 in hex).
_TAG_LENGTH = 2 + 2 * hashlib.sha1().digest_size


@functools.lru_cache(maxsize=16)
def _timing_args(timings: Timings) -> tuple[bytes, bytes]:
    """The encoded registration grace and retention."""
    return _time(timings.registration_grace), _time(timings.retention)


@functools.lru_cache(maxsize=256)
def _spec_args(
    limit: int, lease: float, orphan_timeout: float | None, recheck: float
) -> tuple[bytes, bytes, bytes, bytes]:
    """The encoded per-task options of a RunSpec (few distinct values per process)."""
    return _int(limit), _time(lease), _opt_time(orphan_timeout), _time(recheck)


def _text(value: str) -> bytes:
    # surrogatepass: any Python str round-trips, even one a strict UTF-8 codec would refuse.
    return value.encode("utf-8", "surrogatepass")


def _str(value: bytes) -> str:
    return value.decode("utf-8", "surrogatepass")


def _time(value: float) -> bytes:
    # repr() is the shortest text that reads back as the same double, in Python and in Lua.
    return repr(float(value)).encode()


def _int(value: int) -> bytes:
    return str(int(value)).encode()


def _opt_time(value: float | None) -> bytes:
    return b"" if value is None else _time(value)  # '' stands for None in the scripts


def _opt_int(value: int | None) -> bytes:
    return b"" if value is None else _int(value)


def _password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


def split_store_options(url: str) -> tuple[str, dict[str, str]]:
    """The URL without the store's own query options (:data:`STORE_QUERY_OPTIONS`), and those options.

    redis-py would hand an option it does not know to every connection; these are the store's.
    """
    parts = urlsplit(url)
    if not parts.query:
        return url, {}
    ours: dict[str, str] = {}
    theirs = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name in STORE_QUERY_OPTIONS:
            ours[name] = value
        else:
            theirs.append((name, value))
    if not ours:
        return url, {}
    return urlunsplit(parts._replace(query=urlencode(theirs))), ours


def _flag(name: str, value: object, where: str) -> bool:
    """A True/False option (``true``/``false`` in a URL)."""
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, bool):
        return value
    raise SingletonConfigError(f"{where}: {name} must be true or false, got {value!r}")


#: redis-py's timeouts, in seconds: 0 makes every call fail at once, a negative, non-finite or
#: huge one fails every connect (Python's socket timeouts end at int64 nanoseconds).
TIMEOUT_OPTIONS = ("socket_timeout", "socket_connect_timeout")
_MAX_TIMEOUT = 1e9


def check_timeouts(options: Mapping[str, object], where: str) -> None:
    """SingletonConfigError naming the option and its value when a timeout would fail every call
    (None, no timeout, is allowed)."""
    for name in TIMEOUT_OPTIONS:
        value = options.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= _MAX_TIMEOUT
        ):
            raise SingletonConfigError(
                f"{where}: {name} must be a number of seconds above 0 and at most {_MAX_TIMEOUT:g} "
                f"(or None: no timeout), got {value!r}"
            )


def _count(name: str, value: object, where: str) -> int:
    """A whole number ≥ 1 (digits in a URL)."""
    number = value
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise SingletonConfigError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    return number


@dataclasses.dataclass(frozen=True)
class StoreOptions:
    """The Redis store's own options, from keywords and the URL's query."""

    allow_eviction: bool = False
    wait_replicas: int | None = None
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS


def store_options(url: str, keywords: dict[str, object]) -> StoreOptions:
    """Check the store's options given as keywords (``None``: not given) or in the URL's query.

    An option given both ways must agree. SingletonConfigError names the option and the value
    (the URL redacted); no connection is made.
    """
    where = f"Redis store {redact_url(url)}"
    merged = {name: value for name, value in keywords.items() if value is not None}
    for name, value in split_store_options(url)[1].items():
        if name in merged and str(merged[name]).lower() != value.lower():
            raise SingletonConfigError(
                f"{where}: {name} is given twice with different values: {merged[name]!r} and {value!r} (URL)"
            )
        merged.setdefault(name, value)
    wait_replicas = merged.get("wait_replicas")
    if "wait_timeout_ms" in merged and wait_replicas is None:
        raise SingletonConfigError(f"{where}: wait_timeout_ms needs wait_replicas")
    return StoreOptions(
        allow_eviction=_flag("allow_eviction", merged.get("allow_eviction", False), where),
        wait_replicas=None if wait_replicas is None else _count("wait_replicas", wait_replicas, where),
        wait_timeout_ms=_count(
            "wait_timeout_ms", merged.get("wait_timeout_ms", DEFAULT_WAIT_TIMEOUT_MS), where
        ),
    )


def _as_str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _glob_escape(value: bytes) -> bytes:
    return _GLOB_SPECIAL.sub(rb"\\\1", value)


def _maybe_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _wakes(scope: str, key: str, rows: Sequence[Sequence[Any]]) -> tuple[Wake, ...]:
    return tuple(Wake(scope, key, _str(run_id), int(gen), payload) for run_id, gen, payload in rows)


def _names(rows: Sequence[bytes]) -> tuple[str, ...]:
    return tuple(_str(run_id) for run_id in rows)


def _pairs(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


_RUN_FIELDS = tuple(name.encode() for name in RUN_FIELDS[1:])  # the run hash's fields


def _run_record(run_id: bytes, fields: dict[bytes, bytes]) -> RunRecord:
    return decode_run(_str(run_id), {name.decode(): fields.get(name) for name in _RUN_FIELDS})


def _phantom_views(entries: Sequence[Sequence[Any]]) -> tuple[list[HolderView], list[WaiterView]]:
    """Index entries without run data (a damaged store): shown so an operator can release them."""
    holders, waiters = [], []
    for run_id, _flat, kind, score in entries:
        if kind == b"holder":
            holders.append(HolderView(_str(run_id), int(float(score)), 0.0, 0.0, 0.0, False, phantom=True))
        else:
            waiters.append(WaiterView(_str(run_id), 0, 0.0, RunState.PENDING, False, phantom=True))
    return holders, waiters


class RedisStore(Store):
    """The gate's rules in Lua on one Redis server (data laid out to be Redis Cluster ready).

    Every deadline is decided on the server's clock (``TIME`` inside the scripts).
    ``redis_options`` go to :meth:`redis.Redis.from_url` (timeouts, TLS settings, ...);
    replies must stay bytes, so ``decode_responses`` is refused.
    """

    schemes = ("redis", "rediss")
    drivers = ("redis",)
    extra = "redis"
    migrates_on_first_use = True

    @classmethod
    def check_url(cls, url: str) -> None:
        store_options(url, {})  # the store's own options (allow_eviction, wait_replicas, ...)
        node_url = cls._node_url(split_store_options(url)[0])
        super().check_url(node_url)
        # ValueError: a bad option
        url_options = redis.connection.parse_url(node_url)  # type: ignore[no-untyped-call]
        check_timeouts(url_options, f"Redis store {redact_url(url)}")

    @staticmethod
    def _node_url(url: str) -> str:
        """The URL redis-py's parser reads (a store of several hosts names one of them)."""
        return url

    clock_source = "server"

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "default",
        retention: float | None = None,
        timings: Timings | None = None,
        clock: Clock | None = None,
        functions: bool = True,
        allow_eviction: bool | None = None,
        wait_replicas: int | None = None,
        wait_timeout_ms: int | None = None,
        **redis_options: Any,
    ) -> None:
        super().__init__(url, namespace=namespace, retention=retention, timings=timings, clock=clock)
        if not isinstance(functions, bool):
            raise SingletonConfigError(f"{self!r}: functions must be True or False, got {functions!r}")
        # Cleared at the first call that finds the server or the user without functions.
        self._functions = functions
        self._function_names = _function_library()[1]
        self.options = store_options(
            url,
            {
                "allow_eviction": allow_eviction,
                "wait_replicas": wait_replicas,
                "wait_timeout_ms": wait_timeout_ms,
            },
        )
        # WAIT's arguments, sent behind every writing operation (None: writes do not wait).
        self._wait: tuple[bytes, bytes] | None = None
        if self.options.wait_replicas is not None:
            self._wait = (_int(self.options.wait_replicas), _int(self.options.wait_timeout_ms))
        if redis_options.get("decode_responses"):
            raise SingletonConfigError(f"{self!r}: decode_responses is not supported (payloads are bytes)")
        try:
            node_url = self._node_url(split_store_options(url)[0])
            url_options = redis.connection.parse_url(node_url)  # type: ignore[no-untyped-call]
            check_timeouts(redis_options, repr(self))
            check_timeouts(url_options, f"{self!r} (URL)")
            for name in TIMEOUT_OPTIONS:
                if name not in url_options:  # the URL's own stays (the Sentinel client prefers keywords)
                    # A hung server must fail an operation (StoreUnavailableError), not block it forever.
                    redis_options.setdefault(name, 5.0)
            self._client: redis.Redis = self._connect(split_store_options(url)[0], redis_options)
        except SingletonConfigError:
            raise
        except (ValueError, TypeError) as error:
            # The driver's message may quote the URL: never let it show the password.
            detail, password = str(error), _password(url)
            if password and password in detail:
                detail = type(error).__name__
            raise SingletonConfigError(f"invalid Redis store {self.url}: {detail}") from None
        # Given both ways, redis-py takes the URL's and the Sentinel client the keyword: the shorter counts.
        given = [t for t in (url_options.get("socket_timeout"), redis_options.get("socket_timeout")) if t]
        socket_timeout = min(given, default=None)
        if (
            self._wait is not None
            and socket_timeout
            and self.options.wait_timeout_ms >= socket_timeout * 1000
        ):
            raise SingletonConfigError(
                f"{self!r}: wait_timeout_ms={self.options.wait_timeout_ms} must be shorter than the "
                f"socket_timeout ({socket_timeout}s), or every slow WAIT fails as a lost connection"
            )
        # The server's eviction policy and replicas, checked at first use (once per store).
        self._server_checked = False
        # The refusal check_health found (an allkeys-* policy set at runtime): registrations and
        # claims raise it until a check passes again.
        self._refusal: str | None = None
        self._server_check_lock = threading.Lock()
        self._scripts: dict[str, Script] = {
            name: self._client.register_script(text) for name, text in _load_scripts().items()
        }
        self._ns = _text(self.namespace)
        self._ns_colon = self._ns + b":"
        self._busy_key = self._ns_colon + b"busy"
        self._due_key = self._ns_colon + b"due"
        self._threads = threading.local()
        # Raised when the pinned connections must connect again (the Sentinel store: a failover);
        # each thread compares it with its connection's before every call.
        self._primary_generation = 0

    def _connect(self, url: str, redis_options: dict[str, Any]) -> redis.Redis:
        """The client for ``url`` (the cluster store makes a cluster client here)."""
        client = self._make_client(url, redis_options)
        # Connections are made lazily: build one (unconnected) now so a bad option fails here.
        pool = client.connection_pool
        pool.connection_class(**pool.connection_kwargs)
        return client

    def _make_client(self, url: str, redis_options: dict[str, Any]) -> redis.Redis:
        """The client of every operation (a subclass finds its server another way: Sentinel)."""
        return redis.Redis.from_url(url, **redis_options)

    # -- the server, checked at first use -----------------------------------------------------

    def _check_server_once(self) -> None:
        """Refuse an evicting server, and ``wait_replicas`` above the replicas present, at first use.

        Runs before the first operation of this store object (the adapters' first send, a worker's
        boot); a refusal is raised again at every use, a check that could not reach the server is
        made again at the next.
        """
        if self._server_checked:
            return
        with self._server_check_lock:
            if not self._server_checked:
                try:
                    for server in self._servers():
                        self._check_server(server)
                except redis.exceptions.RedisError as error:
                    self._fail(error)
                self._server_checked = True

    def _servers(self) -> list[redis.Redis]:
        """The servers whose eviction policy and replicas are checked (a cluster: every primary)."""
        return [self._client]

    def _check_server(self, client: redis.Redis) -> None:
        """The checks of one server (a subclass with several primaries calls it on each)."""
        policy = self._eviction_policy(client)
        if policy is None:
            logger.warning(
                "%r: could not read the server's maxmemory-policy (CONFIG GET and INFO memory are "
                "refused to this user); if it is allkeys-*, Redis may evict the store's keys under "
                "memory pressure and two runs of one key can then hold it at once: use noeviction",
                self,
            )
        refusal = self._eviction_refusal(policy)
        if refusal is not None:
            raise SingletonConfigError(refusal)
        if self._wait is not None:
            wait_replicas = self.options.wait_replicas or 0
            replicas = int(client.info("replication").get("connected_slaves", 0))
            if wait_replicas > replicas:
                raise SingletonConfigError(
                    f"{self!r}: wait_replicas={wait_replicas} but the primary has {replicas} connected "
                    "replica(s): every write would fail. Nothing was written"
                )

    def _eviction_refusal(self, policy: str | None) -> str | None:
        """Why the store refuses a server evicting by ``policy``; None: it does not."""
        if policy is None or not policy.startswith("allkeys-") or self.options.allow_eviction:
            return None
        return (
            f"{self!r}: the server's maxmemory-policy is {policy}: under memory pressure Redis "
            "would evict the store's keys (a running holder's slot, the key's token) and admit a "
            "second run of a key while the first runs. Set maxmemory-policy noeviction, or give "
            "the store a dedicated Redis; allow_eviction=true accepts that risk. Nothing was written"
        )

    def check_health(self) -> None:
        """Read every server's eviction policy again (:meth:`Store.check_health`).

        An ``allkeys-*`` policy set while the store runs (``CONFIG SET``) is refused as at first
        use, by this call and by every registration and claim until a call finds it changed back.
        """
        try:
            policies = [self._eviction_policy(server) for server in self._servers()]
        except redis.exceptions.RedisError as error:
            self._fail(error)
        refusal = next(filter(None, map(self._eviction_refusal, policies)), None)
        if refusal is None and self._refusal is not None:
            logger.warning("%r: the server's maxmemory-policy is accepted again: runs are admitted", self)
        self._refusal = refusal
        if refusal is not None:
            raise SingletonConfigError(refusal)

    @staticmethod
    def _eviction_policy(client: redis.Redis) -> str | None:
        """``maxmemory-policy`` by CONFIG GET, or from INFO memory where CONFIG is refused or
        renamed (managed services); None if neither answers."""
        try:
            reply = client.config_get("maxmemory-policy")
            for name, value in reply.items():
                if _as_str(name) == "maxmemory-policy":
                    return _as_str(value)
        except redis.exceptions.ResponseError:
            pass
        try:
            policy = client.info("memory").get("maxmemory_policy")
        except redis.exceptions.ResponseError:
            return None
        return None if policy is None else _as_str(policy)

    def _check_acknowledged(self, acknowledged: int) -> None:
        """``wait_replicas`` not reached: the write is on the primary only, and may be lost by a failover."""
        if self.options.wait_replicas is not None and acknowledged < self.options.wait_replicas:
            raise StoreUnavailableError(
                f"{self!r}: only {acknowledged} of wait_replicas={self.options.wait_replicas} replicas "
                f"acknowledged the write within {self.options.wait_timeout_ms} ms; it is applied on the "
                "primary but may not survive a failover"
            )

    # -- keys ---------------------------------------------------------------------------------

    def _prefix(self, scope: str, key: str) -> bytes:
        """``<namespace>:{<sha1>}:``: the hash tag is a digest, never the user's text."""
        return self._ns_colon + _hash_tag(scope, key) + b":"

    @property
    def _schema_key(self) -> bytes:
        return self._ns + b":schema"

    def _index_key(self, tag: bytes) -> bytes:
        """The busy-key index that lists the key of hash tag ``tag``: on one server, one per
        namespace whatever the tag (the cluster store keeps one per hash slot)."""
        return self._busy_key

    def _due_index_key(self, tag: bytes) -> bytes:
        """The due-key index that lists the key of hash tag ``tag`` (as :meth:`_index_key`)."""
        return self._due_key

    # -- plumbing -----------------------------------------------------------------------------

    def _fail(self, error: redis.exceptions.RedisError) -> NoReturn:
        if isinstance(error, redis.exceptions.ResponseError) and "can't run this command" in str(error):
            # The ACL keeps this user from a command the scripts call: a setup error, not an outage.
            raise SingletonConfigError(f"{self!r}: {self._denied_command(error)}") from error
        raise StoreUnavailableError(f"{self!r}: {type(error).__name__}: {error}") from error

    def _denied_command(self, error: redis.exceptions.RedisError) -> str:
        """Which command a script was refused: TIME (the clock every deadline is decided on) or another."""
        try:
            self._thread_client().eval("return redis.call('TIME')", 0)
        except redis.exceptions.ResponseError as probe:
            if "can't run this command" in str(probe):
                return (
                    "the server refuses TIME inside scripts to this user, and the store decides every "
                    "deadline on the server's clock; allow TIME (ACL +time). Nothing was written"
                )
        except redis.exceptions.RedisError:
            pass
        return f"the user may not run a command the store's scripts need (nothing was written): {error}"

    def _clock_arg(self) -> bytes:
        """The time the scripts decide at: '' for the server's own clock (tests pass a clock)."""
        return b"" if self.clock is None else _time(self.clock())

    def time(self) -> float:
        if self.clock is not None:
            return self.clock()
        try:
            seconds, micros = self._thread_client().time()
        except redis.exceptions.RedisError as error:
            self._fail(error)
        return seconds + micros / 1_000_000

    def _run(self, name: str, keys: Sequence[bytes], args: Sequence[bytes | str]) -> Any:
        return self._eval(name, len(keys), *keys, *args)

    def _eval(self, name: str, numkeys: int, *keys_and_args: bytes | str) -> Any:
        """One FCALL, or one EVALSHA where the server has no functions for us; with
        ``wait_replicas``, a writing operation's WAIT rides in the same round trip."""
        generation = self._primary_generation  # read before the call picks its connection
        wait = None if name == "snapshot" else self._wait
        answer = self._call(name, numkeys, keys_and_args, wait)
        if self._primary_generation != generation:
            self._primary_changed_during_call()
        if wait is None:
            return answer
        reply, acknowledged = answer
        self._check_acknowledged(int(acknowledged))
        return reply

    def _primary_changed_during_call(self) -> NoReturn:
        """A call answered after the store heard of a failover may have been answered by the old
        primary, which loses what it took: it fails closed rather than report that success."""
        raise StoreUnavailableError(
            f"{self!r}: the sentinels announced a new primary while this call was made; it may "
            "have been applied on the old primary only, and lost with it"
        )

    def _call(
        self, name: str, numkeys: int, keys_and_args: Sequence[bytes | str], wait: Sequence[bytes] | None
    ) -> Any:
        """The call, by FCALL or EVALSHA (and WAIT behind it when ``wait`` is given).

        The library (or the script) is loaded once more when the server does not know it (a
        new, restarted or flushed server, a replica just promoted), and the call is made again:
        nothing ran the first time.
        """
        try:
            return self._call_on(self._thread_client(), name, numkeys, keys_and_args, wait)
        except redis.exceptions.RedisError as error:
            self._fail(error)

    def _call_on(
        self,
        client: redis.Redis,
        name: str,
        numkeys: int,
        keys_and_args: Sequence[bytes | str],
        wait: Sequence[bytes] | None,
    ) -> Any:
        """:meth:`_call` on ``client`` (the cluster store picks the primary of the keys' slot);
        raises RedisError."""
        if self._functions:
            function = self._function_names[name]
            try:
                return _call_script(client, b"FCALL", function, numkeys, keys_and_args, wait)
            except redis.exceptions.ResponseError as error:
                if _function_missing(error):
                    if self._load_library(client):
                        return _call_script(client, b"FCALL", function, numkeys, keys_and_args, wait)
                elif not _no_functions(error):
                    raise
                self._functions = False
        script = self._scripts[name]
        try:
            return _call_script(client, b"EVALSHA", script.sha.encode(), numkeys, keys_and_args, wait)
        except redis.exceptions.NoScriptError:
            script.sha = self._load_script(client, script)
            return _call_script(client, b"EVALSHA", script.sha.encode(), numkeys, keys_and_args, wait)

    def _load_script(self, client: redis.Redis, script: Script) -> str:
        """Load ``script`` for EVALSHA; its SHA."""
        return client.script_load(script.script)

    def _load_library(self, client: redis.Redis) -> bool:
        """Load the function library; False if this server or user cannot have functions."""
        try:
            client.function_load(_function_library()[0])
        except redis.exceptions.ResponseError as error:
            if _no_functions(error):
                return False
            if "already exists" not in str(error):  # another process loaded it first
                raise
        return True

    def _thread_client(self) -> redis.Redis:
        """This thread's client, pinned to one connection of the shared pool.

        A pooled call checks a connection out and back in and polls its socket for stale data,
        one more system call per operation; in a worker of many threads each is a GIL hand-off
        (the no-op benchmark: ~25 % less worker CPU per run with pinned connections). The
        connection goes back to the pool when the thread's client is collected, and a forked
        child makes its own. When ``_primary_generation`` has moved on (the Sentinel store heard
        of a failover), the thread connects again before its call: one integer compare per call.
        """
        threads = self._threads
        client: redis.Redis | None = getattr(threads, "client", None)
        if client is None or threads.pid != os.getpid() or threads.generation != self._primary_generation:
            client = self._pin_connection(client)
        return client

    def _pin_connection(self, client: redis.Redis | None) -> redis.Redis:
        """This thread's client made (its first call, or the first in a forked child), or its
        connection made again after a failover: this thread's own, idle between its calls."""
        threads = self._threads
        generation = self._primary_generation  # before connecting: a later failover is seen next call
        if client is not None and threads.pid == os.getpid():
            connection = client.connection
            assert connection is not None  # a single-connection client
            try:
                connection.disconnect()  # type: ignore[no-untyped-call]
                # connect() asks the sentinels; a command's own reconnect would go back to the old host.
                connection.connect()  # type: ignore[no-untyped-call]
            except redis.exceptions.RedisError as error:
                self._fail(error)
        else:
            self._check_server_once()
            client = redis.Redis(connection_pool=self._client.connection_pool, single_connection_client=True)
            threads.client, threads.pid = client, os.getpid()
        threads.generation = generation
        return client

    def _key_op(self, name: str, scope: str, key: str, run_id: str, *args: bytes) -> Any:
        """A per-key script: lib.lua's KEYS and ARGV layout, then ``args``."""
        if self._refusal is not None and name in _ADMITTING:
            raise SingletonConfigError(self._refusal)  # a new error: its traceback is this call's
        return self._eval(name, 8, *self._key_args(scope, key, run_id, *args))

    def _key_args(self, scope: str, key: str, run_id: str, *args: bytes) -> tuple[bytes, ...]:
        """The eight keys and the arguments of a per-key script (lib.lua's layout), then ``args``."""
        return self._tag_args(_hash_tag(scope, key), _text(scope), _text(key), _text(run_id), *args)

    def _tag_args(self, tag: bytes, scope: bytes, key: bytes, run: bytes, *args: bytes) -> tuple[bytes, ...]:
        """:meth:`_key_args` of the key of hash tag ``tag`` (tick and migrate know only the tag:
        they pass an empty scope, key and run id)."""
        prefix = self._ns_colon + tag + b":"
        return (
            prefix + b"meta",
            prefix + b"waiters",
            prefix + b"holders",
            prefix + b"unconfirmed",
            prefix + b"run:" + run,
            prefix + b"settled:" + run,
            self._index_key(tag),
            self._due_index_key(tag),
            scope,
            key,
            run,
            self._clock_arg(),
            *_timing_args(self.timings),
            *args,
        )

    # -- the protocol -------------------------------------------------------------------------

    def register(
        self, spec: RunSpec, *, payload: bytes | None = None, delay: float = 0.0, confirmed: bool = True
    ) -> RegisterOutcome:
        limit, lease, orphan_timeout, recheck = _spec_args(
            spec.limit, spec.lease, spec.orphan_timeout, spec.recheck
        )
        status, in_flight = self._key_op(
            "register",
            spec.scope,
            spec.key,
            spec.run_id,
            b"1" if confirmed else b"0",
            limit,
            _opt_int(spec.max_queue_depth),
            lease,
            orphan_timeout,
            recheck,
            b"0" if payload is None else b"1",
            b"" if payload is None else bytes(payload),
            _time(delay),
        )
        return RegisterOutcome(_REGISTERED[status], int(in_flight))

    def confirm(self, scope: str, key: str, run_id: str) -> bool:
        return bool(self._key_op("confirm", scope, key, run_id))

    def confirm_many(self, runs: Sequence[tuple[str, str, str]]) -> list[bool]:
        """Every confirm in one write on this thread's connection, the replies read in order: one
        round trip for the batch (with ``wait_replicas``, one WAIT behind the last).

        A reply that is an error (a server that lost the library or the script, or has no
        functions for us) sends the batch again one call at a time by :meth:`confirm`, which
        loads what is missing: a confirm made twice changes nothing.
        """
        if len(runs) < 2:
            return super().confirm_many(runs)
        generation = self._primary_generation  # before the connection is chosen: see _eval
        try:
            confirmed = self._confirm_batch(self._thread_client(), runs)
        except redis.exceptions.RedisError as error:
            self._fail(error)
        if self._primary_generation != generation:
            self._primary_changed_during_call()
        return super().confirm_many(runs) if confirmed is None else confirmed

    def _confirm_batch(self, client: redis.Redis, runs: Sequence[tuple[str, str, str]]) -> list[bool] | None:
        """The confirms of ``runs`` in one write on ``client``'s own connection; None if a reply
        is an error (the caller sends them again one at a time). Raises RedisError."""
        if self._functions:
            head = (b"FCALL", self._function_names["confirm"], b"8")
        else:
            head = (b"EVALSHA", self._scripts["confirm"].sha.encode(), b"8")
        calls = [(*head, *self._key_args(scope, key, run_id)) for scope, key, run_id in runs]
        replies, acknowledged = _call_batch(client, calls, self._wait)
        if any(isinstance(reply, Exception) for reply in replies):
            return None
        if acknowledged is not None:
            self._check_acknowledged(int(acknowledged))
        return [bool(reply) for reply in replies]

    def unregister(self, scope: str, key: str, run_id: str) -> bool:
        return bool(self._key_op("unregister", scope, key, run_id))

    def park(self, scope: str, key: str, run_id: str) -> tuple[Wake, ...]:
        return _wakes(scope, key, self._key_op("park", scope, key, run_id))

    def claim(self, spec: RunSpec, generation: int, payload: bytes | None = None) -> ClaimOutcome:
        limit, lease, orphan_timeout, recheck = _spec_args(
            spec.limit, spec.lease, spec.orphan_timeout, spec.recheck
        )
        decision, token, new_generation, position, takeover, evicted, wakes, removed = self._key_op(
            "claim",
            spec.scope,
            spec.key,
            spec.run_id,
            _int(generation),
            limit,
            lease,
            orphan_timeout,
            recheck,
            b"0" if payload is None else b"1",
            b"" if payload is None else bytes(payload),
        )
        return ClaimOutcome(
            _DECISIONS[decision],
            token=_maybe_int(token),
            generation=_maybe_int(new_generation),
            position=_maybe_int(position),
            takeover=bool(takeover),
            evicted=_names(evicted),
            wakes=_wakes(spec.scope, spec.key, wakes),
            removed=_names(removed),
        )

    def suspend(self, scope: str, key: str, run_id: str, token: int, *, delay: float) -> bool:
        return bool(self._key_op("suspend", scope, key, run_id, _int(token), _time(delay)))

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
        released, lost, wakes, evicted, removed = self._key_op(
            "release",
            scope,
            key,
            run_id,
            _opt_int(token),
            _opt_int(generation),
            b"1" if waiting_only else b"0",
        )
        return ReleaseOutcome(
            released=bool(released),
            lost=bool(lost),
            wakes=_wakes(scope, key, wakes),
            evicted=_names(evicted),
            removed=_names(removed),
        )

    def heartbeat(self, holders: Sequence[HolderRef]) -> HeartbeatOutcome:
        if not holders:
            return HeartbeatOutcome((), self.time())
        keys = [self._prefix(ref.scope, ref.key) + b"run:" + _text(ref.run_id) for ref in holders]
        alive, now = self._run("heartbeat", keys, [self._clock_arg(), *(_int(ref.token) for ref in holders)])
        return HeartbeatOutcome(
            tuple(ref.run_id for ref, ok in zip(holders, alive, strict=True) if not ok), float(now)
        )

    def tick_due(self, *, limit: int = 64) -> list[DueOutcome]:
        """``tick.lua`` on each of the ``limit`` keys due earliest that the due index lists as
        due before now (the store's clock): one call per key, which reads the key's scope and
        key itself. A listed key that is gone or idle is only taken off the index. Returns the
        keys where something was done."""
        done = []
        for tag in self._due_tags(self.time(), limit):
            reply = self._eval("tick", 8, *self._tag_args(tag, b"", b"", b""))
            if not reply:
                continue  # gone or idle: only taken off the index
            scope_b, key_b, wakes, evicted, removed = reply
            scope, key = _str(scope_b), _str(key_b)
            outcome = DueOutcome(scope, key, _wakes(scope, key, wakes), _names(evicted), _names(removed))
            if outcome.acted:
                done.append(outcome)
        return done

    def _due_tags(self, now: float, count: int) -> list[bytes]:
        """The hash tags of up to ``count`` keys whose ``due_at`` is before ``now``, earliest first."""
        try:
            tags = self._thread_client().zrangebyscore(
                self._due_key, "-inf", f"({float(now)!r}", start=0, num=count
            )
            return cast(list[bytes], tags)
        except redis.exceptions.RedisError as error:
            self._fail(error)

    # -- inspection ---------------------------------------------------------------------------

    def _scan(self, suffix: bytes) -> Iterator[bytes]:
        """Every key ``<namespace>:{<digest>}:<suffix>`` (glob characters in it escaped)."""
        pattern = _glob_escape(self._ns) + b":" + _TAG_PATTERN + b":" + _glob_escape(suffix)
        self._check_server_once()
        try:
            yield from self._client.scan_iter(match=pattern, count=1000)
        except redis.exceptions.RedisError as error:
            self._fail(error)

    def _snapshot_of(self, meta_key: bytes) -> KeySnapshot | None:
        prefix = meta_key[: -len(b"meta")]
        reply = self._run("snapshot", [meta_key, prefix + b"waiters", prefix + b"holders"], [])
        if not reply:
            return None
        meta_flat, entries = reply
        meta = _pairs(meta_flat)
        if b"scope" not in meta:
            return None  # runs without their key's record: shown once a call on the key repairs it
        records = [_run_record(run_id, _pairs(flat)) for run_id, flat, _kind, _score in entries if flat]
        key_meta = KeyMeta(token=int(meta[b"token"]), seq=int(meta[b"seq"]), limit=int(meta[b"limit"]))
        snap = snapshot_of(_str(meta[b"scope"]), _str(meta[b"key"]), key_meta, records)
        phantom_holders, phantom_waiters = _phantom_views([e for e in entries if not e[1]])
        if phantom_holders or phantom_waiters:
            snap = dataclasses.replace(
                snap,
                holders=snap.holders + tuple(phantom_holders),
                waiters=snap.waiters + tuple(phantom_waiters),
            )
        return snap

    def _busy_tags(self) -> list[bytes]:
        """The hash tags of the keys with runs, from the namespace's busy-key index."""
        self._check_server_once()
        try:
            return sorted(self._client.sscan_iter(self._busy_key, count=1000))
        except redis.exceptions.RedisError as error:
            self._fail(error)

    def snapshot(self, *, scope: str | None = None, key: str | None = None) -> list[KeySnapshot]:
        if scope is not None and key is not None:
            meta_keys: list[bytes] = [self._prefix(scope, key) + b"meta"]
        else:
            # The busy index names every key with runs (idle keys are not read at all).
            meta_keys = [self._ns_colon + tag + b":meta" for tag in self._busy_tags()]
        snaps = []
        for meta_key in meta_keys:
            snap = self._snapshot_of(meta_key)
            if (
                snap is None
                or (scope is not None and snap.scope != scope)
                or (key is not None and snap.key != key)
            ):
                continue
            snaps.append(snap)
        return sorted(snaps, key=lambda s: (s.scope, s.key))

    def operator_release(self, run_id: str) -> ReleaseOutcome | None:
        """Find the run's hash among the busy keys (one pipelined read), then release it.

        A run id registered under several keys is released from the first in (scope, key)
        order, as the base class does.
        """
        suffix = b"run:" + _text(run_id)
        tags = self._busy_tags()
        try:
            pipe = self._client.pipeline(transaction=False)
            for tag in tags:
                prefix = self._ns_colon + tag + b":"
                pipe.exists(prefix + suffix)
                pipe.hmget(prefix + b"meta", ["scope", "key"])
            replies = pipe.execute()
        except redis.exceptions.RedisError as error:
            self._fail(error)
        owners = [
            (_str(scope), _str(key))
            for exists, (scope, key) in zip(replies[0::2], replies[1::2], strict=True)
            if exists and isinstance(scope, bytes) and isinstance(key, bytes)
        ]
        if not owners:
            return super().operator_release(run_id)  # a phantom has no hash: find it by snapshot
        scope_s, key_s = min(owners)
        return self.release(scope_s, key_s, run_id, token=None)

    # -- schema and lifecycle -----------------------------------------------------------------

    def schema_version(self) -> int | None:
        self._check_server_once()
        try:
            value = self._client.get(self._schema_key)
        except redis.exceptions.RedisError as error:
            self._fail(error)
        return None if value is None else int(value)

    def migrate(self) -> None:
        """Record the schema version; from version 2 or older, first build the busy-key index;
        from version 3 or older, then bring each busy key to version 4.

        Versions 1 and 2 kept no index: every key with a holders or a waiters zset is added to
        it, found by one ``SCAN`` of the database (run it with the workers drained, as every
        upgrade: a key that goes idle during the scan may stay listed, and is then skipped by
        ``inspect`` until its next call removes it). Version 4 (``migrate.lua``, one call per
        busy key) renames each run's ``passed_over_at`` to ``reissue_at``, indexes the
        unconfirmed waiters, drops the ``overdue`` zset and makes the key due at once: the first
        heartbeat's :meth:`tick_due` recomputes its ``due_at``. Running it again is harmless.
        """
        found = self.schema_version()
        if found is not None and found < SCHEMA_VERSION:
            if found < 3:
                self._index_busy_keys()
            if found < 4:
                for tag in self._busy_tags():
                    self._eval("migrate", 8, *self._tag_args(tag, b"", b"", b""))
        self._write_schema_version(SCHEMA_VERSION)

    def _index_busy_keys(self) -> None:
        """Add every key with runs to the busy-key index (the upgrade from version 2)."""
        start = len(self._ns_colon)
        end = start + _TAG_LENGTH
        tags = {k[start:end] for k in self._scan(b"holders")}
        tags |= {k[start:end] for k in self._scan(b"waiters")}
        try:
            pipe = self._client.pipeline(transaction=False)
            for tag in sorted(tags):
                pipe.sadd(self._index_key(tag), tag)
            pipe.execute()
        except redis.exceptions.RedisError as error:
            self._fail(error)

    def set_schema_version_for_tests(self, version: int | None) -> None:
        """Pretend another library version wrote this server (the contract suite's mismatch test)."""
        self._write_schema_version(version)

    def _write_schema_version(self, version: int | None) -> None:
        self._check_server_once()
        try:
            if version is None:
                self._client.delete(self._schema_key)
            else:
                self._client.set(self._schema_key, str(version))
        except redis.exceptions.RedisError as error:
            self._fail(error)

    def close(self) -> None:
        try:
            self._client.close()
        except redis.exceptions.RedisError as error:
            self._fail(error)
