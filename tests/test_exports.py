"""What kvpool's packages export (issue 30: ``dir(kvpool)`` listed none of the names imported on first use,
``BlockPool``, ``PagedKVCache``, ``slot_mapping`` ...). Every name of a package's ``__all__`` imports and is
in its ``dir()``; every name a package imports lazily is in both."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

#: The packages and modules that export names; the first four import some of them on first use.
EXPORTING = ["kvpool", "kvpool.spec", "kvpool.allocators", "kvpool.tiers", "kvpool.events", "kvpool.storage",
             "kvpool.requests", "kvpool.engine", "kvpool.trace"]
#: Third-party modules an exported name may need (its extra not installed: that name alone is skipped).
OPTIONAL = ("redis", "zmq", "msgspec", "transformers", "xxhash", "blake3")


def _lazy_names(module: object) -> set[str]:
    """The names ``module`` imports on first use: those ``dir()`` lists beyond its own namespace."""
    return set(dir(module)) - set(vars(module))


@pytest.mark.parametrize("name", EXPORTING)
def test_every_exported_name_imports_and_is_listed(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(getattr(module, "__all__", ()))
    assert exported or _lazy_names(module), f"{name} exports nothing"
    assert _lazy_names(module) <= exported, \
        f"{name}: lazily imported but not in __all__: {_lazy_names(module) - exported}"
    for export in sorted(exported | _lazy_names(module)):
        assert export in dir(module), f"{name}.{export} is exported but not in dir({name})"
        try:
            assert getattr(module, export) is not None
        except ImportError as exc:  # an optional dependency of that name alone
            if not (exc.name or "").startswith(OPTIONAL):
                raise
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        module.no_such_name  # noqa: B018


def test_the_root_lists_its_lazy_names_before_importing_them() -> None:
    """In a fresh process: ``dir(kvpool)`` names BlockPool and PagedKVCache, and listing them imports
    neither module (``import kvpool`` stays cheap)."""
    code = ("import sys, kvpool; names = dir(kvpool); "
            "print('BlockPool' in names, 'PagedKVCache' in names, 'slot_mapping' in names, "
            "'kvpool.storage.paged' in sys.modules, 'kvpool.engine.engine' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True", "False", "False"]


def test_importing_kvpool_and_building_a_spec_imports_no_torch() -> None:
    """In a fresh process: ``import kvpool``, ``kvpool.spec`` and the integer rule (``kvpool.numeric``) leave
    torch (~220 MB resident) out of the process; the KV dtypes import it at first use and are torch's own
    (Qwen2.5-0.5B's 24 layers x 2 KV heads x 64 x K and V x 2 B of bfloat16 = 12,288 B per token)."""
    code = ("import sys, kvpool, kvpool.spec, kvpool.numeric; from kvpool import KVCacheSpec; "
            "print('torch' in sys.modules); "
            "print(kvpool.numeric.as_int(3, 'n'), 'torch' in sys.modules); "
            "s = KVCacheSpec(num_layers=24, num_kv_heads=2, head_dim=64); import torch; "
            "print(s.dtype is torch.bfloat16, s.bytes_per_token, "
            "kvpool.spec.KV_DTYPES['fp8'] is torch.float8_e4m3fn)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "3", "False", "True", "12288", "True"]
