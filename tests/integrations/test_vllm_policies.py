"""Conformance of kvpool's eviction policies inside vLLM's CPU offload tier, 0.33.0 and 0.34.0 (run by
tests/integrations/run.sh in each vLLM venv; skipped where vLLM is not installed).

``CPUOffloadingManager`` loads each kvpool adapter by ``cache_policy_module_path`` exactly as
``kv_connector_extra_config`` makes it, runs 2,000 Mooncake requests (vllm_harness.py), and must evict the
same blocks in the same order, refuse the same stores and hit the same prefixes as a kvpool ``BlockPool``
with that policy given the same events; and kvpool's ``arc-vllm`` must evict as vLLM's own ``arc``."""

from __future__ import annotations

import inspect
from importlib.metadata import version

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: tests/integrations/run.sh runs this file "
                    "in the peer venv (benchmarks/peers/setup.sh)")

import vllm_harness as h  # noqa: E402
from packaging.version import Version  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvpool.integrations import vllm as kv  # noqa: E402

REQUESTS = 2000
CAPACITY = 4096
MODULE = "kvpool.integrations.vllm"


class ConformancePriority(kv.KvpoolPriority):
    """kvpool's priority policy on the harness's clock (one tick per request)."""

    retention_s = h.RETENTION
    clock = staticmethod(h.tick)


@pytest.fixture(scope="module")
def requests() -> list[list[bytes]]:
    return h.trace_keys(REQUESTS)


def vllm_run(policy: str, module: str | None, requests: list[list[bytes]]) -> h.Run:
    manager = CPUOffloadingManager(num_chunks=CAPACITY, cache_policy=policy, cache_policy_module_path=module)
    return h.drive_vllm(manager, requests)


#: vLLM loads each adapter by class name; ``priority`` runs on the harness's clock (ConformancePriority).
CLASSES = {name: cls.__name__ for name, cls in kv.POLICY_CLASSES.items() if name != "priority"}


@pytest.mark.parametrize("name", [*CLASSES, "priority"])
def test_vllm_evicts_as_kvpool_pool(name: str, requests: list[list[bytes]]) -> None:
    if name == "priority":
        theirs = vllm_run("ConformancePriority", __name__, requests)
    else:
        theirs = vllm_run(CLASSES[name], MODULE, requests)
    ours = h.drive_model(name, CAPACITY, requests)
    assert len(theirs.evicted) > 10_000, "the slice must evict (it is the point of the test)"
    assert sum(theirs.hits) > 0
    assert theirs.refused == ours.refused
    assert theirs.hits == ours.hits
    pairs = enumerate(zip(theirs.evicted, ours.evicted, strict=False))
    first = next((i for i, (a, b) in pairs if a != b), None)
    assert first is None and len(theirs.evicted) == len(ours.evicted), (
        f"{name}: first different eviction at {first} of {len(theirs.evicted)}/{len(ours.evicted)}")
    print(f"\n{name}: {len(theirs.evicted)} evictions in the same order, {sum(theirs.hits)} hit blocks, "
          f"{sum(theirs.refused)} stores refused")


def _agreement(a: h.Run, b: h.Run) -> str:
    pairs = enumerate(zip(a.evicted, b.evicted, strict=False))
    same = next((i for i, (x, y) in pairs if x != y), min(len(a.evicted), len(b.evicted)))
    return (f"first {same} of {len(a.evicted)} / {len(b.evicted)} evictions alike, hit blocks "
            f"{sum(a.hits)} / {sum(b.hits)}")


def test_kvpool_arc_vllm_evicts_as_vllm_arc(requests: list[list[bytes]]) -> None:
    """kvpool's ``arc-vllm`` (ARC with vLLM 0.33's rules) is vLLM's own ``arc``: same victims, same hits."""
    ours, theirs = vllm_run("KvpoolARCVllm", MODULE, requests), vllm_run("arc", None, requests)
    print(f"\nKvpoolARCVllm vs vLLM arc: {_agreement(ours, theirs)}")
    assert len(theirs.evicted) > 10_000
    assert ours.hits == theirs.hits and ours.refused == theirs.refused
    assert ours.evicted == theirs.evicted


def test_kvpool_arc_departs_from_vllm_arc(requests: list[list[bytes]]) -> None:
    """kvpool's ``arc`` (the paper's rules) differs from vLLM's ``arc`` by vLLM's departures only: the
    agreement is measured and printed, and the two must part (else ``arc-vllm`` would be pointless)."""
    ours, theirs = vllm_run("KvpoolARC", MODULE, requests), vllm_run("arc", None, requests)
    print(f"\nKvpoolARC (paper) vs vLLM arc: {_agreement(ours, theirs)}")
    assert ours.evicted != theirs.evicted


def test_kvpool_lru_evicts_as_vllm_lru(requests: list[list[bytes]]) -> None:
    """kvpool's LRU (a request's blocks freed again tail first at its end) is vLLM's own LRU order."""
    ours, theirs = vllm_run("KvpoolLRU", MODULE, requests), vllm_run("lru", None, requests)
    print(f"\nKvpoolLRU vs vLLM lru: {_agreement(ours, theirs)}")
    assert len(theirs.evicted) > 10_000
    assert ours.hits == theirs.hits
    assert ours.evicted == theirs.evicted


def test_adapters_follow_the_installed_release() -> None:
    """The interface read from vLLM's base classes is the one its release notes give: ``touch`` on the
    policy and the tier and no ``deferred_release`` before 0.34, the reverse from 0.34; no adapter is left
    abstract (vLLM would refuse to build it)."""
    new = Version(version("vllm")) >= Version("0.34")
    assert kv.POLICY_TOUCH is kv.TIER_TOUCH is (not new)
    assert kv.DEFERRED_RELEASE is new
    for cls in [*kv.POLICY_CLASSES.values(), kv.KvpoolTier]:
        assert not inspect.isabstract(cls), cls
        assert hasattr(cls, "touch") is (not new), cls
