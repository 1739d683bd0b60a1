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
        env={"COLUMNS": "120", "PATH": "/usr/bin:/bin"},
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
    handoff = re.search(r"slowest handoff (\d+) ms", out)
    assert handoff and int(handoff.group(1)) < 1000  # pushed at release, not the 1 s fallback timer
