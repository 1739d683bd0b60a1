"""Probes for the servers and programs the tests need: skip when run by hand, fail in CI."""

from __future__ import annotations

import os
import shutil
import socket
from urllib.parse import urlsplit

import pytest


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
    """The server at ``url`` must be up: see :func:`unavailable`."""
    if not reachable(url):
        unavailable(f"{what} at {urlsplit(url).hostname}:{urlsplit(url).port} is not reachable")


def require_executable(name: str) -> str:
    """The path of a program the test starts (``redis-server``): see :func:`unavailable`."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not installed")
    assert path is not None
    return path
