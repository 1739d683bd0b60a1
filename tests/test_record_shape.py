"""A run's fields and a key's counters are named the same everywhere they are written.

A run field lives in the dataclass (``singleton_tasks.records``), its codec, the SQL schema
files, the numbered migrations, the SQL statements and the Lua. Each test here derives the
expected names from the dataclasses and fails when one of those places names a field more or
less: add a field to :class:`RunRecord` and every test below says where it is still missing.
"""

from __future__ import annotations

import dataclasses
import re
import sqlite3
import uuid
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import POSTGRES_URL, REDIS_URL, StoreFactory, backend_params, require_server

from singleton_tasks.outcomes import RunSpec, RunState
from singleton_tasks.records import KEY_META_FIELDS, RUN_FIELDS, KeyMeta, RunRecord, decode_run, encode_run
from singleton_tasks.stores._sql import (
    POSTGRES,
    SQLITE,
    Dialect,
    _sql_file,
    migration_scripts,
    parse_queries,
    schema_script,
)
from singleton_tasks.stores.base import RuleStore

#: The columns that place a record (its key), before the record's own fields.
KEY_COLUMNS = {"namespace", "scope", "key"}
#: How the SQL stores name KeyMeta's fields (``limit`` is a reserved word in SQL).
SQL_KEY_META_COLUMNS = {"limit": "slot_limit"}
#: The SQL statements that read whole runs, and how many columns of other tables come first.
RUN_SELECTS = {"get_run": 0, "key_summary": 1, "waiters_from": 0, "newest_waiter": 0, "snapshot": 5}


def run_columns() -> set[str]:
    return KEY_COLUMNS | set(RUN_FIELDS)


def key_columns() -> set[str]:
    return KEY_COLUMNS | {SQL_KEY_META_COLUMNS.get(name, name) for name in KEY_META_FIELDS}


def every_field_set(run_id: str, state: RunState, seq: int) -> RunRecord:
    """A run whose every field differs from its default, so a field lost on the way shows."""
    values: dict[str, object] = {
        "run_id": run_id,
        "seq": seq,
        "state": state,
        "created_at": 1_700_000_000.125,
        "confirmed": True,
        "generation": 1_700_000_000_125_003,
        "live": [1_700_000_000_125_002, 1_700_000_000_125_003],
        "payload": b"\x00payload\xff",
        "token": 1_700_000_000_125_007,
        "holder_generation": 1_700_000_000_125_001,
        "admitted_at": 1_700_000_001.25,
        "heartbeat_at": 1_700_000_002.5,
        "lease_expires_at": 1_700_000_032.75,
        "executing": True,
        "lease": 31.5,
        "orphan_timeout": 12.25,
        "recheck": 7.75,
        "seen_at": 1_700_000_003.5,
        "reissue_at": 1_700_000_023.5,
    }
    run = RunRecord(**values)  # type: ignore[arg-type]
    defaults = RunRecord("", seq=0, state=RunState.PENDING, created_at=0.0, confirmed=False, generation=0)
    same = [f.name for f in dataclasses.fields(run) if getattr(run, f.name) == getattr(defaults, f.name)]
    assert not same, f"every_field_set leaves {same} at their defaults: give them values of their own"
    return run


# -- the codec -------------------------------------------------------------------------------------


def test_the_codec_writes_and_reads_every_field_by_name() -> None:
    run = every_field_set("r1", RunState.GATED, 3)
    stored = encode_run(run)
    assert decode_run("r1", stored) == run
    # As a driver returns them: text as bytes, booleans as 0/1, and in any order.
    as_bytes = {
        name: (value.encode() if isinstance(value, str) else int(value) if isinstance(value, bool) else value)
        for name, value in reversed(stored.items())
    }
    assert decode_run("r1", as_bytes) == run


@pytest.mark.parametrize("missing", [name for name in RUN_FIELDS if name != "run_id"])
def test_the_codec_needs_every_field(missing: str) -> None:
    stored = encode_run(every_field_set("r1", RunState.GATED, 3))
    del stored[missing]
    with pytest.raises(KeyError, match=missing):
        decode_run("r1", stored)


# -- the Lua ---------------------------------------------------------------------------------------


def lua(name: str) -> str:
    return resources.files("singleton_tasks.stores").joinpath("lua", name).read_text(encoding="utf-8")


def lua_function(source: str, name: str) -> str:
    """The text of ``local function name(...)`` up to its closing ``end`` at column 0."""
    match = re.search(rf"^local function {name}\(.*?^end$", source, re.MULTILINE | re.DOTALL)
    assert match, f"lib.lua has no local function {name}"
    return match.group(0)


