"""Installing kvpool from a clone (docs/install.md): kvpool is not on the package index, so no page,
docstring or message tells users to ``pip install kvpool``; and the wheel ``python -m build`` makes carries
the compiled hot path into a new venv, where ``kvpool --version`` says so."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kvpool
from kvpool._native import COMPILED_MODULES

ROOT = Path(__file__).resolve().parents[1]
#: What users read: the README, the documentation pages, and kvpool's sources (docstrings become the API
#: pages; messages and --help texts are printed).
READ = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "kvpool").rglob("*.py"))]
FROM_INDEX = re.compile(r"pip3? install\s+(?:-\S+\s+)*[\"']?kvpool(?![\w/.-])")


def test_the_pattern_finds_an_install_from_the_index() -> None:
    found = [bool(FROM_INDEX.search(text)) for text in (
        "pip install kvpool[tiers]", "`pip install 'kvpool[events]'`", "pip install -U kvpool",
        'pip install -e ".[tiers]"', "pip install kvpool-other", "pip install ./kvpool/dist/x.whl")]
    assert found == [True, True, True, False, False, False]


def test_no_page_says_to_install_kvpool_from_the_index() -> None:
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for path in READ for number, line in enumerate(path.read_text().splitlines(), 1)
            if FROM_INDEX.search(line)]
    assert hits == [], "kvpool is not on the package index (docs/install.md says what works)"


def _run(*args: object, **kwargs: object) -> str:
    """Run a command; its stdout, or a failure showing the end of its output."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, check=False, **kwargs)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
    return done.stdout


@pytest.mark.slow
def test_the_wheel_runs_compiled_in_a_new_venv(tmp_path: Path) -> None:
    pytest.importorskip("build")
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler: the wheel would hold the interpreted modules only")
    # pinned as the set-up pins: the isolated build (setuptools, mypy) and torch (the CPU wheel)
    env = {**os.environ, "PIP_CONSTRAINT": str(ROOT / "requirements" / "lock.txt"), "KVPOOL_COMPILE": "1"}
    dist, venv = tmp_path / "dist", tmp_path / "venv"
    # the source archive, then the wheel built from it: the archive must hold all the build needs
    _run(sys.executable, "-m", "build", "--outdir", dist, ROOT, env=env, timeout=1200)
    (wheel,) = dist.glob("kvpool-*.whl")
    assert len(list(dist.glob("kvpool-*.tar.gz"))) == 1
    with zipfile.ZipFile(wheel) as archive:  # kvpool/allocators/block_pool.cpython-311-....so
        names = archive.namelist()
    extensions = {name.split(".")[0].replace("/", ".") for name in names if name.endswith(".so")}
    assert set(COMPILED_MODULES) <= extensions
    try:
        _run(sys.executable, "-m", "venv", venv, timeout=300)
        _run(venv / "bin" / "python", "-m", "pip", "install", "--quiet", wheel, "torch==2.13.0", env=env,
             timeout=1200)
        # from a folder without kvpool's sources, so that only the installed wheel can be imported
        here = {**os.environ, "KVPOOL_PURE_PYTHON": "0"}
        version = _run(venv / "bin" / "kvpool", "--version", cwd=tmp_path, env=here, timeout=300)
        where = _run(venv / "bin" / "python", "-c", "import kvpool; print(kvpool.__file__)", cwd=tmp_path,
                     env=here, timeout=300)
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # ~1 GB of torch
    modules = len(COMPILED_MODULES)
    assert version.strip() == f"kvpool {kvpool.__version__} (hot path compiled (mypyc): {modules} modules)"
    assert Path(where.strip()).is_relative_to(venv)
