"""Deprecated import path: this module moved to :mod:`kvpool.spec.hf_config` (reading a name here warns
with a ``DeprecationWarning`` and returns the one of ``kvpool.spec.hf_config``)."""

from kvpool._lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "kvpool.spec.hf_config")
