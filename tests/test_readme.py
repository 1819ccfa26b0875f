"""The README's examples run as written (issue 9, item 18). Each ```python block follows a marker:
``<!-- doc-test: NAME -->`` (blocks of one NAME run in order in one fresh namespace, so a later block may
use an earlier one's names; their own assertions must hold) or ``<!-- doc-test skipped: why -->``. A block
without a marker fails the test, so a new example cannot go untested unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(?:<!-- doc-test(?P<skip> skipped)?: (?P<name>[^>]*?) -->\n)?"
                   r"```python\n(?P<code>.*?)```", re.S)


def blocks() -> list[tuple[str | None, str]]:
    """(marker, code) of every python block; the marker is the NAME, ``skip:why`` or None."""
    return [(None if m["name"] is None else f"skip:{m['name']}" if m["skip"] else m["name"], m["code"])
            for m in BLOCK.finditer(README.read_text())]


def doc_tests() -> dict[str, str]:
    groups: dict[str, str] = {}
    for name, code in blocks():
        if name is not None and not name.startswith("skip:"):
            groups[name] = groups.get(name, "") + code
    return groups


def test_every_python_block_is_tested_or_says_why_not() -> None:
    assert all(name is not None for name, _ in blocks())
    assert "wire-it-in" in doc_tests()


@pytest.mark.parametrize("name", list(doc_tests()))
def test_readme_block_runs(name: str) -> None:
    namespace: dict[str, object] = {"__name__": f"readme_{name}"}
    exec(compile(doc_tests()[name], f"README.md:{name}", "exec"), namespace)  # noqa: S102 - our own README
    if name == "wire-it-in":  # the request is gone and its blocks stay cached for the next one
        pool = namespace["pool"]
        assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 2
        pool.check_integrity()
