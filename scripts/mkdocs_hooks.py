"""MkDocs hooks (mkdocs.yml ``hooks:``): the README as the site's front page, and the docstrings' Sphinx
roles as cross-references.

The site's ``index.md`` is the README (one front page, never two that drift apart): its links into
``docs/`` become links within the site. The README links only into ``docs/`` (``tests/test_docs_paths.py``
checks it), so every link of the front page is checked by the strict build like any page's.

kvpool's docstrings name other objects with Sphinx roles (``:class:`~kvpool.tiers.HostTier```), which
mkdocstrings leaves as text (``:class:`` before the name). Each becomes an optional autorefs reference: a
link where the name is a documented object's full path, the name in code otherwise; ``~`` shows the last
part only, as Sphinx does. A paragraph ending in reST's ``::`` before a literal block ends in ``:``.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
LITERAL = re.compile(r"::(</p>\s*<div class=\"highlight\">)")
ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(?P<tilde>~?)(?P<name>[\w.\s]+?)</code>")


def _reference(match: re.Match[str]) -> str:
    name = "".join(match["name"].split())  # a name the docstring broke across lines
    shown = name.rsplit(".", 1)[-1] if match["tilde"] else name
    return f'<autoref identifier="{name}" optional><code>{shown}</code></autoref>'


def on_page_content(html: str, **_: object) -> str:
    return LITERAL.sub(r":\1", ROLE.sub(_reference, html))


def on_page_read_source(page: object, **_: object) -> str | None:
    if page.file.src_uri != "index.md":  # type: ignore[attr-defined]
        return None
    return re.sub(r"\]\(docs/", "](", README.read_text())
