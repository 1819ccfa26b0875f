"""Tensor parallelism: real processes on gloo, against the single-process engine and transformers' generate.

Expected tokens and logits come from transformers' own greedy ``generate`` (stock ``sdpa`` attention, its own
DynamicCache, the whole model in one process) and the engine's counters from the single-process engine on
the same scenario: rank 0 makes the same decisions, so prefix hits, preemptions, peak blocks and steps must
be equal. Every multi-process test has a timeout; launches are few because each costs seconds here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

import _tp_helpers as helpers  # noqa: E402

from kvpool.allocators.block_pool import BlockPool  # noqa: E402
from kvpool.engine.distributed import RecordingPool, check_batch_blocks, pool_digest, replay  # noqa: E402
from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.launch import launch  # noqa: E402
from kvpool.engine.models import reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.engine.sharding import check_shardable, kv_heads_of_rank  # noqa: E402
from kvpool.errors import ConfigError, IntegrityError, RankFailedError  # noqa: E402
from kvpool.spec.memory import ModelMemory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def expected(name: str) -> tuple[list, dict]:
    """(transformers' greedy tokens and logits per prompt, the single-process engine's outcomes)."""
    model = helpers.build_model(name)
    refs = {tuple(p): reference_greedy(model, p, helpers.NEW) for p in helpers.PROMPTS}
    single = helpers.run_scenarios(None, [name])[name]
    return refs, single


def assert_tp_matches(outcome: dict, refs: dict, single: dict) -> None:
    for scenario, (_, calls) in helpers.SCENARIOS.items():
        got, ship = outcome[scenario]
        prompts = [p for call in calls for p in call]
        for prompt, tokens, logits in zip(prompts, got["tokens"], got["logits"], strict=True):
            ref_tokens, ref_logits = refs[tuple(prompt)]
            assert tokens == ref_tokens, scenario
            torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
        assert got["tokens"] == single[scenario][0]["tokens"], scenario
        torch.testing.assert_close(got["logits"], single[scenario][0]["logits"], atol=1e-4, rtol=0)
        assert got["stats"] == single[scenario][0]["stats"], scenario  # same decisions as one process
        assert got["all_free"] and ship["steps"] == got["stats"][-1]


@pytest.mark.timeout(300)
def test_tp2_tiny_llama_and_qwen2_match_one_process_and_transformers() -> None:
    outcome = launch(helpers.run_scenarios, 2, ["tiny-llama", "tiny-qwen2"])
    for name in ("tiny-llama", "tiny-qwen2"):
        refs, single = expected(name)
        assert single["batch then prefix hits"][0]["stats"][0] > 0  # prefix hits happened
        assert single["chunked prefill and preemption"][0]["stats"][1] > 0  # and preemptions
        assert_tp_matches(outcome[name], refs, single)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp3_replicates_the_single_kv_head() -> None:
    # 6 query heads, 1 KV head, 3 ranks: every rank holds a copy of the KV head and 2 query heads
    outcome = launch(helpers.run_scenarios, 3, [helpers.MQA])
    refs, single = expected(helpers.MQA)
    assert_tp_matches(outcome[helpers.MQA], refs, single)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tp4_tiny_llama_replicates_each_kv_head_twice() -> None:
    outcome = launch(helpers.run_scenarios, 4, ["tiny-llama"])
    assert_tp_matches(outcome["tiny-llama"], *expected("tiny-llama"))


# ---- lock-step pools, in one process


def test_replayed_log_keeps_a_second_pool_in_lock_step() -> None:
    from kvpool.events import QueueEventPublisher

    torch.set_num_threads(1)
    # with KV events on, the coordinator publishes with parent hashes and token ids: those calls replay too
    engine = LLMEngine(helpers.build_model("tiny-llama"), num_blocks=14, block_size=helpers.BLOCK,
                       max_num_batched_tokens=6, kv_events=QueueEventPublisher())
    recorder = engine.kv_manager.wrap_pool(lambda pool: RecordingPool(pool, on_check=lambda: None))
    mirror = BlockPool(14)
    for prompt in helpers.PROMPTS:
        engine.add_request(prompt, SamplingParams(max_new_tokens=helpers.NEW))
    digests = set()
    while engine.has_unfinished():
        engine.step()
        replay(mirror, recorder.drain(), rank=1)
        assert pool_digest(mirror) == pool_digest(recorder.pool)
        digests.add(pool_digest(mirror))
    assert engine.stats.preemptions > 0 and len(digests) > 10  # the state moved, and both pools with it
    assert mirror.num_free_blocks == 14 and mirror.num_cached_blocks == recorder.num_cached_blocks > 0


def test_replay_and_digest_catch_a_pool_that_diverged() -> None:
    leader, follower = BlockPool(8), BlockPool(8)
    recorder = RecordingPool(leader, on_check=lambda: None)
    follower.allocate(1)  # the follower took block 0 on its own: rank 0's next allocation differs
    with pytest.raises(IntegrityError, match=r"allocate returned \[1, 2\] where rank 0's returned \[0, 1\]"):
        recorder.allocate(2)
        replay(follower, recorder.drain(), rank=1)
    a, b = BlockPool(8), BlockPool(8)
    for pool in (a, b):
        ids = pool.allocate(3)
        pool.cache_blocks(ids[:2], [b"h0", b"h1"])
    a.free([0, 1, 2])
    b.free([1, 0, 2])  # same blocks cached, another eviction order
    assert pool_digest(a) != pool_digest(b)
    with pytest.raises(IntegrityError, match="into block 1, which this rank's pool holds free"):
        check_batch_blocks(a, [(([0, 1],), 4, 5)], block_size=4, rank=1)  # writes block 1, which is free


def test_pins_and_retention_priorities_replay() -> None:
    leader, follower = BlockPool(8), BlockPool(8)
    recorder = RecordingPool(leader, on_check=lambda: None)
    ids = recorder.allocate(3)
    recorder.cache_blocks(ids, [b"a", b"b", b"c"])
    recorder.pin(ids[:1])
    recorder.free(ids[::-1], priority=5)
    assert recorder.pin_prefix([b"a", b"b"]) == ids[:2]
    recorder.unpin(ids[:1])
    replay(follower, recorder.drain(), rank=1)
    assert follower.pinned_blocks() == leader.pinned_blocks() == {ids[0]: 1, ids[1]: 1}
    assert pool_digest(follower) == pool_digest(leader)


def test_recorded_calls_that_raise_are_not_logged() -> None:
    recorder = RecordingPool(BlockPool(4), on_check=lambda: None)
    with pytest.raises(Exception, match="block"):
        recorder.free([3])  # never allocated
    assert recorder.drain() == [] and recorder.num_free_blocks == 4


# ---- sharding rules


def test_kv_heads_of_each_rank() -> None:
    # divided: 8 heads over 4 ranks; replicated: 2 heads over 4 ranks, head h on ranks 2h and 2h + 1
    assert [list(kv_heads_of_rank(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(kv_heads_of_rank(2, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads_of_rank(3, r, 3)) for r in range(3)] == [[0], [1], [2]]  # SmolLM2 at 3


@pytest.mark.parametrize(("heads", "kv", "inner", "tp", "why"), [
    (4, 2, 128, 3, "does not divide the 4 query heads"),
    (4, 2, 128, 8, "more ranks than query heads"),
    (6, 4, 120, 3, "tp_size 3 does not divide num_kv_heads 4"),
    (6, 4, 120, 6, "tp_size 6 is not a multiple of num_kv_heads 4"),  # too many ranks to replicate evenly
    (4, 4, 126, 4, "does not divide intermediate_size 126"),
])
def test_shardable_checks(heads: int, kv: int, inner: int, tp: int, why: str) -> None:
    config = {"model_type": "llama", "num_attention_heads": heads, "num_key_value_heads": kv,
              "intermediate_size": inner, "hidden_size": 16 * heads, "num_hidden_layers": 2}
    with pytest.raises(ConfigError, match=why):
        check_shardable(config, tp)
    check_shardable(config, 1)
    with pytest.raises(ConfigError, match="not 'jamba'"):
        check_shardable({**config, "model_type": "jamba"}, 2)


def test_shardable_checks_leave_the_heads_to_the_callers_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # kvpool generate makes the model's ModelMemory at the TP size itself (its making refuses 4 KV heads over
    # 3 ranks): with check_heads False the layout is checked and no second memory is made
    made = []
    monkeypatch.setattr(ModelMemory, "from_config", classmethod(lambda cls, *a, **k: made.append(a)))
    config = {"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 4,
              "intermediate_size": 120, "hidden_size": 96, "num_hidden_layers": 2}
    check_shardable(config, 3, check_heads=False)
    assert made == []
    with pytest.raises(ConfigError, match="does not divide the 6 query heads"):
        check_shardable(config, 4, check_heads=False)
    check_shardable(config, 3)
    assert len(made) == 1


# ---- the command line


def cli(*argv: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "kvpool", "generate", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_bad_tp_size_is_one_line_before_any_process_starts(capsys: pytest.CaptureFixture) -> None:
    from kvpool.cli import main

    for argv, why in ((["--tp-size", "3"], "tp_size 3 does not divide the 4 query heads"),
                      (["--tp-size", "8"], "more ranks than query heads"),
                      (["--model", "tiny-jamba", "--tp-size", "2"], "not 'jamba'")):
        before = multiprocess_children()
        assert main(["generate", "--model", "tiny-llama", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err and "tensor-parallel ranks" not in err
        assert multiprocess_children() == before


def multiprocess_children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def wait_for_ranks(proc: subprocess.Popen) -> tuple[list[int], list[str]]:
    """Read the launcher's stderr up to its line naming the ranks' pids."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "tensor-parallel ranks" in line:
            return [int(p) for p in line.split("pids ")[1].split(", ")], lines
    raise AssertionError(f"no ranks line: {lines}")


def assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"left over: {[p for p in pids if psutil.pid_exists(p)]}"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_a_killed_rank_ends_the_job_with_its_error_and_no_leftover_process() -> None:
    pids: list[int] = []

    def kill_rank_1_soon(ready: list[int]) -> None:  # the ranks are in their all-reduce loop by then
        pids.extend(ready)
        threading.Timer(1.0, os.kill, (ready[1], signal.SIGKILL)).start()

    with pytest.raises(RankFailedError, match="^rank 1 killed by SIGKILL$"):
        launch(helpers.all_reduce_forever, 2, on_ready=kill_rank_1_soon)
    assert_all_gone(pids)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killing_a_rank_mid_run_ends_the_run_with_an_error_and_no_leftover_process() -> None:
    # 1 + 4000 tokens of tiny-llama take far longer than the few seconds before the kill
    proc = cli("--model", "tiny-llama", "--tp-size", "2", "--prompt", "x", "--max-new-tokens", "4000",
               "--threads", "1")
    pids, _ = wait_for_ranks(proc)
    everything = [*pids, *(p.pid for p in psutil.Process(proc.pid).children(recursive=True))]
    time.sleep(5)  # past loading, into generation
    os.kill(pids[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == "kvpool generate: error: rank 1 killed by SIGKILL"
    assert_all_gone(everything)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_rank() -> None:
    # a pool of its own size (4,001 tokens: 251 blocks of 16), not one planned from the machine's free memory
    # SIGINT back to its default in the child: a test run started in the background by a non-interactive
    # shell (`pytest ... &`) inherits SIGINT ignored, Python keeps it ignored, and the job ran to its end
    proc = cli("--model", "tiny-llama", "--tp-size", "2", "--prompt", "x", "--max-new-tokens", "4000",
               "--threads", "1", "--num-blocks", "512", start_new_session=True,
               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids, _ = wait_for_ranks(proc)
    time.sleep(5)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "kvpool generate: interrupted"
    assert_all_gone(pids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_that_raises_is_reported_and_a_diverged_pool_is_caught() -> None:
    with pytest.raises(RankFailedError, match="rank 1 failed: ValueError: rank 1 fails on purpose") as info:
        launch(helpers.fail_on_rank_1, 2)
    assert info.value.rank == 1 and "fail_on_rank_1" in info.value.traceback
    with pytest.raises(RankFailedError, match="pool state differs across tensor-parallel ranks"):
        launch(helpers.diverge_then_check, 2)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_tp2_and_torchrun_report_what_one_process_reports() -> None:
    # the built-in prompts are up to 1,224 bytes: 80 blocks of 16 with 6 new tokens
    argv = ["--model", "tiny-llama", "--max-new-tokens", "6", "--json", "--threads", "1", "--num-blocks",
            "128"]
    single, tp2 = cli(*argv), cli(*argv, "--tp-size", "2", "--check")
    (out1, err1), (out2, err2) = (p.communicate(timeout=300) for p in (single, tp2))
    assert single.returncode == 0 and tp2.returncode == 0, err1[-2000:] + err2[-2000:]
    one, two = json.loads(out1), json.loads(out2)
    tokens = [r["output_token_ids"] for r in one["requests"]]
    assert [r["matches_reference"] for r in two["requests"]] == [True] * 4
    assert [r["output_token_ids"] for r in two["requests"]] == tokens
    same = ("num_blocks", "peak_blocks_used", "prefix_hit_tokens", "preemptions", "generated_tokens", "steps")
    assert {k: two["stats"][k] for k in same} == {k: one["stats"][k] for k in same}
    assert two["stats"]["tp_size"] == 2 and two["stats"]["pool_bytes"] * 2 == one["stats"]["pool_bytes"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = subprocess.run([*torchrun, "-m", "kvpool", "generate", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    via_torchrun = json.loads(run.stdout)  # rank 0 alone prints
    assert [r["output_token_ids"] for r in via_torchrun["requests"]] == tokens


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smollm2_tp3_matches_transformers() -> None:
    pytest.importorskip("gguf")
    proc = cli("--tp-size", "3", "--max-new-tokens", "6", "--check", "--json")
    out, err = proc.communicate(timeout=850)
    assert proc.returncode == 0, err[-2000:]
    result = json.loads(out)
    assert [r["matches_reference"] for r in result["requests"]] == [True] * 4
    assert "Paris" in result["requests"][2]["text"]
    assert result["stats"]["tp_size"] == 3 and result["stats"]["prefix_hit_tokens"] >= 16
