"""django_dramatiq settings for singleton-tasks (copy into your Django settings module).

django_dramatiq builds each ``MIDDLEWARE`` entry from its dotted path with no arguments, or
takes a middleware object as it is. Either works:

- the dotted path: ``SingletonMiddleware()`` reads its store from ``SINGLETON_TASKS_STORE``;
- an object, when you want other options (``retry_delay``, ``lease``, ``orphan_timeout``, ...).

Order does not matter relative to ``Retries``: the middleware tells a retry from a final
failure by itself.
"""

import os

from singleton_tasks.dramatiq import SingletonMiddleware

os.environ.setdefault("SINGLETON_TASKS_STORE", "redis://localhost:6379/1")

DRAMATIQ_BROKER = {
    "BROKER": "dramatiq.brokers.redis.RedisBroker",
    "OPTIONS": {"url": "redis://localhost:6379/0"},
    "MIDDLEWARE": [
        "dramatiq.middleware.AgeLimit",
        "dramatiq.middleware.TimeLimit",
        "dramatiq.middleware.Callbacks",
        "dramatiq.middleware.Retries",
        "django_dramatiq.middleware.DbConnectionsMiddleware",
        # Either the dotted path (store from SINGLETON_TASKS_STORE) ...
        #   "singleton_tasks.dramatiq.SingletonMiddleware",
        # ... or an object with keyword arguments:
        SingletonMiddleware(store=os.environ["SINGLETON_TASKS_STORE"], retry_delay=1.0, lease=60.0),
    ],
}
