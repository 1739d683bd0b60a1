"""Bad input is refused early and clearly (docs/concepts.md#declaring-a-singleton)."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import POSTGRES_URL, REDIS_URL, StoreFactory
from services import require_server

from singleton_tasks import (
    DISABLED,
    BoundSingleton,
    SingletonConfig,
    SingletonConfigError,
    SingletonError,
    SingletonKeyError,
    SingletonQueueFullError,
    StoreUnavailableError,
    singleton,
    store_from_url,
)
from singleton_tasks.config import MAX_KEY_LENGTH
from singleton_tasks.outcomes import RunSpec
from singleton_tasks.runtime import Gatekeeper
from singleton_tasks.stores import check_store_url, store_classes
from singleton_tasks.stores.base import redact_url, scrub_secrets

# ---------------------------------------------------------------------------- SingletonConfig


@pytest.mark.parametrize("limit", [0, -1, 1.5, 2.0, "2", None, True, False])
def test_limit_must_be_a_positive_int(limit: Any) -> None:
    with pytest.raises(SingletonConfigError, match="limit"):
        SingletonConfig(key="k", limit=limit)


@pytest.mark.parametrize("depth", [-1, -10, 1.5, "3", True])
def test_max_queue_depth_must_be_none_or_a_non_negative_int(depth: Any) -> None:
    with pytest.raises(SingletonConfigError, match="max_queue_depth"):
        SingletonConfig(key="k", max_queue_depth=depth)


def test_valid_numbers_are_accepted() -> None:
    assert SingletonConfig(key="k", limit=3, max_queue_depth=0).max_queue_depth == 0
    assert SingletonConfig(key="k").limit == 1 and SingletonConfig(key="k").max_queue_depth is None
    assert SingletonConfig(key="k", orphan_timeout=DISABLED).orphan_timeout is DISABLED


@pytest.mark.parametrize("key", [42, None, b"store:{id}", ["k"], 1.0])
def test_key_must_be_a_template_or_a_callable(key: Any) -> None:
    with pytest.raises(SingletonConfigError, match="key"):
        SingletonConfig(key=key)


@pytest.mark.parametrize("template", ["", "store:{", "store:}", "{0}", "{}"])
def test_malformed_or_positional_templates(template: str) -> None:
    with pytest.raises(SingletonConfigError):
        SingletonConfig(key=template)


@pytest.mark.parametrize(
    "field, value",
    [("scope", ""), ("scope", 3), ("lease", 0), ("lease", -1.0), ("lease", True), ("orphan_timeout", -5)],
)
def test_other_fields(field: str, value: Any) -> None:
    with pytest.raises(SingletonConfigError, match=field):
        SingletonConfig(key="k", **{field: value})


def test_dict_form_names_the_task() -> None:
    with pytest.raises(SingletonConfigError, match=r"tasks\.sync.*unknown.*'lmit'"):
        SingletonConfig.coerce({"key": "k", "lmit": 2}, task_name="tasks.sync")
    with pytest.raises(SingletonConfigError, match=r"tasks\.sync.*key"):
        SingletonConfig.coerce({"limit": 2}, task_name="tasks.sync")
    with pytest.raises(SingletonConfigError, match=r"tasks\.sync.*limit"):
        SingletonConfig.coerce({"key": "k", "limit": 0}, task_name="tasks.sync")
    with pytest.raises(SingletonConfigError, match=r"tasks\.sync"):
        SingletonConfig.coerce("store:{id}", task_name="tasks.sync")
    config = SingletonConfig(key="k")
    assert SingletonConfig.coerce(config, task_name="t") is config
    assert SingletonConfig.coerce({"key": "k", "limit": 2}, task_name="t").limit == 2


@pytest.mark.parametrize("on_full", ["Replace", "Drop", "", None, True, 0])
def test_on_full_is_raise_drop_or_replace_and_a_bad_value_names_the_task(on_full: Any) -> None:
    with pytest.raises(SingletonConfigError, match=rf"tasks\.sync: singleton on_full .* got {on_full!r}"):
        SingletonConfig.coerce({"key": "k", "max_queue_depth": 1, "on_full": on_full}, task_name="tasks.sync")
    with pytest.raises(SingletonConfigError, match=rf"bad_on_full: singleton on_full .* got {on_full!r}"):

        @singleton(key="k", max_queue_depth=1, on_full=on_full)
        def bad_on_full() -> None: ...


def test_on_full_defaults_to_raise_and_drop_needs_a_max_queue_depth() -> None:
    assert SingletonConfig(key="k").on_full == "raise"
    assert SingletonConfig(key="k", max_queue_depth=0, on_full="drop").on_full == "drop"
    with pytest.raises(SingletonConfigError, match=r"tasks\.sync: .*on_full='drop' needs a max_queue_depth"):
        SingletonConfig.coerce({"key": "k", "on_full": "drop"}, task_name="tasks.sync")


def test_replace_needs_a_max_queue_depth_of_one_or_more() -> None:
    assert SingletonConfig(key="k", max_queue_depth=1, on_full="replace").on_full == "replace"
    with pytest.raises(
        SingletonConfigError, match=r"tasks\.sync: .*on_full='replace' needs a max_queue_depth"
    ):
        SingletonConfig.coerce({"key": "k", "on_full": "replace"}, task_name="tasks.sync")
    with pytest.raises(
        SingletonConfigError,
        match=r"tasks\.sync: .*on_full='replace' with max_queue_depth=0: there is never a waiter to replace; "
        r"use on_full='drop'",
    ):
        SingletonConfig.coerce(
            {"key": "k", "max_queue_depth": 0, "on_full": "replace"}, task_name="tasks.sync"
        )
    with pytest.raises(
        SingletonConfigError, match=r"replace_nothing: .*on_full='replace' with max_queue_depth=0"
    ):

        @singleton(key="k", max_queue_depth=0, on_full="replace")
        def replace_nothing() -> None: ...


# ---------------------------------------------------------------------------- templates at declaration


def sync_inventory(store_id: int, region: str = "eu", *, dry_run: bool = False) -> None:
    """A task's own function."""


