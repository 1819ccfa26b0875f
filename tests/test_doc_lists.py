"""The lists the documentation writes out equal the code's (issue 30: planning.md's built-in configs had lost
``qwen3-next-80b-a3b``, engine.md's models every hybrid, and the README said the build compiles 4 modules
when it compiles 5): the built-in configs, the models ``kvpool generate --model`` takes, the tiny hybrids,
and the compiled module count wherever a page quotes ``hot path compiled (mypyc): N modules``."""

from __future__ import annotations

import re
from pathlib import Path

from kvpool import _native
from kvpool.engine.models import DEFAULT_MODEL, GEMMA3, TINY_HYBRID_MODELS, TINY_MODELS
from kvpool.spec.hf_config import BUILTIN_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _text(page: str) -> str:
    return " ".join((ROOT / page).read_text().split())  # one line: lists wrap anywhere


def _names_between(page: str, start: str, end: str) -> list[str]:
    """The backquoted names on ``page`` after ``start`` and before the next ``end``."""
    text = _text(page)
    tail = text[text.index(start) + len(start):]
    return re.findall(r"`([\w.-]+)`", tail[:tail.index(end)])


def test_planning_lists_every_built_in_config() -> None:
    names = _names_between("docs/planning.md", "the name of a config kvpool ships", "(a file or folder")
    assert names == list(BUILTIN_CONFIGS)


def test_engine_page_lists_every_model_generate_takes() -> None:
    listed = re.search(r"Options: `--model ([\w.|-]+)`", _text("docs/engine.md"))
    assert listed is not None
    assert listed.group(1).split("|") == [DEFAULT_MODEL, GEMMA3, *TINY_MODELS, *TINY_HYBRID_MODELS, "PATH"]


def test_state_pools_page_lists_every_tiny_hybrid() -> None:
    names = _names_between("docs/state-pools.md", "over ten tiny hybrids (", ")")
    assert names == list(TINY_HYBRID_MODELS) and len(names) == 10  # "ten" on the page


def test_every_quoted_module_count_is_the_builds() -> None:
    quoted = [(page.relative_to(ROOT).as_posix(), int(n)) for page in PAGES
              for n in re.findall(r"compiled \(mypyc\): (\d+) modules", " ".join(page.read_text().split()))]
    assert quoted, "no page quotes the build's line any more: drop this test"
    assert all(n == len(_native.COMPILED_MODULES) for _, n in quoted), quoted
