"""An elastic engine under tensor parallelism, on real processes (gloo): sleep / wake, a host tier and
``--kv-memory auto`` run on every rank in step with rank 0 (:mod:`kvpool.engine.tp_memory`). Expected tokens
come from transformers' own greedy ``generate`` on the whole model in this process; every run ends with the
cross-rank integrity check (pools, live blocks and committed pages of every rank compared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import _tp_elastic_helpers as helpers  # noqa: E402
import _tp_helpers  # noqa: E402

from kvpool.engine.launch import launch  # noqa: E402
from kvpool.engine.models import reference_greedy  # noqa: E402
from kvpool.errors import InsufficientMemoryError, MemoryLimitError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def greedy(prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens of each prompt on the whole tiny Llama (seed 1)."""
    model = _tp_helpers.build_model("tiny-llama")
    return [reference_greedy(model, p, _tp_helpers.NEW)[0] for p in prompts]


@pytest.mark.timeout(300)
def test_tp2_sleep_gives_every_rank_its_pages_back_and_wake_generates_the_same_tokens() -> None:
    got = launch(helpers.sleep_and_wake, 2)
    refs = greedy(_tp_helpers.PROMPTS[:2])
    assert got["first"] == refs and got["after"] == refs
    assert got["in_flight"] == refs[0]  # preempted mid-prefill by the sleep, recomputed after the wake
    assert got["preemptions"] == 1
    awake, asleep = got["awake"], got["asleep"]
    # tp 2 gives each rank one of the 2 KV heads: the same blocks, the same bytes a block, the same pages
    assert awake[0] > 0 and awake == [awake[0]] * 2 and got["given"] == awake[0]
    assert asleep == [0, 0]  # every rank's arena gave every page back, its reserve too
    assert got["woken"] == [2 * helpers.PAGE] * 2  # the wake commits each rank's 2 reserve pages again
    assert got["cached_asleep"] == 0  # the prefix index emptied


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tp2_tier_restores_on_every_rank_after_trim_evicted_the_device_cache(tier: str, tmp_path: Path
                                                                             ) -> None:
    url = "host://?blocks=32" if tier == "host" else f"file://{tmp_path}/disk?blocks=32"
    got = launch(helpers.tier_hit, 2, url)
    ref = greedy([_tp_helpers.PROMPTS[0]])[0]
    assert got["first"] == ref and got["again"] == ref
    assert got["trimmed"] > 0 and got["cached_after_trim"] == 0  # no block of the prompt left on the device
    # the 40-token prompt hits at most (40 - 1) // 4 = 9 full blocks (its last token is computed): all 9
    # from each rank's tier
    assert got["hits"] == {"device": 0, tier: 9}


class _Runner:
    """A runner whose wake fails or not, counting its sleeps."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.sleeps = fails, 0

    def wake(self) -> int:
        if self.fails:
            raise MemoryLimitError("over the limit")
        return 4096

    def sleep(self) -> int:
        self.sleeps += 1
        return 4096


class _Group:
    def __init__(self, everyone_ok: bool) -> None:
        self.everyone_ok, self.rank = everyone_ok, 1

    def min_int(self, value: int) -> int:
        return value if self.everyone_ok else 0


def test_a_wake_that_fails_on_one_rank_leaves_every_rank_asleep() -> None:
    from kvpool.engine.tp_memory import wake_agreed

    assert wake_agreed(_Group(True), _Runner(False)) == 4096
    woke = _Runner(False)
    with pytest.raises(InsufficientMemoryError, match="another tensor-parallel rank"):
        wake_agreed(_Group(False), woke)  # this rank woke, another could not
    assert woke.sleeps == 1
    failed = _Runner(True)
    with pytest.raises(MemoryLimitError, match="over the limit"):
        wake_agreed(_Group(False), failed)
    assert failed.sleeps == 0


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_kv_memory_auto_on_two_ranks_matches_transformers() -> None:
    """Each rank measures its memory after the warm-up; the pool is the smallest over the ranks (a rank with
    another pool size would diverge at the first allocation and fail the cross-rank check)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    argv = ["--model", "tiny-llama", "--tp-size", "2", "--kv-memory", "auto", "--max-new-tokens", "6",
            "--threads", "1", "--check", "--json"]
    run = subprocess.run([sys.executable, "-m", "kvpool", "generate", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert [r["matches_reference"] for r in out["requests"]] == [True] * len(out["requests"])
    memory, m = out["stats"]["kv_memory"], out["stats"]["kv_memory"]["measured"]
    assert memory["elastic"] and out["stats"]["tp_size"] == 2
    # rank 0 plans its half of the machine's measured bytes, the pool is the smallest rank's plan: at most
    # that many blocks of 2 layers x K and V x 1 of 2 heads x 16 x 4 B x 16 tokens = 4 KiB
    assert 0 < out["stats"]["num_blocks"] <= m["kv_bytes"] // 2 // 4096
    assert memory["reserved"] <= m["kv_bytes"] // 2
