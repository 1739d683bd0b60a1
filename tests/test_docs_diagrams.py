"""The docs' diagrams (docs/diagrams/*.dot) stay true to the code, and the docs build can draw them.

The diagrams are Graphviz sources that ``tox -e docs`` draws (``sphinx.ext.graphviz``). The run's
life must name every state a run has in the store (``RunState``) as a node that runs reach and
leave, and the claims it draws must be the claim decisions the store gives. Graphviz's ``dot``
is a system program: ``.ci/run`` installs its package when it is missing.
"""

from __future__ import annotations

import configparser
import re
import runpy
import shlex
from pathlib import Path

import pytest

from singleton_tasks.outcomes import Decision, RunState

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUN_LIFE = DOCS / "diagrams" / "run-life.dot"
HANDOFF = DOCS / "diagrams" / "handoff.dot"

COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
NODE = re.compile(r"^\s*([A-Za-z_]\w*)\s*\[", re.M)
PORT = r"(?::\w+)?"  # `node:e`, a port of the node
EDGE = re.compile(rf"([A-Za-z_]\w*){PORT}\s*->\s*([A-Za-z_]\w*){PORT}\s*(?:\[(?P<attrs>.*?)\])?\s*;", re.S)
LABEL = re.compile(r'\blabel="((?:[^"\\]|\\.)*)"')
NOT_NODES = {"graph", "node", "edge", "subgraph"}


def dot_graph(path: Path) -> tuple[set[str], list[tuple[str, str, str]]]:
    """The node ids a DOT source declares, and its edges as (tail, head, label)."""
    text = COMMENT.sub("", path.read_text("utf-8"))
    nodes = {name for name in NODE.findall(text) if name not in NOT_NODES}
    edges = []
    for match in EDGE.finditer(text):
        label = LABEL.search(match["attrs"] or "")
        edges.append((match[1], match[2], label[1].replace("\\n", " ") if label else ""))
    return nodes, edges


def state_problems(path: Path, state: RunState) -> list[str]:
    """What the diagram at ``path`` lacks for ``state``: its node, an edge into it, an edge out."""
    nodes, edges = dot_graph(path)
    if state.value not in nodes:
        return [f"{path.name} does not draw the state {state.value!r}"]
    problems = []
    if not any(head == state.value and tail != state.value for tail, head, _ in edges):
        problems.append(f"no edge of {path.name} moves a run into {state.value!r}")
    if not any(tail == state.value and head != state.value for tail, head, _ in edges):
        problems.append(f"no edge of {path.name} moves a run out of {state.value!r}")
    return problems


@pytest.mark.parametrize("state", list(RunState), ids=lambda state: state.value)
def test_the_run_life_diagram_draws_every_state(state: RunState) -> None:
    assert state_problems(RUN_LIFE, state) == []


def test_the_run_life_diagram_names_the_claim_decisions_the_store_gives() -> None:
    # A stale copy's claim moves no run (its delivery is dropped), nor does a request for the
    # payload (the claim is made again with it): the prose says so, not an edge.
    labels = " ".join(label for _, _, label in dot_graph(RUN_LIFE)[1])
    drawn = set(re.findall(r"claim → (\w+)", labels))
    moving = {d.value for d in Decision if d not in (Decision.STALE, Decision.PAYLOAD_NEEDED)}
    assert drawn == moving


@pytest.mark.parametrize("state", list(RunState), ids=lambda state: state.value)
def test_the_check_sees_a_state_removed_from_the_diagram(tmp_path: Path, state: RunState) -> None:
    """Its node gone (its edges may stay: Graphviz would draw a bare node for them), or every edge
    out of it gone: the check above fails."""
    source = RUN_LIFE.read_text("utf-8")
    without_node = re.sub(rf"^ *{state.value} \[.*?\];\n", "", source, count=1, flags=re.M | re.S)
    without_exits = re.sub(rf"^ *{state.value}(:\w+)? -> (?!{state.value}\b).*\n", "", source, flags=re.M)
    for altered_source in (without_node, without_exits):
        assert altered_source != source
        altered = tmp_path / "run-life.dot"
        altered.write_text(altered_source, "utf-8")
        assert state_problems(altered, state)


def section(page: str, heading: str) -> str:
    """The text of a ``## heading`` section of a page, up to the next ``##`` heading."""
    start = page.index(f"\n## {heading}\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end != -1 else None]


@pytest.mark.parametrize(
    ("heading", "diagram"),
    [("The life of a run", RUN_LIFE), ("Handoff", HANDOFF)],
    ids=["run-life", "handoff"],
)
def test_concepts_shows_each_diagram_where_it_describes_it(heading: str, diagram: Path) -> None:
    concepts = (DOCS / "concepts.md").read_text("utf-8")
    directive = f"```{{graphviz}} {diagram.relative_to(DOCS).as_posix()}\n"
    assert directive in section(concepts, heading)
    assert diagram.is_file()


def test_the_docs_build_draws_the_diagrams_as_svg() -> None:
    conf = runpy.run_path(str(DOCS / "conf.py"))
    assert "sphinx.ext.graphviz" in conf["extensions"]
    assert conf["graphviz_output_format"] == "svg"
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert "docs" in [env.strip() for env in tox["tox"]["env_list"].split(",")]
    command = shlex.split(tox["testenv:docs"]["commands"])
    assert command[0] == "sphinx-build" and "--fail-on-warning" in command and "docs" in command


def test_ci_installs_graphviz_when_dot_is_missing() -> None:
    """.ci/run installs the package that has ``dot`` before it runs tox (whose docs env draws)."""
    script = (ROOT / ".ci" / "run").read_text("utf-8")
    guard = re.search(r"^if ! command -v dot > /dev/null; then\n(?P<body>.*?)^fi$", script, re.S | re.M)
    assert guard, ".ci/run does not check for Graphviz's dot"
    install = re.search(r"apt[-_]get install -y\b[^\n]*\bgraphviz\b", guard["body"])
    assert install, ".ci/run does not install the graphviz package when dot is missing"
    assert "update" in guard["body"], "a fresh CI image has no package lists: apt-get update first"
    assert guard.start() < script.index("\ntox "), ".ci/run installs Graphviz only after tox ran"
