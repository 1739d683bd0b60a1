"""The quickstarts and the migration guide's blocks run as written, against in-process brokers.

A snippet is a fenced ``python`` block preceded by ``<!-- snippet: NAME -->``. Each quickstart is
two snippets: ``FRAMEWORK/tasks.py`` (the module a user saves) and ``FRAMEWORK/producer`` (what
they type to send runs). The test runs both in a fresh interpreter, with the servers the text
names swapped for in-process ones: Dramatiq's ``RedisBroker`` becomes a ``StubBroker``, Celery's
Redis URLs the ``memory://`` transport and a memory result backend, and the Redis store a SQLite
file. docs/migrating.md pairs its modules and sends the same way (``LIBRARY/after`` with
``LIBRARY/send`` or ``LIBRARY/after-send``); its ``before`` blocks use celery-singleton and
celery-once, whose lock store is the test Redis server. Every other ``python`` block of the docs
must at least compile.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from conftest import REDIS_URL
from services import require_server

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
QUICKSTART_PAGES = [DOCS / "getting-started.md", ROOT / "README.md"]

SNIPPET = re.compile(r"<!-- snippet: (?P<name>[\w./-]+) -->\n```python\n(?P<code>.*?)\n```", re.S)
PYTHON_BLOCK = re.compile(r"^```python\n(?P<code>.*?)\n```", re.S | re.M)

STORE_URL = '"redis://localhost:6379/1"'

HARNESS = r"""
import json, sys, time, types

blocks = json.loads(sys.argv[1])
framework, store_url = blocks["framework"], blocks["store_url"]


def load_module(name, code):
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    sys.modules[name] = module
    exec(compile(code, f"<{name}>", "exec"), module.__dict__)
    return module


def produce():
    exec(compile(blocks["producer"], "<producer>", "exec"), {"__name__": "__main__"})


tasks_code = blocks["tasks"].replace(blocks["store_in_text"], repr(store_url))
if framework == "dramatiq":
    import dramatiq
    import dramatiq.brokers.redis
    from dramatiq.brokers.stub import StubBroker

    made = []

    def in_process_broker(*args, **kwargs):
        made.append(StubBroker())
        return made[-1]

    dramatiq.brokers.redis.RedisBroker = in_process_broker
    tasks = load_module("tasks", tasks_code)
    (broker,) = made
    broker.emit_after("process_boot")
    worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=20)
    worker.start()
    started = time.monotonic()
    try:
        produce()
        broker.join(tasks.sync_inventory.queue_name)
        worker.join()
    finally:
        worker.stop()
else:
    from celery.contrib.testing.worker import start_worker

    for real, in_process in [
        ('broker="redis://localhost:6379/0"', 'broker="memory://"'),
        ('backend="redis://localhost:6379/2"', 'backend="cache+memory://"'),
    ]:
        assert real in tasks_code, real
        tasks_code = tasks_code.replace(real, in_process)
    tasks = load_module("tasks", tasks_code)
    tasks.app.conf.broker_transport_options = {"polling_interval": 0.01}
    with start_worker(tasks.app, pool="threads", concurrency=4, perform_ping_check=False):
        started = time.monotonic()
        produce()
