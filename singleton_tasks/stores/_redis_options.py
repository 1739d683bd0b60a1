"""The Redis stores' own options: read from keywords and the URL's query, checked before connecting.

``allow_eviction``, ``wait_replicas`` and ``wait_timeout_ms`` are the store's, not redis-py's
(redis-py would hand an option it does not know to every connection); the socket timeouts are
redis-py's, checked here because a bad one fails every call rather than the constructor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..errors import SingletonConfigError
from .base import redact_url

#: The store's own options in a Redis URL's query (the rest go to redis-py); ``retention`` is
#: every store's (read by the base class).
STORE_QUERY_OPTIONS = ("allow_eviction", "wait_replicas", "wait_timeout_ms", "retention")
#: How long a writing operation waits for its replicas by default (``wait_replicas`` given).
DEFAULT_WAIT_TIMEOUT_MS = 1000
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


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


def default_timeouts(url_options: Mapping[str, object], redis_options: dict[str, object], where: str) -> None:
    """Check the timeouts given as keywords and in the URL, and give each socket timeout neither
    sets a default of 5 s: a hung server must fail an operation (StoreUnavailableError), not
    block it forever."""
    check_timeouts(redis_options, where)
    check_timeouts(url_options, f"{where} (URL)")
    for name in TIMEOUT_OPTIONS:
        if name not in url_options:  # the URL's own stays (the Sentinel client prefers keywords)
            redis_options.setdefault(name, 5.0)


def check_wait_timeout(
    options: StoreOptions, url_options: Mapping[str, Any], redis_options: Mapping[str, Any], where: str
) -> None:
    """SingletonConfigError when ``wait_timeout_ms`` is not shorter than the socket timeout: every
    slow WAIT would fail as a lost connection."""
    # Given both ways, redis-py takes the URL's and the Sentinel client the keyword: the shorter counts.
    given = [t for t in (url_options.get("socket_timeout"), redis_options.get("socket_timeout")) if t]
    socket_timeout = min(given, default=None)
    if (
        options.wait_replicas is not None
        and socket_timeout
        and options.wait_timeout_ms >= socket_timeout * 1000
    ):
        raise SingletonConfigError(
            f"{where}: wait_timeout_ms={options.wait_timeout_ms} must be shorter than the "
            f"socket_timeout ({socket_timeout}s), or every slow WAIT fails as a lost connection"
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


__all__ = [
    "DEFAULT_WAIT_TIMEOUT_MS",
    "STORE_QUERY_OPTIONS",
    "TIMEOUT_OPTIONS",
    "StoreOptions",
    "check_timeouts",
    "check_wait_timeout",
    "default_timeouts",
    "split_store_options",
    "store_options",
]
