"""The sink a pool records KV events into: :class:`KVEventSink`.

**Recording.** A :class:`~kvpool.allocators.block_pool.BlockPool` given a :class:`KVEventSink` calls
:meth:`KVEventSink.check_publish` before it changes anything and :meth:`~KVEventSink.stored` /
:meth:`~KVEventSink.removed` / :meth:`~KVEventSink.cleared` after. The sink buffers events (in the
:class:`~kvpool.events.buffer.EventBuffer` its :class:`~kvpool.events.buffer.EventRecorder` writes into); its
owner calls :meth:`~KVEventSink.flush` once per engine step (as vLLM's scheduler does), which hands one
:class:`~kvpool.events.wire.KVEventBatch` to the publisher. A pool without a sink pays nothing: it records
nothing.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from kvpool.errors import InvalidArgumentError
from kvpool.events.buffer import EventBuffer, EventRecorder
from kvpool.events.publishers import EventPublisher
from kvpool.events.wire import (
    FULL_ATTENTION,
    HASH_FORMATS,
    MEDIUM_GPU,
    TOKEN_MAX,
    TOKEN_MIN,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WireHash,
    wire_extra_keys,
    wire_hash,
    wire_hash_or_none,
    wire_token_ids,
)
from kvpool.numeric import as_int, as_optional_int

KeySplit = Callable[[Hashable], tuple[int, Hashable]]
"""A prefix-index key -> (KV cache group index, block hash) (see :meth:`KVEventSink.use_groups`)."""


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """``[first, last)`` of each run of consecutive ascending ``positions``."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


_PLAIN = {int}


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
        """This sink's :class:`~kvpool.events.buffer.EventRecorder`: what a pool records its plain calls
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
        ``groups[g] = (kv_cache_spec_kind, kv_cache_spec_sliding_window)``, vLLM's names for its kind and
        window (what each memory kind says of itself: :attr:`kvpool.spec.kinds.MemoryKind.event_name`,
        ``event_window``). A KV cache coordinator, whose one pool holds every group's keys, calls this;
        each event then names its group."""
        self._convert()  # what was recorded before goes out as it was read then
        self._split = split_key
        self.recorder.plain = self.recorder.unsplit = False
        self._groups = dict(groups)

    def describe_group(self, index: int, kind: str, window: int | None) -> None:
        """Describe one more group of a split sink's keys (:meth:`use_groups`): group ``index`` as ``kind``
        with ``window`` (a hybrid's recurrent state checkpoints, keyed as a group of their own)."""
        self._groups[as_int(index, "group index", minimum=0)] = (kind, window)

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
                    and (not token_ids or (min(token_ids) >= TOKEN_MIN and max(token_ids) <= TOKEN_MAX)):
                tokens = token_ids[:]  # the common case, checked in C; a copy: the caller may reuse its list
            else:
                tokens = wire_token_ids(token_ids)
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
        tokens = None if token_ids is None else wire_token_ids(token_ids)
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
        the events (:meth:`kvpool.events.buffer.EventBuffer.convert`)."""
        return self._buffer.convert()

    def _removal_event(self, group: int | None, hashes: Sequence[Hashable]) -> BlockRemoved:
        """The ``BlockRemoved`` of one removal record (see :class:`~kvpool.events.buffer.EventBuffer`)."""
        return BlockRemoved(self._wire_list(hashes), self.medium, group)

    def _stored_events(self, record: tuple, append: Callable[[Any], None]) -> None:
        """The ``BlockStored`` events of one storing record (see
        :class:`kvpool.events.buffer.EventBuffer`)."""
        _, keys, runs, parent_hash, tokens, extra_keys, lora_name = record
        n = len(keys)
        for first, last in [(0, n)] if runs is None else runs:
            before = parent_hash if first == 0 else keys[first - 1]
            parent = None if before is None else wire_hash_or_none(self._key(before)[1], self.hash_format)
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


