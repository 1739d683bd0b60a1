"""Celery adapter: :class:`SingletonTask` and :func:`install` (docs/concepts.md).

Only what is Celery-specific lives here; the rules are the store's (``gate.py``) and the
shared worker logic is :class:`singleton_tasks.runtime.Gatekeeper`'s. The adapter's parts:

- :mod:`._install`: ``install``, the worker's bootsteps and the signal connections;
- :mod:`._task`: ``SingletonTask`` (enqueue: register before publishing; gate: ``before_start``);
- :mod:`._settle`: the signal receivers that settle a run when its delivery ends;
- :mod:`._payload`: the run's signature as the JSON the store keeps, and the wakes published from it;
- :mod:`._declaration`: tasks declared a singleton without ``base=SingletonTask``, and ``@singleton``;
- :mod:`._gatekeeper`: each app's :class:`~singleton_tasks.runtime.Gatekeeper`;
- :mod:`._internals`: what the adapter needs of Celery's internals, each item pinned by a test.
"""

from __future__ import annotations

from .._extras import missing

try:
    import celery  # noqa: F401 - the first import of the extra names it when missing
except ImportError as error:
    raise missing("singleton_tasks.celery", "Celery", "celery", error) from error

from ._gatekeeper import gatekeeper_for
from ._install import connect_signals, install
from ._payload import GENERATION_HEADER
from ._task import SingletonTask

__all__ = ["GENERATION_HEADER", "SingletonTask", "gatekeeper_for", "install"]

connect_signals()  # SingletonTask works without install(): the app.conf / env / default store
