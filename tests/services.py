"""Probes for the servers and programs the tests need: skip when run by hand, fail in CI."""

from __future__ import annotations

import os
import shutil
import socket
from urllib.parse import urlsplit

import pytest
from marks import require_marked

#: The mark a test needs to reach a server, by URL scheme (see marks.py).
MARK_OF_SCHEME = {
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
    "redis+cluster": "redis_cluster",
    "rediss+cluster": "redis_cluster",
    "redis+sentinel": "sentinel",
    "rediss+sentinel": "sentinel",
    "postgresql": "postgres",
    "postgres": "postgres",
    "amqp": "rabbitmq",
    "amqps": "rabbitmq",
}
#: The mark a test needs to start a program of its own.
MARK_OF_EXECUTABLE = {"redis-server": "redis", "redis-cli": "redis"}


def unavailable(message: str) -> None:
    """Skip when run by hand; with ``CI`` set a missing service or tool fails the run instead."""
    if os.environ.get("CI"):
        pytest.fail(message + " (CI is set: a missing service fails the run)")
    pytest.skip(message)


def reachable(url: str) -> bool:
    """Whether something listens at the URL's host and port."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), timeout=1.0):
            return True
    except OSError:
        return False


def require_server(url: str, what: str) -> None:
    """The server at ``url`` must be up: see :func:`unavailable`. The test must be marked for it."""
    mark = MARK_OF_SCHEME.get(urlsplit(url).scheme)
    if mark is not None:
        require_marked(mark, what)
    if not reachable(url):
        unavailable(f"{what} at {urlsplit(url).hostname}:{urlsplit(url).port} is not reachable")


def require_executable(name: str) -> str:
    """The path of a program the test starts (``redis-server``): see :func:`unavailable`."""
    if name in MARK_OF_EXECUTABLE:
        require_marked(MARK_OF_EXECUTABLE[name], name)
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed")
    assert path is not None
    return path


def free_port() -> int:
    """A loopback TCP port nothing listens on now (the OS picks it: no fixed port collides)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port
