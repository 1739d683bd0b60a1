"""The README's "run it" command, run as a user would."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow  # the demo's workers run on real time
def test_demo_tells_the_story_on_the_embedded_default() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "singleton_tasks.cli", "demo"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "sqlite:///" in out
    assert re.search(r"send A4\s+→ SingletonQueueFullError: key 'store:A' limit=1 max_queue_depth=2", out)
    assert "5 runs, 1 rejected, 0 same-key overlaps" in out
    assert "A ran in order: ['A1', 'A2', 'A3']" in out
    lanes = {
        line.split("│")[1].strip(): line.split("│")[2] for line in out.splitlines() if "│ store:" in line
    }
    assert set(lanes) == {"store:A", "store:B", "store:C"}
    # B and C started with A1, not after A's backlog: their lanes begin where A's does.
    start = {name: len(lane) - len(lane.lstrip()) for name, lane in lanes.items()}
    assert abs(start["store:B"] - start["store:A"]) <= 2 and abs(start["store:C"] - start["store:A"]) <= 2
    assert lanes["store:A"].rstrip().endswith("3")
    # Each run's token whole (16 digits, from the store's clock), within 80 columns.
    assert max(len(line) for line in out.splitlines()) <= 80, out
    shown = re.findall(r"│ ([ABC]\d) +(\d{16}) │", out)
    assert sorted(label for label, _token in shown) == ["A1", "A2", "A3", "B1", "C1"], out
    handoff = re.search(r"slowest handoff (\d+) ms", out)
    assert handoff and int(handoff.group(1)) < 1000  # pushed at release, not the 1 s fallback timer


def test_the_demo_shows_each_runs_token_whole_at_80_columns() -> None:
    """Tokens are clock-derived (16 digits): the lanes table shows each whole, as the logs and
    `inspect` print it, within 80 columns."""
    import io

    from rich.console import Console

    from singleton_tasks.cli.demo import Run, _print_lanes

    token = 1_796_571_543_583_123
    runs = [
        Run("A", "A1", token, 0.0, 0.5),
        Run("A", "A2", token + 508_000, 0.5, 1.0),
        Run("A", "A3", token + 1_011_000, 1.0, 1.5),
        Run("B", "B1", token + 9_000, 0.0, 0.5),
        Run("C", "C1", token + 7_000, 0.0, 0.5),
    ]
    out = io.StringIO()
    _print_lanes(Console(file=out, width=80, color_system=None), runs, 0.0, 1.5)
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80, out.getvalue()
    for run in runs:
        assert any(f"{run.label}  {run.token}" in line for line in lines), out.getvalue()
