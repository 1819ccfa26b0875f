"""Deprecated import path: this module moved to :mod:`kvpool.spec.state_planner` (reading a name here warns
with a ``DeprecationWarning`` and returns the one of ``kvpool.spec.state_planner``)."""

from kvpool._lazy import moved_module

__getattr__, __dir__ = moved_module(__name__, "kvpool.spec.state_planner")
