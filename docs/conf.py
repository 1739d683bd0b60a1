"""Sphinx configuration of the documentation site: ``tox -e docs`` builds it with warnings as errors."""

from __future__ import annotations

from importlib.metadata import version as _version

project = "singleton-tasks"
author = "The singleton-tasks authors"
copyright = "2026, The singleton-tasks authors"
release = _version("singleton-tasks")
version = release

extensions = [
    "myst_parser",  # the pages are Markdown (they read as they are on GitHub too)
    "sphinx.ext.autodoc",  # the API reference, from the docstrings
    "sphinx.ext.napoleon",  # their "Parameters:" sections
    "sphinx.ext.graphviz",  # the diagrams, drawn from their DOT sources in docs/diagrams/
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Headings h1–h3 get GitHub-style anchors, so `concepts.md#leases` resolves on the site and on
# GitHub alike; a link to a missing page or anchor is a warning, and warnings fail the build.
myst_heading_anchors = 3
myst_enable_extensions = ["deflist"]

# The API reference shows the library's own docstrings, never the ones its classes inherit from
# Celery or Dramatiq (they use roles and labels of those projects' own documentation).
autodoc_inherit_docstrings = False
autodoc_member_order = "bysource"
autodoc_typehints = "signature"

# The diagrams are drawn by Graphviz's `dot` at build time: the Debian/Ubuntu package `graphviz`,
# which .ci/run installs (without it the build fails: "dot command 'dot' cannot be run"). SVG
# keeps their text sharp at any zoom.
graphviz_output_format = "svg"

html_theme = "furo"
html_title = f"singleton-tasks {release}"
html_static_path: list[str] = []
html_theme_options = {
    "source_repository": "https://github.com/singleton-tasks/singleton-tasks/",
    "source_branch": "main",
    "source_directory": "docs/",
}