def bind(key: Any, function: Callable[..., Any] = sync_inventory, name: str = "tasks.sync") -> BoundSingleton:
    signature = inspect.signature(function)
    return BoundSingleton.bind(SingletonConfig(key=key), task_name=name, signature=signature)


def test_template_naming_a_missing_argument_fails_at_declaration() -> None:
    with pytest.raises(SingletonConfigError, match=r"tasks\.sync.*'shop_id'"):
        bind("store:{shop_id}")
    with pytest.raises(SingletonConfigError, match="shop_id"):

        @singleton(key="store:{shop_id}")
        def task(store_id: int) -> None: ...


def test_template_may_use_attributes_items_and_kwargs() -> None:
    assert bind("{store_id.real}").derive_key((7,), {}) == "7"
    assert bind("{region[0]}-{dry_run}").derive_key((1,), {"dry_run": True}) == "e-True"

    def anything(**kwargs: Any) -> None: ...

    assert bind("{whatever}", anything).derive_key((), {"whatever": "x"}) == "x"


def test_template_is_filled_with_defaults_applied() -> None:
    bound = bind("store:{store_id}:{region}:{dry_run}")
    assert bound.derive_key((7,), {}) == "store:7:eu:False"
    assert bound.derive_key((), {"store_id": 7, "region": "us"}) == "store:7:us:False"
    assert bound.derive_key((7, "ap"), {"dry_run": True}) == "store:7:ap:True"


def test_decorator_on_a_plain_function() -> None:
    @singleton(key="store:{store_id}", limit=2, max_queue_depth=3)
    def task(store_id: int, region: str = "eu") -> None: ...

    bound = task.__singleton__  # type: ignore[attr-defined]
    assert isinstance(bound, BoundSingleton)
    assert bound.config.limit == 2 and bound.config.max_queue_depth == 3
    assert bound.scope == bound.task_name and bound.task_name.endswith("task")
    assert bound.derive_key((5,), {}) == "store:5"
    with pytest.raises(SingletonConfigError, match=r"other_task: singleton limit .* got 0"):

        @singleton(key="k", limit=0)
        def other_task() -> None: ...

    with pytest.raises(SingletonConfigError, match=r"third_task: .*max_queue_depth.* got -1"):

        @singleton(key="k", max_queue_depth=-1)
        def third_task() -> None: ...

    with pytest.raises(SingletonConfigError, match="cannot handle"):
        singleton(key="k")(42)


