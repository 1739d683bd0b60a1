"""What the running body can learn about its own admission (docs/concepts.md#the-life-of-a-run)."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Admission:
    """The slot a running body holds: downstream systems fence writes by ``token``."""

    run_id: str
    scope: str
    key: str
    token: int


_current: contextvars.ContextVar[Admission | None] = contextvars.ContextVar(
    "singleton_tasks_admission", default=None
)


def current_admission() -> Admission | None:
    """The admission of the singleton body running in this context, or None."""
    return _current.get()


@contextmanager
def admitted(admission: Admission) -> Iterator[Admission]:
    """Make ``admission`` visible to ``current_admission()`` for the body's duration."""
    reset = _current.set(admission)
    try:
        yield admission
    finally:
        _current.reset(reset)


def enter(admission: Admission | None) -> contextvars.Token[Admission | None]:
    """Set the admission for hook-based adapters whose start and end are separate calls."""
    return _current.set(admission)


def leave(token: contextvars.Token[Admission | None]) -> None:
    """Undo :func:`enter`."""
    _current.reset(token)
