"""The events package (issue 31): ``kvpool/events.py``, ``events_subscriber.py`` and ``event_buffer.py``
became ``kvpool/events/``, and ``options.py`` moved into ``kvpool/cli/``. Every public name of the old module
``kvpool.events`` is the package's, without a warning; the other old paths warn with a ``DeprecationWarning``
naming the new path and give the new module's own objects; importing the package imports none of its
modules (a pool imports the compiled buffer without msgspec)."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("msgspec")

MOVED = {"kvpool.events_subscriber": "kvpool.events.subscriber",
         "kvpool.event_buffer": "kvpool.events.buffer", "kvpool.options": "kvpool.cli.options"}
#: The public names of the old module ``kvpool/events.py`` (before the move), read by hand from it (its own
#: definitions and the three subscriber names it re-exported).
OLD_EVENTS_NAMES = (
    "WireHash", "MEDIUM_GPU", "MEDIUM_CPU", "MEDIUM_STORAGE", "FULL_ATTENTION", "SPEC_KINDS", "KeySplit",
    "EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch",
    "HASH_FORMATS", "wire_hash", "wire_extra_keys", "EventPublisher", "NullEventPublisher",
    "QueueEventPublisher", "KVEventSink", "END_SEQ", "check_endpoint", "ZmqEventPublisher",
    "KVEventSubscriber", "SequenceTracker", "SubscriberStats")
#: The public names of the three other old modules, read by hand from them.
OLD_NAMES = {
    "kvpool.events_subscriber": ("SequenceTracker", "SubscriberStats", "KVEventSubscriber"),
    "kvpool.event_buffer": ("EventBuffer", "EventRecorder"),
    "kvpool.options": ("positive_int", "non_negative_int", "JSON_HELP", "add_json_argument",
                       "DeprecatedAlias", "add_deprecated_alias", "CommaList"),
}
PACKAGE = Path(__file__).resolve().parents[1] / "kvpool"


def test_kvpool_events_keeps_the_old_modules_names_without_a_warning() -> None:
    import kvpool.events

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in OLD_EVENTS_NAMES:
            value = getattr(kvpool.events, name)
            assert name in kvpool.events.__all__ and name in dir(kvpool.events)
            if inspect.isclass(value) or inspect.isfunction(value):  # defined in a module of the package
                assert value.__module__.startswith("kvpool.events."), (name, value.__module__)
    subscriber = importlib.import_module("kvpool.events.subscriber")
    assert kvpool.events.KVEventSubscriber is subscriber.KVEventSubscriber
    assert kvpool.events.wire_hash(b"\x00" * 8 + (5).to_bytes(8, "big"), "int64") == 5  # the last 8 bytes


@pytest.mark.parametrize(("old", "new"), MOVED.items())
def test_an_old_path_gives_the_new_objects_with_a_warning(old: str, new: str) -> None:
    shim, moved = importlib.import_module(old), importlib.import_module(new)
    for name in OLD_NAMES[old]:
        with pytest.warns(DeprecationWarning, match=f"import {name} from {new}"):
            value = getattr(shim, name)
        assert value is getattr(moved, name)
        assert name in dir(shim)


def test_importing_the_package_or_a_pool_imports_no_event_module() -> None:
    """In a fresh process: ``import kvpool.events`` loads none of its modules, and a block pool (which
    imports the compiled buffer) loads neither msgspec nor the wire types."""
    code = ("import sys, kvpool.events\n"
            "def loaded():\n"
            "    return sorted(m for m in sys.modules if m.startswith('kvpool.events.') or m == 'msgspec')\n"
            "a = loaded(); import kvpool.allocators.block_pool; print(a, loaded())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "['kvpool.events.buffer']"]


def test_kvpool_itself_imports_no_old_path_and_no_private_name_of_the_moved_modules() -> None:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvpool"):
                where = f"{path.relative_to(PACKAGE)} imports {node.module}"
                assert node.module not in MOVED, where
                if node.module.startswith("kvpool.events") or node.module in MOVED.values():
                    assert not [a.name for a in node.names if a.name.startswith("_")], where
            elif isinstance(node, ast.Import):
                assert not {a.name for a in node.names} & set(MOVED), path