def test_arguments_that_do_not_fit_the_signature() -> None:
    with pytest.raises(SingletonKeyError, match=r"tasks\.sync") as caught:
        bind("store:{store_id}").derive_key((), {})  # store_id missing
    assert isinstance(caught.value.__cause__, TypeError)


# ---------------------------------------------------------------------------- key functions at run time


def test_key_function_that_raises_is_chained() -> None:
    class Boom(Exception):
        pass

    def key(store_id: int, **_: Any) -> str:
        raise Boom("no such store 7")

    with pytest.raises(SingletonKeyError, match=r"tasks\.sync.*Boom.*no such store 7") as caught:
        bind(key).derive_key((7,), {})
    assert isinstance(caught.value.__cause__, Boom)
    assert isinstance(caught.value, SingletonError) and isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "value, shown",
    [
        (None, "None"),
        ("", "''"),
        (b"store:7", "b'store:7'"),
        (7, "7"),
        (["store", 7], "['store', 7]"),
        ("x" * (MAX_KEY_LENGTH + 1), "513"),
        ("é" * (MAX_KEY_LENGTH + 1), "513"),
    ],
)
def test_key_function_returning_an_unusable_key(value: object, shown: str) -> None:
    with pytest.raises(SingletonKeyError) as caught:
        bind(lambda *a, **k: value).derive_key((7,), {})
    message = str(caught.value)
    assert "tasks.sync" in message and shown in message, message


def test_template_yielding_an_unusable_key() -> None:
    with pytest.raises(SingletonKeyError, match=r"tasks\.sync.*empty"):
        bind("{region}").derive_key((7, ""), {})
    with pytest.raises(SingletonKeyError, match=r"tasks\.sync.*513"):
        bind("{region}").derive_key((7, "y" * 513), {})


def test_keys_up_to_512_characters_are_fine() -> None:
    assert bind(lambda *a, **k: "x" * MAX_KEY_LENGTH).derive_key((7,), {}) == "x" * 512
    assert bind("{region}").derive_key((7, "🦄" * 512), {}) == "🦄" * 512


#: What os.listdir() gives for a file name that is not UTF-8: no store can hold it.
UNSTORABLE = "report-\udcff.csv"


def test_a_key_utf_8_cannot_encode_is_refused_naming_the_task_and_the_key() -> None:
    for bound, args in ((bind("{region}"), (7, UNSTORABLE)), (bind(lambda *a, **k: UNSTORABLE), (7,))):
        with pytest.raises(SingletonKeyError) as caught:
            bound.derive_key(args, {})
        message = str(caught.value)
        assert "tasks.sync" in message and repr(UNSTORABLE) in message and "position 7" in message


def test_a_scope_utf_8_cannot_encode_is_refused_at_declaration() -> None:
    with pytest.raises(SingletonConfigError, match=r"scope 'tasks\\udcff'"):
        SingletonConfig(key="k", scope="tasks\udcff")
    with pytest.raises(SingletonConfigError, match=r"^tasks\.sync: singleton scope"):
        SingletonConfig.coerce({"key": "k", "scope": "\udcff"}, task_name="tasks.sync")
    # Without a scope the task's name is the scope: it must be storable too.
    with pytest.raises(SingletonConfigError, match=r"the task's name, its singleton scope"):
        BoundSingleton.bind(SingletonConfig(key="k"), task_name="tasks.\udcff", signature=None)


def test_a_namespace_utf_8_cannot_encode_is_refused() -> None:
    with pytest.raises(SingletonConfigError, match=r"namespace 'ns\\udcff'"):
        store_from_url("memory://", namespace="ns\udcff")


def test_an_unstorable_key_is_refused_alike_on_every_store(store_factory: StoreFactory) -> None:
    """Derived before any store is called: SQLite and PostgreSQL would raise an untyped
    UnicodeEncodeError, memory and Redis would store it."""
    store = store_factory()
    gatekeeper = Gatekeeper(store)
    for bound in (bind("{region}"), bind(lambda store_id, region="eu", dry_run=False: region)):
        with pytest.raises(SingletonKeyError, match=r"tasks\.sync.*report-\\udcff\.csv"):
            gatekeeper.register(bound, gatekeeper.spec(bound, "r1", (7, UNSTORABLE), {}))
    assert store.snapshot() == []


