"""Every file or folder of this repository that the README or a documentation page names exists (issue 23:
docs/DESIGN.md cited folders the repository does not have). A reference is a path that starts at one of the
repository's top folders (``kvpool/...``, ``tests/...``, ``benchmarks/...``, ``scripts/...``, ``docs/...``,
``requirements/...``, ``.ci/...``) and is not the tail of a longer path or URL (``~/.cache/kvpool/...`` is no
reference); a ``*`` in it is a glob that must match something."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = ("kvpool", "tests", "benchmarks", "scripts", "docs", "requirements", ".ci")
REFERENCE = re.compile(r"(?<![\w./~-])(?:" + "|".join(map(re.escape, TOP)) + r")/[\w.*/-]*")


def references(text: str) -> list[str]:
    """The path-like references in a page's text, trailing punctuation dropped (``kvpool/spec.py.`` names
    ``kvpool/spec.py``)."""
    return sorted({m.group().rstrip(".,") for m in REFERENCE.finditer(text)})


def _exists(reference: str) -> bool:
    return any(ROOT.glob(reference.rstrip("/"))) if "*" in reference else (ROOT / reference).exists()


def test_references_are_found() -> None:
    text = ("`kvpool/storage/paged.py`, (tests/test_tp.py) and docs/DESIGN.md#layers, but not "
            "~/.cache/kvpool/gemma3-270m, https://example.org/docs/x or kvpool[tiers]; kvpool/engine/, "
            ".ci/run.")
    assert references(text) == [".ci/run", "docs/DESIGN.md", "kvpool/engine/", "kvpool/storage/paged.py",
                                "tests/test_tp.py"]
    assert _exists("kvpool/allocators/*.py") and not _exists("tests/no_such_file.py")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_path_exists(page: Path) -> None:
    missing = [ref for ref in references(page.read_text()) if not _exists(ref)]
    assert not missing, f"{page.relative_to(ROOT)} names paths the repository does not have: {missing}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_links_only_into_docs() -> None:
    """The README is also the site's front page (scripts/mkdocs_hooks.py): its links must be anchors, pages
    under docs/ (which the strict build checks, anchors included) or web addresses, never another file of the
    repository, which the site does not have (name those in code: `benchmarks/README.md`)."""
    targets = LINK.findall((ROOT / "README.md").read_text())
    wrong = [t for t in targets if not t.startswith(("#", "docs/", "https://", "http://"))]
    assert not wrong, f"README.md links outside docs/: {wrong}"
    assert all((ROOT / t.split("#")[0]).is_file() for t in targets if t.startswith("docs/"))


#: Packages documented by the command line reference rather than the API pages.
TOOLS = ("kvpool/bench/", "kvpool/cli/")


def test_every_public_module_has_an_api_page() -> None:
    """Each public module (no leading underscore, no package ``__init__``, not a tool, not a deprecated
    import path) is rendered by a
    ``::: kvpool.module`` directive on one of docs/api/'s pages, and every directive names a module."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "kvpool").rglob("*.py")
               if not p.name.startswith("_") and not p.relative_to(ROOT).as_posix().startswith(TOOLS)
               and "moved_module(" not in p.read_text()}  # an old import path: its names are documented anew
    directives = {m for page in (ROOT / "docs" / "api").glob("*.md")
                  for m in re.findall(r"^::: (kvpool[\w.]*)$", page.read_text(), re.M)}
    missing = modules - directives
    assert not missing, f"modules with no ::: directive on a docs/api/ page (add one): {sorted(missing)}"
    # a tool's module may have a page too (kvpool.cli.options, the vocabulary the bench suites share)
    named = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "kvpool").rglob("*.py")}
    named |= {".".join(p.relative_to(ROOT).parts) for p in (ROOT / "kvpool").rglob("*") if p.is_dir()}
    assert not directives - named, f"docs/api/ directives naming no module: {directives - named}"
