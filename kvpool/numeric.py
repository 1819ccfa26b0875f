"""The one rule for numeric arguments, used by every module: integers (ids, counts, sizes, seeds, layer
indices) and real numbers (temperatures, shares, seconds, scales).

An **integer** is a Python ``int``, a numpy integer scalar (or 0-d integer array), or a 0-d integer torch
tensor holding a value (not on the meta device); it is converted to a Python ``int``. A ``bool`` (Python,
numpy or a bool tensor) is never an integer, nor is a float (even ``2.0``), a string, None, or a tensor or
array with dimensions (``torch.tensor([3])`` is a sequence of one id, not a count).

A **sequence of ids** is a list, tuple, range or other iterable of integers, or a 1-D integer tensor or
numpy array (a tensor on any device but meta: its values are read on the host). A bare integer is not a
sequence (APIs that also take a single id say so and wrap it themselves).

A **real number** is an integer or a float (Python or numpy float scalar), never a bool, a string or None;
NaN fails every range. A **seed** is an integer in ``[0, 2**64 - 1]`` (what ``torch.manual_seed`` takes).

The fast paths cost one ``type(x) is int`` test per value (a list of plain ints is checked with one C-level
``set(map(type, ...))``); anything else is converted once. The error type is the caller's
(:class:`InvalidArgumentError` by default; :class:`InvalidIdError` for ids, :class:`ConfigError` for
configuration), and the message names the argument and the value.
"""

from __future__ import annotations

import functools
import math
import operator
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeAlias

from kvpool._lazy import lazy_values
from kvpool.errors import InvalidArgumentError, InvalidIdError

#: The annotation of an integer argument before it is checked by this rule: any object (an ``int``, a numpy
#: integer, a 0-d integer tensor, or a wrong value that the check refuses with the caller's error). Compiled
#: modules (:mod:`kvpool._native`) check a parameter annotated ``int`` themselves, with a ``TypeError`` for a
#: numpy integer and none for a bool; annotated ``IntArg``, the value reaches :func:`as_int` as it does
#: interpreted.
IntArg: TypeAlias = object
#: The same for a real-number argument (checked by :func:`as_real`; a compiled ``float`` parameter would
#: take a bool as 1.0).
RealArg: TypeAlias = object

INT64_MAX = 2**63 - 1
SEED_MAX = 2**64 - 1
_INT = {int}

if TYPE_CHECKING:
    import torch


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.Tensor``, without importing torch (no tensor exists before torch is
    imported, so this module, and the replay path above it, leave torch out of the process)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


@functools.cache
def int_dtypes() -> frozenset[torch.dtype]:
    """The integer torch dtypes an id tensor may have (bool is not one of them); imports torch."""
    import torch

    return frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                      torch.uint32, torch.uint64})


#: ``INT_DTYPES`` (:func:`int_dtypes`), made at first use: importing this module imports no torch.
__getattr__ = lazy_values(__name__, {"INT_DTYPES": int_dtypes})


def index_or_none(value: object) -> int | None:
    """``value`` as a Python int when it is an integer by the rule above, else None."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):  # an int subclass (an IntEnum member): its integer value
        return int(value)
    if is_tensor(value):
        if value.ndim != 0 or value.dtype not in int_dtypes() or value.is_meta:  # type: ignore[attr-defined]
            return None
        return int(value.item())
    dtype = getattr(value, "dtype", None)  # numpy, without importing it: kind 'i' / 'u' and no dimensions
    if getattr(dtype, "kind", None) in ("i", "u") and getattr(value, "ndim", None) == 0:
        return operator.index(value)
    return None


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer by the rule above (so never a bool)."""
    return index_or_none(value) is not None


