"""KV cache events in vLLM's wire format: the event types, the sink a pool records into, and publishers.

KV-aware routers (Dynamo's KV router, llm-d's KV indexer) learn which engine holds which prefix from the
event stream vLLM publishes; an engine on kvpool joins such a fleet by publishing the same stream.

**Event types.** Declared as vLLM 0.33 declares them (``vllm/distributed/kv_events.py``), so a consumer
decodes kvpool's messages with its own vLLM structs: :class:`KVEventBatch` is an ``array_like`` msgspec
Struct ``[ts, events, data_parallel_rank]``; each event is a tagged msgspec Struct (``tag=True``: a map whose
``"type"`` key is the class name), ``omit_defaults=True``: :class:`BlockStored` when hashes enter a pool's
prefix index, :class:`BlockRemoved` when they leave it, :class:`AllBlocksCleared` when it is reset.

**Block hashes on the wire** (vLLM consumers take ``bytes | int``; see :func:`wire_hash`): kvpool's block
hashes are 16-byte ``bytes`` (``kvpool.allocators.hashing``) and go out as those 16 bytes (msgpack ``bin``),
as vLLM's default (SHA-256 ``bytes``) does. ``hash_format="int64"`` sends ``int.from_bytes(h, "big") &
(2**64 - 1)`` instead, vLLM's mapping under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (the last 8 bytes as a
big-endian unsigned integer), for consumers that key on 64-bit integers. Integer hashes (trace hash ids) go
out unchanged in both formats; they must lie in ``[0, 2**64)``. Any other hash type is refused.

**Recording.** A :class:`BlockPool` given a :class:`KVEventSink` calls :meth:`KVEventSink.check_publish`
before it changes anything and :meth:`~KVEventSink.stored` / :meth:`~KVEventSink.removed` /
:meth:`~KVEventSink.cleared` after. The sink buffers events; its owner calls :meth:`~KVEventSink.flush` once
per engine step (as vLLM's scheduler does), which hands one :class:`KVEventBatch` to the publisher. A pool
without a sink pays nothing: it records nothing.

**Publishers** never block the caller. :class:`NullEventPublisher` drops everything (a pool given it gets no
sink); :class:`QueueEventPublisher` is a bounded in-process queue; :class:`ZmqEventPublisher` (``pyzmq``)
sends each batch as vLLM's ZMQ publisher does: multipart ``(topic, seq as 8-byte big-endian, msgpack
payload)`` on a PUB socket, and keeps the last ``buffer_steps`` batches for vLLM's replay protocol on a
ROUTER socket. A full queue drops the batch and counts it (``dropped_batches``, ``dropped_events``); its
sequence number is skipped, so a subscriber sees the gap. Replay never holds up the live stream (a bounded
share of reply frames per live batch), and :meth:`ZmqEventPublisher.close` drains from the sending thread.
:class:`KVEventSubscriber` (:mod:`kvpool.events_subscriber`, re-exported here) receives them in order, fills
gaps from the replay socket and follows a publisher restarted on the same endpoint.

This module sits one floor above the ground: of kvpool above the ground it imports only the buffer its sink
records into, :mod:`kvpool.event_buffer`.
``msgspec`` is needed to import it, ``pyzmq`` for the ZMQ classes (both in kvpool's ``events`` extra).
"""

from __future__ import annotations

import bisect
import itertools
import operator
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import msgspec

from kvpool._lazy import lazy_exports
from kvpool.errors import ConfigError, InvalidArgumentError
from kvpool.event_buffer import EventBuffer, EventRecorder
from kvpool.numeric import as_id_list, as_int, as_optional_int

# ---- the wire types (vLLM 0.33) -------------------------------------------------------------------------

WireHash = bytes | int
"""A block hash on the wire (vLLM's ``ExternalBlockHash``)."""

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
FULL_ATTENTION = "full_attention"
"""vLLM's ``kv_cache_spec_kind`` of a full-attention KV cache group."""
SPEC_KINDS = {"full_attention": FULL_ATTENTION, "sliding_attention": "sliding_window",
              "chunked_attention": "chunked_local_attention"}
"""kvpool's layer kinds (``kvpool.spec.LayerKind`` values) as vLLM's ``kv_cache_spec_kind`` names."""

KeySplit = Callable[[Hashable], tuple[int, Hashable]]
"""A prefix-index key -> (KV cache group index, block hash) (see :meth:`KVEventSink.use_groups`)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's payload: ``[ts, events, data_parallel_rank]`` (seconds since the epoch)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a map tagged ``"type": <class name>``, fields at their default left out."""


