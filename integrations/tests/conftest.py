"""Fixtures of the scenarios: one harness per scenario run (settings, app, workers, producer, log)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from marks import (  # noqa: F401  (hooks: pytest finds them in this module)
    needs,
    pytest_itemcollected,
    pytest_runtest_protocol,
    pytest_terminal_summary,
)
from rich.console import Console
from services import require_server, unavailable

from integrations.checker import BROKER_LOSS_PER_KILL, CheckResult, check_run
from integrations.runlog import RunLog, Scenario
from integrations.runner import (
    Driver,
    PostgresServer,
    Producer,
    RedisServer,
    Workers,
    make_driver,
    migrate,
    postgres_bin,
    wait_drained,
    wait_store_idle,
)
from integrations.settings import BROKER_URLS, LOG_URL, REDIS_URL, Settings

FRAMEWORKS = ["dramatiq", "celery"]
BROKERS = ["redis", "rabbitmq"]


def require(url: str, what: str) -> None:
    """Skip when run by hand without the server; with ``CI`` set a missing server fails the run."""
    require_server(url, what)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "framework" in metafunc.fixturenames:
        # @pytest.mark.frameworks("celery"): a scenario that exists for one framework only.
        only = metafunc.definition.get_closest_marker("frameworks")
        metafunc.parametrize("framework", list(only.args) if only else FRAMEWORKS)
    if "broker" in metafunc.fixturenames:
        chosen = os.environ.get("SINGLETON_TEST_BROKER")  # tox runs one broker per environment
        metafunc.parametrize("broker", [chosen] if chosen else BROKERS)


@dataclass
class Harness:
    """One scenario run: its settings, the app's producer side, its workers and the log."""

    name: str
    framework: str
    store: str
    settings: Settings
    driver: Driver
    log: RunLog
    workers: Workers
    producer: Producer
    report: Callable[[CheckResult], None]
    broker_may_lose: bool = False  # the broker can lose a message when a worker is SIGKILLed
    tolerated: frozenset[str] = frozenset()  # runs the broker lost (see wait_drained)

    def drain(self, run_ids: Sequence[str], *, timeout: float) -> None:
        """Wait for every run to complete (or, on a lossy broker, to be shown lost by the broker)."""
        lost = wait_drained(
            self.log,
            self.settings,
            run_ids,
            timeout=timeout,
            workers=self.workers,
            broker_may_lose=self.broker_may_lose,
        )
        self.tolerated = frozenset(lost)

    def check(self, *, wait_idle: float = 20.0) -> CheckResult:
        """Flush the log, wait for the store to settle, check every invariant, print the table."""
        self.producer.flush()
        wait_store_idle(self.settings, timeout=wait_idle, ignore=self.tolerated)
        self.log.finish(self.settings.run)
        result = check_run(self.settings.run, self.settings.log_url)
        self.report(result)
        result.assert_ok()
        return result


@pytest.fixture(scope="session")
@needs("postgres")
def runlog() -> Iterator[RunLog]:
    require(LOG_URL, "PostgreSQL (the scenario log)")
    log = RunLog(LOG_URL)
    log.ensure_schema()
    yield log
    log.close()


@pytest.fixture
def report(pytestconfig: pytest.Config) -> Callable[[CheckResult], None]:
    """Print an invariant table to the real terminal, whatever the capture mode (CI logs show it)."""
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")

    def show(result: CheckResult) -> None:
        console = Console(width=110, force_terminal=False, soft_wrap=False)
        if capture is not None:
            with capture.global_and_fixture_disabled():
                print()
                result.print(console)
        else:
            result.print(console)

    return show


@pytest.fixture(scope="session")
@needs("postgres")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    """A PostgreSQL of the runner's own (initdb once per session), so a restart touches nothing shared."""
    if postgres_bin() is None:
        unavailable("PostgreSQL server binaries (/usr/lib/postgresql/*/bin) are not installed")
    directory = Path("/tmp") / f"singleton-pg-{uuid.uuid4().hex[:8]}"
    server = PostgresServer(directory)
    server.init()
    server.start()
    yield server
    try:
        server.stop("immediate")
    except AssertionError:
        pass
    import shutil

    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
@needs("redis")
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis-store")
    server.start()
    yield server
    server.stop()


@pytest.fixture
@needs("workers")
def harness(
    runlog: RunLog, tmp_path: Path, report: Callable[[CheckResult], None]
) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(
        name: str,
        framework: str,
        broker: str,
        store: str,
        *,
        store_url: str | None = None,
        threads: int = 4,
        pool: str = "threads",
        **overrides: Any,
    ) -> Harness:
        require(BROKER_URLS[broker], "RabbitMQ" if broker == "rabbitmq" else "Redis (the broker)")
        if store_url is None:
            store_url = {
                "redis": REDIS_URL,
                "postgres": LOG_URL,
                "sqlite": f"sqlite:///{tmp_path / 'store.db'}",
            }[store]
        if store_url.startswith(("redis", "postgres")):
            require(store_url, f"the {store} store")
        tag = uuid.uuid4().hex[:8]
        run = f"{name}-{framework}-{broker}-{store}-{tag}"
        settings = Settings(
            run=run,
            broker=broker,
            broker_url=BROKER_URLS[broker],
            store_url=store_url,
            namespace=f"i{tag}",
            queue=f"integration_{tag}",
            log_url=LOG_URL,
        ).with_(**overrides)
        migrate(settings)
        runlog.begin(
            Scenario(
                run,
                name,
                framework,
                broker,
                store,
                store_url,
                settings.namespace,
                {
                    **{k: v for k, v in vars(settings).items() if isinstance(v, (int, float, str))},
                    # kombu's Redis transport pops a message, then records it as unacked: a SIGKILL
                    # in between loses it (at most one per kill), whatever the library does.
                    "broker_loss_per_kill": (
                        BROKER_LOSS_PER_KILL if framework == "celery" and broker == "redis" else 0
                    ),
                },
                time.time(),
                None,
            )
        )
        driver = make_driver(framework, settings, **({"pool": pool} if framework == "celery" else {}))
        logs = tmp_path / "workers"
        logs.mkdir(exist_ok=True)
        workers = Workers(driver, runlog, logs, threads=threads)
        h = Harness(
            name,
            framework,
            store,
            settings,
            driver,
            runlog,
            workers,
            Producer(driver, runlog),
            report,
            broker_may_lose=framework == "celery" and broker == "redis",
        )
        made.append(h)
        return h

    yield make
    for h in made:
        try:
            h.workers.stop_all()
        finally:
            h.producer.flush()
            h.driver.cleanup()
