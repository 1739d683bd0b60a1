"""What each test needs (a server, real workers, time) as marks: declared once, applied, checked.

A selection by mark is only as good as the marks, and a missing mark is silent: a "no servers" run
once started a 6-node Redis Cluster, because ``not redis`` did not exclude ``redis_cluster``. So
the marks are applied and checked here rather than remembered:

- a fixture that needs a server says so with ``@needs("postgres")``; every test that uses it,
  directly or through other fixtures, gets the mark. A parametrized fixture marks its params
  instead: ``pytest.param("postgres", marks=pytest.mark.postgres)``;
- a test under ``tests/browser/`` gets ``browser`` (:data:`MARK_OF_DIRECTORY`): it drives a real
  chromium, in its own tox env;
- ``redis_cluster`` and ``sentinel`` imply ``redis`` (they start redis-server processes), so
  ``-m "not redis"`` leaves them out too;
- a test with none of :data:`NEEDS_SOMETHING` gets ``fast``: ``pytest -m fast`` (``tox -e fast``)
  is the loop that needs no server and does not sleep;
- :func:`require_marked` (called by ``services.require_server`` and ``require_executable``) fails a
  test that reaches a server its marks do not name, on every run, naming the mark to add;
- a ``fast`` test that waited (sleeping, or on a child process) longer than :data:`SLOW_AFTER` is
  listed at the end of the run: mark it ``slow``, or make it stop waiting.

The conftest files import the hooks below (a ``pytest_plugins`` entry would need a conftest at
the repository's root).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import pytest

#: The marks that keep a test out of the fast loop: a server, real workers, or time.
NEEDS_SOMETHING = ("redis", "postgres", "rabbitmq", "redis_cluster", "sentinel", "workers", "slow", "browser")
#: A mark that brings others with it: a cluster or a Sentinel group is made of redis-servers.
IMPLIES = {"redis_cluster": ("redis",), "sentinel": ("redis",)}
#: A test in one of these directories (under tests/) gets the mark: each runs in its own tox env.
MARK_OF_DIRECTORY = {"browser": "browser"}
#: A ``fast`` test that waited longer than this (seconds of wall time beyond this process's CPU
#: time, setup to teardown) is listed at the end of the run. CPU time is left out on purpose:
#: the model test computes for seconds and belongs in the loop; a test that sleeps does not.
SLOW_AFTER = 2.0

_F = TypeVar("_F", bound=Callable[..., Any])
_running: pytest.Item | None = None
_waited: dict[str, float] = {}


def needs(*marks: str) -> Callable[[_F], _F]:
    """Mark every test that uses the decorated fixture (put it under ``@pytest.fixture``)."""

    def tag(fixture: _F) -> _F:
        fixture._needs = marks  # type: ignore[attr-defined]
        return fixture

    return tag


def require_marked(mark: str, what: str) -> None:
    """Fail the running test unless it carries ``mark`` (or ``workers``: a real-worker test runs
    where its environment's servers are up). A no-op outside a test (the benchmarks)."""
    item = _running
    if item is None or item.get_closest_marker(mark) or item.get_closest_marker("workers"):
        return
    pytest.fail(
        f"{item.nodeid} uses {what} but is not marked {mark!r}: add @pytest.mark.{mark} to the test, "
        f'@needs("{mark}") to its fixture, or marks=pytest.mark.{mark} to its fixture param, '
        "so that -m fast leaves it out",
        pytrace=False,
    )


def _marks_from_fixtures(item: pytest.Function) -> set[str]:
    found: set[str] = set()
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        found.update(getattr(definitions[-1].func, "_needs", ()))  # the definition in effect
    return found


def pytest_itemcollected(item: pytest.Item) -> None:
    found = _marks_from_fixtures(item) if isinstance(item, pytest.Function) else set()
    found.update(mark.name for mark in item.iter_markers() if mark.name in NEEDS_SOMETHING)
    if item.path.parent.name in MARK_OF_DIRECTORY:
        found.add(MARK_OF_DIRECTORY[item.path.parent.name])
    for mark in list(found):
        found.update(IMPLIES.get(mark, ()))
    for name in sorted(found):
        if item.get_closest_marker(name) is None:
            item.add_marker(name)
    if not found:
        item.add_marker("fast")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    global _running
    _running = item
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        return (yield)
    finally:
        _running = None
        waited = (time.perf_counter() - wall) - (time.process_time() - cpu)
        if waited > SLOW_AFTER and item.get_closest_marker("fast") is not None:
            _waited[item.nodeid] = waited


def pytest_terminal_summary(terminalreporter: Any) -> None:
    listed = sorted(_waited.items(), key=lambda entry: -entry[1])
    _waited.clear()  # both conftests import this hook: list once
    if listed:
        terminalreporter.section(f"fast tests that waited over {SLOW_AFTER} s: mark them slow")
        for nodeid, waited in listed:
            terminalreporter.write_line(f"{waited:6.2f}s waited  {nodeid}")
