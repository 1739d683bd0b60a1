"""``redis+sentinel://`` URLs (issue 18): bad ones are typed errors naming the URL, password redacted,
and nothing is written or published; no sentinel is needed for these (the failover itself:
tests/workers/test_sentinel.py)."""

from __future__ import annotations

import time
import uuid

import pytest
from dramatiq.middleware import MiddlewareError
from test_bad_stores import _dramatiq_send

from singleton_tasks import SingletonConfigError, StoreUnavailableError, store_from_url
from singleton_tasks.stores import check_store_url
from singleton_tasks.stores.redis_sentinel import parse_sentinel_url

BAD = {
    "no-service": ("redis+sentinel://:s3cret@127.0.0.1:26379", "no service name"),
    "no-service-slash": ("redis+sentinel://:s3cret@127.0.0.1:26379/", "no service name"),
    "bad-port": ("redis+sentinel://:s3cret@127.0.0.1:26x79/mymaster", "'127.0.0.1:26x79' is not host:port"),
    "empty-host": ("redis+sentinel://:s3cret@127.0.0.1:26379,/mymaster", "'' is not host:port"),
    "bad-db": ("redis+sentinel://:s3cret@127.0.0.1:26379/mymaster/zero", "/service_name or /service_name/db"),
    "bad-wait": (
        "redis+sentinel://:s3cret@127.0.0.1:26379/mymaster?wait_replicas=0",
        "wait_replicas must be",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_sentinel_url_is_refused_by_name_without_its_password(case: str) -> None:
    url, what = BAD[case]
    for refuse in (check_store_url, store_from_url):
        with pytest.raises(SingletonConfigError) as raised:
            refuse(url)
        assert what in str(raised.value), raised.value
        assert "s3cret" not in str(raised.value) and "***" in str(raised.value)


def test_a_sentinel_url_names_its_sentinels_service_and_database() -> None:
    address = parse_sentinel_url("rediss+sentinel://app:s%3Acret@a:1,b,[::1]:3/cache/2?socket_timeout=2")
    assert address.sentinels == (("a", 1), ("b", 26379), ("::1", 3))
    assert address.service_name == "cache" and address.tls
    assert address.node_url == "redis://app:s%3Acret@a/2?socket_timeout=2"
    store = store_from_url("redis+sentinel://:s3cret@127.0.0.1:1/cache/2?socket_timeout=2")
    assert "s3cret" not in repr(store)
    store.close()


def test_unreachable_sentinels_fail_the_first_send_and_publish_nothing() -> None:
    url = "redis+sentinel://:s3cret@127.0.0.1:1,127.0.0.1:2/mymaster"
    send, held = _dramatiq_send(url, f"sn{uuid.uuid4().hex[:10]}")
    for _attempt in range(2):
        started = time.monotonic()
        with pytest.raises(StoreUnavailableError) as raised:
            send()
        assert time.monotonic() - started < 5.0
        assert isinstance(raised.value, MiddlewareError)
        message = str(raised.value)
        assert "mymaster" in message and "127.0.0.1:1,127.0.0.1:2" in message and "s3cret" not in message
        assert held() == 0
