"""Every example runs as documented."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, tmp_path: Path, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SINGLETON_TASKS_STORE": f"sqlite:///{tmp_path / 'example.db'}", **env},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow  # runs the example in a child interpreter
def test_dramatiq_example_on_the_embedded_store(tmp_path: Path) -> None:
    out = run_example("dramatiq_sync_inventory.py", tmp_path, SINGLETON_RETRY_DELAY="0.2")
    assert "refused: sync_inventory: the queue of key 'store:A'" in out
    tokens = [int(t) for t in re.findall(r"syncing store A \(fencing token (\d+)\)", out)]
    assert len(tokens) == 3 and tokens == sorted(set(tokens))  # one increasing token per run
    assert re.search(r"syncing store B \(fencing token \d+\)", out)
    assert out.rstrip().endswith("done: 1 refused")


def test_django_settings_snippet_builds_a_broker_the_way_django_dramatiq_does() -> None:
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from singleton_tasks.dramatiq import SingletonMiddleware

    spec = importlib.util.spec_from_file_location("snippet", EXAMPLES / "django_settings_snippet.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    settings = module.DRAMATIQ_BROKER

    def load_middleware(path_or_obj: object) -> dramatiq.Middleware:  # django_dramatiq.utils
        if isinstance(path_or_obj, str):
            module_path, _, name = path_or_obj.rpartition(".")
            return getattr(importlib.import_module(module_path), name)()  # type: ignore[no-any-return]
        assert isinstance(path_or_obj, dramatiq.Middleware)
        return path_or_obj

    middleware = [
        load_middleware(entry) for entry in settings["MIDDLEWARE"] if not str(entry).startswith("django_")
    ]
    broker = StubBroker(middleware=middleware)
    singles = [m for m in broker.middleware if isinstance(m, SingletonMiddleware)]
    assert len(singles) == 1
    assert "singleton" in broker.actor_options
    # The dotted-path form builds too, reading its store from the environment.
    assert isinstance(load_middleware("singleton_tasks.dramatiq.SingletonMiddleware"), SingletonMiddleware)


@pytest.mark.slow  # runs the example in a child interpreter
def test_celery_example_on_the_embedded_store(tmp_path: Path) -> None:
    out = run_example("celery_sync_inventory.py", tmp_path, SINGLETON_RETRY_DELAY="0.2")
    assert "refused: shop.sync_inventory: the queue of key 'store:A'" in out
    tokens = [int(t) for t in re.findall(r"syncing store A \(fencing token (\d+)\)", out)]
    assert len(tokens) == 3 and tokens == sorted(set(tokens))  # one increasing token per run
    assert "done: ['A', 'A', 'A', 'B', 'statement for 42'], 1 refused" in out
