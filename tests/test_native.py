"""The compiled / interpreted switch (kvpool._native): which file each hot module is loaded from.

Each case runs a fresh interpreter on a copy of the package (so the real tree is never touched), with
extension files put beside the sources by hand where the case needs them: an extension file that is not
a real build stands in for a stale or foreign one, and the rule says it must never be loaded.
"""

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import _native, _native_docs

PACKAGE = Path(_native.__file__).resolve().parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
COMPILED_HERE = _native.status()["compiled"]
PROBE = """
import json, kvpool, importlib
from kvpool import _native
mods = {m: importlib.import_module(m).__file__ for m in _native.COMPILED_MODULES + ("kvpool.units",)}
print(json.dumps({"status": _native.status(), "files": mods}))
"""


def copy_package(tmp_path: Path) -> Path:
    """A copy of the kvpool package under tmp_path (trace data and caches left out), extensions included."""
    shutil.copytree(PACKAGE, tmp_path / "kvpool",
                    ignore=shutil.ignore_patterns("__pycache__", "*.jsonl", "*.csv"))
    return tmp_path / "kvpool"


def probe(root: Path, prelude: str = "", **env: str) -> tuple[dict, str]:
    """Import kvpool from ``root`` in a fresh interpreter, after running ``prelude``: (its status and module
    files, its stderr)."""
    environ = {k: v for k, v in os.environ.items() if k != _native.PURE_ENV}
    environ.update(env, PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", prelude + PROBE], capture_output=True, text=True,
                          env=environ, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def fake_extension(source: Path) -> Path:
    """An extension file beside ``source`` that is no build at all: loading it would fail."""
    ext = source.with_name(source.stem + SUFFIX)
    ext.write_bytes(b"not a shared object")
    return ext


def copy_with_fake_extensions(tmp_path: Path) -> Path:
    """A package copy where every hot module (and units) has a fake extension and no manifest exists."""
    pkg = copy_package(tmp_path)
    for name in (*_native.COMPILED_MODULES, "kvpool.units"):
        fake_extension(pkg.joinpath(*name.split(".")[1:]).with_suffix(".py"))
    for path in pkg.rglob(f"*{SUFFIX}"):  # a real build's manifest would make its modules eligible
        if path.name.startswith(("_native__mypyc", "_native_manifest")):
            path.unlink()
    return pkg


@pytest.mark.parametrize(("value", "pure"), [("1", True), ("yes", True), ("true", True), ("0", False),
                                             ("", False), ("no", False), ("false", False)])
def test_pure_env_values(value, pure):
    assert _native.pure_requested({_native.PURE_ENV: value}) is pure
    assert _native.pure_requested({}) is False


def test_an_extension_that_is_no_build_of_ours_is_never_loaded(tmp_path):
    # CPython prefers an extension over the .py of the same name: without the finder these imports fail
    copy_with_fake_extensions(tmp_path)
    result, _ = probe(tmp_path)
    assert result["status"]["compiled"] is False
    assert "not compiled" in result["status"]["reason"]
    assert all(f.endswith(".py") for f in result["files"].values()), result["files"]


#: What an editable install adds (setuptools appends such a finder to sys.meta_path): kvpool.* names that the
#: path search does not find resolve to the installed tree, here the real compiled package.
EDITABLE_FINDER = """
import importlib.abc, importlib.util, sys
class Editable(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "kvpool._native_manifest":
            return importlib.util.spec_from_file_location(name, {manifest!r})
sys.meta_path.append(Editable())
"""


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build here (scripts/setup.sh builds it)")
def test_the_manifest_of_another_tree_is_not_this_trees_build(tmp_path):
    # CI's failure: the copy had no manifest, the editable install's finder found the installed tree's, and
    # the copy's fake extensions were loaded as if that build were theirs
    copy_with_fake_extensions(tmp_path)
    manifest = next(PACKAGE.glob(f"_native_manifest{SUFFIX}"))
    result, _ = probe(tmp_path, prelude=EDITABLE_FINDER.format(manifest=str(manifest)))
    assert result["status"]["compiled"] is False
    assert "not compiled" in result["status"]["reason"]
    assert all(f.endswith(".py") for f in result["files"].values()), result["files"]


def test_pure_env_forces_the_sources_beside_extensions(tmp_path):
    pkg = copy_package(tmp_path)
    for name in _native.COMPILED_MODULES:
        source = pkg.joinpath(*name.split(".")[1:]).with_suffix(".py")
        if not source.with_name(source.stem + SUFFIX).exists():
            fake_extension(source)
    result, _ = probe(tmp_path, KVPOOL_PURE_PYTHON="1")
    assert result["status"] == {"compiled": False, "modules": [], "reason": "KVPOOL_PURE_PYTHON=1"}
    assert all(f.endswith(".py") for f in result["files"].values()), result["files"]


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build here (scripts/setup.sh builds it)")
def test_the_build_runs_compiled_and_its_digests_are_the_sources():
    import kvpool._native_manifest as manifest

    assert sorted(manifest.SOURCES) == sorted(_native.COMPILED_MODULES)
    for name, digest in manifest.SOURCES.items():
        assert digest == _native.source_digest(_native.module_source(name))
    result, _ = probe(PACKAGE.parent)
    assert result["status"]["compiled"] is True
    for name in _native.COMPILED_MODULES:
        assert result["files"][name].endswith(SUFFIX)
    assert result["files"]["kvpool.units"].endswith("units.py")


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build here (scripts/setup.sh builds it)")
def test_a_build_from_an_older_source_is_refused_with_a_warning(tmp_path):
    pkg = copy_package(tmp_path)
    token = pkg / "allocators" / "token.py"
    token.write_text(token.read_text() + "\n# edited after the build\n")
    result, stderr = probe(tmp_path)
    assert result["status"]["compiled"] is False
    assert "kvpool/allocators/token.py changed since it was compiled" in result["status"]["reason"]
    assert "RuntimeWarning" in stderr and "running the interpreted code" in stderr
    assert all(f.endswith(".py") for f in result["files"].values()), result["files"]  # none of the build


def _public_docs(module) -> dict[str, str | None]:
    """``{qualified name: __doc__}`` of a module, its public classes and functions defined there, and their
    public methods and properties (dunders aside)."""
    docs: dict[str, str | None] = {"": module.__doc__}
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        docs[name] = obj.__doc__
        if isinstance(obj, type):
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and (callable(member) or isinstance(member, property)):
                    docs[f"{name}.{attr}"] = getattr(obj, attr).__doc__
    return docs


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build here (KVPOOL_COMPILE=1 python3 setup.py "
                                              "build_ext --inplace makes one)")
@pytest.mark.parametrize("name", _native.COMPILED_MODULES)
def test_compiled_modules_keep_the_sources_docstrings(name: str) -> None:
    import importlib

    compiled = importlib.import_module(name)
    assert _native.is_compiled(compiled)
    source = _public_docs(_native.interpreted(name))  # what the interpreter makes of the same source
    assert len(source) > 5 and all(doc for qual, doc in source.items() if qual.count(".") == 0)
    for qualname, doc in source.items():
        obj = compiled
        for part in filter(None, qualname.split(".")):
            obj = getattr(obj, part)
        if doc is not None:  # a method without a docstring (a dataclass's own) may keep mypyc's signature
            assert obj.__doc__ == doc, qualname


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build here")
def test_modules_a_compiled_module_imports_itself_get_their_docstrings_too() -> None:
    # mypyc imports policies for block_pool past the import system's finders: in a fresh process, importing
    # block_pool first must still leave policies documented
    code = ("import kvpool.allocators.block_pool, kvpool.allocators.policies as p, kvpool._native as n; "
            "print(n.is_compiled(p), p.__doc__ is not None, p.LRUPolicy.__doc__ is not None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent, env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)}).stdout
    assert out.split() == ["True", "True", "True"]


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build here")
def test_help_shows_the_compiled_classes_docs() -> None:
    import inspect
    import pydoc

    from kvpool import BlockPool, KVCacheCoordinator, TokenToKVPoolAllocator

    for cls in (BlockPool, KVCacheCoordinator, TokenToKVPoolAllocator):
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        assert cls.__doc__.split("\n")[0].strip() in text
    assert "Hand out ``n`` blocks" in pydoc.render_doc(BlockPool.allocate, renderer=pydoc.plaintext)
    assert str(inspect.signature(BlockPool.allocate)) == "(self, /, n)"  # the text signature stays


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build here")
@pytest.mark.parametrize("name", _native.COMPILED_MODULES)
def test_compiled_classes_have_their_sources_signatures(name: str) -> None:
    """Issue 30: a compiled class's ``__init__`` read ``(self, /, *args, **kwargs)`` (CPython's text for any C
    type's); now the class and its ``__init__`` have the interpreted build's signatures, annotations and
    defaults included, and construct as before."""
    import importlib
    import inspect

    def shown(obj: object, annotations: bool) -> list[tuple[object, ...]]:
        return [(p.name, p.kind, p.default, *([p.annotation] if annotations else []))
                for p in inspect.signature(obj).parameters.values()]

    compiled, source = importlib.import_module(name), _native.interpreted(name)
    classes = [n for n, c in vars(source).items() if isinstance(c, type) and c.__module__ == source.__name__]
    if not classes:
        pytest.skip(f"{name} defines functions only")
    # the classes defining __init__
    written = _native_docs.source_init_signatures(_native.module_source(name), vars(source))
    own = {c for c in classes if "__init__" in vars(getattr(source, c)) and "__dataclass_fields__" not in
           vars(getattr(source, c))}  # the classes whose source defines __init__ (the others inherit one)
    assert own <= set(written)
    for cls in classes:
        mine, theirs = getattr(compiled, cls), getattr(source, cls)
        # a dataclass's generated __init__ is a plain function in both builds, its annotations the types
        # mypyc erased them to (tuple for tuple[list[int], ...]): names, kinds and defaults only there
        full = cls in written
        assert shown(mine.__init__, full) == shown(theirs.__init__, full), cls
        assert shown(mine, full) == shown(theirs, full), cls
        assert "*args" not in str(inspect.signature(mine.__init__)), cls


@pytest.mark.skipif(not COMPILED_HERE, reason="no compiled build here")
def test_a_compiled_class_constructs_as_before_from_interpreted_code() -> None:
    import inspect

    from kvpool import BlockPool, InvalidArgumentError
    from kvpool.allocators.policies import EvictionPolicy, LRUPolicy

    assert _native.is_compiled(sys.modules["kvpool.allocators.block_pool"])
    assert str(inspect.signature(BlockPool.__init__)).startswith("(self, num_blocks: 'IntArg', *, ")
    pool = BlockPool(8, policy=LRUPolicy())
    assert pool.allocate(3) == [0, 1, 2] and pool.num_free_blocks == 5
    with pytest.raises(InvalidArgumentError, match="num_blocks must be an integer >= 1, got 0"):
        BlockPool(0)

    class Mine(EvictionPolicy):  # an interpreted subclass of a compiled class calls its __init__
        def __init__(self) -> None:
            super().__init__()
            self.made = True

    assert Mine().made and isinstance(Mine(), EvictionPolicy)


def test_the_package_says_it_is_typed() -> None:
    assert (PACKAGE / "py.typed").is_file()
    assert '"py.typed"' in (PACKAGE.parent / "pyproject.toml").read_text()
