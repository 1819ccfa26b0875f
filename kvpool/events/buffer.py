"""The buffer a KV event sink records into, compiled with the pool's hot path (``kvpool._native``).

A :class:`kvpool.events.sink.KVEventSink` buffers what a pool tells it as records and turns them into vLLM
events only when the events are taken. The records live here, in an :class:`EventBuffer` (one per sink and
the sinks :meth:`~kvpool.events.sink.KVEventSink.for_medium` made from it), and each sink writes into it
through its own :class:`EventRecorder`. The two calls a :class:`~kvpool.allocators.block_pool.BlockPool`
makes most go straight to the recorder, with no call into the interpreter where kvpool runs compiled: a
``cache_blocks`` whose blocks all enter the index, with bytes hashes and plain token ids (checked, and its
``BlockStored`` built at once: the event is its record), and a removal (one record per run of removals,
converted when taken). Each is checked and buffered as it came; anything else the recorder declines (it
returns False, having changed nothing) and the pool calls the sink, which checks and buffers it its own way.

This module imports nothing of kvpool, and :mod:`kvpool.events`, the package it is in, imports nothing when
it is imported (so a pool imports this module without msgspec): the sink hands the recorder what it needs
(its block size, its batch bound, its medium and group, whether its keys are their own wire form, the
``BlockStored`` type).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, cast

#: Token ids the recorder takes as they are (machine-sized ints); others go to the sink's own check.
#: (Final: compiled, a C constant, not a lookup in the module's globals per token.)
_TOKEN_LIMIT: Final = (1 << 62) - 1


class EventBuffer:
    """A sink's records, in the order they came, and the events already converted from some of them.

    ``events``: events in their wire form, older than every record. ``records``: not converted yet: a
    storing call's ``(sink, hashes, runs, parent, tokens, extra_keys, lora_name)`` tuple; a removal's list
    ``[sink, group, hashes]``; or an event in its wire form (a reset's ``AllBlocksCleared``, the
    ``BlockStored`` of a plain call the recorder took), taken as it is. ``count``: the
    events of both, as if each record were converted when it came. ``tail``: the last event or record when
    it is a removal (a record, or a converted ``BlockRemoved``) of the medium and group ``tail_key``, which
    the next removal of those joins; else None.
    """

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.records: list[Any] = []
        self.count = 0
        self.tail: Any = None
        self.tail_key: Any = None

    def take_records(self) -> list[Any]:
        """The records, leaving none (the events stay)."""
        records = self.records
        self.records = []
        return records

    def convert(self) -> list[Any]:
        """Turn the records into events, appended to ``events`` (which it returns), leaving no records: a
        storing tuple by its sink's ``_stored_events(record, append)``, a removal by its sink's
        ``_removal_event(group, hashes)`` (and ``tail`` moves to that event), an event as it is."""
        events = self.events
        if not self.records:
            return events
        records = self.take_records()
        append = events.append
        for record in records:
            kind = type(record)
            if kind is tuple:
                record[0]._stored_events(record, append)
            elif kind is list:
                removal = cast(list[Any], record)
                event = removal[0]._removal_event(removal[1], removal[2])
                append(event)
                if self.tail is record:
                    self.tail = event
            else:
                append(record)
        return events

    def clear(self) -> None:
        """Forget everything (the events were handed over)."""
        self.events, self.records, self.count, self.tail = [], [], 0, None


class EventRecorder:
    """One sink's way into its :class:`EventBuffer`: what ``BlockStored`` and ``BlockRemoved`` need of
    the sink, and whether its keys are plain (``plain``: bytes hashes, no key split; ``unsplit``: no key
    split). ``owner`` is the sink whose ``_flush_full()`` publishes a full buffer (the buffer's owner);
    ``stored_type`` builds a ``BlockStored`` from its 11 leading fields, in declaration order.
    """

    def __init__(self, owner: Any, buffer: EventBuffer, block_size: int, max_events: int, medium: str | None,
                 group: int | None, kind: str | None, window: int | None, plain: bool, stored_type: Any
                 ) -> None:
        self.owner, self.buffer = owner, buffer
        self.block_size, self.max_events = block_size, max_events
        self.medium, self.group, self.kind, self.window = medium, group, kind, window
        self.plain = self.unsplit = plain
        self.stored_type = stored_type
        self.sink: Any = owner  # the sink whose records these are (set by the sink)
        # object, not a tuple type: compiled, a typed tuple would be boxed anew at each read, and the
        # removal's ``tail_key is removal_key`` test below would never hold
        self.removal_key: object = (medium, group)

    def store(self, block_hashes: Sequence[Any], parent_hash: Any, token_ids: Any, lora_name: Any) -> bool:
        """Buffer the ``BlockStored`` of a ``cache_blocks`` call all of whose blocks entered the index, if
        it is plain: the sink's keys plain, every hash (and the parent, if any) bytes, ``token_ids`` None or
        a list of ``block_size`` machine-sized ints per block. Returns False, buffering nothing, otherwise.
        The event holds lists of its own (the caller may reuse its lists)."""
        if not self.plain:
            return False
        hashes = list(block_hashes)
        n = len(hashes)
        for i in range(n):
            if type(hashes[i]) is not bytes:
                return False
        if parent_hash is not None and type(parent_hash) is not bytes:
            return False
        tokens: list[Any] = []
        if token_ids is not None:
            if type(token_ids) is not list:
                return False
            given = cast(list[Any], token_ids)
            if len(given) != n * self.block_size:
                return False
            for i in range(len(given)):
                t = given[i]
                if type(t) is not int:
                    return False
                v = cast(int, t)
                if v > _TOKEN_LIMIT or v < -_TOKEN_LIMIT:
                    return False
            tokens = given[:]
        buf = self.buffer
        buf.records.append(self.stored_type(hashes, parent_hash, tokens, self.block_size, None, self.medium,
                                            lora_name, [None] * n, self.group, self.kind, self.window))
        buf.count += 1
        buf.tail = None
        if buf.count >= self.max_events:  # inside a pool's call: must not raise
            self.owner._flush_full()
        return True

    def removed(self, block_hashes: list[Any]) -> bool:
        """Buffer that ``block_hashes`` left the index, if the sink's keys are not split: joining the
        removal just recorded when it is of this medium and group. Returns False, buffering nothing,
        otherwise."""
        if not self.unsplit:
            return False
        if not block_hashes:
            return True
        buf = self.buffer
        tail, key = buf.tail, buf.tail_key
        if tail is not None and (key is self.removal_key or key == self.removal_key):
            if type(tail) is not list:
                return False  # it joins a converted BlockRemoved: the sink extends it in wire form
            cast(list[Any], cast(list[Any], tail)[2]).extend(block_hashes)
            return True
        record = [self.sink, self.group, list(block_hashes)]
        buf.records.append(record)
        buf.tail, buf.tail_key = record, self.removal_key
        buf.count += 1
        if buf.count >= self.max_events:  # inside a pool's call: must not raise
            self.owner._flush_full()
        return True
