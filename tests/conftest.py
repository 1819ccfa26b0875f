"""Test settings: hypothesis runs derandomized (a fixed seed) so a red run always means a real fault; shared
fixtures (one torch thread, real Redis servers)."""

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "deterministic", derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

from redis_servers import (  # noqa: E402, F401 (fixtures: real Redis servers)
    redis_cluster_nodes,
    redis_single,
    redis_stalling,
)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and a busy shared machine makes two threads stall
    (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs (root needed, as in CI); skipped where mounting is not allowed."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def per_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk tiers keep a file per value (``FileTier.segment_bytes`` 0, not segments): for the tests that
    damage, move or delete one value's whole file."""
    from kvpool.tiers.file import FileTier

    monkeypatch.setattr(FileTier, "segment_bytes", 0)