def test_key_function_gets_the_tasks_own_arguments() -> None:
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def key(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "k"

    bind(key).derive_key((7,), {"dry_run": True})
    assert seen == [((7,), {"dry_run": True})]  # no defaults injected, nothing reordered


# ---------------------------------------------------------------------------- store URLs


KNOWN = ["memory", "postgresql", "redis", "redis+cluster", "redis+sentinel", "sqlite"]


@pytest.mark.parametrize("url", ["nosuch://host/db", "mysql://u@h/db", "http://127.0.0.1/"])
def test_unknown_scheme_lists_the_known_ones(url: str) -> None:
    with pytest.raises(SingletonConfigError) as caught:
        store_from_url(url)
    assert all(scheme in str(caught.value) for scheme in KNOWN), caught.value
    tls = {"rediss", "rediss+cluster", "rediss+sentinel"}
    assert sorted(store_classes()) == sorted({*KNOWN, "postgres", *tls})


def test_each_scheme_is_served_by_the_class_that_declares_it() -> None:
    for scheme, store_class in store_classes().items():
        assert scheme in store_class.schemes, (scheme, store_class)


def test_a_memory_store_imports_no_driver() -> None:
    """The scheme lookup stops at the class serving it: memory:// imports neither redis-py nor psycopg."""
    code = (
        "import sys\n"
        "from singleton_tasks import store_from_url\n"
        "store_from_url('memory://lookup')\n"
        "print(sorted(m for m in ('redis', 'psycopg', 'psycopg_pool') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("url", ["", "redis", "127.0.0.1:6379", "redis:/127.0.0.1", "://nothing"])
def test_malformed_url_lists_the_known_schemes(url: str) -> None:
    with pytest.raises(SingletonConfigError) as caught:
        store_from_url(url)
    assert all(scheme in str(caught.value) for scheme in KNOWN), caught.value


def test_non_str_url() -> None:
    with pytest.raises(SingletonConfigError):
        store_from_url(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "option"),
    [("sqlite:///x.db", "bogus"), ("memory://", "busy_timeout"), ("postgresql://u:secret@h/db", "nope")],
)
def test_unknown_store_option_names_it_and_hides_the_password(url: str, option: str) -> None:
    with pytest.raises(SingletonConfigError, match=option) as caught:
        store_from_url(url, **{option: 1})
    assert "secret" not in str(caught.value)


SECRET_URLS = [
    "redis://u:secret@127.0.0.1:1/0",
    "redis://:secret@127.0.0.1:1/0",
    "rediss://u:secret@127.0.0.1:1/0",
    "postgresql://u:secret@127.0.0.1:1/test",
    "postgresql://u:secret@127.0.0.1:1/test?password=secret",
    "nosuch://u:secret@127.0.0.1:1/0",
    "redis//u:secret@127.0.0.1:1/0",  # typos: not URLs at all, still no password shown
    "redis:/u:secret@127.0.0.1:1/0",
    "u:secret@127.0.0.1:1",
    "redis://u:secret@[::1/0",
    "redis://u:secret@127.0.0.1:notaport/0",
]


def store_or_error(url: str, **options: Any) -> tuple[Any, str]:
    """The store (and its repr) or the configuration error's text."""
    try:
        store = store_from_url(url, **options)
    except SingletonConfigError as error:
        return None, f"{error} {error!r} {error.__cause__!r}"
    return store, repr(store) + " " + str(store.url)


@pytest.mark.parametrize("url", SECRET_URLS)
def test_password_never_shown(url: str) -> None:
    store, text = store_or_error(url, **({"timeout": 1.0} if url.startswith("postgresql") else {}))
    assert "secret" not in text, text
    if store is None:
        return
    with pytest.raises(StoreUnavailableError) as caught:
        store.register(RunSpec("s", "k", "r"))
    store.close()
    error = caught.value
    for shown in (str(error), repr(error), str(error.__cause__), repr(error.__cause__)):
        assert "secret" not in shown, shown


@pytest.mark.parametrize(
    "url, options",
    [
        ("redis://127.0.0.1:1/0", {}),
        # Waits out the pool's timeout twice (two operations): 2 s of real time.
        pytest.param("postgresql://127.0.0.1:1/test", {"timeout": 1.0}, marks=pytest.mark.slow),
        ("sqlite:////nonexistent-dir/sub/singleton.db", {}),
    ],
)
def test_unreachable_store_fails_the_first_operation_chained(url: str, options: dict[str, Any]) -> None:
    store = store_from_url(url, **options)  # connecting is lazy: declaring a worker does not fail
    try:
        with pytest.raises(StoreUnavailableError) as caught:
            store.register(RunSpec("s", "k", "r"))
        assert caught.value.__cause__ is not None
        assert not isinstance(caught.value.__cause__, SingletonError)  # the driver's own error
        with pytest.raises(StoreUnavailableError):
            store.schema_version()
    finally:
        store.close()


# ---------------------------------------------------------------------------- ?retention= in store URLs

#: A URL of each scheme whose store is made without connecting (the cluster's client connects).
UNCONNECTED_URLS = [
    "memory://retention",
    "sqlite:///retention.db",
    "postgresql://u:secret@127.0.0.1:1/test",
    "postgres://u:secret@127.0.0.1:1/test?connect_timeout=3",
    "redis://u:secret@127.0.0.1:1/0",
    "rediss://u:secret@127.0.0.1:1/0?socket_timeout=2",
    "redis+sentinel://u:secret@127.0.0.1:1/service",
    "rediss+sentinel://u:secret@127.0.0.1:1/service/2",
]
CLUSTER_URLS = ["redis+cluster://u:secret@127.0.0.1:1", "rediss+cluster://127.0.0.1:1,127.0.0.1:2"]


def with_query(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


@pytest.mark.parametrize("url", UNCONNECTED_URLS)
def test_every_scheme_takes_retention_in_its_url(url: str, tmp_path: Path) -> None:
    url = with_query(url.replace("retention.db", str(tmp_path / "retention.db")), "retention=3.5")
    check_store_url(url)
    store = store_from_url(url)
    try:
        assert store.retention == 3.5
    finally:
        store.close()


@pytest.mark.parametrize("url", CLUSTER_URLS)
def test_the_cluster_schemes_take_retention_in_their_url(url: str) -> None:
    check_store_url(with_query(url, "retention=3.5"))  # a live cluster: tests/test_redis_cluster.py


@pytest.mark.parametrize("value", ["0", "-1", "abc", "", "inf", "nan", "1e400"])
@pytest.mark.parametrize("url", [*UNCONNECTED_URLS, *CLUSTER_URLS])
def test_a_bad_retention_in_any_url_is_refused_naming_it(url: str, value: str) -> None:
    url = with_query(url, f"retention={value}")
    for check in (check_store_url, store_from_url):
        with pytest.raises(SingletonConfigError, match="retention") as caught:
            check(url)  # the cluster's is refused before its client connects
        assert repr(value) in str(caught.value) and "secret" not in str(caught.value)


def test_retention_given_twice_in_a_url_is_refused() -> None:
    with pytest.raises(SingletonConfigError, match=r"retention= is given 2 times"):
        store_from_url("redis://127.0.0.1:1/0?retention=5&retention=5")


@pytest.mark.parametrize("url", ["memory://both", "redis://127.0.0.1:1/0?socket_timeout=1"])
def test_retention_as_a_keyword_and_in_the_url_must_agree(url: str) -> None:
    assert store_from_url(with_query(url, "retention=60"), retention=60.0).retention == 60.0
    with pytest.raises(SingletonConfigError, match="given twice") as caught:
        store_from_url(with_query(url, "retention=60"), retention=30)
    assert "30" in str(caught.value) and "60" in str(caught.value)


def test_the_other_url_options_still_reach_the_sqlite_file(tmp_path: Path) -> None:
    store = store_from_url(f"sqlite:///{tmp_path / 'kept.db'}?retention=7")
    try:
        store.migrate()
        store.register(RunSpec("s", "k", "r"))
        assert sorted(path.name for path in tmp_path.iterdir())[0] == "kept.db"
        assert [snap.key for snap in store.snapshot()] == ["k"]
    finally:
        store.close()


@pytest.mark.parametrize(
    "url",
    [
        pytest.param(with_query(POSTGRES_URL, "application_name=kept"), marks=pytest.mark.postgres),
        pytest.param(with_query(REDIS_URL, "client_name=kept"), marks=pytest.mark.redis),
    ],
)
def test_the_other_url_options_still_reach_the_server(url: str) -> None:
    require_server(url, url.partition(":")[0])
    store = store_from_url(with_query(url, "retention=7"), namespace=f"r{uuid.uuid4().hex[:8]}")
    try:
        assert store.retention == 7.0
        store.time()  # a call on the server: it took the URL
        if url.startswith("redis"):
            assert store._thread_client().client_getname() in ("kept", b"kept")  # type: ignore[attr-defined]
        else:
            with store._get_pool().connection() as connection:  # type: ignore[attr-defined]
                assert connection.info.parameter_status("application_name") in ("kept", b"kept")
    finally:
        store.close()


# ---------------------------------------------------------------------------- timeouts

REDIS_URLS = [
    "redis://u:secret@127.0.0.1:1/0",
    "redis+sentinel://u:secret@127.0.0.1:1/service",
    "redis+cluster://u:secret@127.0.0.1:1",  # refused before its client connects
]
#: Timeouts that make every call fail: 0 at once, the others at every connect.
FAILING_TIMEOUTS = [0, 0.0, -1, float("nan"), float("inf"), 1e300, "5", True]


@pytest.mark.parametrize("value", FAILING_TIMEOUTS, ids=repr)
@pytest.mark.parametrize("option", ["socket_timeout", "socket_connect_timeout"])
@pytest.mark.parametrize("url", REDIS_URLS)
def test_a_redis_timeout_that_fails_every_call_is_refused(url: str, option: str, value: object) -> None:
    with pytest.raises(SingletonConfigError, match=option) as caught:
        store_from_url(url, **{option: value})
    assert repr(value) in str(caught.value) and "secret" not in str(caught.value)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e300"])
@pytest.mark.parametrize("option", ["socket_timeout", "socket_connect_timeout"])
@pytest.mark.parametrize("url", REDIS_URLS)
def test_a_redis_timeout_in_the_url_that_fails_every_call_is_refused(
    url: str, option: str, value: str
) -> None:
    url = with_query(url, f"{option}={value}")
    for check in (check_store_url, store_from_url):
        with pytest.raises(SingletonConfigError, match=option) as caught:
            check(url)
        assert repr(float(value)) in str(caught.value) and "secret" not in str(caught.value)


@pytest.mark.parametrize("option", ["socket_timeout", "socket_connect_timeout"])
def test_a_sentinel_timeout_that_fails_every_call_is_refused(option: str) -> None:
    with pytest.raises(SingletonConfigError, match=f"sentinel_kwargs: {option}.*got 0"):
        store_from_url("redis+sentinel://127.0.0.1:1/service", sentinel_kwargs={option: 0})


@pytest.mark.parametrize("url", REDIS_URLS[:2])
def test_usable_redis_timeouts_are_kept(url: str) -> None:
    store = store_from_url(with_query(url, "socket_timeout=2.5"), socket_connect_timeout=None)
    try:
        kwargs = store._client.connection_pool.connection_kwargs  # type: ignore[attr-defined]
        # The URL's timeout, not the store's 5 s default over it (the Sentinel client preferred it).
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (2.5, None)
    finally:
        store.close()


def test_wait_timeout_ms_is_checked_against_a_socket_timeout_in_the_url() -> None:
    with pytest.raises(SingletonConfigError, match=r"wait_timeout_ms=1000 must be shorter.*0\.5s"):
        store_from_url("redis://127.0.0.1:1/0?socket_timeout=0.5&wait_replicas=1")


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "5"], ids=repr)
def test_a_postgres_timeout_that_fails_every_call_is_refused(value: object) -> None:
    with pytest.raises(SingletonConfigError, match="timeout") as caught:
        store_from_url("postgresql://u:secret@127.0.0.1:1/test", timeout=value)
    assert repr(value) in str(caught.value) and "secret" not in str(caught.value)