print(f"elapsed {time.monotonic() - started:.2f}", flush=True)
"""


def snippets(page: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for match in SNIPPET.finditer(page.read_text(encoding="utf-8")):
        assert match["name"] not in found, f"{page.name}: snippet {match['name']} appears twice"
        found[match["name"]] = match["code"]
    return found


def run_as_written(framework: str, tasks: str, producer: str, store_url: str, cwd: Path) -> str:
    """What the ``tasks`` module and the ``producer`` print, run in a child interpreter with a worker.

    The store the module names (:data:`STORE_URL`) is replaced by ``store_url``.
    """
    assert STORE_URL in tasks, f"the {framework} module no longer names the store {STORE_URL}"
    blocks = {
        "framework": framework,
        "store_in_text": STORE_URL,
        "store_url": store_url,
        "tasks": tasks,
        "producer": producer,
    }
    result = subprocess.run(
        [sys.executable, "-c", HARNESS, json.dumps(blocks)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow  # runs each quickstart in a child interpreter
@pytest.mark.parametrize("page", QUICKSTART_PAGES, ids=lambda page: page.name)
@pytest.mark.parametrize("framework", ["dramatiq", "celery"])
def test_quickstart_runs_as_written(page: Path, framework: str, tmp_path: Path) -> None:
    found = snippets(page)
    tasks, producer = found.get(f"{framework}/tasks.py"), found.get(f"{framework}/producer")
    assert tasks and producer, f"{page.name} has no {framework} quickstart snippets"
    out = run_as_written(framework, tasks, producer, f"sqlite:///{tmp_path / 'store.db'}", tmp_path)
    # The fourth start of store A is refused by the backlog cap (limit 1 + max_queue_depth 2).
    assert out.count("refused:") == 1, out
    assert "the queue of key 'store:A'" in out, out
    tokens = [int(token) for token in re.findall(r"syncing store A, fencing token (\d+)", out)]
    assert len(tokens) == 3 and tokens == sorted(set(tokens)), out
    assert out.count("syncing store B,") == 1, out
    # Three 0.5 s bodies of store A on four threads: only one at a time, so at least 1.5 s.
    elapsed = float(re.findall(r"elapsed (\d+\.\d+)", out)[-1])
    assert elapsed >= 1.5, out
    if framework == "celery":
        assert "['A', 'A', 'A', 'B']" in out, out


MIGRATING = DOCS / "migrating.md"

#: The keys celery-singleton and celery-once lock a sync_inventory run of store A under.
BEFORE_BLOCK_LOCKS = ["SINGLETONLOCK_*", "qo_tasks.sync_inventory_*"]


def refused_once(out: str, error: str) -> None:
    """The second send of store A was refused with ``error``, and only the first one ran."""
    assert out.count("refused:") == 1 and error in out, out
    assert out.count("syncing store A (nightly)") == 1 and "(manual)" not in out, out


def dropped_once(out: str, results: str) -> None:
    """The second send of store A was dropped quietly; the two results printed are ``results``."""
    assert out.count("syncing store A (nightly)") == 1 and "(manual)" not in out, out
    assert f"\n{results}\n" in out, out


def one_at_a_time_in_order(out: str) -> None:
    """Store A's batches ran one at a time, in the order they were sent; B's ran too."""
    events = re.findall(r"store (\w) batch (\d) (starts|ends)", out)
    of_a = [(batch, event) for store, batch, event in events if store == "A"]
    assert of_a == [(batch, event) for batch in "012" for event in ("starts", "ends")], out
    assert [event for store, _, event in events if store == "B"] == ["starts", "ends"], out


#: The migration guide's runs: its module, its sends, and what their output must show.
MIGRATIONS = {
    "celery-singleton/before": (
        "celery-singleton/before-send",
        lambda out: refused_once(out, "Attempted to queue a duplicate of task ID"),
    ),
    "celery-singleton/after": (
        "celery-singleton/after-send",
        lambda out: refused_once(out, "the queue of key 'store:A'"),
    ),
    "celery-once/before": ("celery-once/send", lambda out: dropped_once(out, "A None")),
    "celery-once/after": ("celery-once/send", lambda out: dropped_once(out, "A A")),
    "dramatiq-mutex/after": ("dramatiq-mutex/send", one_at_a_time_in_order),
}


@pytest.mark.slow  # runs each migration in a child interpreter
@pytest.mark.parametrize(
    "module",
    [
        pytest.param(name, marks=[pytest.mark.redis] if name.endswith("/before") else [])
        for name in MIGRATIONS
    ],
)
def test_a_migration_runs_as_written(module: str, tmp_path: Path) -> None:
    found = snippets(MIGRATING)
    sends, check = MIGRATIONS[module]
    assert module in found and sends in found, f"{MIGRATING.name} has no snippets {module}, {sends}"
    framework = "dramatiq" if "import dramatiq" in found[module] else "celery"
    if module.endswith("/before"):
        # celery-singleton and celery-once keep their locks in Redis only. A lock left by an
        # interrupted run would refuse the first send: they are cleared first.
        require_server(REDIS_URL, "Redis")
        with redis.Redis.from_url(REDIS_URL) as client:
            for pattern in BEFORE_BLOCK_LOCKS:
                for lock in client.scan_iter(pattern):
                    client.delete(lock)
        store_url = REDIS_URL
    else:
        store_url = f"sqlite:///{tmp_path / 'store.db'}"
    check(run_as_written(framework, found[module], found[sends], store_url, tmp_path))


def test_every_migration_block_is_run() -> None:
    """A snippet added to the guide without a run is caught here, not left unrun."""
    run = set(MIGRATIONS) | {sends for sends, _ in MIGRATIONS.values()}
    assert set(snippets(MIGRATING)) == run


def all_pages() -> list[Path]:
    return [*sorted(DOCS.glob("*.md")), ROOT / "README.md", ROOT / "benchmarks" / "README.md"]


@pytest.mark.parametrize("page", all_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_python_block_compiles(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for number, match in enumerate(PYTHON_BLOCK.finditer(text), 1):
        compile(match["code"], f"{page.name} python block {number}", "exec")
