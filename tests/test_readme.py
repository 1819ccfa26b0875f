"""The examples of the README and of the documentation pages (``docs/**/*.md``) run as written (issue 9,
item 18; issue 23). Each ```python block follows a marker: ``<!-- doc-test: NAME -->`` (blocks of one NAME
on one page run in order in one fresh namespace, so a later block may use an earlier one's names; their own
assertions must hold) or ``<!-- doc-test skipped: why -->``. A block without a marker fails the test, so a
new example cannot go untested unnoticed.

A ```bash block after ``<!-- doc-test: shell -->`` runs in bash (``set -euo pipefail``, every command must
succeed) in a fresh folder, with ``kvpool`` this checkout's CLI; its loopback ports become free ones of the
tests' range and ``/tmp/`` the test's own folder, and background jobs it starts are stopped at its end. Mark
the command blocks that run in seconds (tiny models, short replays): a newcomer copies them first.

The tests are named by page (``README.md:wire-it-in``, ``docs/tiers.md:0``): ``-k docs/tiers.md`` runs one
page's."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _ports import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Every page whose examples run: the README, then the documentation site's pages.
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
SHELL = re.compile(r"<!-- doc-test: shell -->\n```bash\n(?P<code>.*?)```", re.S)
PORT = re.compile(r"(?<=127\.0\.0\.1:)\d+|(?<=localhost:)\d+|(?<=--metrics-port )\d+")
BLOCK = re.compile(r"(?:<!-- doc-test(?P<skip> skipped)?: (?P<name>[^>]*?) -->\n)?"
                   r"```python\n(?P<code>.*?)```", re.S)


def _page(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(path: Path = README) -> list[tuple[str | None, str]]:
    """(marker, code) of every python block of a page; the marker is the NAME, ``skip:why`` or None."""
    return [(None if m["name"] is None else f"skip:{m['name']}" if m["skip"] else m["name"], m["code"])
            for m in BLOCK.finditer(path.read_text())]


def doc_tests(path: Path = README) -> dict[str, str]:
    groups: dict[str, str] = {}
    for name, code in blocks(path):
        if name is not None and not name.startswith("skip:"):
            groups[name] = groups.get(name, "") + code
    return groups


#: (page, NAME) of every doc test, pages in order.
DOC_TESTS = [(path, name) for path in PAGES for name in doc_tests(path)]


@pytest.mark.parametrize("path", PAGES, ids=_page)
def test_every_python_block_is_tested_or_says_why_not(path: Path) -> None:
    untested = [code.splitlines()[0] for name, code in blocks(path) if name is None]
    assert not untested, f"{_page(path)}: python blocks without a doc-test marker: {untested}"


def torch_threads(n: int | None = None) -> int | None:
    """torch's intra-op thread count (None without torch); with ``n``, set it back to ``n`` first."""
    if "torch" not in sys.modules:
        return None
    import torch

    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def test_the_wire_in_example_is_tested() -> None:
    assert "wire-it-in" in doc_tests(README)


@pytest.mark.parametrize(("path", "name"), DOC_TESTS, ids=[f"{_page(p)}:{n}" for p, n in DOC_TESTS])
def test_readme_block_runs(path: Path, name: str) -> None:
    namespace: dict[str, object] = {"__name__": f"doc_{name}"}
    threads = torch_threads()
    try:  # a page's code as a reader runs it: no __future__ import of this file, its own thread setting
        exec(compile(doc_tests(path)[name], f"{_page(path)}:{name}", "exec", dont_inherit=True),  # noqa: S102
             namespace)
    finally:
        torch_threads(threads)
    if name == "wire-it-in":  # the request is gone and its blocks stay cached for the next one
        pool = namespace["pool"]
        assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 2
        pool.check_integrity()


def shell_blocks(path: Path = README) -> list[str]:
    return [m["code"] for m in SHELL.finditer(path.read_text())]


#: (page, index) of every shell block, pages in order.
SHELL_BLOCKS = [(path, index) for path in PAGES for index in range(len(shell_blocks(path)))]


def test_the_quick_commands_are_tested() -> None:
    codes = [code for path in PAGES for code in shell_blocks(path)]
    assert any("--disk-dir" in code for code in codes) and any("--kv-events" in code for code in codes)


@pytest.mark.parametrize(("path", "index"), SHELL_BLOCKS, ids=[f"{_page(p)}:{i}" for p, i in SHELL_BLOCKS])
def test_readme_shell_block_runs(path: Path, index: int, tmp_path: Path) -> None:
    ports: dict[str, int] = {}
    code = PORT.sub(lambda m: str(ports.setdefault(m.group(), free_port())), shell_blocks(path)[index])
    code = code.replace("/tmp/", f"{tmp_path}/")
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    work.mkdir()
    (bin_dir / "kvpool").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvpool "$@"\n')
    (bin_dir / "kvpool").chmod(0o755)
    script = f"trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\nset -euo pipefail\n{code}"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "output.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code_returned = proc.wait(timeout=300)
        finally:  # whatever the block left running (a subscriber in the background) goes with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert code_returned == 0, f"{_page(path)} shell block {index} failed:\n{code}\n{log.read_text()[-3000:]}"


def test_wire_in_example_leaks_nothing_when_the_pool_is_short() -> None:
    # the example run twice on one pool, the second time with every block but its 2 cached hits held by
    # another request: 40 tokens need 3 blocks and only those 2 are free, so the example must refuse before
    # touching them (a touch, then a failed allocate, kept both hits in use: the leak)
    code = doc_tests()["wire-it-in"]
    namespace: dict[str, object] = {"__name__": "readme_short"}
    exec(compile(code, "README.md:wire-it-in", "exec"), namespace)  # noqa: S102 - our own README
    pool = namespace["pool"]
    neighbour = pool.allocate(pool.num_free_blocks - 2)  # uncached free blocks go first: the 2 hits stay
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 2
    again = code.replace("cache, pool = PagedKVCache(spec, num_blocks=64), BlockPool(64)",
                         "cache = PagedKVCache(spec, num_blocks=64)")
    assert again != code
    from kvpool import OutOfBlocksError

    with pytest.raises(OutOfBlocksError):
        exec(compile(again, "README.md:wire-it-in", "exec"), namespace)  # noqa: S102 - our own README
    assert pool.num_used_blocks == len(neighbour) and pool.num_cached_blocks == 2
    pool.check_integrity()
