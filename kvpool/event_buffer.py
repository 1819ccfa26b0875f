"""Deprecated import path: this module moved to :mod:`kvpool.events.buffer` (reading a name here warns
with a ``DeprecationWarning`` and returns the one of ``kvpool.events.buffer``)."""

from kvpool._lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "kvpool.events.buffer")
