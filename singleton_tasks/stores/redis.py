"""``redis://`` / ``rediss://``: the store protocol on Redis, the gate's rules in Lua, one call per operation.

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
one ``FCALL``: ``lib.lua`` then runs once per server instead of once per call
(benchmarks/README.md#where-the-client-cpu-goes). Servers without functions, or users not
allowed to load them, get the same scripts by ``EVALSHA``.

This module holds the protocol; its helpers are modules of their own:
``_redis_scripts`` (loading the scripts, encoding arguments, decoding replies),
``_redis_options`` (the store's URL and keyword options), ``_redis_server`` (the eviction
policy, replicas and ACL checks), ``_redis_plumbing`` (pinned connections, FCALL/EVALSHA,
WAIT, the failover check, driver errors translated once), ``_redis_call`` (the wire path)
and ``_driver_errors`` (every check of a driver error's text).

Extension points
----------------
The Cluster and Sentinel stores are subclasses that override a small, written contract of
hooks (:class:`~singleton_tasks.stores._redis_hooks.RedisStoreHooks`: thirteen methods, each
marked *Hook.* here, checked by mypy) rather than a client-strategy object the store would be
composed with. The two subclasses change different, small things (the cluster where a call and
an index go, Sentinel only how a connection is made and made again); each hook is called from
one place; and a strategy object would rewrite the failover and resharding paths that only the
cluster and Sentinel suites exercise, for no behaviour gained.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

try:  # the driver, when installed (Store.check_drivers names the extra otherwise)
    import redis
    import redis.connection
    import redis.exceptions

    from ._redis_call import call_batch as _call_batch  # imports the driver too
except ImportError:  # pragma: no cover - the core-only install (tests/test_extras.py)
    pass

from ..config import Timings
from ..errors import SingletonConfigError
from ..outcomes import (
    ClaimOutcome,
    DueOutcome,
    HeartbeatOutcome,
    HolderRef,
    KeySnapshot,
    PayloadRequest,
    RegisterOutcome,
    ReleaseOutcome,
    RunSpec,
    Wake,
)
from . import _redis_scripts as lua
from ._redis_hooks import RedisStoreHooks
from ._redis_options import (
    check_timeouts,
    check_wait_timeout,
    default_timeouts,
    split_store_options,
    store_options,
)
from ._redis_plumbing import RedisPlumbing
from ._redis_server import ServerChecks
from .base import SCHEMA_VERSION, Clock, redact_url, scrub_secrets

#: The operations a refusal found by check_health stops: those that let a new run in.
_ADMITTING = frozenset({"register", "claim"})
_GLOB_SPECIAL = re.compile(rb"([*?\[\]\\])")
_TAG_PATTERN = b"{" + b"[0-9a-f]" * 40 + b"}"


def _glob_escape(value: bytes) -> bytes:
    return _GLOB_SPECIAL.sub(rb"\\\1", value)


class RedisStore(RedisPlumbing):
    """The gate's rules in Lua on one Redis server (data laid out to be Redis Cluster ready).

    Every deadline is decided on the server's clock (``TIME`` inside the scripts).
    ``redis_options`` go to :meth:`redis.Redis.from_url` (timeouts, TLS settings, ...);
    replies must stay bytes, so ``decode_responses`` is refused.
    """

    schemes = ("redis", "rediss")
    drivers = ("redis", "hiredis")  # hiredis packs the script calls (_redis_call)
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
        """*Hook.* The URL redis-py's parser reads (a store of several hosts names one of them)."""
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
        self.options = store_options(
            url,
            {
                "allow_eviction": allow_eviction,
                "wait_replicas": wait_replicas,
                "wait_timeout_ms": wait_timeout_ms,
            },
        )
        self._wait = None
        if self.options.wait_replicas is not None:
            self._wait = (lua.int_arg(self.options.wait_replicas), lua.int_arg(self.options.wait_timeout_ms))
        if redis_options.get("decode_responses"):
            raise SingletonConfigError(f"{self!r}: decode_responses is not supported (payloads are bytes)")
        try:
            node_url = self._node_url(split_store_options(url)[0])
            url_options = redis.connection.parse_url(node_url)  # type: ignore[no-untyped-call]
            default_timeouts(url_options, redis_options, repr(self))
            self._client = self._connect(split_store_options(url)[0], redis_options)
        except SingletonConfigError:
            raise
        except (ValueError, TypeError) as error:
            # The driver's message may quote the URL: never let it show the password.
            detail = scrub_secrets(str(error), url)
            raise SingletonConfigError(f"invalid Redis store {self.url}: {detail}") from None
        check_wait_timeout(self.options, url_options, redis_options, repr(self))
        self._init_calls(functions)
        self._server_checks = ServerChecks(repr(self), self.options)
        self._ns = lua.text(self.namespace)
        self._ns_colon = self._ns + b":"
        self._busy_key = self._ns_colon + b"busy"
        self._due_key = self._ns_colon + b"due"

    def _connect(self, url: str, redis_options: dict[str, Any]) -> redis.Redis:
        """*Hook.* The client for ``url`` (the cluster store makes a cluster client here)."""
        client = self._make_client(url, redis_options)
        # Connections are made lazily: build one (unconnected) now so a bad option fails here.
        pool = client.connection_pool
        pool.connection_class(**pool.connection_kwargs)
        return client

    def _make_client(self, url: str, redis_options: dict[str, Any]) -> redis.Redis:
        """*Hook.* The client of every operation (a subclass finds its server another way: Sentinel)."""
        return redis.Redis.from_url(url, **redis_options)

    def check_health(self) -> None:
        """Read every server's eviction policy again (:meth:`Store.check_health`).

        An ``allkeys-*`` policy set while the store runs (``CONFIG SET``) is refused as at first
        use, by this call and by every registration and claim until a call finds it changed back.
        """
        self._server_checks.check_health(self._servers, self._errors)

    # -- keys ---------------------------------------------------------------------------------

    def _prefix(self, scope: str, key: str) -> bytes:
        """``<namespace>:{<sha1>}:``: the hash tag is a digest, never the user's text."""
        return self._ns_colon + lua.hash_tag(scope, key) + b":"

    @property
    def _schema_key(self) -> bytes:
        return self._ns + b":schema"

    def _index_key(self, tag: bytes) -> bytes:
        """*Hook.* The busy-key index that lists the key of hash tag ``tag``: on one server, one per
        namespace whatever the tag (the cluster store keeps one per hash slot)."""
        return self._busy_key

    def _due_index_key(self, tag: bytes) -> bytes:
        """*Hook.* The due-key index that lists the key of hash tag ``tag`` (as :meth:`_index_key`)."""
        return self._due_key

    def _clock_arg(self) -> bytes:
        """The time the scripts decide at: '' for the server's own clock (tests pass a clock)."""
        return b"" if self.clock is None else lua.time_arg(self.clock())

    def time(self) -> float:
        if self.clock is not None:
            return self.clock()
        with self._errors:
            seconds, micros = self._thread_client().time()
        return seconds + micros / 1_000_000

    def _run(self, name: str, keys: Sequence[bytes], args: Sequence[bytes | str]) -> Any:
        return self._eval(name, len(keys), *keys, *args)

    def _key_op(self, name: str, scope: str, key: str, run_id: str, *args: bytes) -> Any:
        """A per-key script: lib.lua's KEYS and ARGV layout, then ``args``."""
        refusal = self._server_checks.refusal
        if refusal is not None and name in _ADMITTING:
            raise SingletonConfigError(refusal)  # a new error: its traceback is this call's
        return self._eval(name, 8, *self._key_args(scope, key, run_id, *args))

    def _key_args(self, scope: str, key: str, run_id: str, *args: bytes) -> tuple[bytes, ...]:
        """The eight keys and the arguments of a per-key script (lib.lua's layout), then ``args``."""
        return self._tag_args(
            lua.hash_tag(scope, key), lua.text(scope), lua.text(key), lua.text(run_id), *args
        )

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
            *lua.timing_args(self.timings),
            *args,
        )

    # -- the protocol -------------------------------------------------------------------------

    def register(
        self, spec: RunSpec, *, payload: bytes | None = None, delay: float = 0.0, confirmed: bool = True
    ) -> RegisterOutcome:
        limit, lease, orphan_timeout, recheck = lua.spec_args(
            spec.limit, spec.lease, spec.orphan_timeout, spec.recheck
        )
        status, in_flight, *replaced = self._key_op(
            "register",
            spec.scope,
            spec.key,
            spec.run_id,
            b"1" if confirmed else b"0",
            limit,
            lua.opt_int_arg(spec.max_queue_depth),
            lease,
            orphan_timeout,
            recheck,
            *lua.payload_args(payload),
            lua.time_arg(delay),
            b"1" if spec.replace_when_full else b"0",
        )
        return RegisterOutcome(
            lua.REGISTERED[status], int(in_flight), replaced=lua.from_text(replaced[0]) if replaced else None
        )

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
        with self._errors:
            confirmed = self._confirm_batch(self._thread_client(), runs)
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
            self._server_checks.check_acknowledged(int(acknowledged))
        return [bool(reply) for reply in replies]

    def unregister(self, scope: str, key: str, run_id: str) -> bool:
        return bool(self._key_op("unregister", scope, key, run_id))

    def park(self, scope: str, key: str, run_id: str) -> tuple[Wake, ...]:
        return lua.wakes(scope, key, self._key_op("park", scope, key, run_id))

    def claim(
        self, spec: RunSpec, generation: int, payload: bytes | PayloadRequest | None = None
    ) -> ClaimOutcome:
        limit, lease, orphan_timeout, recheck = lua.spec_args(
            spec.limit, spec.lease, spec.orphan_timeout, spec.recheck
        )
        reply = self._key_op(
            "claim",
            spec.scope,
            spec.key,
            spec.run_id,
            lua.int_arg(generation),
            limit,
            lease,
            orphan_timeout,
            recheck,
            *lua.payload_args(payload),
        )
        return lua.claim_outcome(spec.scope, spec.key, reply)

    def suspend(self, scope: str, key: str, run_id: str, token: int, *, delay: float) -> bool:
        return bool(self._key_op("suspend", scope, key, run_id, lua.int_arg(token), lua.time_arg(delay)))

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
        reply = self._key_op(
            "release",
            scope,
            key,
            run_id,
            lua.opt_int_arg(token),
            lua.opt_int_arg(generation),
            b"1" if waiting_only else b"0",
        )
        return lua.release_outcome(scope, key, reply)

    def heartbeat(self, holders: Sequence[HolderRef]) -> HeartbeatOutcome:
        if not holders:
            return HeartbeatOutcome((), self.time())
        keys = [self._prefix(ref.scope, ref.key) + b"run:" + lua.text(ref.run_id) for ref in holders]
        alive, now = self._run(
            "heartbeat", keys, [self._clock_arg(), *(lua.int_arg(ref.token) for ref in holders)]
        )
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
            outcome = lua.due_outcome(reply)
            if outcome.acted:
                done.append(outcome)
        return done

    def _due_tags(self, now: float, count: int) -> list[bytes]:
        """*Hook.* The hash tags of up to ``count`` keys due before ``now``, earliest first."""
        with self._errors:
            tags = self._thread_client().zrangebyscore(
                self._due_key, "-inf", f"({float(now)!r}", start=0, num=count
            )
            return cast(list[bytes], tags)

    # -- inspection ---------------------------------------------------------------------------

    def _scan(self, suffix: bytes) -> Iterator[bytes]:
        """Every key ``<namespace>:{<digest>}:<suffix>`` (glob characters in it escaped)."""
        pattern = _glob_escape(self._ns) + b":" + _TAG_PATTERN + b":" + _glob_escape(suffix)
        self._check_servers()
        with self._errors:
            yield from self._client.scan_iter(match=pattern, count=1000)

    def _snapshot_of(self, meta_key: bytes) -> KeySnapshot | None:
        prefix = meta_key[: -len(b"meta")]
        reply = self._run("snapshot", [meta_key, prefix + b"waiters", prefix + b"holders"], [])
        return lua.key_snapshot(reply) if reply else None

    def _busy_tags(self) -> list[bytes]:
        """*Hook.* The hash tags of the keys with runs, from the namespace's busy-key index."""
        self._check_servers()
        with self._errors:
            return sorted(self._client.sscan_iter(self._busy_key, count=1000))

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
        suffix = b"run:" + lua.text(run_id)
        tags = self._busy_tags()
        with self._errors:
            pipe = self._client.pipeline(transaction=False)
            for tag in tags:
                prefix = self._ns_colon + tag + b":"
                pipe.exists(prefix + suffix)
                pipe.hmget(prefix + b"meta", ["scope", "key"])
            replies = pipe.execute()
        owners = [
            (lua.from_text(scope), lua.from_text(key))
            for exists, (scope, key) in zip(replies[0::2], replies[1::2], strict=True)
            if exists and isinstance(scope, bytes) and isinstance(key, bytes)
        ]
        if not owners:
            return super().operator_release(run_id)  # a phantom has no hash: find it by snapshot
        scope_s, key_s = min(owners)
        return self.release(scope_s, key_s, run_id, token=None)

    # -- schema and lifecycle -----------------------------------------------------------------

    def schema_version(self) -> int | None:
        self._check_servers()
        with self._errors:
            value = self._client.get(self._schema_key)
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
        end = start + lua.TAG_LENGTH
        tags = {k[start:end] for k in self._scan(b"holders")}
        tags |= {k[start:end] for k in self._scan(b"waiters")}
        with self._errors:
            pipe = self._client.pipeline(transaction=False)
            for tag in sorted(tags):
                pipe.sadd(self._index_key(tag), tag)
            pipe.execute()

    def set_schema_version_for_tests(self, version: int | None) -> None:
        """Pretend another library version wrote this server (the contract suite's mismatch test)."""
        self._write_schema_version(version)

    def _write_schema_version(self, version: int | None) -> None:
        self._check_servers()
        with self._errors:
            if version is None:
                self._client.delete(self._schema_key)
            else:
                self._client.set(self._schema_key, str(version))

    def close(self) -> None:
        with self._errors:
            self._client.close()


if TYPE_CHECKING:
    _HOOKS: type[RedisStoreHooks] = RedisStore  # the store has every hook, with its contract's signature
