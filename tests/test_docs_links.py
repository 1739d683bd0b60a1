"""Every link of the README and the docs resolves, and the README stays a user's page.

The docs build (``tox -e docs``) checks the site's own links and anchors; this test also covers
the Markdown files outside ``docs/`` (README.md, benchmarks/, integrations/), and the links into
this repository written as absolute GitHub URLs (the README's must be absolute: PyPI renders it
without the repository around it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REPO_URL = "https://github.com/singleton-tasks/singleton-tasks"
PAGES = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    ROOT / "integrations" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(!?)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
OWN = re.compile(re.escape(REPO_URL) + r"/(blob|tree)/main/([^#?]*)(?:#(.*))?$")


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub (and MyST, configured alike in docs/conf.py) gives a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    deepest = 3 if page.parent.name == "docs" else 6  # the site gives anchors to h1–h3 only
    return {
        slug(m[2]) for m in HEADING.finditer(FENCE.sub("", page.read_text("utf-8"))) if len(m[1]) <= deepest
    }


def links(page: Path) -> list[tuple[bool, str]]:
    return [(bool(m[1]), m[2]) for m in LINK.finditer(prose(page.read_text("utf-8")))]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if ROOT in path.parents else str(path)


def problem(page: Path, target: str) -> str | None:
    """Why ``target`` (a link on ``page``) does not resolve, or None."""
    own = OWN.match(target)
    if own:
        kind, path, anchor = own.groups()
        resolved = ROOT / path
        if kind == "tree" and not resolved.is_dir():
            return f"{target}: no directory {path} in the repository"
        if kind == "blob" and not resolved.is_file():
            return f"{target}: no file {path} in the repository"
    elif re.match(r"[a-z][a-z0-9+.-]*:", target):
        return None  # another site: not checked (no network in CI)
    else:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            return f"{target}: {shown(resolved)} missing"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{target}: no heading with anchor #{anchor} in {shown(resolved)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_resolves(page: Path) -> None:
    problems = [p for _image, target in links(page) if (p := problem(page, target))]
    assert not problems, "\n".join(problems)


def test_the_link_check_finds_broken_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Here\n\n## Two words\n", encoding="utf-8")
    assert problem(page, "#two-words") is None
    assert problem(page, "#three") is not None
    assert problem(page, "missing.md") is not None
    assert problem(page, f"{REPO_URL}/blob/main/docs/concepts.md#leases") is None
    assert problem(page, f"{REPO_URL}/blob/main/docs/concepts.md#no-such-section") is not None
    assert problem(page, f"{REPO_URL}/blob/main/docs/no-such-page.md") is not None
    assert problem(page, f"{REPO_URL}/tree/main/examples") is None
    page.write_text("[a](#here) `[b](nope.md)` ![c](pic.png)\n```\n[d](nope.md)\n```\n", encoding="utf-8")
    assert links(page) == [(False, "#here"), (True, "pic.png")]
    assert slug("What `release` does") == "what-release-does"


def test_readme_is_a_users_page() -> None:
    text = (ROOT / "README.md").read_text("utf-8")
    assert len(text.splitlines()) <= 200
    for narrative in ("this VM", "third VM", "worktree", "the code that lands", "session"):
        assert narrative.lower() not in text.lower(), f"README.md tells a story: {narrative!r}"
    # PyPI renders the README without the repository: no images, no relative links.
    found = links(ROOT / "README.md")
    assert found, "the README links into the docs"
    assert not [target for image, target in found if image], "no images in the README"
    relative = [target for _image, target in found if not re.match(r"https?://", target)]
    assert not relative, f"relative links break on PyPI: {relative}"
    # The project's two commands.
    assert re.search(r'^pip install -e "\.\[all\]" tox && singleton-tasks demo', text, re.M)
    assert re.search(r"^tox\s", text, re.M), "the README shows the test command"


def test_project_urls_point_into_the_repository() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text("utf-8")
    assert 'readme = "README.md"' in pyproject
    assert (ROOT / "LICENSE").is_file()
    table = pyproject.split("[project.urls]", 1)[1].split("\n[", 1)[0]
    urls = re.findall(r'^\w+ = "([^"]+)"$', table, re.M)
    assert len(urls) >= 3
    assert all(url.startswith(REPO_URL) for url in urls)
    broken = [problem(ROOT / "README.md", url) for url in urls]
    assert broken == [None] * len(broken), broken


PACKAGE_REFERENCE = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")


def test_the_packages_references_to_the_docs_resolve() -> None:
    """The code cites the docs by page and anchor (``docs/concepts.md#leases``); each must exist."""
    broken, cited = [], 0
    for source in sorted((ROOT / "singleton_tasks").rglob("*")):
        if source.suffix not in {".py", ".lua", ".sql"}:
            continue
        text = source.read_text("utf-8")
        assert "SPEC §" not in text, f"{shown(source)} cites a document that ships nowhere"
        for match in PACKAGE_REFERENCE.finditer(text):
            cited += 1
            page, anchor = ROOT / "docs" / match[1], match[2]
            if not page.is_file() or (anchor and anchor not in anchors(page)):
                broken.append(f"{shown(source)}: {match[0]}")
    assert cited > 0 and broken == []
