"""The Redis store's Lua scripts and their wire format: loading, argument encoding, reply decoding.

The scripts in ``lua/`` are loaded here twice over: each operation as a script for ``EVALSHA``
(``lib.lua`` in front of it), and all of them as one function library for ``FCALL``. Arguments
go to the scripts as bytes (:func:`text`, :func:`time_arg`, ...) and replies come back as
nested lists of bytes, decoded here into the store protocol's outcomes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

from ..config import Timings
from ..outcomes import (
    ClaimOutcome,
    Decision,
    DueOutcome,
    HolderView,
    KeySnapshot,
    PayloadRequest,
    Registered,
    ReleaseOutcome,
    RunState,
    WaiterView,
    Wake,
)
from ..records import RUN_FIELDS, KeyMeta, RunRecord, decode_run
from .base import snapshot_of

OPERATIONS = (
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

# Replies as the scripts spell them (a dict lookup is cheaper than an Enum call by value).
DECISIONS = {d.value.encode(): d for d in Decision}
REGISTERED = {r.value.encode(): r for r in Registered}


@functools.cache
def _lua_sources() -> tuple[str, dict[str, str]]:
    """``lib.lua`` and each operation's script."""
    folder = resources.files(__package__ or "singleton_tasks.stores") / "lua"
    lib = (folder / "lib.lua").read_text(encoding="utf-8")
    return lib, {name: (folder / f"{name}.lua").read_text(encoding="utf-8") for name in OPERATIONS}


def load_scripts() -> dict[str, str]:
    """Each operation as a script for EVALSHA: ``lib.lua`` (shared helpers), then the operation."""
    lib, operations = _lua_sources()
    return {name: lib + "\n" + text for name, text in operations.items()}


@functools.cache
def function_library() -> tuple[str, dict[str, bytes]]:
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


# -- arguments ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def hash_tag(scope: str, key: str) -> bytes:
    """``{<sha1>}``: the digest of the scope and key (bounded cache: hot keys are derived once)."""
    scope_b, key_b = text(scope), text(key)
    # The length prefix keeps (scope, key) pairs apart even if the scope holds a NUL.
    return b"{" + hashlib.sha1(b"%d\0%s\0%s" % (len(scope_b), scope_b, key_b)).hexdigest().encode() + b"}"


#: Every hash tag has this length (braces around a SHA-1 in hex).
TAG_LENGTH = 2 + 2 * hashlib.sha1().digest_size


@functools.lru_cache(maxsize=16)
def timing_args(timings: Timings) -> tuple[bytes, bytes]:
    """The encoded registration grace and retention."""
    return time_arg(timings.registration_grace), time_arg(timings.retention)


@functools.lru_cache(maxsize=256)
def spec_args(
    limit: int, lease: float, orphan_timeout: float | None, recheck: float
) -> tuple[bytes, bytes, bytes, bytes]:
    """The encoded per-task options of a RunSpec (few distinct values per process)."""
    return int_arg(limit), time_arg(lease), opt_time_arg(orphan_timeout), time_arg(recheck)


def text(value: str) -> bytes:
    # surrogatepass: any Python str round-trips, even one a strict UTF-8 codec would refuse.
    return value.encode("utf-8", "surrogatepass")


def time_arg(value: float) -> bytes:
    # repr() is the shortest text that reads back as the same double, in Python and in Lua.
    return repr(float(value)).encode()


def int_arg(value: int) -> bytes:
    return str(int(value)).encode()


def opt_time_arg(value: float | None) -> bytes:
    return b"" if value is None else time_arg(value)  # '' stands for None in the scripts


def opt_int_arg(value: int | None) -> bytes:
    return b"" if value is None else int_arg(value)


def payload_args(payload: bytes | PayloadRequest | None) -> tuple[bytes, bytes]:
    """The flag and the bytes of an optional payload (register.lua, claim.lua): '1' given,
    '0' None, '2' ``PAYLOAD_ON_REQUEST`` (claim only)."""
    if payload is None:
        return b"0", b""
    if payload is PayloadRequest.ON_REQUEST:
        return b"2", b""
    return b"1", bytes(payload)


