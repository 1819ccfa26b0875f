"""One memory limit across processes (issue 32, item 5): SharedMemoryBudget over one file. Expected bytes by
hand: pages of 4 KiB, a limit of 8 pages."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.errors import ConfigError, MemoryLimitError
from kvpool.storage.arena import CountingBackend, PageArena
from kvpool.storage.shared_budget import SharedMemoryBudget

PAGE = 4096

CHILD = r"""
import sys
from kvpool.storage.arena import CountingBackend, PageArena
from kvpool.storage.shared_budget import SharedMemoryBudget
budget = SharedMemoryBudget(sys.argv[1])
arena = PageArena(64 * 4096, page_size=4096, budget=budget, backend=CountingBackend)
arena.commit(range(6))  # 6 pages
print("committed", flush=True)
sys.stdin.readline()  # held until the parent says
"""


def test_two_processes_commit_under_one_limit_and_a_dead_one_gives_its_share_back(tmp_path) -> None:
    path = tmp_path / "budget"
    budget = SharedMemoryBudget(path, limit_bytes=8 * PAGE)
    arena = PageArena(64 * PAGE, page_size=PAGE, budget=budget, backend=CountingBackend)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "committed"
        assert budget.committed_bytes == 6 * PAGE and budget.own_bytes == 0
        with pytest.raises(MemoryLimitError):
            arena.commit(range(3))  # 6 + 3 > 8 pages: refused, nothing counted
        assert arena.committed_bytes == 0 and budget.committed_bytes == 6 * PAGE
        arena.commit(range(2))  # 6 + 2 = 8: at the limit
        with pytest.raises(MemoryLimitError):
            budget.set_limit(7 * PAGE)  # below the 8 pages the two hold
    finally:
        child.kill()  # gone without giving its pages back
        child.wait()
    assert budget.committed_bytes == 2 * PAGE  # its slot is dropped
    arena.commit(range(2, 8))  # 8 pages, all this process's now
    arena.release(range(8))
    assert budget.committed_bytes == 0
    budget.close()


def test_a_file_of_another_kind_is_refused(tmp_path) -> None:
    path = tmp_path / "not-a-budget"
    path.write_bytes(b"hello")
    with pytest.raises(ConfigError):
        SharedMemoryBudget(path)
    with pytest.raises(ConfigError):
        SharedMemoryBudget(tmp_path / "missing-dir" / "budget")
