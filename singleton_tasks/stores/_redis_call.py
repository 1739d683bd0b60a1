"""The Redis stores' one hand-written path: a script call written straight to a pinned connection.

Every store operation is one ``FCALL`` (or ``EVALSHA``) on the calling thread's pinned
connection. It is written here rather than through redis-py's ``fcall``/``evalsha`` for two
things redis-py's path does not do, and a third it does more slowly:

1. **WAIT in the same write.** With ``wait_replicas``, ``WAIT numreplicas timeout`` goes right
   behind the call, in the same write on the same connection (WAIT counts that connection's
   writes): still one round trip. redis-py's pipeline takes another connection from the pool
   and rewrites the call's error message (the store reads a missing function or a server
   without functions from it).
2. **Reconnecting where the connection says.** A dropped connection is connected again by its
   own ``connect()``: a Sentinel-managed connection asks the sentinels for the current primary
   there, while ``send_packed_command``'s own reconnect (``connect_check_health``) goes back to
   the host it knew, the old primary after a failover. On redis-py's path the Sentinel failover
   test (tests/workers/test_sentinel.py) fails.
3. **Client CPU.** redis-py's general path (command parsing, observability hooks, a lock,
   per-argument packing) costs more CPU per call; a worker of many threads is bound by that CPU
   under the GIL. The difference measured is inside the host's spread
   (benchmarks/README.md#where-the-client-cpu-goes): on its own, no reason to keep the path.

redis-py internals used here, checked on redis-py 8.2.0 (``tests/test_framework_internals.py``
fails when an upgrade changes one): ``Connection.send_packed_command(packed, check_health=)``,
``Connection.read_response()``, ``Connection.retry.call_with_retry(call, failed)``,
``Connection.disconnect()``, ``Connection.connect()`` and the attribute ``Connection._sock``
(None while disconnected). The reply and its errors (``NoScriptError``, ...) are redis-py's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import hiredis
import redis
import redis.exceptions


def _resp_command(parts: Sequence[bytes]) -> bytes:
    """One command in RESP: an array of bulk strings (packed in C by hiredis, which redis-py's
    own fast path uses too)."""
    # hiredis' stub types its argument as a 1-tuple; it packs any tuple of arguments.
    packed: bytes = hiredis.pack_command(tuple(parts))  # type: ignore[arg-type]
    return packed


def _round_trip(conn: Any, packed: list[bytes]) -> list[Any]:
    """Write ``packed`` commands at once and read every reply in order, with the connection's
    retry policy; a reply that is an error is returned in its place (the connection stays in
    step)."""

    def call() -> list[Any]:
        if getattr(conn, "_sock", None) is None:
            conn.connect()  # reason 2 above
        conn.send_packed_command(packed, check_health=False)
        replies: list[Any] = []
        for _ in packed:
            try:
                replies.append(conn.read_response())
            except redis.exceptions.ResponseError as error:
                replies.append(error)
        return replies

    def failed(_error: Exception) -> None:
        conn.disconnect()

    return conn.retry.call_with_retry(call, failed)  # type: ignore[no-any-return]


def _encoded(part: bytes | str) -> bytes:
    return part if isinstance(part, bytes) else part.encode("utf-8", "surrogatepass")


def call_script(
    client: redis.Redis,
    command: bytes,
    name: bytes,
    numkeys: int,
    keys_and_args: Sequence[bytes | str],
    wait: Sequence[bytes] | None = None,
) -> Any:
    """``EVALSHA sha`` or ``FCALL function`` on the client's own connection, with its retry policy.

    A ``str`` argument is sent as UTF-8 with surrogates passed (any Python str round-trips).
    With ``wait`` the reply is ``(the call's reply, replicas that acknowledged)``. A client
    without a connection of its own (a cluster client's routed path) takes redis-py's path.
    """
    if client.connection is None:  # not a single-connection client: take the general path
        call_general = client.fcall if command == b"FCALL" else client.evalsha
        reply = call_general(name.decode(), numkeys, *keys_and_args)
        return reply if wait is None else (reply, client.execute_command("WAIT", *wait))  # type: ignore[no-untyped-call]
    replies, acknowledged = call_batch(
        client, [[command, name, b"%d" % numkeys, *map(_encoded, keys_and_args)]], wait
    )
    if isinstance(replies[0], Exception):
        raise replies[0]
    return replies[0] if wait is None else (replies[0], acknowledged)


def call_batch(
    client: redis.Redis, calls: Sequence[Sequence[bytes]], wait: Sequence[bytes] | None = None
) -> tuple[list[Any], Any]:
    """Commands in one write on the client's own connection (a single-connection client), every
    reply read in order: ``(replies, replicas that acknowledged or None)``, a reply that is an
    error in its place.
    """
    packed = [_resp_command(call) for call in calls]
    if wait is not None:
        packed.append(_resp_command([b"WAIT", *wait]))
    replies = _round_trip(client.connection, packed)
    acknowledged = replies.pop() if wait is not None else None
    if isinstance(acknowledged, Exception):
        raise acknowledged
    return replies, acknowledged


__all__ = ["call_batch", "call_script"]