class BlockStored(KVCacheEvent):
    """Blocks entered the prefix index: ``block_hashes`` in chain order, each one's parent the one before
    it and the first one's ``parent_block_hash`` (None: the first block of a sequence); ``token_ids`` the
    tokens of all of them (``len(block_hashes) * block_size``; empty where the caller gave none);
    ``extra_keys`` one entry per block (None: no key), untagged as vLLM publishes them."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Hashes left the prefix index (evicted, or unpublished by ``evict_blocks``)."""

    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix index was emptied (``reset_prefix_cache``): forget every hash of this publisher."""


class KVEventBatch(EventBatch):
    """The payload of every message: a timestamp, the events of one step, the data-parallel rank."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---- block hashes on the wire ---------------------------------------------------------------------------

HASH_FORMATS = ("bytes", "int64")
_U64 = (1 << 64) - 1


def wire_hash(block_hash: Hashable, hash_format: str = "bytes") -> WireHash:
    """The wire form of a kvpool block hash (see the module docstring): ``bytes`` unchanged, or (``int64``)
    the last 8 bytes as a big-endian unsigned integer; an int in ``[0, 2**64)`` unchanged.

    Raises:
        InvalidArgumentError: a hash that is neither bytes nor such an int, or an unknown format.
    """
    if type(block_hash) is bytes:
        if hash_format == "bytes":
            return block_hash
        if hash_format == "int64":
            return int.from_bytes(block_hash, "big") & _U64
        raise InvalidArgumentError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")
    if type(block_hash) is int and 0 <= block_hash <= _U64:
        return block_hash
    raise InvalidArgumentError(
        f"a block hash sent as a KV event must be bytes or an int in [0, 2**64), got {block_hash!r}")


def _wire_or_none(block_hash: Hashable, hash_format: str) -> WireHash | None:
    try:
        return wire_hash(block_hash, hash_format)
    except InvalidArgumentError:
        return None


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """``[first, last)`` of each run of consecutive ascending ``positions``."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


#: Token ids msgpack (and vLLM's ``list[int]``) can carry: an int64 or a uint64.
_TOKEN_MIN, _TOKEN_MAX = -(1 << 63), (1 << 64) - 1
_PLAIN, _BYTES = {int}, {bytes}


def _int_list(values: Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints (a numpy int, a 0-d tensor, a tensor or array converted, as
    :mod:`kvpool.numeric` reads ids); InvalidArgumentError for anything else or one msgpack cannot carry."""
    out = as_id_list(values, "token_ids", error=InvalidArgumentError)
    if out and not (min(out) >= _TOKEN_MIN and max(out) <= _TOKEN_MAX):
        raise InvalidArgumentError(f"token_ids must lie in [-2**63, 2**64), got {min(out)} .. {max(out)}")
    return out


def wire_extra_keys(keys: tuple | None) -> tuple[Any, ...] | None:
    """One block's extra keys (``kvpool.allocators.hashing.block_extra_keys``) as vLLM publishes them:
    untagged, ``("mm", content_hash, offset)`` -> ``(content_hash, offset)``, ``("lora", name, path, digest)``
    -> the LoRA name, any other ``(tag, ..., value)`` -> its last value (the cache salt, an embeddings
    digest); kvpool's order."""
    if keys is None:
        return None
    return tuple(tuple(k[1:]) if k[0] == "mm" else k[1] if k[0] == "lora" else k[-1] for k in keys)


# ---- publishers -----------------------------------------------------------------------------------------


class EventPublisher:
    """Takes :class:`KVEventBatch` es and sends them somewhere; :meth:`publish` never blocks.

    Counters: ``published_batches`` / ``published_events`` (accepted), ``dropped_batches`` /
    ``dropped_events`` (refused because a bounded buffer was full, or, from a sink flushing itself, because
    the publisher was closed). ``enabled`` is False only for the null publisher: an engine given it records
    nothing. Use as a context manager, or call :meth:`close`.
    """

    enabled = True

    def __init__(self) -> None:
        self.published_batches = self.published_events = self.dropped_batches = self.dropped_events = 0
        self._closed = False

    def publish(self, batch: KVEventBatch) -> None:
        """Hand one batch over (or drop and count it).

        Raises:
            InvalidArgumentError: the publisher is closed.
        """
        if self._closed:
            raise InvalidArgumentError(f"{type(self).__name__} is closed")
        self.offer(batch)

    def offer(self, batch: KVEventBatch) -> bool:
        """:meth:`publish` that never raises: a closed publisher drops and counts the batch. What a sink
        calls in the middle of a pool's call (see :meth:`KVEventSink.flush`). Returns whether it was taken."""
        taken = not self._closed and self._offer(batch)
        if taken:
            self.published_batches += 1
            self.published_events += len(batch.events)
        else:
            self.dropped_batches += 1
            self.dropped_events += len(batch.events)
        return taken

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def _offer(self, batch: KVEventBatch) -> bool:
        """Take the batch; False when it had to be dropped."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop; batches already accepted are delivered first. Idempotent."""
        self._closed = True

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullEventPublisher(EventPublisher):
    """Publishes nothing (the default): an engine given it attaches no sink, so recording costs nothing."""

    enabled = False

    def _offer(self, batch: KVEventBatch) -> bool:
        return True


