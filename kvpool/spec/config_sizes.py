"""What a size in a Hugging Face ``config.json`` may be: an integer (never a bool, float or string) of at
least 1 (``qk_rope_head_dim`` at least 0) and at most :data:`MAX_DIM` (a layer count at most
:data:`MAX_LAYERS`), read from the file or from transformers' defaults; a zero, negative or non-integer
value is a :class:`~kvpool.errors.ConfigError` naming the key, never replaced by another field
(:func:`config_int`).
"""

from __future__ import annotations

from typing import Any

from kvpool.errors import ConfigError
from kvpool.numeric import as_int

#: Largest size accepted in a config (a tensor dimension; anything larger is a corrupt file).
MAX_DIM = 2**31 - 1
#: Most layers a model may have. The deepest published transformers have about 1,000 layers; a spec keeps
#: one entry per layer (its layer types, its KV cache groups' layer lists), so a config asking for 2**31
#: layers would build lists of gigabytes before any check could refuse it.
MAX_LAYERS = 2**16
#: Config keys that count layers (checked against :data:`MAX_LAYERS` before anything is built per layer).
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer")


def too_many_layers(what: str, value: int) -> str:
    """The message for a layer count above :data:`MAX_LAYERS`."""
    return (f"{what} is {value:,}: more layers than any model has (at most {MAX_LAYERS:,}; the deepest "
            f"published transformers have about 1,000)")


def config_int(config: dict[str, Any], key: str, minimum: int = 1) -> int | None:
    """``config[key]`` checked as a size (see the module docstring); None when absent or null. A layer
    count (:data:`LAYER_COUNT_KEYS`) is at most :data:`MAX_LAYERS`."""
    value = config.get(key)
    if value is None:
        return None
    what = f"config.json field {key!r}"
    value = as_int(value, what, minimum=minimum, maximum=MAX_DIM, error=ConfigError)
    if key in LAYER_COUNT_KEYS and value > MAX_LAYERS:
        raise ConfigError(too_many_layers(what, value))
    return value