def lua_table_keys(text: str) -> list[str]:
    """The keys of the first table constructor ``{ name = ..., }`` in ``text`` (one per line)."""
    body = text[text.index("{") :]
    return re.findall(r"^\s+(\w+) = ", body, re.MULTILINE)


def test_lua_stores_every_run_field() -> None:
    source = lua("lib.lua")
    fields = re.search(r"^local FIELDS = \{(.*?)\}", source, re.MULTILINE | re.DOTALL)
    assert fields, "lib.lua has no FIELDS list"
    stored = re.findall(r"'(\w+)'", fields.group(1))
    # FIELDS: every field but the hash's own name (run_id) and the payload, read only when needed.
    assert sorted(stored) == sorted(set(RUN_FIELDS) - {"run_id", "payload"})
    assert len(stored) == len(set(stored))
    assert "put(a, 'payload', run.payload)" in lua_function(source, "save_run")


def test_lua_builds_runs_with_every_field() -> None:
    source = lua("lib.lua")
    assert sorted(lua_table_keys(lua_function(source, "load_run"))) == sorted(RUN_FIELDS)
    # A new waiter's record: its table, then seen() sets when it was seen and is issued again.
    made = lua_table_keys(lua_function(source, "new_waiter"))
    made += re.findall(r"^\s+run\.(\w+) = ", lua_function(source, "seen"), re.MULTILINE)
    assert sorted(made) == sorted(RUN_FIELDS)


def test_the_lua_snapshot_measures_payloads_without_reading_them() -> None:
    """A snapshot reads every key's runs: their fields by name (lib.lua's FIELDS), never a payload."""
    source = lua("snapshot.lua")
    assert "HMGET', hash, unpack(FIELDS))" in source
    assert re.findall(r"HGETALL', ([^)]*)\)", source) == ["KEYS[1]"]  # the meta hash only
    assert "HSTRLEN', hash, 'payload')" in source
    assert not re.search(r"'HGET'|'HVALS'", source)


def test_lua_reads_and_writes_every_key_meta_field() -> None:
    source = lua("lib.lua")
    load = lua_function(source, "load_meta")
    read = re.search(r"HMGET', K\.meta, (.*?)\)", load)
    assert read, "load_meta reads no meta fields"
    assert re.findall(r"'(\w+)'", read.group(1)) == list(KEY_META_FIELDS)
    assert [key for key in lua_table_keys(load) if key != "saved"] == list(KEY_META_FIELDS)
    written = re.findall(r"a\[#a \+ 1\] = '(\w+)'", lua_function(source, "save_meta"))
    assert sorted(written) == sorted(KEY_META_FIELDS)


@pytest.mark.parametrize("backend", backend_params(["redis"]))
def test_a_redis_run_hash_holds_every_field(store_factory: StoreFactory) -> None:
    """What the Lua really writes: a new run's hash has a field per RunRecord field."""
    import redis

    store = store_factory()
    store.register(RunSpec("shape", "k", "r1"), payload=b"payload")
    with redis.Redis.from_url(REDIS_URL) as client:
        (run_hash,) = client.scan_iter(match=f"{store.namespace}:*run:r1")
        assert {name.decode() for name in client.hkeys(run_hash)} == set(RUN_FIELDS) - {"run_id"}
        (meta_hash,) = client.scan_iter(match=f"{store.namespace}:*meta")
        meta_fields = {name.decode() for name in client.hkeys(meta_hash)}
    # A new key's hash holds no due_at while it has none (lib.lua's save_meta).
    assert meta_fields - {"scope", "key"} <= set(KEY_META_FIELDS)
    assert set(KEY_META_FIELDS) - {"due_at"} <= meta_fields


# -- the SQL files ---------------------------------------------------------------------------------


