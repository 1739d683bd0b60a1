"""Each optional part names the extra that installs it, in real environments without it (issue 16).

The tests build the project's wheel once and install it into fresh virtual environments (no
system site-packages) the way a user would: ``singleton-tasks`` alone, ``singleton-tasks[redis]``
and ``singleton-tasks[celery]``. Nothing is mocked: the missing packages are not there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

from singleton_tasks.stores import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # fresh virtual environments, pip


def _pip(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--quiet", "--wheel-dir", str(folder), str(ROOT))
    (built,) = folder.glob("singleton_tasks-*.whl")
    return built


class Env:
    """A fresh virtual environment with the project's wheel and the extras asked for."""

    def __init__(self, folder: Path, wheel: Path, extras: str) -> None:
        venv.EnvBuilder(with_pip=False, system_site_packages=False).create(folder)
        self.python = folder / "bin" / "python"
        self.bin = folder / "bin"
        requirement = f"{wheel}[{extras}]" if extras else str(wheel)
        _pip("--python", str(self.python), "install", "--quiet", requirement)

    def run(self, *args: str, code: str | None = None) -> subprocess.CompletedProcess[str]:
        command = [str(self.python), "-c", textwrap.dedent(code)] if code is not None else list(args)
        env = {"PATH": f"{self.bin}:/usr/bin:/bin", "COLUMNS": "120", "HOME": os.environ.get("HOME", "/tmp")}
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=self.bin)

    def has(self, module: str) -> bool:
        probe = self.run(
            code=f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        )
        return probe.returncode == 0


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Env:
    return Env(tmp_path_factory.mktemp("core"), wheel, "")


@pytest.fixture(scope="module")
def redis_only(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Env:
    return Env(tmp_path_factory.mktemp("redis-only"), wheel, "redis")


@pytest.fixture(scope="module")
def celery_only(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Env:
    return Env(tmp_path_factory.mktemp("celery-only"), wheel, "celery")


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (
            "singleton_tasks.dramatiq",
            "singleton_tasks.dramatiq needs Dramatiq: pip install 'singleton-tasks[dramatiq]'",
        ),
        (
            "singleton_tasks.celery",
            "singleton_tasks.celery needs Celery: pip install 'singleton-tasks[celery]'",
        ),
    ],
)
def test_an_adapter_without_its_framework_names_its_extra(core: Env, module: str, message: str) -> None:
    assert not core.has("dramatiq") and not core.has("celery")
    result = core.run(code=f"import {module}")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: " + message), result.stderr


def test_metrics_without_prometheus_client_name_their_extra(core: Env) -> None:
    assert not core.has("prometheus_client")
    result = core.run(
        code="""
        from singleton_tasks import metrics
        metrics.observe_rejected("task")  # the hooks stay no-ops without the extra
        assert metrics.active() is None
        metrics.install()
        """
    )
    assert result.returncode == 1
    assert (
        "ModuleNotFoundError: singleton_tasks.metrics needs prometheus_client: "
        "pip install 'singleton-tasks[metrics]'" in result.stderr
    ), result.stderr


def test_the_core_works_and_a_store_driver_names_its_extra(core: Env) -> None:
    result = core.run(
        code="""
        from singleton_tasks import SingletonConfigError, singleton, store_from_url
        @singleton(key="{x}")
        def plain(x): return x
        store = store_from_url("sqlite:///core.db")
        store.migrate()
        print("sqlite ok", store.schema_version())
        for url in ("redis://localhost/0", "postgresql://localhost/db"):
            try:
                store_from_url(url)
            except SingletonConfigError as error:
                print(error)
        """
    )
    assert result.returncode == 0, result.stderr
    assert f"sqlite ok {SCHEMA_VERSION}" in result.stdout
    assert "the redis:// store needs its driver: pip install 'singleton-tasks[redis]'" in result.stdout
    assert (
        "the postgresql:// store needs its driver: pip install 'singleton-tasks[postgres]'" in result.stdout
    )


@pytest.mark.parametrize("env_name", ["core", "redis_only"])
def test_the_demo_without_a_framework_names_the_extras(request: pytest.FixtureRequest, env_name: str) -> None:
    env: Env = request.getfixturevalue(env_name)
    result = env.run("singleton-tasks", "demo")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "pip install 'singleton-tasks[dramatiq]' (or 'singleton-tasks[celery]')" in result.stderr
    asked = env.run("singleton-tasks", "demo", "--framework", "celery")
    assert asked.returncode == 2
    assert "pip install 'singleton-tasks[celery]'" in asked.stderr


def test_the_demo_runs_on_celery_when_only_celery_is_installed(celery_only: Env) -> None:
    assert celery_only.has("celery") and not celery_only.has("dramatiq")
    result = celery_only.run("singleton-tasks", "demo")
    assert result.returncode == 0, result.stderr
    assert "singleton-tasks demo on Celery" in result.stdout
    assert "SingletonQueueFullError: key 'store:A' limit=1 max_queue_depth=2" in result.stdout
    assert "5 runs, 1 rejected, 0 same-key overlaps" in result.stdout
    assert "A ran in order: ['A1', 'A2', 'A3']" in result.stdout
    dramatiq = celery_only.run(code="import singleton_tasks.dramatiq")
    assert "pip install 'singleton-tasks[dramatiq]'" in dramatiq.stderr


def test_the_readmes_two_commands_work_with_the_pip_of_a_fresh_venv(tmp_path: Path) -> None:
    """The first command installs everything the second needs, with the pip ``venv`` ships."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    install, test = (line.split("#", 1)[0].strip() for line in block.strip().splitlines())
    folder = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(folder)  # ensurepip's pip
    env = {
        "PATH": f"{folder / 'bin'}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "COLUMNS": "120",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    first = subprocess.run(
        ["bash", "-c", install], cwd=ROOT, env=env, capture_output=True, text=True, timeout=480
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "5 runs, 1 rejected, 0 same-key overlaps" in first.stdout
    program = test.split()[0]
    assert (folder / "bin" / program).exists(), f"{install!r} does not install {program!r}"
    # This tox meets tox.ini's `requires` (no provisioning) and reads the dependency groups itself:
    # the pip of the environment it installs them into is not the old one of this venv.
    listed = subprocess.run(
        [str(folder / "bin" / program), "config", "-e", "unit", "-k", "dependency_groups"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "dependency_groups = test" in listed.stdout, listed.stdout
    assert ".tox/.tox" not in listed.stdout + listed.stderr  # not provisioned


def test_the_dramatiq_rabbitmq_extra_installs_what_rabbitmq_broker_imports(
    tmp_path_factory: pytest.TempPathFactory, wheel: Path
) -> None:
    """``dramatiq`` alone lacks pika: a worker on RabbitMQ dies on import; ``dramatiq-rabbitmq`` has it."""
    env = Env(tmp_path_factory.mktemp("dramatiq-only"), wheel, "dramatiq")
    code = (
        "from dramatiq.brokers.rabbitmq import RabbitmqBroker\nimport singleton_tasks.dramatiq\nprint('ok')"
    )
    before = env.run(code=code)
    assert before.returncode == 1 and "No module named 'pika'" in before.stderr, before.stderr
    _pip("--python", str(env.python), "install", "--quiet", f"{wheel}[dramatiq-rabbitmq]")
    after = env.run(code=code)
    assert after.returncode == 0 and after.stdout.strip() == "ok", after.stderr