# -- replies ------------------------------------------------------------------------------------


def from_text(value: bytes) -> str:
    return value.decode("utf-8", "surrogatepass")


def maybe_int(value: Any) -> int | None:
    return None if value is None else int(value)


# Most replies name no run: () without building a generator (every claim and release parses three).
def wakes(scope: str, key: str, rows: Sequence[Sequence[Any]]) -> tuple[Wake, ...]:
    if not rows:
        return ()
    return tuple(Wake(scope, key, from_text(run_id), int(gen), payload) for run_id, gen, payload in rows)


def names(rows: Sequence[bytes]) -> tuple[str, ...]:
    if not rows:
        return ()
    return tuple(from_text(run_id) for run_id in rows)


def pairs(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


_RUN_FIELDS = tuple(name.encode() for name in RUN_FIELDS[1:])  # the run hash's fields


def run_record(run_id: bytes, fields: dict[bytes, bytes]) -> RunRecord:
    return decode_run(from_text(run_id), {name.decode(): fields.get(name) for name in _RUN_FIELDS})


def _phantom_views(entries: Sequence[Sequence[Any]]) -> tuple[list[HolderView], list[WaiterView]]:
    """Index entries without run data (a damaged store): shown so an operator can release them."""
    holders, waiters = [], []
    for run_id, _fields, kind, score, _payload_size in entries:
        if kind == b"holder":
            holders.append(
                HolderView(from_text(run_id), int(float(score)), 0.0, 0.0, 0.0, False, phantom=True)
            )
        else:
            waiters.append(WaiterView(from_text(run_id), 0, 0.0, RunState.PENDING, False, phantom=True))
    return holders, waiters


def claim_outcome(scope: str, key: str, reply: Sequence[Any]) -> ClaimOutcome:
    """``claim.lua``'s reply."""
    decision, token, new_generation, position, takeover, evicted, woken, removed = reply
    return ClaimOutcome(
        DECISIONS[decision],
        token=maybe_int(token),
        generation=maybe_int(new_generation),
        position=maybe_int(position),
        takeover=bool(takeover),
        evicted=names(evicted),
        wakes=wakes(scope, key, woken),
        removed=names(removed),
    )


def release_outcome(scope: str, key: str, reply: Sequence[Any]) -> ReleaseOutcome:
    """``release.lua``'s reply."""
    released, lost, woken, evicted, removed = reply
    return ReleaseOutcome(
        released=bool(released),
        lost=bool(lost),
        wakes=wakes(scope, key, woken),
        evicted=names(evicted),
        removed=names(removed),
    )


def due_outcome(reply: Sequence[Any]) -> DueOutcome:
    """``tick.lua``'s reply for a key with runs (it names the key's scope and key)."""
    scope_b, key_b, woken, evicted, removed = reply
    scope, key = from_text(scope_b), from_text(key_b)
    return DueOutcome(scope, key, wakes(scope, key, woken), names(evicted), names(removed))


def key_snapshot(reply: Sequence[Any]) -> KeySnapshot | None:
    """``snapshot.lua``'s reply (not empty); None for runs without their key's record (shown
    once a call on the key repairs it)."""
    meta_flat, entries = reply
    meta = pairs(meta_flat)
    if b"scope" not in meta:
        return None
    records = [
        run_record(run_id, pairs(fields)) for run_id, fields, _kind, _score, _size in entries if fields
    ]
    sizes = {
        from_text(run_id): None if size < 0 else size for run_id, _fields, _kind, _score, size in entries
    }
    key_meta = KeyMeta(token=int(meta[b"token"]), seq=int(meta[b"seq"]), limit=int(meta[b"limit"]))
    snap = snapshot_of(from_text(meta[b"scope"]), from_text(meta[b"key"]), key_meta, records, sizes)
    phantom_holders, phantom_waiters = _phantom_views([e for e in entries if not e[1]])
    if phantom_holders or phantom_waiters:
        snap = dataclasses.replace(
            snap,
            holders=snap.holders + tuple(phantom_holders),
            waiters=snap.waiters + tuple(phantom_waiters),
        )
    return snap
