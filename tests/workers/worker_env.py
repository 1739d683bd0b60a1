"""What the real-worker test modules share: the servers they need and a fresh namespace per app."""

from __future__ import annotations

import os
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from conftest import BROKER_REDIS_URL, POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_server
from prometheus_client.parser import text_string_to_metric_families
from test_docs_snippets import DOCS, snippets

from singleton_tasks import store_from_url

#: The apps' bodies log to this Redis database (it outlives killed workers).
LOG_URL = os.environ.get("SINGLETON_TEST_LOG_REDIS_URL", "redis://127.0.0.1:6379/13")
BROKERS = {"redis": BROKER_REDIS_URL, "rabbitmq": RABBITMQ_URL}
STORES = {"redis": REDIS_URL, "postgres": POSTGRES_URL}


def brokers() -> list[str]:
    chosen = os.environ.get("SINGLETON_TEST_BROKER")  # tox runs one broker per environment
    return [chosen] if chosen else list(BROKERS)


def fresh_namespace(broker: str, store: str, prefix: str) -> str:
    """Require the broker, store and log servers; a new store namespace (migrated on PostgreSQL)."""
    require_server(BROKERS[broker], "RabbitMQ" if broker == "rabbitmq" else "Redis")
    require_server(STORES[store], "PostgreSQL" if store == "postgres" else "Redis")
    require_server(LOG_URL, "Redis")
    namespace = f"{prefix}{uuid.uuid4().hex[:10]}"
    if store == "postgres":
        migrated = store_from_url(STORES[store], namespace=namespace)
        migrated.migrate()
        migrated.close()
    return namespace


def metrics_setup(name: str, folder: Path, replace: tuple[str, str] | None = None) -> Path:
    """The metrics snippet ``name`` of docs/operations.md as a file a worker app runs; ``replace``
    swaps one literal of the text (a port) for the test's own."""
    code = snippets(DOCS / "operations.md")[name]
    if replace is not None:
        assert replace[0] in code, f"the snippet {name} no longer contains {replace[0]!r}"
        code = code.replace(*replace)
    path = folder / "metrics_setup.py"
    path.write_text(code)
    return path


def scraped(port: int, name: str, **labels: str) -> float | None:
    """One sample served at http://127.0.0.1:``port``/metrics; None when absent or nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def assert_waits_timed_from_send(
    waited: float | None, runs: list[dict[str, Any]], sent_by: dict[str, float]
) -> None:
    """``waited`` (the wait_seconds sum) covers how long m1 and m2 waited behind the run before
    them: each was admitted after that run ended, and sent before ``sent_by`` its label."""
    ended = {run["label"]: run["end"] for run in runs}
    least = sum(ended[before] - sent_by[after] for before, after in (("m0", "m1"), ("m1", "m2")))
    assert least > 0.5  # the two waited about 0.3 s and 0.6 s
    assert waited is not None and waited >= least
