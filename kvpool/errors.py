"""Every error kvpool raises. All subclass :class:`KVPoolError`; an operation that raises changes nothing."""

from __future__ import annotations


class KVPoolError(Exception):
    """Base class of every kvpool error."""


class ConfigError(KVPoolError, ValueError):
    """A model config, KV cache spec or CLI value that cannot be used (names the field and the value)."""


class InsufficientMemoryError(KVPoolError):
    """The memory budget cannot hold the smallest usable pool (says how many bytes are missing)."""


class MemoryLimitError(InsufficientMemoryError):
    """Committing memory would pass a limit (a page arena's own, or a budget several arenas share), or a
    limit would be set below what is committed now; nothing was committed and the limit is unchanged."""


class AsleepError(KVPoolError, RuntimeError):
    """An operation on memory that ``sleep()`` gave back: call ``wake()`` first; nothing changed."""


class DriverError(KVPoolError, RuntimeError):
    """A device driver call failed for a reason other than memory (the message names the call and the
    driver's error)."""


class OutOfBlocksError(KVPoolError):
    """An allocation asked for more blocks, pages or slots than are available; nothing was handed out.

    ``blocks_needed``: the pool size in blocks that would hold the request, where the raiser knows it
    (the engine's "this request can never fit"); None otherwise."""

    def __init__(self, *args: object, blocks_needed: int | None = None) -> None:
        super().__init__(*args)
        self.blocks_needed = blocks_needed


class PinLimitError(KVPoolError):
    """A pin that would keep more blocks pinned than the pool's pin cap allows; nothing was pinned."""


class InvalidArgumentError(KVPoolError, ValueError):
    """A bad argument: negative count, wrong shape, dtype, device or layer, out-of-range slot."""


class InvalidIdError(InvalidArgumentError):
    """A block, page, slot or row id that is out of range, negative, reserved, or repeated in one call."""


class DoubleFreeError(KVPoolError):
    """Freeing an id that is not allocated (or a ref count that would go below zero)."""


class IntegrityError(KVPoolError, AssertionError):
    """``check_integrity()`` found a broken invariant (see DESIGN.md); the message names it."""


class TraceFormatError(KVPoolError, ValueError):
    """A malformed trace row; the message names the file and line. ``skippable``: a row that
    ``skip_malformed=True`` would have skipped and counted (not a bad header or a file that is not text)."""

    def __init__(self, *args: object, skippable: bool = False) -> None:
        super().__init__(*args)
        self.skippable = skippable


class CollectiveError(KVPoolError, RuntimeError):
    """A torch.distributed collective failed on this rank: another rank stopped, or the group broke."""


class RankFailedError(KVPoolError, RuntimeError):
    """A tensor-parallel rank failed (raised, or was killed); the others were stopped.

    Attributes: ``rank`` (the rank whose failure came first, counting a rank's own error before the
    collective errors it caused on the others) and ``traceback`` (its formatted traceback, or "")."""

    def __init__(self, message: str, rank: int = -1, traceback: str = "") -> None:
        super().__init__(message)
        self.rank, self.traceback = rank, traceback

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.rank, self.traceback)


class ModelError(KVPoolError, RuntimeError):
    """The model's own code (transformers) raised while loading or running it; the message names the model,
    the transformers version and the original error (chained as ``__cause__``). Unlike the errors above,
    the run it stopped is not undone: an engine whose forward raised is not reused."""