class QueueEventPublisher(EventPublisher):
    """A bounded in-process queue of batches (a router in the same process, tests).

    ``maxsize`` batches at most; a batch that finds it full is dropped and counted. :meth:`get` and
    :meth:`drain` take batches out, from any thread.
    """

    def __init__(self, maxsize: int = 10_000) -> None:
        super().__init__()
        maxsize = as_int(maxsize, "maxsize", minimum=1)
        self._queue: queue.Queue[KVEventBatch] = queue.Queue(maxsize)

    def _offer(self, batch: KVEventBatch) -> bool:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            return False
        return True

    def get(self, timeout: float | None = None) -> KVEventBatch | None:
        """The oldest batch, waiting up to ``timeout`` seconds (None: forever); None if none came."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def drain(self) -> list[KVEventBatch]:
        """Every batch queued now, oldest first."""
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out


# ---- the sink a pool records into -----------------------------------------------------------------------


class KVEventSink:
    """What a :class:`~kvpool.allocators.block_pool.BlockPool` calls when its prefix index changes.

    It buffers each change as the pool reported it, and turns the buffer into vLLM events (hashes in their
    wire form, see :func:`wire_hash`) when they are taken: :meth:`flush` publishes them as one
    :class:`KVEventBatch` (the owner calls it once per engine step), and so does recording the
    ``max_batch_events``-th buffered event (the batch holds exactly that many). Everything a call records
    is checked when it is recorded, so the conversion never fails; the events are the same, batch for
    batch, as if each had been converted when it was recorded.

    Args:
        publisher: where batches go.
        block_size: tokens per block of the pool (``BlockStored.block_size``).
        medium: where the KV lives: ``"GPU"`` (device memory), ``"CPU"``, ``"STORAGE"``.
        group_idx: the KV cache group of the pool (0 for a model with one group).
        kv_cache_spec_kind: the group's kind (vLLM's names, e.g. ``"full_attention"``), sent with each
            ``BlockStored``.
        sliding_window: the group's sliding window in tokens, sent with each ``BlockStored``.
        hash_format: ``"bytes"`` or ``"int64"`` (see :func:`wire_hash`).

    Raises:
        InvalidArgumentError: a bad block size, group index, batch bound or hash format.
    """

    def __init__(self, publisher: EventPublisher, *, block_size: int, medium: str = MEDIUM_GPU,
                 group_idx: int | None = 0, kv_cache_spec_kind: str | None = FULL_ATTENTION,
                 sliding_window: int | None = None, hash_format: str = "bytes",
                 max_batch_events: int = 4096) -> None:
        block_size = as_int(block_size, "block_size", minimum=1)
        max_batch_events = as_int(max_batch_events, "max_batch_events", minimum=1)
        group_idx = as_optional_int(group_idx, "group_idx", minimum=0)
        if hash_format not in HASH_FORMATS:
            raise InvalidArgumentError(f"hash_format must be one of {HASH_FORMATS}, got {hash_format!r}")
        self.publisher, self.block_size, self.medium = publisher, block_size, medium
        self.group_idx, self.kind, self.sliding_window = group_idx, kv_cache_spec_kind, sliding_window
        self.hash_format, self.max_batch_events = hash_format, max_batch_events
        self._buffer = EventBuffer()
        self._removal_key: tuple[str | None, int | None] = (medium, group_idx)
        self._split: KeySplit | None = None
        self._groups: dict[int, tuple[str | None, int | None]] = {}
        self._owner: KVEventSink = self  # the sink whose buffer this one records into (see for_medium)
        self.recorder = self._recorder()

    def _recorder(self) -> EventRecorder:
        """This sink's :class:`~kvpool.event_buffer.EventRecorder`: what a pool records its plain calls
        through (keys plain: bytes hashes, no split)."""
        rec = EventRecorder(self._owner, self._buffer, self.block_size, self.max_batch_events, self.medium,
                            self.group_idx, self.kind, self.sliding_window, self.hash_format == "bytes",
                            BlockStored)
        rec.sink = self
        rec.unsplit = self._split is None
        rec.plain = rec.plain and rec.unsplit
        return rec

    def use_groups(self, split_key: KeySplit, groups: Mapping[int, tuple[str, int | None]]) -> None:
        """Read the pool's keys as ``split_key(key) -> (group index, block hash)``, and describe group g as
        ``groups[g] = (layer kind, window in tokens)`` (``kvpool.spec.LayerKind`` values, sent under
        vLLM's names; the window goes out for sliding groups only). A KV cache coordinator, whose one
        pool holds every group's keys, calls this; each event then names its group."""
        self._convert()  # what was recorded before goes out as it was read then
        self._split = split_key
        self.recorder.plain = self.recorder.unsplit = False
        self._groups = {g: (SPEC_KINDS.get(kind, kind), window if kind == "sliding_attention" else None)
                        for g, (kind, window) in groups.items()}

    def for_medium(self, medium: str) -> KVEventSink:
        """A sink for another tier's pool (``"CPU"``: the host tier) that records into this one's buffer,
        so one :meth:`flush` per step publishes both, in order. It reads keys as this sink does."""
        other = KVEventSink(self.publisher, block_size=self.block_size, medium=medium,
                            group_idx=self.group_idx, kv_cache_spec_kind=self.kind,
                            sliding_window=self.sliding_window, hash_format=self.hash_format,
                            max_batch_events=self.max_batch_events)
        other._buffer, other._split, other._groups = self._buffer, self._split, self._groups
        other._owner = self
        other.recorder = other._recorder()
        return other

    def _key(self, key: Hashable) -> tuple[int | None, Hashable]:
        return (self.group_idx, key) if self._split is None else self._split(key)

    # ---- called by the pool
    def check_publish(self, block_hashes: Sequence[Hashable], parent_hash: Hashable | None, num_blocks: int,
                      token_ids: Sequence[int] | None, extra_keys: Sequence[tuple | None] | None) -> None:
        """Refuse, before the pool changes anything, what :meth:`stored` could not send: ``block_hashes``
        are those that may enter the index, of a call naming ``num_blocks`` blocks.

        Raises:
            InvalidArgumentError: a hash (or the parent hash) with no wire form, ``token_ids`` not
                ``block_size`` integers per block (each in [-2**63, 2**64)), or ``extra_keys`` not one entry
                per block.
        """
        self._checked_tokens(block_hashes, parent_hash, num_blocks, token_ids, extra_keys)

    def _checked_tokens(self, block_hashes: Sequence[Hashable], parent_hash: Hashable | None, num_blocks: int,
                        token_ids: Sequence[int] | None, extra_keys: Sequence[tuple | None] | None
                        ) -> list[int] | None:
        """:meth:`check_publish`, returning the token ids as a list of Python ints of the sink's own."""
        fmt, split = self.hash_format, self._split
        for h in block_hashes:
            if type(h) is not bytes or split is not None:  # bytes are their own wire form
                wire_hash(h if split is None else split(h)[1], fmt)
        if parent_hash is not None:
            wire_hash(self._key(parent_hash)[1], fmt)
        n, bs = num_blocks, self.block_size
        tokens = None
        if token_ids is not None:
            if type(token_ids) is list and len(token_ids) == n * bs and set(map(type, token_ids)) <= _PLAIN \
                    and (not token_ids or (min(token_ids) >= _TOKEN_MIN and max(token_ids) <= _TOKEN_MAX)):
                tokens = token_ids[:]  # the common case, checked in C; a copy: the caller may reuse its list
            else:
                tokens = _int_list(token_ids)
                if len(tokens) != n * bs:
                    raise InvalidArgumentError(f"token_ids must hold {n} blocks x {bs} = {n * bs} tokens, "
                                               f"got {len(token_ids)}")
                if tokens is token_ids:
                    tokens = tokens[:]
        if extra_keys is not None and len(extra_keys) != n:
            raise InvalidArgumentError(f"extra_keys needs one entry per block ({n}), got {len(extra_keys)}")
        return tokens

    def stored(self, block_hashes: Sequence[Hashable], new: Sequence[int], parent_hash: Hashable | None,
               token_ids: Sequence[int] | None, extra_keys: Sequence[tuple | None] | None,
               lora_name: str | None) -> None:
        """Record that ``block_hashes[i]`` entered the index for each position ``i`` in ``new`` (ascending):
        one ``BlockStored`` per run of consecutive positions. ``block_hashes``, ``token_ids`` and
        ``extra_keys`` describe the whole call (checked by :meth:`check_publish` first); ``parent_hash`` is
        the hash before ``block_hashes[0]``. A run whose parent is a hash that was not stored and has no
        wire form (a placeholder beside a null block) goes out with parent None."""
        n = len(block_hashes)
        tokens = None if token_ids is None else _int_list(token_ids)
        if tokens is not None and tokens is token_ids:
            tokens = tokens[:]  # the sink's own copy
        self._store(block_hashes, None if len(new) == n else list(new), parent_hash, tokens, extra_keys,
                    lora_name)

    def check_and_store(self, block_hashes: Sequence[Hashable], new: Sequence[int] | None,
                        parent_hash: Hashable | None, token_ids: Sequence[int] | None,
                        extra_keys: Sequence[tuple | None] | None, lora_name: str | None,
                        checked: Sequence[Hashable] | None = None) -> None:
        """:meth:`check_publish` of ``checked`` (default: ``block_hashes``), then :meth:`stored` of the
        positions ``new`` (None: every position), in one call; it raises before recording anything. What a
        pool calls once per ``cache_blocks`` when it knows which blocks enter the index before it changes
        anything.

        Raises:
            InvalidArgumentError: as :meth:`check_publish`.
        """
        if new is None and extra_keys is None and self.recorder.store(block_hashes, parent_hash, token_ids,
                                                                       lora_name):
            return  # the common call: every block new, bytes hashes, plain token ids, no extra keys
        n, hashes = len(block_hashes), block_hashes if checked is None else checked
        tokens = self._checked_tokens(hashes, parent_hash, n, token_ids, extra_keys)
        if new is not None and len(new) == n:
            new = None
        self._store(block_hashes, new, parent_hash, tokens, extra_keys, lora_name)

    def _store(self, block_hashes: Sequence[Hashable], new: Sequence[int] | None,
               parent_hash: Hashable | None, tokens: list[int] | None,
               extra_keys: Sequence[tuple | None] | None, lora_name: str | None) -> None:
        """Buffer one storing call (``new``: its positions that entered the index, None for all of them;
        ``tokens``: the sink's own checked list). A call whose keys name several groups (a tier's pool
        taking evicted blocks of every group, a restore) is buffered as one call per group, in the order
        the groups first appear, each with its group's blocks in the call's order and the call's
        ``parent_hash``, as if the caller had made one call per group: each run of new blocks names its own
        group, and its parent is the block before it in that group (the call's ``parent_hash`` for the
        group's first block)."""
        parts = None if self._split is None else self._group_positions(block_hashes)
        if parts is None:
            self._store_group(block_hashes, new, parent_hash, tokens, extra_keys, lora_name)
            return
        entered = None if new is None else set(new)
        bs = self.block_size
        for positions in parts:
            mine = None if entered is None else [j for j, i in enumerate(positions) if i in entered]
            if mine is not None and len(mine) == len(positions):
                mine = None
            own = None if tokens is None else [t for i in positions for t in tokens[i * bs:(i + 1) * bs]]
            self._store_group([block_hashes[i] for i in positions], mine, parent_hash, own,
                              None if extra_keys is None else [extra_keys[i] for i in positions], lora_name)

    def _group_positions(self, keys: Sequence[Hashable]) -> list[list[int]] | None:
        """The positions of ``keys`` by group, groups in the order they first appear (a split sink's
        keys); None when they are all of one group."""
        split = self._split
        assert split is not None
        groups = list(map(operator.itemgetter(0), map(split, keys)))
        if not groups or groups.count(groups[0]) == len(groups):
            return None
        parts: dict[int | None, list[int]] = {}
        for i, g in enumerate(groups):
            parts.setdefault(g, []).append(i)
        return list(parts.values())

    def _store_group(self, block_hashes: Sequence[Hashable], new: Sequence[int] | None,
                     parent_hash: Hashable | None, tokens: list[int] | None,
                     extra_keys: Sequence[tuple | None] | None, lora_name: str | None) -> None:
        """Buffer one storing call of one group's blocks (as :meth:`_store`)."""
        runs = None if new is None else _runs(new)
        if runs is not None and not runs:
            return
        buf = self._buffer
        buf.records.append((self, list(block_hashes), runs, parent_hash, tokens,
                            None if extra_keys is None else list(extra_keys), lora_name))
        buf.count += 1 if runs is None else len(runs)
        buf.tail = None
        if buf.count >= self.max_batch_events:  # inside a pool's call: must not raise
            self._owner._flush_full()

    def removed(self, block_hashes: Sequence[Hashable]) -> None:
        """Record that ``block_hashes`` left the index: a ``BlockRemoved`` (one per run of one group's
        hashes), or more hashes for the one just recorded when nothing came between."""
        if not block_hashes:
            return
        if self._split is None:
            if not self.recorder.removed(block_hashes if type(block_hashes) is list else list(block_hashes)):
                self._removed(self._removal_key, self.group_idx, block_hashes)
            return
        split = [self._split(k) for k in block_hashes]
        for group, run in itertools.groupby(split, key=lambda pair: pair[0]):
            self._removed((self.medium, group), group, [h for _, h in run])

    def _removed(self, key: tuple[str | None, int | None], group: int | None, hashes: Sequence[Hashable]
                 ) -> None:
        buf = self._buffer
        tail = buf.tail
        if tail is not None and buf.tail_key == key:  # joins the removal just recorded
            if type(tail) is list:
                tail[2].extend(hashes)
            else:
                tail.block_hashes += self._wire_list(hashes)
            return
        record = [self, group, list(hashes)]
        buf.records.append(record)
        buf.tail, buf.tail_key = record, key
        buf.count += 1
        if buf.count >= self.max_batch_events:  # inside a pool's call: must not raise
            self._owner._flush_full()

    def cleared(self) -> None:
        """Record that the index was emptied (``AllBlocksCleared``)."""
        buf = self._buffer
        buf.records.append(AllBlocksCleared())
        buf.count += 1
        buf.tail = None
        if buf.count >= self.max_batch_events:
            self._owner._flush_full()

    # ---- the conversion
    def _convert(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """Turn the buffered records into events (appended to the buffer's events, in order); returns
        the events (:meth:`kvpool.event_buffer.EventBuffer.convert`)."""
        return self._buffer.convert()

    def _removal_event(self, group: int | None, hashes: Sequence[Hashable]) -> BlockRemoved:
        """The ``BlockRemoved`` of one removal record (see :class:`~kvpool.event_buffer.EventBuffer`)."""
        return BlockRemoved(self._wire_list(hashes), self.medium, group)

    def _stored_events(self, record: tuple, append: Callable[[Any], None]) -> None:
        """The ``BlockStored`` events of one storing record (see :class:`kvpool.event_buffer.EventBuffer`)."""
        _, keys, runs, parent_hash, tokens, extra_keys, lora_name = record
        n = len(keys)
        for first, last in [(0, n)] if runs is None else runs:
            before = parent_hash if first == 0 else keys[first - 1]
            parent = None if before is None else _wire_or_none(self._key(before)[1], self.hash_format)
            append(self._block_stored(keys, parent, first, last, tokens, extra_keys, lora_name))

    def _block_stored(self, keys: Sequence[Hashable], parent: WireHash | None, first: int, last: int,
                      tokens: list[int] | None, extra_keys: Sequence[tuple | None] | None,
                      lora_name: str | None) -> BlockStored:
        bs, run = self.block_size, keys[first:last]
        group, kind, window = self.group_idx, self.kind, self.sliding_window
        if self._split is not None:  # a record holds one group's blocks (see _store)
            group = self._split(run[0])[0]
            run = [self._split(k)[1] for k in run]
            kind, window = self._groups.get(group, (kind, window))
        extra = ([None] * (last - first) if extra_keys is None
                 else [wire_extra_keys(k) for k in extra_keys[first:last]])
        return BlockStored(
            block_hashes=self._wire_list(run), parent_block_hash=parent,
            token_ids=[] if tokens is None else tokens[first * bs:last * bs], block_size=bs, lora_id=None,
            medium=self.medium, lora_name=lora_name, extra_keys=extra, group_idx=group,
            kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window)

    def _wire_list(self, hashes: Sequence[Hashable]) -> list[WireHash]:
        """Checked hashes (see :meth:`check_publish`) in their wire form, as a new list."""
        if self.hash_format == "bytes":  # bytes and ints go out as they are
            return list(hashes)  # type: ignore[arg-type]
        return [wire_hash(h, self.hash_format) for h in hashes]

    # ---- called by the pool's owner
    @property
    def pending_events(self) -> int:
        """Events recorded since the last flush."""
        return self._buffer.count

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The buffered events (oldest first), leaving the buffer empty, without publishing them. (The
        buffer is one for a sink and those :meth:`for_medium` made from it: emptied for all of them.)"""
        events = self._convert()
        self._buffer.clear()
        return events

    def flush(self, ts: float | None = None, *, strict: bool = True) -> int:
        """Publish the buffered events as one batch stamped ``ts`` (default: now); returns how many.
        ``strict=False`` (how the sink flushes itself at ``max_batch_events``, in the middle of a pool's
        call) never raises: a closed publisher drops and counts the batch.

        Raises:
            InvalidArgumentError: (strict) the publisher is closed.
        """
        events = self.take_events()
        if events:
            batch = KVEventBatch(time.time() if ts is None else ts, events)
            self.publisher.publish(batch) if strict else self.publisher.offer(batch)
        return len(events)

    def _flush_full(self) -> int:
        """How the sink flushes itself once ``max_batch_events`` are buffered (inside a pool's call: never
        raises): batches of exactly that many events, as if each batch had gone out when its last event
        was recorded; the rest (a call that recorded several events past the bound) stays buffered."""
        events, bound, buf = self._convert(), self.max_batch_events, self._buffer
        sent = 0
        while len(events) - sent >= bound:
            self.publisher.offer(KVEventBatch(time.time(), events[sent:sent + bound]))
            sent += bound
        if sent:
            rest = events[sent:]
            buf.events, buf.count = rest, len(rest)
            if buf.tail is not None and (not rest or rest[-1] is not buf.tail):
                buf.tail = None
        return sent


# ---- ZMQ transport (vLLM's ZmqEventPublisher protocol) --------------------------------------------------

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's end-of-replay marker."""

_TCP = re.compile(r"^tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})$")


def check_endpoint(endpoint: str) -> str:
    """``endpoint`` if ZMQ can use it: ``tcp://HOST:PORT`` (HOST a name, an IPv4 address, ``[IPv6]`` or
    ``*``; PORT 1-65535), ``ipc://PATH`` or ``inproc://NAME``.

    Raises:
        ConfigError: anything else, naming the endpoint.
    """
    match = _TCP.match(endpoint) if isinstance(endpoint, str) else None
    if match and 1 <= int(match.group(2)) <= 65535:
        return endpoint
    if isinstance(endpoint, str) and re.match(r"^(ipc|inproc)://.+$", endpoint):
        return endpoint
    raise ConfigError(f"malformed ZMQ endpoint {endpoint!r}: expected tcp://HOST:PORT (port 1-65535), "
                      "ipc://PATH or inproc://NAME")


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise ImportError("ZMQ KV events need pyzmq: pip install pyzmq") from None
    return zmq


def _open(ctx: Any, kind: int, endpoint: str, bind: bool, hwm: int) -> Any:
    """A socket of ``kind`` bound (or connected) to ``endpoint`` with high-water marks ``hwm`` (set first:
    ZMQ applies them to later binds and connects only); ConfigError for an address in use."""
    zmq = _zmq()
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    try:
        sock.bind(endpoint) if bind else sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close()
        why = zmq.strerror(exc.errno).lower()
        raise ConfigError(f"cannot {'bind' if bind else 'connect'} {endpoint}: {why}") from None
    return sock


class _Replays:
    """The replay requests being answered: a cursor each into the kept batches (ascending sequence
    numbers), answered a few frames at a time, round-robin, up to the last batch kept when it came."""

    def __init__(self, buffer: deque[tuple[int, bytes]], topic: bytes) -> None:
        self._buffer, self._topic = buffer, topic
        self._active: deque[list[Any]] = deque()  # [identity, next seq, last seq to send]

    def __len__(self) -> int:
        return len(self._active)

    def add(self, identity: bytes, start: int) -> None:
        self._active.append([identity, start, self._buffer[-1][0] if self._buffer else -1])

    def frames(self, budget: int) -> list[tuple[bytes, ...]]:
        """Up to ``budget`` ROUTER messages, each reply ending with its end marker."""
        out: list[tuple[bytes, ...]] = []
        while self._active and len(out) < budget:
            frame = self._frame(self._active[0])
            out.append(frame)
            if frame[3] is END_SEQ:
                self._active.popleft()
            else:
                self._active.rotate(-1)
        return out

    def _frame(self, cursor: list[Any]) -> tuple[bytes, ...]:
        identity, start, last = cursor
        i = bisect.bisect_left(self._buffer, start, key=operator.itemgetter(0))
        if i == len(self._buffer) or self._buffer[i][0] > last:  # (batches the buffer let go are gaps)
            return identity, b"", b"", END_SEQ, b""
        seq, payload = self._buffer[i]
        cursor[1] = seq + 1
        return identity, b"", self._topic, seq.to_bytes(8, "big"), payload


class ZmqEventPublisher(EventPublisher):
    """Publishes batches as vLLM's ``ZmqEventPublisher`` does (byte for byte), from a background thread.

    Each batch gets the next sequence number (0, 1, ...) when :meth:`publish` takes it and goes into a
    bounded queue of ``max_queue_size`` batches (full: dropped, counted, its number skipped); the thread
    encodes it (msgpack) and sends ``(topic, seq.to_bytes(8, "big"), payload)`` on a PUB socket (high-water
    mark ``hwm`` messages per subscriber: past it ZMQ drops for that subscriber, the sender never blocks)
    and keeps the last ``buffer_steps`` for replay.

    ``endpoint`` is bound (kvpool binds every address; a subscriber connects), or connected with
    ``connect=True`` (to a subscriber or proxy that binds; vLLM connects unless the address holds ``*``,
    ``::``, ``ipc://`` or ``inproc://``). ``replay_endpoint``: a ROUTER socket (always bound) answering
    vLLM's replay request ``(identity, b"", start_seq as 8 bytes)`` with ``(identity, b"", topic, seq,
    payload)`` for each kept batch from ``start_seq`` on, then ``(identity, b"", b"", END_SEQ, b"")``.
    ``data_parallel_rank`` is written into batches that carry none (vLLM writes its rank, 0 by default).
    A batch the thread cannot encode (a value msgpack cannot carry, e.g. in a caller's extra keys) is
    skipped and counted in ``unsent_batches``; its number is a gap, as a dropped batch's.

    Replay never holds up the live stream: the thread takes up to ``MAX_REPLAYS`` requests at a time (the
    rest wait in the socket) and sends at most ``REPLAY_FRAMES_PER_BATCH`` of their frames, round-robin,
    before each live batch. A reply holds the batches kept from ``start_seq`` up to the last one kept when
    the request was taken. Counters: ``sent_batches``, ``replay_frames``, ``undelivered_batches`` (still
    queued when :meth:`close` ran out of time); ``thread_error`` says why the thread stopped, if it failed.

    Raises:
        ConfigError: a malformed endpoint, or one that cannot be bound (an address in use).
        ImportError: pyzmq is not installed.
    """

    REPLAY_FRAMES_PER_BATCH = 64
    MAX_REPLAYS = 64

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 connect: bool = False, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, data_parallel_rank: int = 0) -> None:
        super().__init__()
        zmq = _zmq()
        check_endpoint(endpoint)
        if replay_endpoint is not None:
            check_endpoint(replay_endpoint)
        buffer_steps, hwm, max_queue_size = (as_int(value, name, minimum=1) for name, value in (
            ("buffer_steps", buffer_steps), ("hwm", hwm), ("max_queue_size", max_queue_size)))
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self._topic, self._rank = topic.encode(), data_parallel_rank
        self._ctx = zmq.Context()
        self._replay = None
        try:
            self._pub = _open(self._ctx, zmq.PUB, endpoint, bind=not connect, hwm=hwm)
            if replay_endpoint is not None:  # room for a whole replay and its end marker
                self._replay = _open(self._ctx, zmq.ROUTER, replay_endpoint, bind=True,
                                     hwm=2 * (buffer_steps + 1))
        except BaseException:
            self._pub_close()
            raise
        self._seq = itertools.count()
        self.unsent_batches = 0  # taken, but not encodable: skipped by the sending thread (a gap)
        self.sent_batches = self.replay_frames = self.undelivered_batches = 0
        self.thread_error: str | None = None
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._replays = _Replays(self._buffer, self._topic)
        self._stop, self._abort = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-kv-events", daemon=True)
        self._thread.start()

    @property
    def last_seq(self) -> int:
        """The sequence number of the latest batch taken (-1 before the first)."""
        return self.published_batches + self.dropped_batches - 1

    def _offer(self, batch: KVEventBatch) -> bool:
        seq = next(self._seq)
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        """The sending thread: it alone touches the sockets, and closes them when it ends."""
        encode = msgspec.msgpack.Encoder().encode
        try:
            while self._step(encode):
                pass
        except Exception as exc:  # never raise from the thread: keep what happened for the owner
            self.thread_error = f"{type(exc).__name__}: {exc}"
        finally:
            self.undelivered_batches = self._queue.qsize()
            self._pub_close(linger_ms=0 if self._abort.is_set() else 1000)  # let the last messages leave

    def _step(self, encode: Callable[[Any], bytes]) -> bool:
        """Answer a bounded share of the replay requests, then send one live batch; False: stop now."""
        stopping = self._stop.is_set()
        if self._abort.is_set():
            return False
        if self._replay is not None and not stopping:
            self._serve_replays()
        try:  # with replay work waiting, do not wait for a batch; when stopping, drain what is queued
            seq, batch = (self._queue.get_nowait() if stopping or len(self._replays)
                          else self._queue.get(timeout=0.02))
        except queue.Empty:
            return not stopping
        try:
            payload = encode(batch)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError):
            self.unsent_batches += 1  # a value msgpack cannot carry (an extra key): a gap, not a
            return True  # dead thread that would silently drop every later batch
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.sent_batches += 1
        return True

    def _serve_replays(self) -> None:
        """Take new requests (up to ``MAX_REPLAYS`` being answered) and send ``REPLAY_FRAMES_PER_BATCH``
        frames of them; anything that is not a replay request is ignored, as vLLM does."""
        while len(self._replays) < self.MAX_REPLAYS and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) == 3 and len(frames[2]) == 8:
                self._replays.add(frames[0], int.from_bytes(frames[2], "big"))
        frames = self._replays.frames(self.REPLAY_FRAMES_PER_BATCH)
        for frame in frames:
            self._replay.send_multipart(frame)  # a ROUTER never blocks: past a peer's hwm it drops
        self.replay_frames += len(frames)
        if frames:
            time.sleep(0)  # let the caller's threads have the interpreter between shares

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (waiting up to ``timeout`` seconds; replies still being sent are cut
        short), then close the sockets (the sending thread does, so that none closes under it). Batches
        left unsent when the time is up are counted in ``undelivered_batches``. Idempotent."""
        if self._closed:
            return
        super().close()
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()  # it ends after the step it is in
            self._thread.join()
        self.undelivered_batches = self._queue.qsize()  # (one taken while it closed included)

    def _pub_close(self, linger_ms: int = 0) -> None:
        """Close the sockets: the PUB socket's last messages get ``linger_ms`` to leave; replies still
        queued for a client that does not read them are dropped at once."""
        if getattr(self, "_pub", None) is not None:
            self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


# KVEventSubscriber, SequenceTracker and SubscriberStats live in kvpool.events_subscriber (one floor up);
# `from kvpool.events import KVEventSubscriber` keeps working, resolved on first use, so this floor imports
# nothing above it
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(
    ("KVEventSubscriber", "SequenceTracker", "SubscriberStats"), "kvpool.events_subscriber"))
