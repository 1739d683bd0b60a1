"""``singleton-tasks web``: the lanes, live in a browser (docs/web.md).

Installed by the ``web`` extra (Starlette and uvicorn): ``pip install 'singleton-tasks[web]'``.
:func:`create_app` is the ASGI application; :mod:`.lanes` its data, ``inspect``'s document
read once per interval for every open page.
"""

from __future__ import annotations

from .._extras import missing

try:
    from .app import create_app
except ImportError as error:  # pragma: no cover - exercised in tests/test_extras.py's bare venv
    raise missing("singleton-tasks web", "Starlette", "web", error) from None

__all__ = ["create_app"]
