"""Deprecated import path: this module moved to :mod:`kvpool.events.subscriber` (reading a name here warns
with a ``DeprecationWarning`` and returns the one of ``kvpool.events.subscriber``)."""

from kvpool._lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "kvpool.events.subscriber")