def as_int(value: object, what: str, *, minimum: int | None = None, maximum: int | None = None,
           error: type[Exception] = InvalidArgumentError) -> int:
    """``value`` as a Python int in ``[minimum, maximum]`` (either bound optional), else ``error`` naming
    ``what``, the rule and the value."""
    v = value if type(value) is int else index_or_none(value)
    if v is None or (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise error(f"{what} must be {_rule(minimum, maximum)}, got {_show(value)}")
    return v


def as_optional_int(value: object, what: str, *, minimum: int | None = None, maximum: int | None = None,
                    error: type[Exception] = InvalidArgumentError) -> int | None:
    """None stays None; anything else as :func:`as_int`."""
    return None if value is None else as_int(value, what, minimum=minimum, maximum=maximum, error=error)


def as_seed(value: object, what: str = "seed", *, error: type[Exception] = InvalidArgumentError) -> int:
    """``value`` as a seed: an integer in ``[0, SEED_MAX]``."""
    return as_int(value, what, minimum=0, maximum=SEED_MAX, error=error)


def as_real(value: object, what: str, *, minimum: float = -math.inf, maximum: float = math.inf,
            open_min: bool = False, finite: bool = False, error: type[Exception] = InvalidArgumentError
            ) -> float:
    """``value`` (an integer or a float, never a bool) as a float in ``[minimum, maximum]`` (``(minimum,
    maximum]`` with ``open_min``; never infinite with ``finite``); NaN is never in range. Else ``error``
    naming ``what``."""
    v = value if type(value) is float else _real_or_none(value)
    ok = v is not None and (v > minimum if open_min else v >= minimum) and v <= maximum
    if not ok or (finite and not math.isfinite(v)):  # type: ignore[arg-type]
        kind = "a finite number" if finite else "a number"
        if maximum < math.inf:
            rule = f"{kind} in {'(' if open_min else '['}{minimum:g}, {maximum:g}]"
        else:
            rule = f"{kind} {'>' if open_min else '>='} {minimum:g}" if minimum > -math.inf else kind
        raise error(f"{what} must be {rule}, got {_show(value)}")
    return v  # type: ignore[return-value]


def _real_or_none(value: object) -> float | None:
    integer = index_or_none(value)
    if integer is not None:
        try:
            return float(integer)
        except OverflowError:  # past the float range
            return math.inf if integer > 0 else -math.inf
    if isinstance(value, float):  # a float subclass (numpy float64)
        return float(value)
    if getattr(getattr(value, "dtype", None), "kind", None) == "f" and getattr(value, "ndim", None) == 0:
        return float(value)  # type: ignore[arg-type]  # another numpy float scalar
    return None


def as_id_list(ids: Iterable[object], what: str = "ids", *, error: type[Exception] = InvalidIdError
               ) -> list[int]:
    """A sequence of ids (see the module docstring) as a list of Python ints (range not checked).

    A list of plain ints is returned as is (no copy)."""
    if type(ids) is list and set(map(type, ids)) <= _INT:
        return ids
    if is_tensor(ids):
        if ids.ndim != 1:  # type: ignore[attr-defined]
            raise error(f"{what} must be a sequence or a 1-D integer tensor, got {_show(ids)}")
        return _readable(ids, what, error).tolist()  # type: ignore[arg-type]  # any integer dtype: no int64 copy first
    if getattr(ids, "ndim", None) is not None and hasattr(ids, "tolist") and hasattr(ids, "dtype"):
        return _numpy_ids(ids, what, error)
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise error(f"{what} must be a sequence of integer ids, got {_show(ids)}")
    values = list(ids)
    if set(map(type, values)) <= _INT:
        return values
    out = [index_or_none(v) for v in values]
    if None in out:
        bad = values[out.index(None)]
        raise error(f"{what} must be integers (never bools), got {_show(bad)} in {_head(values)}")
    return out  # type: ignore[return-value]


def as_one_or_ids(ids: object, what: str = "ids", *, error: type[Exception] = InvalidIdError) -> list[int]:
    """One id (an integer by the rule above) or a sequence of ids (a list, a 1-D tensor or array ...), as a
    list of Python ints (range not checked)."""
    one = index_or_none(ids)
    if one is not None:
        return [one]
    if is_tensor(ids) and ids.ndim == 0:  # type: ignore[attr-defined]  # a bool or float scalar: refused below
        ids = ids.reshape(1)  # type: ignore[attr-defined]
    return as_id_list(ids, what, error=error)  # type: ignore[arg-type]


def as_id_tensor(ids: object, what: str = "ids", *, error: type[Exception] = InvalidIdError,
                 flatten: bool = False, to_host: bool = True) -> torch.Tensor:
    """A sequence of ids as a 1-D int64 tensor on the host (a CPU int64 tensor is returned as is).

    ``flatten``: also take a tensor of any shape, or a single integer (reshaped to 1-D). ``to_host=False``
    leaves a tensor on its device."""
    import torch

    if isinstance(ids, torch.Tensor):
        t = id_tensor(ids, what, error=error, to_host=to_host)
        if t.ndim != 1:
            if not flatten:
                raise error(f"{what} must be a 1-D integer tensor, got shape {list(t.shape)}")
            t = t.reshape(-1)
        return t
    if flatten and is_int(ids):
        ids = [ids]
    values = as_id_list(ids, what, error=error)  # type: ignore[arg-type]
    try:
        return torch.tensor(values, dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError):  # past int64
        raise error(f"{what} must be ids within int64, got {_head(values)}") from None


def id_tensor(t: torch.Tensor, what: str = "ids", *, error: type[Exception] = InvalidIdError,
              to_host: bool = True) -> torch.Tensor:
    """An integer tensor of any shape as int64, on the host unless ``to_host`` is False (no copy when it
    already is)."""
    import torch

    t = _readable(t, what, error, to_host)
    return t if t.dtype is torch.int64 else t.long()


def _readable(t: torch.Tensor, what: str, error: type[Exception], to_host: bool = True) -> torch.Tensor:
    """``t`` checked to be an integer tensor with values (on the host unless ``to_host`` is False)."""
    if t.dtype not in int_dtypes():
        raise error(f"{what} must be an integer tensor (never bool), got dtype {t.dtype}")
    if t.is_meta:
        raise error(f"{what} is a meta tensor: it has no values to read")
    return t.cpu() if to_host and not t.is_cpu else t


def _numpy_ids(arr: object, what: str, error: type[Exception]) -> list[int]:
    kind = getattr(getattr(arr, "dtype", None), "kind", None)
    if kind not in ("i", "u") or getattr(arr, "ndim", None) != 1:
        raise error(f"{what} must be a 1-D integer array, got {_show(arr)}")
    return arr.tolist()  # type: ignore[attr-defined]


def _rule(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an integer in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an integer >= {minimum}"
    if maximum is not None:
        return f"an integer <= {maximum}"
    return "an integer"


def _show(value: object) -> str:
    if is_tensor(value):
        return f"a {value.dtype} tensor of shape {list(value.shape)} on {value.device}"  # type: ignore[attr-defined]
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4,300-digit str limit
        big = isinstance(value, int)
        return f"an integer of {value.bit_length():,} bits" if big else type(value).__name__
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"


def _head(values: list[object]) -> str:
    return _show(values[:8]) + ("..." if len(values) > 8 else "")
