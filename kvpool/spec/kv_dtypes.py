"""KV cache dtypes: the names accepted everywhere (``KV_DTYPES``, :func:`parse_kv_dtype`) and the dtype
of ``--kv-cache-dtype auto`` as vLLM picks it (:func:`auto_kv_dtype`).

Importing this module imports no torch: ``KV_DTYPES`` (name -> torch dtype) is made at first use, and
the functions import torch when called."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvpool._lazy import lazy_values
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: KV cache dtype names accepted everywhere (CLI, ``from_hf_config``, ``parse_kv_dtype``) -> the name of
#: the torch dtype (an attribute of ``torch``).
KV_DTYPE_NAMES: dict[str, str] = {
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
}


#: Bytes per element of each torch dtype name of :data:`KV_DTYPE_NAMES` (``torch.<name>.itemsize``).
KV_DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1,
                                  "float8_e5m2": 1}


def torch_dtypes(names: Mapping[str, str]) -> dict[str, torch.dtype]:
    """``names`` (name -> the name of a torch dtype) with the torch dtypes; imports torch."""
    import torch

    return {name: getattr(torch, attr) for name, attr in names.items()}


@functools.cache
def kv_dtypes() -> dict[str, torch.dtype]:
    """:data:`KV_DTYPE_NAMES` with torch dtypes (``KV_DTYPES``); imports torch."""
    return torch_dtypes(KV_DTYPE_NAMES)


#: ``KV_DTYPES`` (name -> torch dtype, :func:`kv_dtypes`), made at first use.
__getattr__ = lazy_values(__name__, {"KV_DTYPES": kv_dtypes})


def parse_kv_dtype(name: str | torch.dtype, model_dtype: str | None = None, *,
                   model_type: str | None = None) -> torch.dtype:
    """Resolve a KV cache dtype name to a torch dtype: :func:`kv_dtype_name`'s, from ``torch``.

    ``"auto"`` means the dtype vLLM runs the model in (:func:`auto_kv_dtype` of ``model_dtype``, a config's
    ``dtype`` / ``torch_dtype``, and ``model_type``): a 16-bit config dtype as it is, float32 or none cast
    down to bfloat16. Raises :class:`ConfigError` listing the accepted names for an unknown one (or for a
    torch dtype that is not a KV dtype, such as int8).
    """
    import torch

    return getattr(torch, kv_dtype_name(name, model_dtype, model_type=model_type))


def kv_dtype_name(name: object, model_dtype: str | None = None, *, model_type: str | None = None) -> str:
    """:func:`parse_kv_dtype` without torch: the name of the torch dtype (``"bfloat16"``,
    ``"float8_e4m3fn"``: a key of :data:`KV_DTYPE_BYTES`), from a name of :data:`KV_DTYPE_NAMES`,
    ``"auto"`` (with ``model_dtype`` and ``model_type``, as :func:`auto_kv_dtype`) or a torch dtype (its
    ``str`` is ``torch.<name>``). Imports no torch. Raises :class:`ConfigError` as :func:`parse_kv_dtype`."""
    key = str(name).lower().removeprefix("torch.")
    if key == "auto":
        return auto_kv_dtype_name(model_dtype, model_type)[0]
    if key not in KV_DTYPE_NAMES:
        accepted = ", ".join(["auto", *KV_DTYPE_NAMES])
        raise ConfigError(f"unknown KV cache dtype {name!r}; accepted: {accepted}")
    return KV_DTYPE_NAMES[key]


#: Model types vLLM never runs in float16 (``_FLOAT16_NOT_SUPPORTED_MODELS`` in vllm/config/model.py:
#: numerical instability), so ``auto`` gives them bfloat16 even when their config says float16.
NO_FLOAT16_MODEL_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text", "plamo2", "glm4"})


def auto_kv_dtype(model_dtype: str | None, model_type: str | None = None) -> tuple[torch.dtype, str]:
    """The KV dtype of ``--kv-cache-dtype auto`` and the rule that chose it, as vLLM picks the model dtype
    for ``dtype="auto"`` (its KV cache dtype ``auto`` is the model dtype): ``_resolve_auto_dtype`` in
    vllm/config/model.py on a GPU of compute capability >= 8.0, whose supported dtypes are bfloat16,
    float16, float32 in that order (``CudaPlatform.supported_dtypes``).

    * a config naming no dtype counts as float32 (vLLM reads the weights' safetensors header first; a
      config alone has none), and float32 is cast down to the first supported dtype: bfloat16;
    * bfloat16 and float16 stay, except float16 for :data:`NO_FLOAT16_MODEL_TYPES` (bfloat16);
    * any other dtype (fp8 weights) is not a model dtype vLLM runs in: bfloat16.

    On older GPUs (compute capability < 8.0, no bfloat16) vLLM picks float16 instead: the same 2 bytes,
    so every count is the same. Returns ``(dtype, rule)``, ``rule`` a phrase for people (``"the config's
    float32, cast down to bfloat16 as vLLM does"``). Raises :class:`ConfigError` for a dtype name that is
    not in ``KV_DTYPES``.
    """
    import torch

    name, rule = auto_kv_dtype_name(model_dtype, model_type)
    return getattr(torch, name), rule


def auto_kv_dtype_name(model_dtype: str | None, model_type: str | None = None) -> tuple[str, str]:
    """:func:`auto_kv_dtype` with the dtype's name (a key of :data:`KV_DTYPE_BYTES`); imports no torch."""
    if model_dtype in (None, "auto"):
        return "bfloat16", "the config names no dtype: vLLM takes it as float32 and casts it down to bfloat16"
    named = kv_dtype_name(model_dtype)
    if named == "float32":
        return "bfloat16", "the config's float32, cast down to bfloat16 as vLLM does"
    if named == "float16" and model_type in NO_FLOAT16_MODEL_TYPES:
        return "bfloat16", f"the config's float16, but vLLM never runs {model_type} in float16: bfloat16"
    if named in ("bfloat16", "float16"):
        return named, f"the config's {named}"
    return "bfloat16", f"the config's {named} is no dtype vLLM runs a model in: bfloat16"


class TorchDtypeField:
    """A dataclass field holding a dtype by name, read as a torch dtype: set with anything ``parse`` takes
    (checked then, without torch; by default :func:`kv_dtype_name`'s KV dtypes), read as ``torch.<name>``
    (torch is imported at the first read). So a spec can be built, sized (:attr:`KVCacheSpec.dtype_bytes
    <kvpool.spec.kv.KVCacheSpec.dtype_bytes>`, :attr:`RecurrentStateSpec.conv_bytes
    <kvpool.spec.state.RecurrentStateSpec.conv_bytes>`) and compared by name in a process that never imports
    torch (a trace replay). The field's default is ``default``; ``parse(value, field)`` gives the torch
    dtype's name of a value set (``field``: the field's name, for its ConfigError)."""

    def __init__(self, default: str, parse: Callable[[object, str], str] | None = None) -> None:
        self.default = default
        self.parse = parse or _kv_name
        self.name = self.slot = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_{name}_name"

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self.default  # the dataclass's default for the field
        import torch

        return getattr(torch, obj.__dict__[self.slot])

    def __set__(self, obj: object, value: object) -> None:
        obj.__dict__[self.slot] = self.parse(value, self.name)

    def name_of(self, obj: object) -> str:
        """The dtype's name on ``obj`` (``"bfloat16"``), no torch imported."""
        return str(obj.__dict__[self.slot])


def _kv_name(value: object, field: str) -> str:
    return kv_dtype_name(value)