@pytest.mark.parametrize("value", ["abc", "1e400", "nan", ""])
def test_a_postgres_connect_timeout_that_fails_every_connection_is_refused(value: str) -> None:
    url = f"postgresql://u:secret@127.0.0.1:1/test?connect_timeout={value}"
    for check in (check_store_url, store_from_url):
        with pytest.raises(SingletonConfigError, match="connect_timeout") as caught:
            check(url)
        assert repr(value) in str(caught.value) and "secret" not in str(caught.value)


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "10"])
def test_a_postgres_connect_timeout_psycopg_reads_is_accepted(value: str) -> None:
    """0 or less is psycopg's own default (130 s), not an error: nothing fails because of it."""
    url = f"postgresql://127.0.0.1:1/test?connect_timeout={value}"
    check_store_url(url)
    store_from_url(url).close()


# ---------------------------------------------------------------------------- SingletonQueueFullError


class AdapterQueueFull(SingletonQueueFullError):
    """As an adapter subclasses it (Dramatiq: also a MiddlewareError)."""


def test_queue_full_error_carries_its_facts_and_pickles() -> None:
    error = SingletonQueueFullError(
        task_name="tasks.sync", scope="tasks.sync", key="store:7", limit=1, max_queue_depth=2
    )
    assert (error.task_name, error.scope, error.key, error.limit, error.max_queue_depth) == (
        "tasks.sync",
        "tasks.sync",
        "store:7",
        1,
        2,
    )
    assert "store:7" in str(error) and "limit=1" in str(error) and "max_queue_depth=2" in str(error)
    assert isinstance(error, SingletonError)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        copy = pickle.loads(pickle.dumps(error, protocol=protocol))
        assert type(copy) is SingletonQueueFullError
        assert (copy.task_name, copy.scope, copy.key, copy.limit, copy.max_queue_depth) == (
            "tasks.sync",
            "tasks.sync",
            "store:7",
            1,
            2,
        )
        assert str(copy) == str(error)
    sub = AdapterQueueFull(task_name="t", scope="s", key="k", limit=2, max_queue_depth=None)
    assert pickle.loads(pickle.dumps(sub)).max_queue_depth is None


