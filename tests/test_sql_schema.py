"""The SQL schema files, the numbered migrations and schema versioning of the SQL stores.

Applying every migration to an empty database must give exactly the schema that a fresh
install gets from the dialect's schema file (tables, columns, constraints, indexes, version).
"""

from __future__ import annotations

import re
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from conftest import POSTGRES_URL, backend_params, require_server
from marks import needs

from singleton_tasks import store_from_url
from singleton_tasks.errors import SchemaVersionError
from singleton_tasks.stores import SCHEMA_VERSION
from singleton_tasks.stores._sql import (
    POSTGRES,
    SQLITE,
    Dialect,
    SQLStore,
    migration_scripts,
    parse_queries,
    queries,
    schema_script,
)

DIALECTS = {"sqlite": SQLITE, "postgres": POSTGRES}


# -- SQLite -----------------------------------------------------------------------------------------


def _sqlite_apply(path: Path, scripts: list[str]) -> None:
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        for script in scripts:
            connection.execute("BEGIN IMMEDIATE")
            for statement in SQLITE.statements(script):
                connection.execute(statement)
            connection.execute("COMMIT")
    finally:
        connection.close()


def _sqlite_shape(path: Path) -> dict[str, Any]:
    connection = sqlite3.connect(path)
    try:
        shape: dict[str, Any] = {}
        tables = [r[0] for r in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in sorted(tables):
            shape[f"table {table}"] = connection.execute(f"PRAGMA table_xinfo('{table}')").fetchall()
            for _seq, index, unique, origin, partial in connection.execute(f"PRAGMA index_list('{table}')"):
                [sql] = connection.execute(
                    "SELECT sql FROM sqlite_master WHERE name = ?", (index,)
                ).fetchone()
                shape[f"index {index}"] = (
                    table,
                    unique,
                    origin,
                    partial,
                    connection.execute(f"PRAGMA index_xinfo('{index}')").fetchall(),
                    None if sql is None else " ".join(sql.replace("IF NOT EXISTS ", "").split()),
                )
        shape["versions"] = connection.execute("SELECT version FROM singleton_schema_version").fetchall()
        return shape
    finally:
        connection.close()


def test_sqlite_migrations_give_the_schema(tmp_path: Path) -> None:
    _sqlite_apply(tmp_path / "migrated.db", [script for _version, script in migration_scripts(SQLITE)])
    _sqlite_apply(tmp_path / "fresh.db", [schema_script(SQLITE)])
    migrated, fresh = _sqlite_shape(tmp_path / "migrated.db"), _sqlite_shape(tmp_path / "fresh.db")
    assert migrated == fresh
    assert {"table singleton_keys", "table singleton_runs", "table singleton_settled"} <= set(fresh)
    assert fresh["versions"] == [(v,) for v in range(1, SCHEMA_VERSION + 1)]


# -- PostgreSQL: each database in a schema of its own ---------------------------------------------------


@pytest.fixture
@needs("postgres")
def pg_schemas() -> Iterator[list[str]]:
    require_server(POSTGRES_URL, "PostgreSQL")
    import psycopg

    names = [f"st_schema_test_{uuid.uuid4().hex[:10]}" for _ in range(2)]
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        for name in names:
            connection.execute(f'CREATE SCHEMA "{name}"')
    yield names
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        for name in names:
            connection.execute(f'DROP SCHEMA "{name}" CASCADE')


def _pg_url(schema: str) -> str:
    separator = "&" if "?" in POSTGRES_URL else "?"
    return f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"


def _pg_apply(schema: str, scripts: list[str]) -> None:
    import psycopg

    with psycopg.connect(_pg_url(schema)) as connection:
        for script in scripts:
            with connection.transaction():
                connection.execute(script)


def _pg_shape(schema: str) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(POSTGRES_URL) as connection:
        columns = connection.execute(
            "SELECT table_name, column_name, ordinal_position, data_type, is_nullable, column_default "
            "FROM information_schema.columns WHERE table_schema = %s ORDER BY 1, 3",
            [schema],
        ).fetchall()
        indexes = connection.execute(
            "SELECT tablename, indexname, replace(indexdef, %s, '') FROM pg_indexes "
            "WHERE schemaname = %s ORDER BY 1, 2",
            [f"{schema}.", schema],
        ).fetchall()
        constraints = connection.execute(
            "SELECT c.relname, k.conname, k.contype, pg_get_constraintdef(k.oid) FROM pg_constraint k "
            "JOIN pg_class c ON c.oid = k.conrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s ORDER BY 1, 2",
            [schema],
        ).fetchall()
        versions = connection.execute(
            f'SELECT version FROM "{schema}".singleton_schema_version ORDER BY 1'
        ).fetchall()
    return {"columns": columns, "indexes": indexes, "constraints": constraints, "versions": versions}


def test_postgres_migrations_give_the_schema(pg_schemas: list[str]) -> None:
    migrated, fresh = pg_schemas
    _pg_apply(migrated, [script for _version, script in migration_scripts(POSTGRES)])
    _pg_apply(fresh, [schema_script(POSTGRES)])
    assert _pg_shape(migrated) == _pg_shape(fresh)
    shape = _pg_shape(fresh)
    assert {row[0] for row in shape["columns"]} == {
        "singleton_schema_version",
        "singleton_keys",
        "singleton_runs",
        "singleton_settled",
    }
    assert shape["versions"] == [(v,) for v in range(1, SCHEMA_VERSION + 1)]


# -- the files themselves -------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS.values(), ids=DIALECTS.keys())
def test_migrations_are_numbered_up_to_the_schema_version(dialect: Dialect) -> None:
    versions = [version for version, _script in migration_scripts(dialect)]
    assert versions == list(range(1, SCHEMA_VERSION + 1))
    for version, script in migration_scripts(dialect):
        assert f"VALUES ({version})" in script, "each migration records its version"
    assert f"VALUES ({SCHEMA_VERSION})" in schema_script(dialect)


def test_queries_parse_per_dialect() -> None:
    text = (
        "-- name: a\nSELECT :x;\n"
        "-- name: b (postgres)\nSELECT 1\n-- comment: :y\n;\n"
        "-- name: b (sqlite)\nSELECT 2"
    )
    assert parse_queries(text, "postgres") == {"a": "SELECT :x", "b": "SELECT 1"}
    assert parse_queries(text, "sqlite") == {"a": "SELECT :x", "b": "SELECT 2"}
    assert queries(POSTGRES)["lock_key"].endswith("FOR UPDATE")
    assert "FOR UPDATE" not in queries(SQLITE)["lock_key"]
    assert "%(namespace)s" in queries(POSTGRES)["get_run"] and ":namespace" in queries(SQLITE)["get_run"]
    assert queries(POSTGRES).keys() - {"migration_lock"} == queries(SQLITE).keys()
    for sql in queries(POSTGRES).values():
        assert not re.search(r"(?<![:\w]):\w", sql), "every :name was converted"


# -- migrate, schema_version and check_schema on real databases -------------------------------------------


@pytest.fixture(params=backend_params(list(DIALECTS)))
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    require_server(POSTGRES_URL, "PostgreSQL")
    import psycopg

    schema = f"st_schema_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{schema}"')
    yield _pg_url(schema)
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_migrate_creates_then_is_idempotent(empty_url: str) -> None:
    store = store_from_url(empty_url)
    try:
        assert store.schema_version() is None
        with pytest.raises(SchemaVersionError, match="migrate"):
            store.check_schema()
        store.migrate()
        assert store.schema_version() == SCHEMA_VERSION
        store.check_schema()
        store.migrate()
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()


def test_check_schema_refuses_another_version(empty_url: str) -> None:
    store = store_from_url(empty_url)
    assert isinstance(store, SQLStore)
    try:
        store.migrate()
        store.set_schema_version_for_tests(SCHEMA_VERSION + 1)
        assert store.schema_version() == SCHEMA_VERSION + 1
        with pytest.raises(SchemaVersionError, match=r"singleton-tasks migrate"):
            store.check_schema()
        with pytest.raises(SchemaVersionError, match="newer"):
            store.migrate()  # never downgrades
        store.set_schema_version_for_tests(None)  # version rows lost: migrate re-applies safely
        assert store.schema_version() is None
        store.migrate()
        store.check_schema()
    finally:
        store.close()


def test_concurrent_migrate_callers(empty_url: str) -> None:
    stores = [store_from_url(empty_url) for _ in range(6)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(stores))

    def run(store: Any) -> None:
        try:
            barrier.wait()
            store.migrate()
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    try:
        assert errors == []
        assert all(s.schema_version() == SCHEMA_VERSION for s in stores)
    finally:
        for store in stores:
            store.close()


# -- the waiters are read through their index ---------------------------------------------------------


def test_postgres_waiter_queries_use_the_index(pg_schemas: list[str]) -> None:
    import psycopg

    _pg_apply(pg_schemas[0], [schema_script(POSTGRES)])
    params = {"namespace": "n", "scope": "s", "key": "k", "after_seq": 0, "count": 64, "seq": 5}
    with psycopg.connect(_pg_url(pg_schemas[0])) as connection:
        connection.execute("SET enable_seqscan = off")
        for name in ("waiters_from", "waiters_before"):
            plan = connection.execute("EXPLAIN " + queries(POSTGRES)[name], params).fetchall()
            assert "singleton_runs_waiters" in " ".join(row[0] for row in plan), plan


def test_sqlite_waiter_queries_use_the_index(tmp_path: Path) -> None:
    path = tmp_path / "plan.db"
    _sqlite_apply(path, [schema_script(SQLITE)])
    params = {"namespace": "n", "scope": "s", "key": "k", "after_seq": 0, "count": 64, "seq": 5}
    connection = sqlite3.connect(path)
    try:
        for name in ("waiters_from", "waiters_before"):
            plan = connection.execute("EXPLAIN QUERY PLAN " + queries(SQLITE)[name], params).fetchall()
            assert "singleton_runs_waiters" in " ".join(str(row[-1]) for row in plan), plan
    finally:
        connection.close()
