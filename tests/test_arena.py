"""PageArena on both back ends: the CPU one over real memory, the CUDA one over the fake driver
(``tests/_fake_cuda.py``, which checks every call's order and arguments).

The state machine drives an arena through commit, release, resize, limit changes, a budget shared with a
second arena, sleep and wake, bad inputs included, against a model that is a set of committed pages, a
usable prefix, a limit and the bytes written into each page (on the CPU, where the memory can be read: a
committed page reads what was written since its last commit, a fresh one reads 0).
A commit writes a value into the pages it names; a failed call must leave every page's bytes as they were.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from _fake_cuda import FakeDriver
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.errors import (
    AsleepError,
    ConfigError,
    InsufficientMemoryError,
    InvalidIdError,
    MemoryLimitError,
)
from kvpool.storage.arena import MemoryBudget, PageArena, runs
from kvpool.storage.arena_cuda import CUDABackend
from kvpool.storage.resident import resident_bytes

PAGE = 8192  # two 4 KiB OS pages: small arenas, and a page that is not the OS page
MiB = 2**20


def fake_cuda(driver: FakeDriver):
    """A back-end factory: the CUDA back end over ``driver``, its tensor a CPU stand-in of the size, made
    (as torch's ``cudaPointerGetAttributes`` needs) while the base address is mapped and open."""

    def to_tensor(ptr: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
        assert ptr in driver.mapped and ptr in driver.accessible, "torch handed an unmapped address"
        return torch.zeros(nbytes, dtype=torch.uint8)

    return lambda device: CUDABackend(device, driver=driver, to_tensor=to_tensor)


# ---- the CPU back end over real memory ------------------------------------------------------------------

def test_cpu_pages_read_what_was_written_and_zero_after_release() -> None:
    arena = PageArena(4 * PAGE, page_size=PAGE)
    t, address = arena.tensor, arena.tensor.data_ptr()
    assert arena.num_pages == 4 and arena.nbytes == 4 * PAGE and address % PAGE == 0
    assert arena.commit([2, 0, 2]) == [0, 2] and arena.committed_pages() == [0, 2]
    t[0 * PAGE:1 * PAGE].fill_(7)
    t[2 * PAGE:3 * PAGE].fill_(9)
    assert arena.release([0, 1]) == [0]  # page 1 was not committed: nothing to release
    assert int(t[:PAGE].max()) == 0 and int(t[2 * PAGE:3 * PAGE].min()) == 9  # page 0 given back, 2 kept
    assert arena.commit([0]) == [0] and int(t[:PAGE].max()) == 0  # a fresh page reads 0
    assert arena.tensor.data_ptr() == address  # never moved


def test_runs_are_maximal_consecutive_stretches() -> None:
    assert list(runs([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 1), (7, 2)]
    assert list(runs([])) == []


def test_cpu_resident_pages_are_the_committed_ones() -> None:
    """mincore over the arena: exactly the committed pages are in RAM (nothing else of the arena)."""
    arena = PageArena(64 * PAGE, page_size=PAGE)
    assert resident_bytes(arena.tensor) == 0
    arena.commit(range(10, 30))
    assert resident_bytes(arena.tensor) == 20 * PAGE
    arena.release(range(0, 20))
    assert resident_bytes(arena.tensor) == 10 * PAGE


@pytest.mark.slow
def test_cpu_rss_follows_committed_pages_in_a_fresh_process() -> None:
    """The lead's check on this machine: +256 MiB after 128 pages of 2 MiB, -128 MiB after 64 released
    (RSS read in a fresh process, so nothing else it allocates blurs it)."""
    code = textwrap.dedent("""
        import torch, psutil
        from kvpool.storage.arena import PageArena
        rss = lambda: psutil.Process().memory_info().rss
        start = rss()
        arena = PageArena(4 << 30)                      # 4 GiB reserved
        reserved = rss()
        arena.commit(range(128))
        committed = rss()
        arena.release(range(64))
        released = rss()
        print(reserved - start, committed - reserved, committed - released)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    reserve, grow, shrink = (int(x) for x in out.split())
    assert reserve < 16 * MiB
    assert 256 * MiB <= grow <= 256 * MiB + 16 * MiB     # 128 x 2 MiB
    assert 128 * MiB - 4 * MiB <= shrink <= 128 * MiB + 4 * MiB  # 64 x 2 MiB


# ---- bad input: a typed error, nothing changed -----------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"nbytes": 0}, {"nbytes": 1.5}, {"page_size": 4096 + 1},
                                    {"page_size": 0}, {"limit_bytes": -1}, {"budget": 5},
                                    {"device": "meta"}, {"device": "nonsense"}])
def test_bad_construction_is_a_config_error(kwargs: dict) -> None:
    args = {"nbytes": PAGE, "page_size": PAGE, **kwargs}
    with pytest.raises(ConfigError):
        PageArena(args.pop("nbytes"), **args)


def test_bad_calls_raise_typed_errors_and_change_nothing() -> None:
    arena = PageArena(4 * PAGE, page_size=PAGE, limit_bytes=2 * PAGE)
    arena.commit([1])
    arena.tensor[PAGE:2 * PAGE].fill_(3)
    before = (arena.committed_pages(), arena.usable_pages, arena.limit_bytes)
    for bad in ([4], [-1], [True], [1.0], "0", [0, 9]):
        with pytest.raises(InvalidIdError):
            arena.commit(bad)
        with pytest.raises(InvalidIdError):
            arena.release(bad)
    with pytest.raises(MemoryLimitError):
        arena.commit([0, 2])  # 3 pages would pass the 2-page limit
    with pytest.raises(MemoryLimitError):
        arena.set_limit(PAGE - 1)  # below the one committed page
    with pytest.raises(InvalidIdError):
        arena.resize(1)  # page 1 is committed
    with pytest.raises(InvalidIdError):
        arena.resize(5)  # past the reservation
    with pytest.raises(InvalidIdError):
        arena.is_committed(4)
    assert (arena.committed_pages(), arena.usable_pages, arena.limit_bytes) == before
    assert int(arena.tensor[PAGE:2 * PAGE].min()) == 3  # the committed page kept its bytes


def test_resize_bounds_the_pages_that_may_be_committed() -> None:
    arena = PageArena(4 * PAGE, page_size=PAGE)
    arena.resize(2)
    with pytest.raises(InvalidIdError):
        arena.commit([2])
    assert arena.commit([1]) == [1]
    arena.resize(4)
    assert arena.commit([3]) == [3]


def test_sleep_releases_everything_and_wake_commits_the_same_pages_reading_zero() -> None:
    arena = PageArena(4 * PAGE, page_size=PAGE)
    arena.commit([0, 3])
    arena.tensor.fill_(5)  # pages 1 and 2 too: written without a commit (the CPU allows it)
    assert arena.sleep() == 2 * PAGE and arena.asleep and arena.num_committed == 0
    for call in (lambda: arena.commit([1]), lambda: arena.release([0]), lambda: arena.resize(1),
                 arena.release_all, arena.sleep):
        with pytest.raises(AsleepError):
            call()
    assert arena.wake() == 2 * PAGE and not arena.asleep
    assert arena.committed_pages() == [0, 3]
    assert int(arena.tensor[:PAGE].max()) == 0 and int(arena.tensor[3 * PAGE:].max()) == 0
    assert arena.wake() == 0  # awake already: a no-op


def test_wake_past_a_limit_lowered_meanwhile_stays_asleep() -> None:
    budget = MemoryBudget(4 * PAGE)
    arena = PageArena(4 * PAGE, page_size=PAGE, budget=budget)
    arena.commit([0, 1])
    arena.sleep()
    other = PageArena(4 * PAGE, page_size=PAGE, budget=budget)
    other.commit([0, 1, 2])  # the other arena takes the budget while this one sleeps
    with pytest.raises(MemoryLimitError):
        arena.wake()
    assert arena.asleep and budget.committed_bytes == 3 * PAGE
    other.release([2])
    assert arena.wake() == 2 * PAGE and budget.committed_bytes == 4 * PAGE


def test_a_budget_shared_by_two_arenas_caps_their_sum() -> None:
    budget = MemoryBudget(3 * PAGE)
    a = PageArena(4 * PAGE, page_size=PAGE, budget=budget)
    b = PageArena(4 * PAGE, page_size=PAGE, budget=budget)
    a.commit([0, 1])
    with pytest.raises(MemoryLimitError):
        b.commit([0, 1])
    assert b.num_committed == 0 and budget.committed_bytes == 2 * PAGE
    a.release([0])
    b.commit([0, 1])  # the busy one grows where the idle one gave pages back
    assert budget.committed_bytes == 3 * PAGE == a.committed_bytes + b.committed_bytes
    with pytest.raises(MemoryLimitError):
        budget.set_limit(2 * PAGE)
    budget.set_limit(None)
    a.commit([2, 3])
    assert budget.committed_bytes == 5 * PAGE


# ---- the CUDA back end over the fake driver --------------------------------------------------------------

def test_cuda_calls_come_in_the_drivers_order_with_granular_sizes() -> None:
    drv = FakeDriver()
    g = drv.granularity
    arena = PageArena(3 * g + 1, device="cuda:0", backend=fake_cuda(drv))  # rounds up to 4 pages
    assert arena.num_pages == 4 and arena.page_size == g
    assert drv.names()[:3] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert "cuMemGetAllocationGranularity" in drv.names()
    (reserve,) = [args for name, args in drv.calls if name == "cuMemAddressReserve"]
    assert reserve[:2] == (4 * g, g)
    # page 0 mapped while torch is handed the address (it asks the driver which device it is on), then not
    made = [n for n in drv.names() if n.startswith("cuMem")]
    assert made[made.index("cuMemAddressReserve") + 1:] == ["cuMemCreate", "cuMemMap", "cuMemSetAccess",
                                                            "cuMemsetD8", "cuMemUnmap", "cuMemRelease"]
    assert drv.mapped == {} and drv.handles == {} and arena.num_committed == 0
    drv.calls.clear()
    arena.commit([0, 1, 3])  # two runs: pages 0-1 and page 3
    body = [n for n in drv.names() if n not in ("cuCtxPushCurrent", "cuCtxPopCurrent")]
    assert body == ["cuMemCreate", "cuMemMap", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemsetD8",
                    "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemsetD8"]
    base = min(drv.reservations)
    access = [args for name, args in drv.calls if name == "cuMemSetAccess"]
    assert [(a[0] - base, a[1]) for a in access] == [(0, 2 * g), (3 * g, g)]
    assert len(drv.mapped) == 3 and drv.context_depth == 0
    drv.calls.clear()
    arena.release([1, 3])
    body = [n for n in drv.names() if n not in ("cuCtxPushCurrent", "cuCtxPopCurrent")]
    assert body == ["cuCtxSynchronize", "cuMemUnmap", "cuMemRelease", "cuCtxSynchronize", "cuMemUnmap",
                    "cuMemRelease"]
    assert sorted(m - base for m in drv.mapped) == [0]
    arena.close()
    assert drv.reservations == {} and drv.handles == {} and drv.mapped == {} and drv.retained == 0


def test_cuda_out_of_memory_mid_run_undoes_the_run_and_changes_nothing() -> None:
    drv = FakeDriver(fail_create_after=3)
    arena = PageArena(8 * drv.granularity, device="cuda", backend=fake_cuda(drv))
    arena.commit([0])
    with pytest.raises(InsufficientMemoryError):
        arena.commit([2, 3, 4, 6])  # the 3rd handle fails inside the first run
    assert arena.committed_pages() == [0] and len(drv.handles) == 1 and len(drv.mapped) == 1
    drv.fail_create_after = None
    assert arena.commit([2, 3]) == [2, 3]


def test_cuda_page_size_must_be_a_multiple_of_the_granularity() -> None:
    drv = FakeDriver()
    with pytest.raises(ConfigError):
        PageArena(4 * drv.granularity, device="cuda", page_size=drv.granularity // 2, backend=fake_cuda(drv))


def test_the_fake_driver_matches_the_real_bindings_signatures() -> None:
    """Every driver function the back end calls exists in cuda-python with the parameters the fake takes."""
    driver = pytest.importorskip("cuda.bindings.driver")
    import inspect

    fake = FakeDriver()
    names = ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease",
             "cuCtxPushCurrent", "cuCtxPopCurrent", "cuCtxSynchronize", "cuGetErrorName",
             "cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemAddressFree", "cuMemCreate",
             "cuMemMap", "cuMemSetAccess", "cuMemsetD8", "cuMemUnmap", "cuMemRelease"]
    for name in names:
        first_line = getattr(driver, name).__doc__.splitlines()[0]  # "cuMemMap(ptr, size_t size, ...)"
        real = len([p for p in first_line[first_line.index("(") + 1:first_line.rindex(")")].split(",")
                    if p.strip()])
        assert real == len(inspect.signature(getattr(fake, name)).parameters), name
    for enum_name in ("CUmemAllocationType", "CUmemLocationType", "CUmemAllocationGranularity_flags",
                      "CUmemAccess_flags", "CUresult"):
        for member in getattr(fake, enum_name):
            assert int(getattr(getattr(driver, enum_name), member.name)) == int(member), member


# ---- the state machine -----------------------------------------------------------------------------------

PAGES = st.lists(st.integers(0, 7), max_size=4) | st.lists(st.integers(-1, 9), max_size=3)


class ArenaMachine(RuleBasedStateMachine):
    """An arena of 8 pages (and a second one sharing its budget) against a model of pages."""

    BACKEND = "cpu"
    N = 8

    def __init__(self) -> None:
        super().__init__()
        if self.BACKEND == "cpu":
            self.page, kwargs = PAGE, {"page_size": PAGE}
        else:
            self.drv = FakeDriver()
            self.page, kwargs = self.drv.granularity, {"device": "cuda", "backend": fake_cuda(self.drv)}
        self.budget = MemoryBudget(None)
        self.arena = PageArena(self.N * self.page, budget=self.budget, **kwargs)
        self.other = PageArena(2 * self.page, budget=self.budget, **kwargs)
        self.committed: set[int] = set()
        self.content: dict[int, int] = {}  # page -> the byte written into it since its commit
        self.usable, self.limit, self.budget_limit, self.asleep = self.N, None, None, None
        self.other_pages = 0

    def _valid(self, pages: list[int], bound: int) -> bool:
        return all(0 <= p < bound for p in pages)

    def _room(self, new: int) -> bool:
        mine = (len(self.committed) + new) * self.page
        total = (len(self.committed) + self.other_pages + new) * self.page
        return ((self.limit is None or mine <= self.limit)
                and (self.budget_limit is None or total <= self.budget_limit))

    @rule(pages=PAGES, value=st.integers(0, 255))
    def commit(self, pages: list[int], value: int) -> None:
        """Commit, then write ``value`` into every page named (all of them committed now)."""
        if self.asleep is not None:
            with pytest.raises(AsleepError):
                self.arena.commit(pages)
            return
        if not self._valid(pages, self.usable):
            with pytest.raises(InvalidIdError):
                self.arena.commit(pages)
            return
        new = sorted(set(pages) - self.committed)
        if not self._room(len(new)):
            with pytest.raises(MemoryLimitError):
                self.arena.commit(pages)
            return
        assert self.arena.commit(pages) == new
        self.committed |= set(new)
        for p in new:
            self.content[p] = 0
        self.same_bytes()  # fresh pages read 0, the others what was written
        if self.BACKEND == "cpu":
            for p in pages:
                self.arena.tensor[p * self.page:(p + 1) * self.page].fill_(value)
                self.content[p] = value

    @rule(pages=PAGES)
    def release(self, pages: list[int]) -> None:
        if self.asleep is not None:
            with pytest.raises(AsleepError):
                self.arena.release(pages)
            return
        if not self._valid(pages, self.N):
            with pytest.raises(InvalidIdError):
                self.arena.release(pages)
            return
        assert self.arena.release(pages) == sorted(set(pages) & self.committed)
        self.committed -= set(pages)

    @rule(size=st.integers(-1, 9))
    def resize(self, size: int) -> None:
        if self.asleep is not None:
            with pytest.raises(AsleepError):
                self.arena.resize(size)
        elif not 0 <= size <= self.N or any(p >= size for p in self.committed):
            with pytest.raises(InvalidIdError):
                self.arena.resize(size)
        else:
            self.arena.resize(size)
            self.usable = size

    @rule(pages=st.none() | st.integers(0, 9))
    def set_limit(self, pages: int | None) -> None:
        limit = None if pages is None else pages * self.page
        if limit is not None and limit < len(self.committed) * self.page:
            with pytest.raises(MemoryLimitError):
                self.arena.set_limit(limit)
        else:
            self.arena.set_limit(limit)
            self.limit = limit

    @rule(pages=st.none() | st.integers(0, 10))
    def set_budget(self, pages: int | None) -> None:
        limit = None if pages is None else pages * self.page
        if limit is not None and limit < (len(self.committed) + self.other_pages) * self.page:
            with pytest.raises(MemoryLimitError):
                self.budget.set_limit(limit)
        else:
            self.budget.set_limit(limit)
            self.budget_limit = limit

    @rule(count=st.integers(0, 2))
    def other_commits(self, count: int) -> None:
        """The arena beside this one takes or gives back budget."""
        self.other.release_all()
        self.other_pages = 0
        extra = (len(self.committed) + count) * self.page
        if self.budget_limit is not None and extra > self.budget_limit:
            with pytest.raises(MemoryLimitError):
                self.other.commit(range(count))
            return
        self.other.commit(range(count))
        self.other_pages = count

    @precondition(lambda self: self.asleep is None)
    @rule()
    def sleep(self) -> None:
        assert self.arena.sleep() == len(self.committed) * self.page
        self.asleep, self.committed = set(self.committed), set()

    @precondition(lambda self: self.asleep is not None)
    @rule()
    def wake(self) -> None:
        pages = self.asleep
        assert pages is not None
        self.committed = pages
        if not self._room(0):
            self.committed = set()
            with pytest.raises(MemoryLimitError):
                self.arena.wake()
            return
        assert self.arena.wake() == len(pages) * self.page
        self.asleep = None
        self.content.update(dict.fromkeys(pages, 0))

    @invariant()
    def same_pages(self) -> None:
        assert self.arena.committed_pages() == sorted(self.committed)
        assert self.arena.committed_bytes == len(self.committed) * self.page
        assert self.budget.committed_bytes == (len(self.committed) + self.other_pages) * self.page
        assert self.arena.usable_pages == self.usable and self.arena.asleep == (self.asleep is not None)
        if self.BACKEND != "cpu":  # the driver maps exactly the committed pages
            assert len(self.drv.mapped) == len(self.committed) + self.other_pages
            assert self.drv.context_depth == 0

    @invariant()
    def same_bytes(self) -> None:
        if self.BACKEND == "cpu":
            for p in self.committed:
                chunk = self.arena.tensor[p * self.page:(p + 1) * self.page]
                assert int(chunk.min()) == int(chunk.max()) == self.content[p]


class CUDAArenaMachine(ArenaMachine):
    BACKEND = "cuda"


TestCPUArena = ArenaMachine.TestCase
TestCPUArena.settings = settings(max_examples=60, stateful_step_count=30)
TestCUDAArena = CUDAArenaMachine.TestCase
TestCUDAArena.settings = settings(max_examples=60, stateful_step_count=30)