def _plain(a: Any, b: Any = "B", c: Any = None) -> None: ...


def _keyword_only(a: Any, *, b: Any = "B") -> None: ...


def _var(a: Any, *rest: Any, **more: Any) -> None: ...


@pytest.mark.parametrize("fn", [_plain, _keyword_only, _var])
@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((), {}),
        ((1,), {}),
        ((1, 2), {}),
        ((1, 2, 3), {}),
        ((1, 2, 3, 4), {}),
        ((1,), {"c": 3}),
        ((), {"a": 1}),
    ],
)
def test_key_arguments_bind_as_signature_bind_does(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    # Plain signatures take a faster path than Signature.bind: same mapping, same errors.
    signature = inspect.signature(fn)
    bound = BoundSingleton.bind(SingletonConfig(key="{a}"), task_name="t", signature=signature)
    try:
        reference = signature.bind(*args, **kwargs)
    except TypeError as error:
        with pytest.raises(TypeError, match=str(error).split("'")[0]):
            bound._bound_arguments(args, kwargs)
        return
    reference.apply_defaults()
    expected = dict(reference.arguments)
    expected.update(expected.pop("more", {}))
    assert bound._bound_arguments(args, kwargs) == expected


@pytest.mark.parametrize(
    ("url", "secrets"),
    [
        ("redis://:hunter22@127.0.0.1:6379/0", ["hunter22"]),
        ("postgresql://bob@db/app?password=hunter22", ["hunter22"]),  # libpq's query form
        ("redis://:p%40ss@127.0.0.1/0", ["p%40ss", "p@ss"]),  # as written and as a driver decodes it
    ],
)
def test_a_drivers_message_shows_no_password_of_the_url(url: str, secrets: list[str]) -> None:
    message = f"cannot connect to {url}: " + ", ".join(f"auth {secret} refused" for secret in secrets)
    scrubbed = scrub_secrets(message, url)
    assert not any(secret in scrubbed for secret in secrets), scrubbed
    assert redact_url(url) in scrubbed and "***" in scrubbed
