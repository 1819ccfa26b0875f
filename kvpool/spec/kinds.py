"""The memory kinds: one class per kind of memory a model keeps for a request, each the owner of its rules.

A kind says, in plain numbers (tokens, blocks of ``block_size`` tokens, positions):

* **the blocks a request holds and may skip**: :meth:`MemoryKind.skipped_blocks` (leading blocks no later
  query reads again: freed, the null block in their place), :meth:`MemoryKind.skip_moves_at` (the computed
  tokens at which that count next grows), :meth:`MemoryKind.max_blocks` (the most a request holds at once:
  its share of a plan) and :meth:`MemoryKind.steady_blocks` (what a request running past its window holds);
* **its longest hit**: :meth:`MemoryKind.hit_start` (the first block a prefix of k blocks needs) and
  :meth:`MemoryKind.longest_hit` (the longest prefix whose needed blocks are all cached);
* **what attention reads**: :meth:`MemoryKind.window_start` (the first key a query reads), the mask rule
  built on it, :meth:`MemoryKind.kernel_bounds` (the paged kernel's window and chunk) and
  :attr:`MemoryKind.model_sliding_window` (what a model passes as ``sliding_window``);
* **its event metadata**: :attr:`MemoryKind.event_name` and :attr:`MemoryKind.event_window` (vLLM's
  ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``).

The kinds, with their formulas (B the block size):

=======================  ============================  ==============================  ======================
kind                     a query at q reads            skipped blocks at n tokens      a prefix of k blocks
=======================  ============================  ==============================  ======================
:class:`FullAttention`   keys ``0 .. q``               0                               needs blocks 0 .. k-1
:class:`SlidingWindow`   keys in ``(q - W, q]``        ``max(0, (n - W + 1) // B)``    skipped(kB) .. k-1
:class:`ChunkedLocal`    keys ``C (q // C) .. q``      ``C (n // C) // B``             skipped(kB) .. k-1
:class:`RecurrentState`  its state (all before q)      none (one state a request)      the state at k only
=======================  ============================  ==============================  ======================

(transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - W``; ``chunked_overlay``; vLLM's
``SlidingWindowSpec`` / ``ChunkedLocalAttentionSpec`` / ``MambaSpec``.) A recurrent layer's state after
token t sums up the whole prefix, so a cached prefix of k blocks is reusable only where the state at its
end was saved: its hit needs the one checkpoint at boundary k.

Adding a kind is one class here (a subclass of :class:`MemoryKind` overriding the rules that differ) and
its tests; a kind that Hugging Face configs name in ``layer_types`` also gets that name in
:class:`kvpool.spec.kv.LayerKind` and :data:`ATTENTION_KINDS`. This module imports nothing of kvpool above
the ground floor and is compiled with the allocators' hot path (``kvpool._native.COMPILED_MODULES``), so
the KV cache coordinator calls these rules natively.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.errors import ConfigError

#: Computed tokens that never come: what :meth:`MemoryKind.skip_moves_at` gives a kind that skips nothing.
NEVER = 2**62


def cdiv(a: int, b: int) -> int:
    """Integer ceiling of ``a / b`` (no float rounding)."""
    return -(-a // b)


class MemoryKind:
    """The rules of one kind of per-request memory (see the module docstring). ``window``: W (sliding) or C
    (chunked) tokens, 0 for a kind without one. Kinds are values: equal when of one class and window."""

    def __init__(self, window: int = 0) -> None:
        self.window = window

    # ---- names --------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The kind's name: the Hugging Face layer type (``"full_attention"``, ...) for attention kinds."""
        return "full_attention"

    @property
    def event_name(self) -> str:
        """vLLM's ``kv_cache_spec_kind`` of the kind (``KVCacheSpecKind``, vllm/v1/kv_cache_interface.py)."""
        return "full_attention"

    @property
    def event_window(self) -> int | None:
        """vLLM's ``kv_cache_spec_sliding_window``: the window of a sliding kind, else None."""
        return None

    def describe(self) -> str:
        """``"sliding_attention (window 1024)"``, ``"chunked_attention (chunk 8192)"`` or
        ``"full_attention"``."""
        return self.name

    def window_phrase(self) -> str:
        """The window for people (``"sliding window of 4096 tokens"``); ``""`` without one."""
        return ""

    # ---- the blocks a request holds -----------------------------------------------------------------

    @property
    def needs_whole_prefix(self) -> bool:
        """Whether a cached prefix needs every one of its blocks (:meth:`hit_start` always 0): its longest hit
        is the plain cached prefix of the block hashes."""
        return False

    @property
    def frees_blocks(self) -> bool:
        """Whether a request's leading blocks leave the kind's reach before it ends (then its table holds the
        pool's null block in their place, so a pool serving the kind reserves one)."""
        return False

    def skipped_blocks(self, num_tokens: int, block_size: int) -> int:
        """Leading blocks that no query at position ``>= num_tokens`` reads again."""
        return 0

    def skip_moves_at(self, skipped: int, block_size: int) -> int:
        """The fewest computed tokens at which :meth:`skipped_blocks` exceeds ``skipped`` (:data:`NEVER` for a
        kind that skips nothing)."""
        return NEVER

    def max_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, computing ``chunk_tokens`` tokens
        per step and freeing :meth:`skipped_blocks` before each: ``cdiv(n, B)`` for full attention."""
        return cdiv(num_tokens, block_size)

    def steady_blocks(self, chunk_tokens: int, block_size: int) -> int:
        """The blocks a request running past its window holds (its least need to keep running): one block for
        a kind that holds every token (it grows one block at a time)."""
        return 1

    # ---- the longest hit ----------------------------------------------------------------------------

    def hit_start(self, num_blocks: int, block_size: int) -> int:
        """The first block a cached prefix of ``num_blocks`` blocks needs (those before it are skipped)."""
        return self.skipped_blocks(num_blocks * block_size, block_size)

    def longest_hit(self, bound: int, block_size: int, cached: Callable[[int], bool]) -> int:
        """The longest k <= ``bound`` whose blocks ``hit_start(k) .. k - 1`` all hold: ``cached(i)`` says
        whether block i of the prefix is. A scan down from the bound, skipping past each missing block (no
        prefix longer than it can be restored), so each block is asked at most once: O(bound)."""
        k, i = bound, bound - 1
        while k > 0:
            start = self.hit_start(k, block_size)
            while i >= start and cached(i):
                i -= 1
            if i < start:
                return k
            k, i = i, i - 1
        return 0

    # ---- what attention reads -----------------------------------------------------------------------

    def window_start(self, position: int) -> int:
        """The first key position a query at ``position`` reads (0: every earlier key)."""
        return 0

    def window_starts(self, start: int, end: int) -> list[int]:
        """:meth:`window_start` of each position ``start .. end - 1`` (one call for a request's queries)."""
        return [self.window_start(p) for p in range(start, end)]

    def kernel_bounds(self) -> tuple[int, int]:
        """``(window, chunk)`` as the paged kernel takes them: W for a sliding window, C for chunks, 0 for
        none."""
        return 0, 0

    @property
    def model_sliding_window(self) -> int | None:
        """The ``sliding_window`` a transformers attention layer of the kind passes (None: none)."""
        return None

    # ---- a spec's checks (rules of the class: asked before a window is known) ------------------------

    @staticmethod
    def window_field() -> str:
        """The spec field that gives the kind's window when a layer names none (``""``: it has none)."""
        return ""

    @staticmethod
    def check_window(window: int, block_size: int, what: str) -> None:
        """Raise ConfigError (``what`` names the window and its value) for a window the kind cannot have at
        ``block_size``."""

    # ---- values -------------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryKind) and type(other) is type(self) and other.window == self.window

    def __hash__(self) -> int:
        return hash((self.name, self.window))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.window})" if self.window else f"{type(self).__name__}()"

    def __reduce__(self) -> tuple[type[MemoryKind], tuple[int]]:
        """Pickled as its class and window (a tensor-parallel rank, a sweep's worker rebuilds it)."""
        return type(self), (self.window,)


