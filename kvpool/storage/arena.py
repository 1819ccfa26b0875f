"""``PageArena``: address space reserved once, physical memory committed and released in pages under it.

A KV cache on an arena keeps one tensor over the whole reservation, so the tensor, every per-layer view,
every slot mapping and every block table keep their addresses for the life of the cache (no copy, no new
tensor), while its physical memory follows what is in use: a page is committed before a block on it is
first handed out and released once no block on it is (:mod:`kvpool.storage.page_map` says which blocks
live on which page). One interface, two back ends:

* CPU (:mod:`kvpool.storage.arena_cpu`): an anonymous private ``mmap`` of the reservation; a commit faults
  the pages in (``madvise(MADV_POPULATE_WRITE)``), a release gives them back (``madvise(MADV_DONTNEED)``),
  after which they read 0. The tensor is ``torch.frombuffer`` over the mapping (no copy).
* CUDA (:mod:`kvpool.storage.arena_cuda`): the driver's virtual memory management API through NVIDIA's
  ``cuda-python`` bindings: ``cuMemAddressReserve`` once, then per page ``cuMemCreate`` + ``cuMemMap`` and
  ``cuMemSetAccess`` per run of pages on commit, ``cuMemUnmap`` + ``cuMemRelease`` on release (the
  design kvcached and vLLM 0.34's extensible KV cache use).

Pages are ``page_size`` bytes (2 MiB by default, a multiple of the back end's granularity: the OS page on
the CPU, ``cuMemGetAllocationGranularity`` on CUDA). A freshly committed page reads 0 (on CUDA the back end
clears it). Reading or writing a page that is not committed is the caller's fault: on CUDA it is an illegal
address; on the CPU it reads 0 and a write commits it behind the arena's back (the next release drops it).

Two bounds on what may be committed, both checked before anything changes: ``limit_bytes`` (this arena's
own; lowering it below what is committed is refused) and a :class:`MemoryBudget` that several arenas share
(two models in one process under one memory limit). ``resize`` bounds which pages may be committed (the
prefix ``[0, usable_pages)`` of the reservation). ``sleep`` releases every page and ``wake`` commits the same
pages again (reading 0). Every call validates its whole argument first: a call that raises changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.errors import AsleepError, ConfigError, InvalidIdError, MemoryLimitError
from kvpool.numeric import as_id_list, as_int
from kvpool.units import human_bytes, plural

if TYPE_CHECKING:
    import torch

#: Bytes per page unless asked otherwise: the CUDA granularity of every current GPU and the x86-64 huge page.
DEFAULT_PAGE_SIZE = 2 << 20


class ArenaBackend(Protocol):
    """What a back end does for a :class:`PageArena`: reserve, commit and release runs of pages.

    ``granularity``: the unit page sizes must be a multiple of (bytes). ``reserve(nbytes, page_size)`` is
    called once; ``commit(first, count)`` backs pages ``first .. first + count - 1`` with physical memory
    that reads 0, or raises :class:`InsufficientMemoryError` having committed none of them;
    ``release(first, count)`` gives committed pages back; ``tensor()`` is a ``uint8 [nbytes]`` tensor over
    the whole reservation (no copy, the same address for its whole life); ``close()`` releases everything.
    """

    device: torch.device
    granularity: int

    def reserve(self, nbytes: int, page_size: int) -> None: ...

    def commit(self, first: int, count: int) -> None: ...

    def release(self, first: int, count: int) -> None: ...

    def tensor(self) -> torch.Tensor: ...

    def close(self) -> None: ...


class MemoryBudget:
    """A limit in bytes that several arenas commit under (two engines in one process, one memory limit).

    Thread-safe: arenas of engines running in different threads may charge it at once. ``limit_bytes``:
    None for no limit. Raises :class:`MemoryLimitError` from :meth:`charge` past the limit and from
    :meth:`set_limit` below what is committed.
    """

    def __init__(self, limit_bytes: int | None = None) -> None:
        self._lock = threading.Lock()
        self._committed = 0
        self._limit = _check_limit(limit_bytes)

    @property
    def limit_bytes(self) -> int | None:
        """The limit in bytes (None: none)."""
        return self._limit

    @property
    def committed_bytes(self) -> int:
        """Bytes the arenas under this budget hold committed now."""
        return self._committed

    def set_limit(self, limit_bytes: int | None) -> None:
        """Change the limit at run time; below :attr:`committed_bytes` it raises MemoryLimitError."""
        limit = _check_limit(limit_bytes)
        with self._lock:
            if limit is not None and limit < self._committed:
                raise MemoryLimitError(f"a limit of {human_bytes(limit)} is below the "
                                       f"{human_bytes(self._committed)} committed under this budget")
            self._limit = limit

    def charge(self, nbytes: int) -> None:
        """Count ``nbytes`` more as committed, or raise MemoryLimitError (nothing counted)."""
        with self._lock:
            if self._limit is not None and self._committed + nbytes > self._limit:
                raise MemoryLimitError(f"committing {human_bytes(nbytes)} more would pass the budget's "
                                       f"limit of {human_bytes(self._limit)} "
                                       f"({human_bytes(self._committed)} committed)")
            self._committed += nbytes

    def credit(self, nbytes: int) -> None:
        """Count ``nbytes`` as given back."""
        with self._lock:
            self._committed -= nbytes

    def __repr__(self) -> str:
        limit = "none" if self._limit is None else human_bytes(self._limit)
        return f"MemoryBudget(committed={human_bytes(self._committed)}, limit={limit})"


@dataclass(frozen=True)
class ElasticConfig:
    """How a store sits on a page arena (the ``elastic=`` option of the KV caches and the state cache).

    Attributes:
        page_size: bytes per page (default 2 MiB), a multiple of the back end's granularity.
        limit_bytes: the arena's own limit on committed bytes (None: none).
        budget: a :class:`MemoryBudget` shared with other arenas (None: none).
        reserve_pages: committed pages with no block on them that a store keeps instead of releasing at
            once, against churn (kvcached keeps 5 to 10); ``trim()`` releases them too.
        backend: a factory ``(device) -> ArenaBackend`` replacing the default back end of the device
            (tests: the CUDA back end over a fake driver).
    """

    page_size: int = DEFAULT_PAGE_SIZE
    limit_bytes: int | None = None
    budget: MemoryBudget | None = None
    reserve_pages: int = 0
    backend: Callable[[torch.device], ArenaBackend] | None = None

    def arena(self, nbytes: int, device: str | torch.device) -> PageArena:
        """A :class:`PageArena` of at least ``nbytes`` on ``device`` with these settings."""
        return PageArena(nbytes, device=device, page_size=self.page_size, limit_bytes=self.limit_bytes,
                         budget=self.budget, backend=self.backend)


def elastic_config(elastic: bool | ElasticConfig) -> ElasticConfig | None:
    """The ``elastic=`` option of a store as a config (True: the defaults), or None for a fixed buffer.
    Raises ConfigError for anything else."""
    if isinstance(elastic, ElasticConfig):
        return elastic
    if elastic is True:
        return ElasticConfig()
    if elastic is False:
        return None
    raise ConfigError(f"elastic must be True, False or an ElasticConfig, got {elastic!r}")


class PageArena:
    """A reservation of ``num_pages`` pages of ``page_size`` bytes, committed and released page by page.

    Args:
        nbytes: bytes to reserve (rounded up to whole pages); the tensor is ``uint8 [num_pages * page_size]``.
        device: ``"cpu"`` or a CUDA device.
        page_size: bytes per page (default 2 MiB); a multiple of the back end's granularity.
        limit_bytes: at most this many bytes committed at once (None: no limit of its own).
        budget: a :class:`MemoryBudget` shared with other arenas, charged for every page committed.
        backend: a factory ``(device) -> ArenaBackend`` instead of the device's own back end.

    Raises:
        ConfigError: ``nbytes`` < 1, a page size that is not a positive multiple of the granularity, a
            device with no back end (not CPU or CUDA), or a reservation the back end refuses.
    """

    def __init__(self, nbytes: int, *, device: str | torch.device = "cpu", page_size: int = DEFAULT_PAGE_SIZE,
                 limit_bytes: int | None = None, budget: MemoryBudget | None = None,
                 backend: Callable[[torch.device], ArenaBackend] | None = None) -> None:
        nbytes = as_int(nbytes, "nbytes", minimum=1, error=ConfigError)
        page_size = as_int(page_size, "page_size", minimum=1, error=ConfigError)
        if budget is not None and not isinstance(budget, MemoryBudget):
            raise ConfigError(f"budget must be a MemoryBudget, got {type(budget).__name__}")
        self._backend = (backend or default_backend)(_device(device))
        granularity = self._backend.granularity
        if page_size % granularity:
            raise ConfigError(f"page_size must be a multiple of the {self._backend.device.type} granularity "
                              f"{human_bytes(granularity)}, got {page_size} B")
        self.page_size = page_size
        self.num_pages = -(-nbytes // page_size)
        self._limit = _check_limit(limit_bytes)
        self._budget = budget
        self._backend.reserve(self.num_pages * page_size, page_size)
        self.device = self._backend.device
        self._committed = bytearray(self.num_pages)
        self._num_committed = 0
        self._usable = self.num_pages
        self._asleep: list[int] | None = None
        self.tensor = self._backend.tensor()

    # ------------------------------------------------------------------------------------------ sizes
    @property
    def nbytes(self) -> int:
        """Bytes reserved: ``num_pages * page_size``."""
        return self.num_pages * self.page_size

    @property
    def usable_pages(self) -> int:
        """Pages ``[0, usable_pages)`` may be committed (:meth:`resize`); ``num_pages`` at first."""
        return self._usable

    @property
    def num_committed(self) -> int:
        """Pages committed now."""
        return self._num_committed

    @property
    def committed_bytes(self) -> int:
        """Bytes committed now: ``num_committed * page_size``."""
        return self._num_committed * self.page_size

    @property
    def limit_bytes(self) -> int | None:
        """This arena's own limit on committed bytes (None: none); a shared budget may bound it further."""
        return self._limit

    @property
    def budget(self) -> MemoryBudget | None:
        """The budget shared with other arenas, if any."""
        return self._budget

    @property
    def asleep(self) -> bool:
        """True between :meth:`sleep` and :meth:`wake`."""
        return self._asleep is not None

    def is_committed(self, page: int) -> bool:
        """Whether page ``page`` is committed. Raises InvalidIdError outside ``[0, num_pages)``."""
        page = as_int(page, "page", minimum=0, maximum=self.num_pages - 1, error=InvalidIdError)
        return bool(self._committed[page])

    def committed_pages(self) -> list[int]:
        """The committed pages, ascending."""
        return [p for p, c in enumerate(self._committed) if c]

    def view(self, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A contiguous ``dtype`` tensor of ``shape`` over bytes ``[offset, offset + its bytes)`` of the
        reservation (a view of :attr:`tensor`: same memory, no copy). ``offset`` must be a multiple of the
        dtype's size. Raises ConfigError when it does not fit."""
        count = 1
        for size in shape:
            count *= size
        end = offset + count * dtype.itemsize
        if offset < 0 or offset % dtype.itemsize or end > self.nbytes:
            raise ConfigError(f"a {dtype} tensor {list(shape)} at byte {offset} does not fit the arena's "
                              f"{human_bytes(self.nbytes)}")
        return self.tensor[offset:end].view(dtype).view(shape)

    # ------------------------------------------------------------------------------------ commit etc.
    def commit(self, pages: Iterable[int]) -> list[int]:
        """Commit ``pages`` (ids, repeats and committed pages allowed); return those newly committed,
        ascending. They read 0.

        Raises:
            InvalidIdError: a page outside ``[0, usable_pages)`` or not an integer.
            MemoryLimitError: the new pages would pass ``limit_bytes`` or the budget's limit.
            InsufficientMemoryError: the back end could not commit them (out of memory).
            AsleepError: the arena is asleep.
        Nothing is committed when it raises.
        """
        self.check_awake()
        new = sorted({p for p in self._checked(pages) if not self._committed[p]})
        if new:
            self._commit_new(new)
        return new

    def release(self, pages: Iterable[int]) -> list[int]:
        """Release ``pages`` (repeats and uncommitted pages allowed); return those released, ascending.
        Their contents are gone: committed again they read 0. Raises InvalidIdError (a page outside
        ``[0, num_pages)``) or AsleepError; nothing is released then."""
        self.check_awake()
        gone = sorted({p for p in self._checked(pages, self.num_pages) if self._committed[p]})
        self._release(gone)
        return gone

    def release_all(self) -> int:
        """Release every committed page; return how many. Raises AsleepError."""
        self.check_awake()
        gone = self.committed_pages()
        self._release(gone)
        return len(gone)

    def resize(self, usable_pages: int) -> None:
        """Let only pages ``[0, usable_pages)`` be committed from now on (at most ``num_pages``: the
        reservation never grows). Raises InvalidIdError for a size outside ``[0, num_pages]`` or one
        that would leave a committed page outside (release it first), AsleepError; nothing changes then."""
        self.check_awake()
        size = as_int(usable_pages, "usable_pages", minimum=0, maximum=self.num_pages, error=InvalidIdError)
        beyond = [p for p in range(size, self._usable) if self._committed[p]]
        if beyond:
            raise InvalidIdError(f"pages {_head(beyond)} beyond {size} are committed: release them first")
        self._usable = size

    def set_limit(self, limit_bytes: int | None) -> None:
        """Change this arena's own limit at run time (None: none). Raises MemoryLimitError for a limit
        below :attr:`committed_bytes` (nothing changes then), ConfigError for one that is not a count."""
        limit = _check_limit(limit_bytes)
        if limit is not None and limit < self.committed_bytes:
            raise MemoryLimitError(f"a limit of {human_bytes(limit)} is below the "
                                   f"{human_bytes(self.committed_bytes)} this arena has committed")
        self._limit = limit

    def sleep(self) -> int:
        """Release every committed page and remember which they were (:meth:`wake` commits them again);
        return the bytes given back. Until :meth:`wake`, commit, release and resize raise AsleepError."""
        self.check_awake()
        pages = self.committed_pages()
        self._release(pages)
        self._asleep = pages
        return len(pages) * self.page_size

    def wake(self) -> int:
        """Commit again the pages :meth:`sleep` released (reading 0); return the bytes committed. A no-op
        when awake. Raises MemoryLimitError / InsufficientMemoryError (still asleep, nothing committed)."""
        if self._asleep is None:
            return 0
        pages = self._asleep
        if pages:
            self._commit_new(pages)
        self._asleep = None
        return len(pages) * self.page_size

    def close(self) -> None:
        """Release every page and the reservation. The tensor and every view of it must be unused."""
        if self._asleep is None:
            self._release(self.committed_pages())
        self._asleep = None
        self._backend.close()

    def stats(self) -> dict[str, Any]:
        """``device``, ``page_size``, ``reserved_bytes``, ``usable_bytes``, ``committed_bytes``,
        ``committed_pages``, ``limit_bytes`` (None: none) and ``asleep``."""
        return {"device": str(self.device), "page_size": self.page_size, "reserved_bytes": self.nbytes,
                "usable_bytes": self._usable * self.page_size, "committed_bytes": self.committed_bytes,
                "committed_pages": self._num_committed, "limit_bytes": self._limit, "asleep": self.asleep}

    def __repr__(self) -> str:
        pages, size = plural(self.num_pages, "page"), human_bytes(self.page_size)
        return f"PageArena({self.device}, {pages} of {size}, {self._num_committed} committed)"

    # ---------------------------------------------------------------------------------------- helpers
    def _checked(self, pages: Iterable[int], bound: int | None = None) -> list[int]:
        """``pages`` as ints, each in ``[0, bound)`` (default: the usable pages); InvalidIdError."""
        ids = as_id_list(pages, "pages")
        bound = self._usable if bound is None else bound
        bad = [p for p in ids if not 0 <= p < bound]
        if bad:
            raise InvalidIdError(f"pages must be in [0, {bound}), got {_head(bad)}")
        return ids

    def check_awake(self) -> None:
        """Raise AsleepError while the arena is asleep."""
        if self._asleep is not None:
            raise AsleepError("the arena is asleep (sleep() released its pages): call wake() first")

    def _commit_new(self, pages: list[int]) -> None:
        """Commit ``pages`` (sorted, none committed) under the limits, run by run; all or none."""
        nbytes = len(pages) * self.page_size
        if self._limit is not None and self.committed_bytes + nbytes > self._limit:
            raise MemoryLimitError(f"committing {plural(len(pages), 'page')} ({human_bytes(nbytes)}) would "
                                   f"pass the arena's limit of {human_bytes(self._limit)} "
                                   f"({human_bytes(self.committed_bytes)} committed)")
        if self._budget is not None:
            self._budget.charge(nbytes)
        done: list[tuple[int, int]] = []
        try:
            for first, count in runs(pages):
                self._backend.commit(first, count)
                done.append((first, count))
        except BaseException:
            for first, count in done:
                self._backend.release(first, count)
            if self._budget is not None:
                self._budget.credit(nbytes)
            raise
        for p in pages:
            self._committed[p] = 1
        self._num_committed += len(pages)

    def _release(self, pages: list[int]) -> None:
        """Release ``pages`` (sorted, all committed), run by run."""
        for first, count in runs(pages):
            self._backend.release(first, count)
        for p in pages:
            self._committed[p] = 0
        self._num_committed -= len(pages)
        if self._budget is not None and pages:
            self._budget.credit(len(pages) * self.page_size)


def runs(pages: list[int]) -> Iterator[tuple[int, int]]:
    """``(first, count)`` of each maximal run of consecutive ids in ``pages`` (sorted, distinct)."""
    i = 0
    while i < len(pages):
        j = i + 1
        while j < len(pages) and pages[j] == pages[j - 1] + 1:
            j += 1
        yield pages[i], j - i
        i = j


class CountingBackend:
    """A back end that holds no memory and only counts: a model of what an arena of that layout would
    commit (a trace replay's elastic pool). Its tensor is on the ``meta`` device (no bytes); granularity 1."""

    granularity = 1

    def __init__(self, device: torch.device | None = None) -> None:
        self._nbytes = 0

    @property
    def device(self) -> torch.device:
        """The ``meta`` device (torch imported here: a replay that only counts pages imports none)."""
        import torch

        return torch.device("meta")

    def reserve(self, nbytes: int, page_size: int) -> None:
        self._nbytes = nbytes

    def commit(self, first: int, count: int) -> None:
        pass

    def release(self, first: int, count: int) -> None:
        pass

    def tensor(self) -> torch.Tensor:
        import torch

        return torch.empty(self._nbytes, dtype=torch.uint8, device="meta")

    def close(self) -> None:
        pass


def default_backend(device: torch.device) -> ArenaBackend:
    """The back end of ``device``: :class:`~kvpool.storage.arena_cpu.CPUBackend` on the CPU,
    :class:`~kvpool.storage.arena_cuda.CUDABackend` on CUDA (it imports ``cuda-python``). ConfigError
    for any other device."""
    if device.type == "cpu":
        from kvpool.storage.arena_cpu import CPUBackend

        return CPUBackend()
    if device.type == "cuda":
        from kvpool.storage.arena_cuda import CUDABackend

        return CUDABackend(device)
    raise ConfigError(f"a page arena needs a CPU or CUDA device, got {device}")


def _device(device: str | torch.device) -> torch.device:
    import torch  # at first use: importing this module imports no torch

    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"not a device: {device!r} ({exc})") from None


def _check_limit(limit_bytes: int | None) -> int | None:
    return None if limit_bytes is None else as_int(limit_bytes, "limit_bytes", minimum=0, error=ConfigError)


def _head(values: list[int]) -> str:
    return f"{values[:8]}{'...' if len(values) > 8 else ''}"