def sqlite_columns(path: Path, scripts: list[str]) -> dict[str, set[str]]:
    """Apply ``scripts`` in order to a new SQLite database; its tables' columns."""
    connection = sqlite3.connect(path, isolation_level=None)
    try:
        for script in scripts:
            for statement in SQLITE.statements(script):
                connection.execute(statement)
        tables = [row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        info = "PRAGMA table_info('{}')"
        return {table: {row[1] for row in connection.execute(info.format(table))} for table in tables}
    finally:
        connection.close()


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A new, empty PostgreSQL schema, dropped afterwards."""
    require_server(POSTGRES_URL, "PostgreSQL")
    import psycopg

    name = f"st_shape_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(f'CREATE SCHEMA "{name}"')
    yield name
    with psycopg.connect(POSTGRES_URL, autocommit=True) as connection:
        connection.execute(f'DROP SCHEMA "{name}" CASCADE')


def postgres_columns(schema: str, scripts: list[str]) -> dict[str, set[str]]:
    """Apply ``scripts`` in order to an empty schema; its tables' columns."""
    import psycopg

    separator = "&" if "?" in POSTGRES_URL else "?"
    url = f"{POSTGRES_URL}{separator}options={quote(f'-csearch_path={schema}')}"
    with psycopg.connect(url) as connection:
        for script in scripts:
            with connection.transaction():
                connection.execute(script)
        rows = connection.execute(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = %s", [schema]
        ).fetchall()
    columns: dict[str, set[str]] = {}
    for table, column in rows:
        columns.setdefault(table, set()).add(column)
    return columns


def scripts_of(dialect: Dialect, source: str) -> list[str]:
    if source == "schema file":
        return [schema_script(dialect)]
    return [script for _version, script in migration_scripts(dialect)]


def assert_record_columns(columns: dict[str, set[str]]) -> None:
    assert columns["singleton_runs"] == run_columns()
    assert columns["singleton_keys"] == key_columns()


@pytest.mark.parametrize("source", ["schema file", "migrations in order"])
def test_sqlite_tables_have_the_record_fields(source: str, tmp_path: Path) -> None:
    assert_record_columns(sqlite_columns(tmp_path / "shape.db", scripts_of(SQLITE, source)))


@pytest.mark.postgres
@pytest.mark.parametrize("source", ["schema file", "migrations in order"])
def test_postgres_tables_have_the_record_fields(source: str, pg_schema: str) -> None:
    assert_record_columns(postgres_columns(pg_schema, scripts_of(POSTGRES, source)))


def select_list(sql: str) -> list[str]:
    """The column names of a statement's outermost SELECT list (``r.seq`` → ``seq``)."""
    listed = re.search(r"^\s*SELECT\s+(.*?)\s+FROM\b", sql, re.IGNORECASE | re.DOTALL)
    assert listed, sql
    return [column.strip().split(".")[-1] for column in listed.group(1).split(",")]


@pytest.mark.parametrize("dialect", [SQLITE, POSTGRES], ids=["sqlite", "postgres"])
@pytest.mark.parametrize("statement", sorted(RUN_SELECTS))
def test_sql_statements_read_every_run_field(dialect: Dialect, statement: str) -> None:
    """Runs are decoded by column name: a statement that reads runs selects every field once."""
    sql = parse_queries(_sql_file("queries.sql"), dialect.name)[statement]
    columns = select_list(sql)[RUN_SELECTS[statement] :]
    assert sorted(columns) == sorted(RUN_FIELDS)


@pytest.mark.parametrize("dialect", [SQLITE, POSTGRES], ids=["sqlite", "postgres"])
def test_sql_save_run_writes_every_run_field(dialect: Dialect) -> None:
    sql = parse_queries(_sql_file("queries.sql"), dialect.name)["save_run"]
    inserted = re.search(r"INSERT INTO singleton_runs \((.*?)\)", sql, re.DOTALL)
    assert inserted
    assert sorted(c.strip() for c in inserted.group(1).split(",")) == sorted(run_columns())
    assert sorted(re.findall(r":(\w+)", sql)) == sorted(run_columns())
    updated = re.findall(r"^\s+(\w+) = excluded\.(\w+)", sql, re.MULTILINE)
    assert all(column == value for column, value in updated)
    assert sorted(column for column, _value in updated) == sorted(set(RUN_FIELDS) - {"run_id"})


# -- every store that keeps records through a KeyTransaction ------------------------------------------


@pytest.mark.parametrize("backend", backend_params(["memory", "sqlite", "postgres"]))
def test_a_record_comes_back_as_it_was_saved(store_factory: StoreFactory) -> None:
    """Saved and read again in a new transaction: the key's counters, a holder and a waiter."""
    store = store_factory()
    assert isinstance(store, RuleStore)
    holder = every_field_set("held", RunState.HOLDING, 1)
    waiter = dataclasses.replace(every_field_set("waits", RunState.GATED, 2), token=0, executing=False)
    meta = KeyMeta(token=holder.token, seq=2, limit=3, idle_until=None, due_at=1_700_000_050.5)
    with store.transaction("shape", "k") as tx:
        tx.save_meta(meta)
        tx.save_run(holder)
        tx.save_run(waiter)
    with store.transaction("shape", "k") as tx:
        assert tx.meta() == meta
        assert tx.holders() == [holder]
        assert tx.waiters_from(0, 10) == [waiter]
        assert tx.newest_waiter() == waiter
        assert tx.get_run("held") == holder
        assert tx.get_run("waits") == waiter
        idle = KeyMeta(token=meta.token, seq=0, limit=meta.limit, idle_until=4_000_000_000.25, due_at=None)
        tx.delete_run("held")
        tx.delete_run("waits")
        tx.save_meta(idle)
    with store.transaction("shape", "k") as tx:
        assert tx.meta() == idle
