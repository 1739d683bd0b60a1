"""``python -m benchmarks``: every case side by side with its baseline, one table of medians and ratios."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import click

from .common import SIZES, THREADS, Report, Size, quiet_framework_logs, render

CASES = (
    "noop",
    "burst",
    "handoff",
    "roundtrips",
    "admission",
    "postgres",
    "backline",
    "celery",
    "growth",
    "cluster",
    "replicas",
    "idle",
    "send",
)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or cpu
    return f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, {platform.system()}"


def _versions() -> str:
    from importlib.metadata import version

    return ", ".join(
        f"{name} {version(name)}" for name in ("dramatiq", "celery", "kombu", "redis", "psycopg")
    )


@click.command()
@click.option(
    "--size",
    type=click.Choice(list(SIZES)),
    default="small",
    show_default=True,
    help="small: the CI smoke run (< 2 min); medium; full: the issue's sizes.",
)
@click.option(
    "--cases",
    default=",".join(CASES),
    show_default=True,
    help=f"Comma-separated subset of: {', '.join(CASES)}.",
)
@click.option(
    "--runs",
    type=click.IntRange(1),
    default=5,
    show_default=True,
    help="Runs per variant for side-by-side cases (baseline and subject alternate).",
)
@click.option(
    "--brokers", default="redis,rabbitmq", show_default=True, help="Brokers for cases 2, 3, 8 and 13."
)
@click.option(
    "--worker-timeouts",
    default="1000,10,2",
    show_default=True,
    help="Dramatiq worker_timeout values (ms) to compare for RedisBroker handoffs (cases 3, 7); "
    "the last also runs case 2 on RedisBroker.",
)
@click.option(
    "--stores",
    default="memory,sqlite,redis,postgres",
    show_default=True,
    help="Stores for case 9 (growth).",
)
@click.option(
    "--plot",
    "plot_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write PNG charts here (needs the 'bench' extra: matplotlib).",
)
@click.option(
    "--cluster-url",
    envvar="BENCH_CLUSTER_URL",
    default=None,
    metavar="URL",
    help="redis+cluster:// store for case 10 [env BENCH_CLUSTER_URL; default: a loopback cluster "
    "started on ports 7101-7106 for the case].",
)
def main(
    size: str,
    cases: str,
    runs: int,
    brokers: str,
    worker_timeouts: str,
    stores: str,
    plot_dir: Path | None,
    cluster_url: str | None,
) -> None:
    """Measure singleton-tasks against plain Dramatiq/Celery and the tools used today."""
    chosen = [c.strip() for c in cases.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CASES))
    if unknown:
        raise click.BadParameter(f"unknown case(s): {', '.join(unknown)}", param_hint="--cases")
    kinds = [b.strip() for b in brokers.split(",") if b.strip()]
    timeouts = [int(t) for t in worker_timeouts.split(",") if t.strip()]
    growth_stores = [s.strip() for s in stores.split(",") if s.strip()]
    quiet_framework_logs()
    spec = SIZES[size]
    report = Report()
    report.notes.append(f"machine: {machine()}; {_versions()}")
    report.notes.append(
        f"workers: in-process dramatiq.Worker / Celery threads pool, 1 process × {THREADS} threads, "
        "on the real brokers and stores; body times from one perf_counter clock"
    )
    from . import dramatiq_cases as dq
    from . import store_cases as st

    # Small sizes run fewer repeats of the slow cases: CI only needs the table printed.
    slow_runs = runs if size != "small" else min(runs, 3)
    # The defaults forms (and Celery's prefork form) start a worker process per run: one each at
    # the smallest size.
    defaults_runs = runs if size != "small" else 1
    steps: dict[str, Callable[[], None]] = {
        "noop": lambda: dq.case_noop(report, spec, slow_runs, kinds),
        "burst": lambda: _burst(report, spec, slow_runs, defaults_runs, kinds, timeouts[-1]),
        "handoff": lambda: _handoff(report, spec, defaults_runs, kinds, timeouts),
        "roundtrips": lambda: dq.case_round_trips(report, spec),
        "admission": lambda: st.case_admission(report, spec),
        "postgres": lambda: st.case_postgres(report, spec, runs),
        "backline": lambda: dq.case_backline(report, spec, 1 if size != "medium" else min(runs, 3), timeouts),
        "celery": lambda: _celery(report, spec, slow_runs, defaults_runs, kinds),
        "growth": lambda: _growth(report, spec, growth_stores),
        "cluster": lambda: _cluster(report, spec, slow_runs, cluster_url, timeouts[-1]),
        "replicas": lambda: dq.case_replicas(report, spec, slow_runs),
        "idle": lambda: _idle(report, spec, defaults_runs),
        "send": lambda: _send(report, spec, runs, kinds),
    }
    started = time.perf_counter()
    for name in CASES:
        if name not in chosen:
            continue
        t0 = time.perf_counter()
        try:
            steps[name]()
        except Exception as error:  # one broken case must not hide the others' figures
            report.target(name, "(case did not complete)", f"{type(error).__name__}: {error}", False)
        click.echo(f"[{name}: {time.perf_counter() - t0:.1f} s]", err=True)
    header = f"singleton-tasks benchmarks — size {size}, {runs} runs — {time.perf_counter() - started:.0f} s"
    render(report, header)
    if plot_dir is not None:
        from .plots import write_plots

        for path in write_plots(report, plot_dir):
            click.echo(f"wrote {path}")


def _burst(report: Report, spec: Size, runs: int, defaults_runs: int, kinds: list[str], wt: int) -> None:
    from . import defaults_cases, dramatiq_cases

    dramatiq_cases.case_burst(report, spec, runs, kinds, wt)
    defaults_cases.case_burst_defaults(report, spec, defaults_runs, kinds)


def _handoff(report: Report, spec: Size, defaults_runs: int, kinds: list[str], timeouts: list[int]) -> None:
    from . import defaults_cases, dramatiq_cases

    dramatiq_cases.case_handoff(report, spec, kinds, timeouts)
    defaults_cases.case_handoff_defaults(report, spec, defaults_runs, kinds)


def _idle(report: Report, spec: Size, runs: int) -> None:
    from . import defaults_cases

    defaults_cases.case_idle(report, spec, runs)


def _celery(report: Report, spec: Size, runs: int, prefork_runs: int, kinds: list[str]) -> None:
    from . import celery_cases

    celery_cases.case_celery(report, spec, runs, kinds, prefork_runs)


def _send(report: Report, spec: Size, runs: int, kinds: list[str]) -> None:
    from . import celery_cases, dramatiq_cases

    dramatiq_cases.case_send(report, spec, runs, kinds)
    celery_cases.case_celery_send(report, spec.noop, runs, kinds)


def _growth(report: Report, spec: object, stores: list[str]) -> None:
    from . import growth_cases

    growth_cases.case_growth(report, spec, stores)  # type: ignore[arg-type]


def _cluster(report: Report, spec: Size, runs: int, url: str | None, worker_timeout: int) -> None:
    from . import cluster_cases

    cluster_cases.case_cluster(report, spec, runs, url, worker_timeout)


if __name__ == "__main__":
    main()
