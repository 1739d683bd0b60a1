"""Each install command of the docs installs what the code it is shown for needs (issue 28).

An install command is ``pip install "singleton-tasks[EXTRAS]"`` (or ``".[EXTRAS]"``) in README.md
or a page of docs/; single-quoted ones quote the library's error messages and are only checked
for naming extras that exist. What a command must install comes from:

- its comment, in a ``bash`` block: ``# Celery on a Redis broker, with the Redis store`` names
  the framework, the broker and the store;
- otherwise the quickstart it serves: a command in a section with a ``FRAMEWORK/tasks.py``
  snippet, or a comment naming a framework but no broker, is checked against that snippet (of
  the section, else of the page): its broker class or URL and its store URL.

The extras are read from pyproject.toml, with ``singleton-tasks[...]`` inside an extra resolved.
Nothing is installed: the test compares requirement names (the extras' own installs are checked
in fresh environments by tests/test_extras.py).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib  # Python 3.11+: the tests run on 3.11
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROJECT = "singleton-tasks"

INSTALL = re.compile(
    r"""pip install (?:-e )?(?P<quote>["'])(?P<target>singleton-tasks|\.)\[(?P<extras>[^\]]*)\](?P=quote)"""
)
FENCE = re.compile(r"^```(?P<lang>\w*)")
SNIPPET = re.compile(r"<!-- snippet: (?P<framework>\w+)/tasks\.py -->")

#: What each part needs installed: a requirement name, with the extra of it that must be asked for.
FRAMEWORK_NEEDS = {"dramatiq": {"dramatiq"}, "celery": {"celery"}}
BROKER_NEEDS = {
    ("dramatiq", "redis"): {"redis"},  # dramatiq[redis] is the redis client
    ("dramatiq", "rabbitmq"): {"dramatiq[rabbitmq]"},  # pika
    ("celery", "redis"): {"celery[redis]"},  # kombu's Redis transport and its pins
    ("celery", "rabbitmq"): set(),  # py-amqp comes with Celery
}
STORE_NEEDS = {"redis": {"redis"}, "postgres": {"psycopg", "psycopg_pool"}}


@functools.cache
def extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


def installs(names: set[str]) -> set[str]:
    """What installing the project with extras ``names`` asks for: ``name`` and ``name[extra]``."""
    known = extras()
    asked: set[str] = set()
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        assert name in known, f"no extra named {name!r} in pyproject.toml"
        for requirement in known[name]:
            if requirement.name == PROJECT:
                todo.extend(requirement.extras)
                continue
            asked.add(requirement.name)
            asked.update(f"{requirement.name}[{extra}]" for extra in requirement.extras)
    return asked


@dataclass
class Command:
    page: str
    line: int
    extras: set[str]
    quoted: str  # " or '
    label: str  # the comment after it in a bash block; "" in prose
    section: str
    snippets: dict[str, str] = field(default_factory=dict)  # framework → its tasks.py, of the section

    def __str__(self) -> str:
        return f"{self.page}:{self.line} [{','.join(sorted(self.extras))}]"


@dataclass
class Page:
    commands: list[Command]
    snippets: dict[str, str]  # framework → its tasks.py snippet on the page
    code: str  # every python block


def read(page: Path) -> Page:
    commands: list[Command] = []
    snippets: dict[str, dict[str, str]] = {}  # section → framework → code
    page_snippets: dict[str, str] = {}
    python: list[str] = []
    section, fence, block, pending = "", None, [], None
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence, block = opened["lang"], []
            continue
        if fence is not None and line.startswith("```"):
            if fence == "python":
                python.append("\n".join(block))
                if pending:
                    snippets.setdefault(section, {})[pending] = python[-1]
                    page_snippets.setdefault(pending, python[-1])
            fence, pending = None, None
            continue
        if fence is None and line.startswith("#"):
            section = line.lstrip("#").strip()
            continue
        if fence is None and (marker := SNIPPET.search(line)):
            pending = marker["framework"]
        if fence is not None:
            block.append(line)
        for match in INSTALL.finditer(line):
            comment = line[match.end() :].partition("#")[2].strip() if fence == "bash" else ""
            names = {e.strip() for e in match["extras"].split(",") if e.strip()}
            commands.append(Command(page.name, number, names, match["quote"], comment, section))
    for command in commands:
        command.snippets = snippets.get(command.section, {})
    return Page(commands, page_snippets, "\n".join(python))


PAGE_OF = {page.name: read(page) for page in PAGES}
COMMANDS = [command for page in PAGE_OF.values() for command in page.commands]


#: How a comment names a broker and a store, and how a quickstart's code uses them.
BROKER_IN_LABEL = {"redis": r"\bon (a )?Redis( broker)?\b", "rabbitmq": r"\bon RabbitMQ\b"}
STORE_IN_LABEL = {"redis": r"\bRedis store\b", "postgres": r"\bPostgreSQL store\b"}
BROKER_IN_CODE = {
    "redis": r"\bRedisBroker\b|broker=[\"']rediss?://",
    "rabbitmq": r"\bRabbitmqBroker\b|broker=[\"'](py)?amqps?://",
}
STORE_IN_CODE = {"redis": r"store=[\"']rediss?(\+\w+)?://", "postgres": r"store=[\"']postgres(ql)?://"}


def named(text: str, patterns: dict[str, str]) -> str | None:
    """The one name whose pattern ``text`` matches; None if none does."""
    found = [name for name, pattern in patterns.items() if re.search(pattern, text)]
    assert len(found) <= 1, f"{text!r} names {found}"
    return found[0] if found else None


def from_label(label: str) -> tuple[str | None, str | None, str | None]:
    """(framework, broker, store) a comment names; None for what it does not name."""
    framework = named(label, {name: rf"(?i)\b{name}\b" for name in FRAMEWORK_NEEDS})
    return framework, named(label, BROKER_IN_LABEL), named(label, STORE_IN_LABEL)


def from_code(code: str) -> tuple[str | None, str | None]:
    """(broker, store) a quickstart's tasks.py uses."""
    return named(code, BROKER_IN_CODE), named(code, STORE_IN_CODE)


def needs(command: Command) -> tuple[set[str], str]:
    """What the command must install, and what that was read from."""
    framework, broker, store = from_label(command.label)
    source = f"its comment {command.label!r}"
    if framework is None and len(command.snippets) == 1:
        (framework,) = command.snippets
        source = f"the {framework} quickstart of section {command.section!r}"
    if framework is None:
        return (STORE_NEEDS[store] if store else set()), source
    code = command.snippets.get(framework) or PAGE_OF[command.page].snippets.get(framework)
    if broker is None or (store is None and not command.label):
        assert code is not None, (
            f"{command}: say which broker it is for (`# {framework.title()} on a Redis broker, ...`): "
            f"{command.page} has no {framework}/tasks.py snippet to read it from"
        )
        code_broker, code_store = from_code(code)
        broker = broker or code_broker
        store = store or code_store
        source += f" and the {framework}/tasks.py snippet of {command.page}"
    assert broker is not None, f"{command}: no broker in {source}"
    wanted = FRAMEWORK_NEEDS[framework] | BROKER_NEEDS[framework, broker]
    if store is not None:
        wanted |= STORE_NEEDS[store]
    return wanted, f"{framework} on {broker}" + (f", {store} store" if store else "") + f" ({source})"


def missing(command: Command) -> tuple[set[str], str]:
    wanted, why = needs(command)
    return wanted - installs(command.extras), why


EVERY_BROKER = {("dramatiq", "redis"), ("dramatiq", "rabbitmq"), ("celery", "redis"), ("celery", "rabbitmq")}


@pytest.mark.parametrize(
    ("page", "offered"),
    [
        ("README.md", EVERY_BROKER),
        ("getting-started.md", EVERY_BROKER),
        ("deployment.md", {("dramatiq", "rabbitmq"), ("celery", "rabbitmq")}),
        ("dramatiq.md", {("dramatiq", "rabbitmq")}),
        ("celery.md", {("celery", "redis"), ("celery", "rabbitmq")}),
    ],
)
def test_a_page_says_what_to_install_for_each_broker_it_covers(
    page: str, offered: set[tuple[str, str]]
) -> None:
    """Each framework on each broker has a command whose comment names them (checked by the next test)."""
    labelled = {from_label(command.label)[:2] for command in PAGE_OF[page].commands if command.label}
    assert offered <= labelled, f"{page}: no install command for {sorted(offered - labelled)}"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_an_install_command_installs_what_its_code_needs(command: Command) -> None:
    installs(command.extras)  # every extra named exists
    if command.quoted == "'":
        return  # quotes an error message
    lacking, why = missing(command)
    assert not lacking, f"{command} for {why} does not install {sorted(lacking)}"


@pytest.mark.parametrize(
    ("shown", "pattern", "wanted"),
    [
        # A page that shows Dramatiq on RabbitMQ says how to install pika.
        ("dramatiq-on-rabbitmq", r"\bRabbitmqBroker\b", "dramatiq[rabbitmq]"),
        ("celery-on-redis", r"broker=[\"']rediss?://", "celery[redis]"),
    ],
)
def test_a_page_showing_a_broker_shows_how_to_install_it(shown: str, pattern: str, wanted: str) -> None:
    showing = [(name, page) for name, page in PAGE_OF.items() if re.search(pattern, page.code)]
    assert showing, f"no page shows {shown} ({pattern!r}): the check would check nothing"
    for name, read_page in showing:
        offered = [c for c in read_page.commands if c.quoted == '"' and wanted in installs(c.extras)]
        assert offered, f"{name} shows {shown} ({pattern!r}) but no install command of it installs {wanted}"


CELERY_QUICKSTART = (
    "## Quickstart: Celery\n\n<!-- snippet: celery/tasks.py -->\n```python\n"
    'app = Celery("tasks", broker="redis://localhost:6379/0")\ninstall(app, store="redis://localhost:6379/1")\n'
    "```\n"
)


def install_block(extras: str, comment: str) -> str:
    """A page with one labelled install command and a Celery quickstart on Redis."""
    return (
        f'# Page\n\n## Install\n\n```bash\npip install "singleton-tasks[{extras}]"  # {comment}\n```\n\n'
        + (CELERY_QUICKSTART)
    )


def quickstart(extras: str, code: str) -> str:
    """A page whose Dramatiq quickstart says in its text what to install."""
    return (
        f'# Page\n\n## Quickstart\n\n`pip install "singleton-tasks[{extras}]"`, then:\n\n'
        f"<!-- snippet: dramatiq/tasks.py -->\n```python\n{code}\n```\n"
    )


@pytest.mark.parametrize(
    ("text", "lacking"),
    [
        # the old getting-started.md: the Celery quickstart is on a Redis broker
        (install_block("redis,celery", "Celery, with the Redis store"), {"celery[redis]"}),
        (
            install_block("redis,dramatiq", "Dramatiq on RabbitMQ, with the Redis store"),
            {"dramatiq[rabbitmq]"},
        ),
        (
            install_block("celery", "Celery on RabbitMQ, with the PostgreSQL store"),
            {"psycopg", "psycopg_pool"},
        ),
        (quickstart("dramatiq", 'RedisBroker()\nSingletonMiddleware(store="sqlite:///x.db")'), {"redis"}),
        (quickstart("dramatiq", 'StubBroker()\nSingletonMiddleware(store="postgresql://db")'), "no broker"),
        (install_block("celery-redis", "Celery on RabbitMQ, with the Redis store"), set()),
        (install_block("dramatiq-rabbitmq,redis", "Dramatiq on RabbitMQ, with the Redis store"), set()),
        (quickstart("dramatiq,redis", 'RedisBroker()\nSingletonMiddleware(store="redis://x")'), set()),
    ],
)
def test_the_check_finds_what_a_command_lacks(tmp_path: Path, text: str, lacking: set[str] | str) -> None:
    """The check itself, on pages made for it."""
    page = tmp_path / "page.md"
    page.write_text(text)
    PAGE_OF[page.name] = read(page)
    try:
        (command,) = PAGE_OF[page.name].commands
        if isinstance(lacking, str):
            with pytest.raises(AssertionError, match=lacking):
                missing(command)
        else:
            assert missing(command)[0] == lacking
    finally:
        del PAGE_OF[page.name]
