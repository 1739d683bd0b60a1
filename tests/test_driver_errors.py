"""Every check of a driver error's text (``singleton_tasks/stores/_driver_errors.py``), pinned
against the real error: each test provokes it on a real Redis server or SQLite database and
asserts the check recognises it (and does not take a neighbouring error for it). A driver or
server upgrade that rewords one fails here."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
import redis
import redis.exceptions
from conftest import REDIS_URL, require_server
from services import free_port

from singleton_tasks.errors import StoreUnavailableError
from singleton_tasks.stores import _driver_errors as errors
from singleton_tasks.stores.base import scrub_secrets


@pytest.fixture
def admin() -> Iterator[Any]:
    require_server(REDIS_URL, "Redis")
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def limited_user(admin: Any) -> Iterator[Any]:
    """A factory of clients of a new ACL user with the given command rules (deleted after)."""
    made: list[tuple[str, Any]] = []

    def make(*commands: str, keys: str = "*") -> Any:
        user = f"drverr{uuid.uuid4().hex[:8]}"
        admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=[keys], commands=list(commands))
        host = REDIS_URL.split("://", 1)[1]
        client = redis.Redis.from_url(f"redis://{user}:pw@{host}")
        made.append((user, client))
        return client

    yield make
    for user, client in made:
        client.close()
        admin.acl_deluser(user)


# -- Redis --------------------------------------------------------------------------------------


@pytest.mark.redis
def test_an_unknown_command_reads_as_a_server_without_functions(admin: Any) -> None:
    """A server older than Redis 7 answers FCALL as it answers any command it does not know."""
    with pytest.raises(redis.exceptions.ResponseError) as info:
        admin.execute_command("SINGLETON_TASKS_NO_SUCH_COMMAND", "x")
    assert errors.redis_no_functions(info.value)


@pytest.mark.redis
def test_a_user_refused_fcall_or_function_reads_as_no_functions(admin: Any, limited_user: Any) -> None:
    client = limited_user("+@all", "-fcall", "-function")
    with pytest.raises(redis.exceptions.NoPermissionError) as fcall:
        client.fcall("singleton_tasks_absent", 0)
    assert errors.redis_no_functions(fcall.value)
    with pytest.raises(redis.exceptions.NoPermissionError) as load:
        client.function_load(
            "#!lua name=singleton_tasks_absent\nredis.register_function('f', function() end)"
        )
    assert errors.redis_no_functions(load.value)


@pytest.mark.redis
def test_a_key_the_acl_keeps_from_the_user_is_not_read_as_no_functions(limited_user: Any) -> None:
    client = limited_user("+@all", keys="allowed:*")
    with pytest.raises(redis.exceptions.NoPermissionError) as info:
        client.get("forbidden")
    assert not errors.redis_no_functions(info.value)
    assert not errors.redis_script_denied(info.value)


@pytest.mark.redis
def test_fcall_of_a_missing_function_reads_as_function_missing(admin: Any) -> None:
    with pytest.raises(redis.exceptions.ResponseError) as info:
        admin.fcall(f"singleton_tasks_absent_{uuid.uuid4().hex}", 0)
    assert errors.redis_function_missing(info.value)
    assert not errors.redis_no_functions(info.value)


@pytest.mark.redis
def test_loading_a_library_twice_reads_as_library_exists(admin: Any) -> None:
    name = f"singleton_tasks_test_{uuid.uuid4().hex[:12]}"
    code = f"#!lua name={name}\nredis.register_function('{name}_f', function() return 1 end)"
    admin.function_load(code)
    try:
        with pytest.raises(redis.exceptions.ResponseError) as info:
            admin.function_load(code)
        assert errors.redis_library_exists(info.value)
        assert not errors.redis_no_functions(info.value)
    finally:
        admin.function_delete(name)


@pytest.mark.redis
def test_evalsha_of_an_unknown_script_is_redis_pys_no_script_error(admin: Any) -> None:
    """Not a text check: the store relies on redis-py turning NOSCRIPT into NoScriptError."""
    with pytest.raises(redis.exceptions.NoScriptError):
        admin.evalsha("0" * 40, 0)


@pytest.mark.redis
def test_a_command_a_script_may_not_run_reads_as_script_denied(admin: Any, limited_user: Any) -> None:
    client = limited_user("+@all", "-time")
    with pytest.raises(redis.exceptions.ResponseError) as info:
        client.eval("return redis.call('TIME')", 0)
    assert errors.redis_script_denied(info.value)
    with pytest.raises(redis.exceptions.ResponseError) as other:
        admin.eval("return redis.call('SINGLETON_TASKS_NO_SUCH_COMMAND')", 0)
    assert not errors.redis_script_denied(other.value)


@pytest.mark.redis
def test_a_seed_node_without_cluster_mode_reads_as_cluster_mode_disabled(admin: Any) -> None:
    from redis.cluster import RedisCluster

    with pytest.raises((redis.exceptions.RedisClusterException, redis.exceptions.RedisError)) as info:
        where = admin.connection_pool.connection_kwargs  # a cluster has only database 0: no URL
        RedisCluster(host=where["host"], port=where["port"], password=where.get("password"))
    # redis-py says both (no reachable node, because cluster mode is off): the store asks this first.
    assert errors.redis_cluster_mode_disabled(str(info.value))


@pytest.mark.redis
def test_no_reachable_seed_node_reads_as_cluster_unreachable() -> None:
    from redis.cluster import RedisCluster

    port = free_port()
    with pytest.raises((redis.exceptions.RedisClusterException, redis.exceptions.RedisError)) as info:
        RedisCluster(host="127.0.0.1", port=port, socket_connect_timeout=1)
    assert errors.redis_cluster_unreachable(str(info.value))
    assert not errors.redis_cluster_mode_disabled(str(info.value))


# -- SQLite -------------------------------------------------------------------------------------


@pytest.mark.sqlite
def test_a_database_another_connection_locks_reads_as_locked(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    holder = sqlite3.connect(path, isolation_level=None)
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(sqlite3.OperationalError) as info:
            other.execute("BEGIN EXCLUSIVE")
        assert errors.sqlite_locked(info.value)
        with pytest.raises(sqlite3.OperationalError) as unrelated:
            holder.execute("SELECT * FROM no_such_table")
        assert not errors.sqlite_locked(unrelated.value)
    finally:
        holder.close()
        other.close()


@pytest.mark.sqlite
def test_adding_a_column_twice_and_dropping_a_missing_one_read_as_such() -> None:
    connection = sqlite3.connect(":memory:")
    try:
        connection.execute("CREATE TABLE t (a INTEGER)")
        connection.execute("ALTER TABLE t ADD COLUMN b INTEGER")
        with pytest.raises(sqlite3.OperationalError) as added:
            connection.execute("ALTER TABLE t ADD COLUMN b INTEGER")
        assert errors.sqlite_duplicate_column(added.value)
        assert not errors.sqlite_no_such_column(added.value)
        with pytest.raises(sqlite3.OperationalError) as dropped:
            connection.execute("ALTER TABLE t DROP COLUMN c")
        assert errors.sqlite_no_such_column(dropped.value)
        assert not errors.sqlite_duplicate_column(dropped.value)
        # The SQL stores see it wrapped: the check reads the wrapping's text too.
        assert errors.sqlite_no_such_column(errors.unavailable("store", dropped.value))
    finally:
        connection.close()


# -- translation and scrubbing -----------------------------------------------------------------


def test_translated_errors_send_only_the_named_errors_to_fail() -> None:
    def fail(error: BaseException) -> NoReturn:
        raise errors.unavailable("the store", error) from error

    translated = errors.TranslatedErrors((OSError,), fail)
    with pytest.raises(StoreUnavailableError, match=r"^the store: ConnectionRefusedError: no$") as info:
        with translated:
            raise ConnectionRefusedError("no")
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    with pytest.raises(KeyError), translated:
        raise KeyError("other")
    with translated:
        pass


def test_scrub_secrets_hides_the_urls_password_only() -> None:
    url = "redis://user:s3cret@host:6379/0"
    assert scrub_secrets("bad option in redis://user:s3cret@host", url) == (
        "bad option in redis://user:***@host"
    )
    assert scrub_secrets("no password here", "redis://host") == "no password here"
    assert scrub_secrets("s3cret", "redis://[bad") == "s3cret"  # an unparsable URL: as given
