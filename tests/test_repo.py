"""The repository as CI sees it: ``.ci/run`` runs exactly the README's commands (the quick start's three,
then its "Tests and CI" block), and git tracks no binary file (a wheel, a build, weights: they come from a
registry or a build, never from the repository)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"```bash\n(?P<code>.*?)```", re.S)
#: ``step NAME 'COMMAND'`` in .ci/run: each runs one README command.
STEP = re.compile(r"^step (?:\"[^\"]+\"|\S+) '(?P<command>[^']+)'", re.M)
BINARY_SUFFIXES = (".whl", ".so", ".pyd", ".dll", ".dylib", ".o", ".a", ".pyc", ".zip", ".gz", ".tgz", ".xz",
                   ".bz2", ".zst", ".tar", ".bin", ".pt", ".pth", ".safetensors", ".gguf", ".npy", ".npz",
                   ".pkl", ".exe")


def readme_block(heading: str) -> list[str]:
    """The commands of the first bash block under README's ``## heading``, without their comments."""
    section = ROOT.joinpath("README.md").read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    code = FENCE.search(section)
    assert code, f"README's {heading!r} has no bash block"
    return [re.sub(r"\s+# .*$", "", line).strip() for line in code["code"].splitlines() if line.strip()]


def test_ci_runs_the_readmes_commands_in_order() -> None:
    readme = readme_block("Quick start") + readme_block("Tests and CI")
    ci = STEP.findall(ROOT.joinpath(".ci", "run").read_text())
    assert ci == readme
    # what a newcomer runs first: a new venv, then the set-up in it
    assert readme[0].startswith("python3 -m venv .venv && . .venv/bin/activate && ")


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
