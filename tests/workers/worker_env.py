"""What the real-worker test modules share: the servers they need and a fresh namespace per app."""

from __future__ import annotations

import os
import uuid

from conftest import BROKER_REDIS_URL, POSTGRES_URL, RABBITMQ_URL, REDIS_URL, require_server

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
