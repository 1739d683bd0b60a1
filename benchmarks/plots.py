"""``--plot DIR``: a lane timeline (Gantt) of the same-key burst and the handoff-latency distribution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import FLOOR_TARGET, HANDOFF_P50_MS, HANDOFF_P99_MS, Report, percentile


def write_plots(report: Report, directory: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # the optional 'bench' extra
        raise SystemExit(f"--plot needs matplotlib: pip install 'singleton-tasks[bench]' ({error})") from None
    directory.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    bursts = sorted(k for k in report.plots if k.startswith("burst."))
    if bursts:
        fig, axes = plt.subplots(len(bursts), 1, figsize=(11, 2.2 * len(bursts) + 0.6), squeeze=False)
        for ax, name in zip(axes[:, 0], bursts, strict=True):
            t0, spans = report.plots[name]
            _gantt(ax, t0, spans, plt)
            _, kind, variant = name.split(".")
            label = "SingletonMiddleware" if variant == "singleton" else "ConcurrentRateLimiter + Retries"
            label += ", burst queued before the worker starts"
            end = max((s.end for s in spans), default=t0) - t0
            ax.set_title(
                f"{label} on {kind}: {len(spans)} bodies, makespan {end:.2f} s", fontsize=9, loc="left"
            )
        axes[-1, 0].set_xlabel("seconds since the first body started")
        fig.suptitle("Same-key burst: one lane per worker thread, colour = send order", fontsize=10)
        fig.tight_layout()
        path = directory / "burst_lanes.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    handoffs = sorted(k for k in report.plots if k.startswith("handoff."))
    if handoffs:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name in handoffs:
            values = sorted(report.plots[name])
            _, kind, wt = name.split(".")
            ys = [(i + 1) / len(values) for i in range(len(values))]
            label = f"{kind}" + (f", worker_timeout={wt} ms" if kind == "redis" else "")
            ax.step(
                values,
                ys,
                where="post",
                label=f"{label} (p50 {percentile(values, 50):.1f}, p99 {percentile(values, 99):.1f} ms)",
            )
        ax.axvline(HANDOFF_P50_MS, color="grey", linestyle=":", linewidth=1)
        ax.axvline(HANDOFF_P99_MS, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("handoff latency, body end → next body start (ms, log)")
        ax.set_ylabel("fraction of handoffs")
        ax.set_title(
            f"Handoff latency distribution (targets: p50 ≤ {HANDOFF_P50_MS:g} ms dotted, "
            f"p99 ≤ {HANDOFF_P99_MS:g} ms dashed)",
            fontsize=10,
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = directory / "handoff_latency.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    floors = [k for k in report.plots if k.startswith("floor.")]
    if floors:
        path = directory / "floor_ratios.png"
        _floor_chart(floors, report, path, plt)
        written.append(path)
    return written


def _floor_chart(names: list[str], report: Report, path: Path, plt: Any) -> None:
    """One group of bars per case: each variant's throughput over the floor's, the target marked."""
    fig, axes = plt.subplots(
        len(names), 1, figsize=(9, 1.1 + 0.42 * sum(len(report.plots[n]) for n in names))
    )
    axes = axes if len(names) > 1 else [axes]
    for ax, name in zip(axes, names, strict=True):
        ratios: dict[str, float] = report.plots[name]
        labels = list(ratios)
        colours = ["tab:green" if label == "singleton-tasks" else "tab:grey" for label in labels]
        ax.barh(labels, [ratios[label] for label in labels], color=colours)
        for y, label in enumerate(labels):
            ax.text(ratios[label], y, f" {ratios[label]:.2f}×", va="center", fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.axvline(FLOOR_TARGET, color="tab:red", linestyle="--", linewidth=1)
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
        ax.set_title(name.removeprefix("floor."), fontsize=9, loc="left")
        ax.set_xlim(0, max(1.2, max(ratios.values()) * 1.15))
    axes[-1].set_xlabel(f"throughput over the floor's, medians (dashed: the target, {FLOOR_TARGET:.2f}×)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _gantt(ax: Any, t0: float, spans: list[Any], plt: Any) -> None:
    lanes = sorted({s.thread for s in spans})
    lane_of = {name: i for i, name in enumerate(lanes)}
    count = max((s.index for s in spans), default=0) + 1
    cmap = plt.get_cmap("viridis")
    for s in spans:
        ax.broken_barh(
            [(s.start - t0, s.end - s.start)],
            (lane_of[s.thread] - 0.4, 0.8),
            facecolors=cmap(s.index / max(1, count - 1)),
        )
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"thread {i + 1}" for i in range(len(lanes))], fontsize=7)
    ax.set_xlim(left=0)
