"""Deprecated import path: this module moved to :mod:`kvpool.cli.options` (reading a name here warns
with a ``DeprecationWarning`` and returns the one of ``kvpool.cli.options``)."""

from kvpool._lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "kvpool.cli.options")
