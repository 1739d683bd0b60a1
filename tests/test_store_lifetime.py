"""A store is freed when its last reference goes: no reference cycle leaves it to the collector.

The garbage collector runs at any allocation and at interpreter exit; a Redis client closed from
there (its ``__del__``) takes its connection pool's lock and can block for ever on a lock held by
the interrupted code or by a daemon thread frozen at exit (a producer process that never exits).
"""

from __future__ import annotations

import gc
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import backend_url

from singleton_tasks.outcomes import RunSpec
from singleton_tasks.stores import store_from_url


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_a_store_is_freed_by_its_last_reference(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, collector_off: None
) -> None:
    store = store_from_url(backend_url(backend, tmp_path, request), namespace=f"life{uuid.uuid4().hex[:8]}")
    store.migrate()
    store.register(RunSpec("s", "k", "r"))
    store.snapshot()
    try:
        store.confirm("s", "k", "r")
    finally:
        store.unregister("s", "k", "r")
    alive = weakref.ref(store)
    store.close()
    del store
    assert alive() is None, [type(referrer).__name__ for referrer in gc.get_referrers(alive())]