class FullAttention(MemoryKind):
    """Every key: a request holds all its blocks; a prefix is a hit where all its blocks are cached."""

    def __init__(self, window: int = 0) -> None:
        super().__init__(0)  # no window, whatever a caller passes

    @property
    def needs_whole_prefix(self) -> bool:
        return True

    def longest_hit(self, bound: int, block_size: int, cached: Callable[[int], bool]) -> int:
        """The cached prefix: a scan up to the first missing block (O(hit))."""
        k = 0
        while k < bound and cached(k):
            k += 1
        return k


class _Windowed(MemoryKind):
    """A kind whose queries read a bounded window of keys: its blocks leave the window as a request grows."""

    def __init__(self, window: int = 0) -> None:
        if window < 1:
            raise ConfigError(f"a {self.name} layer needs a window of at least 1 token, got {window}")
        super().__init__(window)

    @property
    def frees_blocks(self) -> bool:
        return True

    def steady_blocks(self, chunk_tokens: int, block_size: int) -> int:
        """:meth:`max_blocks` of a request longer than any window."""
        return self.max_blocks(NEVER, block_size, chunk_tokens)



class SlidingWindow(_Windowed):
    """Keys in ``(q - W, q]``: a decoding request needs its last W - 1 tokens' KV and the new one."""

    @property
    def name(self) -> str:
        return "sliding_attention"

    @property
    def event_name(self) -> str:
        return "sliding_window"

    @property
    def event_window(self) -> int | None:
        return self.window

    def describe(self) -> str:
        return f"{self.name} (window {self.window})"

    def window_phrase(self) -> str:
        return f"sliding window of {self.window} tokens"

    def skipped_blocks(self, num_tokens: int, block_size: int) -> int:
        """The blocks wholly before token ``num_tokens - W + 1``: ``max(0, (n - W + 1) // B)`` (vLLM's
        ``remove_skipped_blocks``)."""
        return max(0, (num_tokens - self.window + 1) // block_size)

    def skip_moves_at(self, skipped: int, block_size: int) -> int:
        """``(n - W + 1) // B > skipped`` first at ``n = (skipped + 1) B + W - 1``."""
        return (skipped + 1) * block_size + self.window - 1

    def max_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """``min(cdiv(n, B), cdiv(W + c - 2, B) + 1)``: the keys of c queries span W - 1 + c tokens at any
        offset in a block (c = 1: vLLM's SlidingWindowSpec bound ``cdiv(W - 1, B) + 1``)."""
        return min(cdiv(num_tokens, block_size), cdiv(self.window + chunk_tokens - 2, block_size) + 1)

    def window_start(self, position: int) -> int:
        return max(0, position - self.window + 1)

    def kernel_bounds(self) -> tuple[int, int]:
        return self.window, 0

    @property
    def model_sliding_window(self) -> int | None:
        return self.window

    @staticmethod
    def window_field() -> str:
        return "sliding_window"


class ChunkedLocal(_Windowed):
    """Keys from the start of q's chunk of C tokens (Llama 4's ``chunked_overlay``); C a multiple of B, so a
    chunk's blocks are freed whole."""

    @property
    def name(self) -> str:
        return "chunked_attention"

    @property
    def event_name(self) -> str:
        return "chunked_local_attention"

    def describe(self) -> str:
        return f"{self.name} (chunk {self.window})"

    def window_phrase(self) -> str:
        return f"chunk of {self.window} tokens"

    def skipped_blocks(self, num_tokens: int, block_size: int) -> int:
        """The blocks before the start of the chunk holding token ``num_tokens``: ``C (n // C) // B``."""
        return self.window * (num_tokens // self.window) // block_size

    def skip_moves_at(self, skipped: int, block_size: int) -> int:
        """The next chunk start past block ``skipped``: ``C cdiv((skipped + 1) B, C)``."""
        return self.window * cdiv((skipped + 1) * block_size, self.window)

    def max_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """``min(cdiv(n, B), cdiv(C - 1 + c, B))`` (c = 1: ``C / B``)."""
        return min(cdiv(num_tokens, block_size), cdiv(self.window - 1 + chunk_tokens, block_size))

    def window_start(self, position: int) -> int:
        return self.window * (position // self.window)

    def kernel_bounds(self) -> tuple[int, int]:
        return 0, self.window

    @staticmethod
    def window_field() -> str:
        return "attention_chunk_size"

    @staticmethod
    def check_window(window: int, block_size: int, what: str) -> None:
        if window % block_size:
            raise ConfigError(f"{what} must be a multiple of block_size {block_size} (a chunk's blocks are "
                              f"freed whole)")


class RecurrentState(MemoryKind):
    """A recurrent layer's state: one per request (a slot of the state pool, whatever the length), written
    by every step; a cached prefix of k blocks is restorable only from a checkpoint of the state at
    boundary k (the state after k B tokens, keyed by block ``k - 1``'s hash)."""

    @property
    def name(self) -> str:
        return "recurrent_state"

    @property
    def event_name(self) -> str:
        return "mamba"

    def max_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """One state slot per request, whatever its length."""
        return 1

    def hit_start(self, num_blocks: int, block_size: int) -> int:
        """Only the checkpoint at the prefix's end: block ``k - 1``."""
        return max(0, num_blocks - 1)


#: The attention kinds by the Hugging Face layer type name that configs give (``kvpool.spec.kv.LayerKind``).
ATTENTION_KINDS: dict[str, type[MemoryKind]] = {
    "full_attention": FullAttention, "sliding_attention": SlidingWindow, "chunked_attention": ChunkedLocal,
}


def attention_kind(layer_type: str, window: int | None = None) -> MemoryKind:
    """The kind of layers of Hugging Face layer type ``layer_type`` with ``window`` tokens (W or C; None for
    full attention, which ignores it). Raises ConfigError for an unknown layer type or a missing window."""
    cls = ATTENTION_KINDS.get(layer_type)
    if cls is None:
        raise ConfigError(f"unknown layer type {layer_type!r}; known: {', '.join(ATTENTION_KINDS)}")
    return cls(window or 0)
