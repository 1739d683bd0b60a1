"""The exported contract suite (singleton_tasks.testing) on every bundled store."""

from __future__ import annotations

import uuid

from conftest import look_at_runs_never_seen

from singleton_tasks.outcomes import Decision, RunSpec
from singleton_tasks.stores.memory import MemoryStore
from singleton_tasks.testing import StoreContract


class TestStoreContract(StoreContract):
    """Runs with the ``store_factory`` fixture of conftest.py: memory, sqlite, redis, postgres."""


def test_the_memory_store_keeps_no_key_a_call_wrote_nothing_to() -> None:
    """Calls about runs the store never saw write nothing: no key is left behind (one that never
    held a run is never idle, so never forgotten). The SQL stores' twin is in test_sql_stores.py."""
    store = MemoryStore(f"memory://{uuid.uuid4().hex}")
    look_at_runs_never_seen(store)
    server = store._server
    assert list(server.keys) == []
    assert store.claim(RunSpec("s", "k1", "r1"), 0, b"r1").decision is Decision.ADMITTED  # the claim again
    assert [key for _namespace, _scope, key in server.keys] == ["k1"]
