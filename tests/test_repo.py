"""The repository: git tracks no binary file (a wheel, a build, weights: they come from a registry or a
build, never from the repository)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BINARY_SUFFIXES = (".whl", ".so", ".pyd", ".dll", ".dylib", ".o", ".a", ".pyc", ".zip", ".gz", ".tgz", ".xz",
                   ".bz2", ".zst", ".tar", ".bin", ".pt", ".pth", ".safetensors", ".gguf", ".npy", ".npz",
                   ".pkl", ".exe")


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if done.returncode:
        pytest.skip(f"git ls-files failed: {done.stderr.decode().strip()}")
    return [ROOT / name for name in done.stdout.decode().split("\0") if name]


def is_binary(path: Path) -> bool:
    """A binary file's suffix, or a NUL byte in its first 64 KiB (no text file has one)."""
    if path.name.lower().endswith(BINARY_SUFFIXES):
        return True
    return path.is_file() and b"\0" in path.read_bytes()[:65536]


def test_no_binary_file_is_tracked() -> None:
    files = tracked_files()
    assert any(path.name == "README.md" for path in files)  # the listing is this repository's
    assert [str(path.relative_to(ROOT)) for path in files if is_binary(path)] == []


def test_the_binary_check_sees_a_wheel_and_nul_bytes(tmp_path: Path) -> None:
    # the two rules of test_no_binary_file_is_tracked, on files made here: a wheel's name, a NUL byte
    wheel, blob, text = tmp_path / "ninja-1.13.2-py3-none-any.whl", tmp_path / "data.json", tmp_path / "a.md"
    wheel.write_bytes(b"PK")
    blob.write_bytes(b'{"a": 1}\0')
    text.write_text("# text\n")
    flagged = [p.name for p in (wheel, blob, text) if is_binary(p)]
    assert flagged == ["ninja-1.13.2-py3-none-any.whl", "data.json"]
