"""PostgreSQL plans of the namespace-wide sweeps: they read the expiry indexes, never the whole table.

A worker sweeps now and then (its heartbeat thread); with a million settled markers or idle keys in
the namespace a sequential scan per sweep would cost seconds. The batched subselect must walk the
index in its order (``ORDER BY expires_at`` / ``ORDER BY idle_until``) so its ``LIMIT`` stops early.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from conftest import POSTGRES_URL, require_server
from marks import needs

from singleton_tasks.stores._sql import POSTGRES, queries, schema_script

ROWS = 50_000
NOW = 1_000_000.0


@pytest.fixture(scope="module")
@needs("postgres")
def filled() -> Iterator[Any]:
    """A schema of our own with ROWS markers and idle keys expiring one a second after NOW, analyzed."""
    require_server(POSTGRES_URL, "PostgreSQL")
    import psycopg

    schema = f"st_plans_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
    separator = "&" if "?" in POSTGRES_URL else "?"
    url = f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    try:
        with psycopg.connect(url, autocommit=True) as connection:
            connection.execute(schema_script(POSTGRES))
            connection.execute(
                "INSERT INTO singleton_settled (namespace, scope, key, run_id, generation, expires_at) "
                "SELECT 'ns', 's', 'k' || i, 'r' || i, i, %s + i FROM generate_series(1, %s) AS i",
                [NOW, ROWS],
            )
            connection.execute(
                "INSERT INTO singleton_keys (namespace, scope, key, token, seq, slot_limit, idle_until) "
                "SELECT 'ns', 's', 'k' || i, i, i, 1, %s + i FROM generate_series(1, %s) AS i",
                [NOW, ROWS],
            )
            connection.execute("ANALYZE singleton_settled")
            connection.execute("ANALYZE singleton_keys")
            yield connection
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


def plan(connection: Any, name: str, now: float) -> str:
    params = {"namespace": "ns", "now": now, "count": 500}
    rows = connection.execute("EXPLAIN " + queries(POSTGRES)[name], params).fetchall()
    return "\n".join(row[0] for row in rows)


@pytest.mark.parametrize(
    ("name", "table", "index"),
    [
        ("sweep_settled", "singleton_settled", "singleton_settled_expiry"),
        ("sweep_keys", "singleton_keys", "singleton_keys_idle"),
    ],
)
@pytest.mark.parametrize("expired", [0.0, 0.5, 1.0])
def test_sweep_reads_the_expiry_index(filled: Any, name: str, table: str, index: str, expired: float) -> None:
    """Whatever share of the rows has expired — after a retention window, all of them: a scan of
    the heap in its order would stop early for the first batch, then wade through the dead rows
    of the batches before it, growing with every batch."""
    text = plan(filled, name, NOW + expired * ROWS + 0.5)
    assert f"Seq Scan on {table}" not in text, text
    assert index in text, text
