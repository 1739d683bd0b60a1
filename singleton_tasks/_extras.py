"""Optional dependencies: an import that fails names the extra that installs it."""

from __future__ import annotations


def missing(feature: str, what: str, extra: str, error: ImportError) -> ModuleNotFoundError:
    """The error to raise when ``feature`` cannot import ``what``, installed by ``extra``."""
    return ModuleNotFoundError(
        f"{feature} needs {what}: pip install 'singleton-tasks[{extra}]' ({error})", name=error.name
    )
