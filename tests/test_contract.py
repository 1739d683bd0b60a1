"""The exported contract suite (singleton_tasks.testing) on every bundled store."""

from __future__ import annotations

from singleton_tasks.testing import StoreContract


class TestStoreContract(StoreContract):
    """Runs with the ``store_factory`` fixture of conftest.py: memory, sqlite, redis, postgres."""
