"""The spec package (issue 31): ``hf_config``, ``spec``, ``state_spec``, ``planner`` and ``state_planner``
moved under ``kvpool/spec/``. The old import paths keep working: every name read there is the new module's
own object and warns with a ``DeprecationWarning`` that names the new path, at the caller's line; the names
of the old module ``kvpool.spec`` are the package's, without a warning. kvpool itself uses the new paths."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

MOVED = {"kvpool.hf_config": "kvpool.spec.hf_config", "kvpool.state_spec": "kvpool.spec.state",
         "kvpool.planner": "kvpool.spec.planner", "kvpool.state_planner": "kvpool.spec.state_planner"}
#: The public names of the old module ``kvpool/spec.py`` (before the move), read by hand from it.
OLD_SPEC_NAMES = ("KV_DTYPES", "NO_FLOAT16_MODEL_TYPES", "AttentionKind", "KVCacheGroup", "KVCacheSpec",
                  "LayerKind", "LayerShape", "auto_kv_dtype", "cdiv", "kv_cache_groups", "parse_kv_dtype")
PACKAGE = Path(__file__).resolve().parents[1] / "kvpool"


def _own_names(module: object) -> list[str]:
    """The public functions, classes and constants ``module`` defines (not those it imports)."""
    return [n for n, v in vars(module).items() if not n.startswith("_")
            and getattr(v, "__module__", module.__name__) == module.__name__ and not isinstance(v, type(ast))]


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_an_old_path_gives_the_new_objects_with_a_warning(old: str, new: str) -> None:
    shim, moved = importlib.import_module(old), importlib.import_module(new)
    names = _own_names(moved)
    assert len(names) >= 5
    for name in names:
        with pytest.warns(DeprecationWarning, match=f"import {name} from {new}"):
            value = getattr(shim, name)
        assert value is getattr(moved, name)
    assert set(names) <= set(dir(shim))
    with pytest.raises(AttributeError):
        shim.__path__  # noqa: B018 - a module, not a package: import machinery probes must not warn


def test_the_warning_points_at_the_importing_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from kvpool.planner import plan_pool  # noqa: F401
    assert [(w.category, w.filename) for w in caught] == [(DeprecationWarning, __file__)]


def test_kvpool_spec_keeps_the_old_modules_names_without_a_warning() -> None:
    import kvpool.spec
    import kvpool.spec.kv

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in OLD_SPEC_NAMES:
            assert getattr(kvpool.spec, name) is getattr(kvpool.spec.kv, name)
    assert kvpool.spec.LayerKind("sliding_attention") is kvpool.spec.LayerKind.SLIDING


def test_kvpool_itself_imports_no_old_path() -> None:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not set(names) & set(MOVED), f"{path.relative_to(PACKAGE)} imports {names}"
