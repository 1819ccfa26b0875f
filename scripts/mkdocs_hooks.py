"""MkDocs hook (mkdocs.yml ``hooks:``): the docstrings' Sphinx roles as cross-references.

kvpool's docstrings name other objects with Sphinx roles (``:class:`~kvpool.tiers.HostTier```), which
mkdocstrings leaves as text (``:class:`` before the name). Each becomes an optional autorefs reference: a
link where the name is a documented object's full path, the name in code otherwise; ``~`` shows the last
part only, as Sphinx does.
"""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(?P<tilde>~?)(?P<name>[\w.\s]+?)</code>")


def _reference(match: re.Match[str]) -> str:
    name = "".join(match["name"].split())  # a name the docstring broke across lines
    shown = name.rsplit(".", 1)[-1] if match["tilde"] else name
    return f'<autoref identifier="{name}" optional><code>{shown}</code></autoref>'


def on_page_content(html: str, **_: object) -> str:
    return ROLE.sub(_reference, html)
