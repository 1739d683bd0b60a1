"""Prometheus metrics of the gate (docs/operations.md#metrics), behind the optional ``metrics`` extra.

The adapters report events through the module-level hooks (``observe_*``); each hook is a
no-op when ``prometheus_client`` is not installed or metrics are disabled, so calling them
costs nothing to users without the extra.

Which registry:

- By default the metrics are created, on the first event, in ``prometheus_client.REGISTRY``
  (what ``start_http_server`` / ``make_wsgi_app`` expose) of the process the event happens in:
  rejections and dropped sends in the process that sends, the rest in the worker.
- :func:`install` picks another registry or prefixes the names; call it before the process
  counts its first event.
- Dramatiq's ``Prometheus`` middleware runs ``prometheus_client`` in multiprocess mode and
  exposes whatever every worker process writes to its ``PROMETHEUS_MULTIPROC_DIR``. The metrics
  here join that exposition as long as they are created after the middleware set the
  directory in ``after_process_boot``: that is why they are created lazily, on the first event,
  and why this module imports ``prometheus_client`` only then (it picks its multiprocess mode
  at import time). A Celery prefork worker uses the same mode, the directory set before it starts.

Metric names (label ``task``: the Dramatiq actor / Celery task name):

==========================================  ===================================================
``singleton_tasks_admitted_total``          deliveries admitted to a slot (body ran)
``singleton_tasks_gated_total``             deliveries denied and deferred (waiting in line)
``singleton_tasks_woken_total``             wake copies published to gated waiters
``singleton_tasks_released_total``          runs settled that freed a slot or place in line
``singleton_tasks_rejected_total``          enqueues refused with ``SingletonQueueFullError``
``singleton_tasks_dropped_total``           sends dropped by ``on_full="drop"``: their key was
                                            full, nothing was published
``singleton_tasks_replaced_total``          runs replaced in line by a newer send
                                            (``on_full="replace"``): they never run
``singleton_tasks_evicted_total``           orphaned holders evicted (labelled with the task
                                            whose store call evicted them: same scope)
``singleton_tasks_taken_over_total``        admissions over a holder whose lease lapsed
``singleton_tasks_wait_seconds``            histogram: send (enqueue) → admission
``singleton_tasks_handoff_seconds``         histogram: a holder's release (the wake publish
                                            that follows it) → admission of the woken run
==========================================  ===================================================
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from ._extras import missing
from .outcomes import ClaimOutcome, Decision, ReleaseOutcome

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
HANDOFF_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _require_prometheus() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError as error:
        raise missing("singleton_tasks.metrics", "prometheus_client", "metrics", error) from error


class SingletonMetrics:
    """The counters and histograms, registered in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None, *, prefix: str = "singleton_tasks") -> None:
        _require_prometheus()
        from prometheus_client import REGISTRY, Counter, Histogram

        reg = REGISTRY if registry is None else registry
        self.registry = reg

        def counter(name: str, doc: str) -> Any:
            return Counter(f"{prefix}_{name}", doc, ["task"], registry=reg)

        self.admitted = counter("admitted", "Singleton deliveries admitted to a slot.")
        self.gated = counter("gated", "Singleton deliveries denied and deferred while their key is busy.")
        self.woken = counter("woken", "Wake copies published to gated waiters that now own a slot.")
        self.released = counter("released", "Singleton runs settled, freeing their slot or place in line.")
        self.rejected = counter("rejected", "Singleton enqueues rejected: the key's queue was full.")
        self.dropped = counter(
            "dropped", "Singleton sends dropped (on_full='drop'): the key's queue was full."
        )
        self.replaced = counter(
            "replaced", "Singleton runs replaced in line by a newer send (on_full='replace'): they never run."
        )
        self.evicted = counter("evicted", "Orphaned holders evicted after their lease lapsed.")
        self.taken_over = counter("taken_over", "Admissions that took over a holder whose lease lapsed.")
        self.reissued = counter(
            "reissued", "Waiters issued again from the store: none of their copies showed up in time."
        )
        self.abandoned = counter(
            "abandoned", "Waiters removed: issued again and again, none of their copies reached the store."
        )
        self.wait_time = Histogram(
            f"{prefix}_wait_seconds",
            "Time from a singleton run's send (enqueue) to its admission.",
            ["task"],
            buckets=WAIT_BUCKETS,
            registry=reg,
        )
        self.handoff = Histogram(
            f"{prefix}_handoff_seconds",
            "Time from a holder's release (the wake it published) to the woken run's admission.",
            ["task"],
            buckets=HANDOFF_BUCKETS,
            registry=reg,
        )
        self._children: dict[tuple[int, str], Any] = {}

    def of(self, metric: Any, task: str) -> Any:
        """``metric.labels(task)``, looked up once per task (labels() validates and locks each call)."""
        key = (id(metric), task)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(task)
        return child


_lock = threading.Lock()
_active: SingletonMetrics | None = None
_disabled = False
_by_registry: dict[int, SingletonMetrics] = {}


def install(
    registry: CollectorRegistry | None = None, *, prefix: str = "singleton_tasks"
) -> SingletonMetrics:
    """Create (once per registry) the metrics in ``registry`` and send the hooks' events there.

    Raises ImportError (naming the extra) when ``prometheus_client`` is missing
    (``pip install 'singleton-tasks[metrics]'``).
    """
    global _active, _disabled
    _require_prometheus()
    from prometheus_client import REGISTRY

    reg = REGISTRY if registry is None else registry
    with _lock:
        # A registry refuses the same metric twice: installing again reuses the first set.
        metrics = _by_registry.get(id(reg))
        if metrics is None or metrics.registry is not reg:
            metrics = SingletonMetrics(reg, prefix=prefix)
            _by_registry[id(reg)] = metrics
        _active, _disabled = metrics, False
        return metrics


def disable() -> None:
    """Turn every hook into a no-op (until :func:`install` is called)."""
    global _active, _disabled
    with _lock:
        _active, _disabled = None, True


def active() -> SingletonMetrics | None:
    """The metrics the hooks report to; created in the default registry on first use."""
    global _disabled
    metrics = _active
    if metrics is not None or _disabled:
        return metrics
    try:
        return install()
    except ImportError:
        _disabled = True  # the extra is not installed: stay a no-op, never retry the import
        return None


# -- hooks the adapters call ----------------------------------------------------------------


def observe_admitted(
    task: str,
    *,
    now: float | None = None,
    registered_at: float | None = None,
    woken_at: float | None = None,
    takeover: bool = False,
) -> None:
    """A delivery was admitted; times are epoch seconds of the library clock.

    ``registered_at``: when the run was registered (enqueued) → observes the wait time.
    ``woken_at``: when the wake copy being admitted was published → observes the handoff.
    """
    metrics = active()
    if metrics is None:
        return
    metrics.of(metrics.admitted, task).inc()
    if takeover:
        metrics.of(metrics.taken_over, task).inc()
    if now is not None and registered_at is not None:
        metrics.of(metrics.wait_time, task).observe(max(0.0, now - registered_at))
    if now is not None and woken_at is not None:
        metrics.of(metrics.handoff, task).observe(max(0.0, now - woken_at))


def observe_gated(task: str) -> None:
    """A delivery was denied and deferred (its key has no free slot for it)."""
    metrics = active()
    if metrics is not None:
        metrics.of(metrics.gated, task).inc()


def _add(task: str, count: int, counter: str) -> None:
    """Add ``count`` to the ``counter`` of ``task``; a count of 0 (the usual answer) costs nothing."""
    if count > 0:
        metrics = active()
        if metrics is not None:
            metrics.of(getattr(metrics, counter), task).inc(count)


def observe_woken(task: str, count: int = 1) -> None:
    """``count`` wake copies were published (``task``: the woken message's task)."""
    _add(task, count, "woken")


def observe_released(task: str) -> None:
    """A run settled and freed its slot or its place in line."""
    metrics = active()
    if metrics is not None:
        metrics.of(metrics.released, task).inc()


def observe_rejected(task: str) -> None:
    """An enqueue was refused with ``SingletonQueueFullError``."""
    metrics = active()
    if metrics is not None:
        metrics.of(metrics.rejected, task).inc()


def observe_dropped(task: str) -> None:
    """A send was dropped: its key was full and its task says ``on_full="drop"``."""
    metrics = active()
    if metrics is not None:
        metrics.of(metrics.dropped, task).inc()


def observe_replaced(task: str) -> None:
    """A send took the place in line of the key's newest waiter (``on_full="replace"``)."""
    metrics = active()
    if metrics is not None:
        metrics.of(metrics.replaced, task).inc()


def observe_evicted(task: str, count: int = 1) -> None:
    """``count`` orphaned holders were evicted by a store call made for ``task``."""
    _add(task, count, "evicted")


def observe_reissued(task: str, count: int = 1) -> None:
    """``count`` waiters were issued again by a key's own due work (``task``: their scope)."""
    _add(task, count, "reissued")


def observe_abandoned(task: str, count: int = 1) -> None:
    """``count`` waiters were removed as abandoned (``task``: their task, or their scope)."""
    _add(task, count, "abandoned")


def observe_claim(
    task: str,
    outcome: ClaimOutcome,
    *,
    now: float | None = None,
    registered_at: float | None = None,
    woken_at: float | None = None,
) -> None:
    """Everything a claim outcome counts: admitted / taken over / gated / evicted (not wakes)."""
    if active() is None:
        return
    observe_evicted(task, len(outcome.evicted))
    if outcome.decision is Decision.ADMITTED:
        observe_admitted(
            task, now=now, registered_at=registered_at, woken_at=woken_at, takeover=outcome.takeover
        )
    elif outcome.decision is Decision.GATED:
        observe_gated(task)


def observe_release(task: str, outcome: ReleaseOutcome) -> None:
    """Everything a release outcome counts: released / evicted (not wakes)."""
    if active() is None:
        return
    observe_evicted(task, len(outcome.evicted))
    if outcome.released:
        observe_released(task)


__all__ = [
    "HANDOFF_BUCKETS",
    "WAIT_BUCKETS",
    "SingletonMetrics",
    "active",
    "disable",
    "install",
    "observe_abandoned",
    "observe_admitted",
    "observe_claim",
    "observe_dropped",
    "observe_evicted",
    "observe_gated",
    "observe_reissued",
    "observe_rejected",
    "observe_release",
    "observe_released",
    "observe_replaced",
    "observe_woken",
]
