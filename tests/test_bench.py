"""Smoke tests of `kvpool bench`: each suite runs at toy sizes and its derived columns follow from the raw
timings it reports (the ratios are the suites' own definitions, recomputed here). No timing is asserted."""

import json
import logging
import os
from pathlib import Path

import pytest

from kvpool.cli import main


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def bench(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_alloc_rows_and_ratios(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "alloc", "--sizes", "256", "--ops", "256", "--repeat", "1", "--peer-rounds", "0")
    ops = {row["op"] for row in result["rows"]}
    assert {"allocate(1)+free", "allocate(256)+free", "evicting allocate(1)", "token alloc(1)+free(1)"} <= ops
    for row in result["rows"]:
        assert row["kvpool_ns"] > 0
        if row["baseline_ns"]:
            assert row["ratio"] == pytest.approx(row["kvpool_ns"] / row["baseline_ns"], abs=5e-4)


def test_targets_without_the_peer_venvs_prints_no_peer_ratio(capsys: pytest.CaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path) -> None:
    # PEER_VENVS names an empty folder: every peer row says so, with no ratio (the stored figure is shown
    # beside it in the alloc table, labelled, never divided)
    from kvpool.bench import targets

    monkeypatch.setenv("PEER_VENVS", str(tmp_path))
    monkeypatch.setitem(targets.SUITE_ARGS, "alloc", ["--sizes", "256", "--ops", "256", "--repeat", "1"])
    skip = "replay,tiers,groups,attention,engine"
    assert main(["bench", "targets", "--skip", skip]) == 0
    out = capsys.readouterr().out
    peer_lines = [line for line in out.splitlines() if "ns / kvpool ns" in line]
    assert len(peer_lines) == 6 and all("peer not installed" in line for line in peer_lines)
    assert all(line.split()[-3:-1] == ["-", "-"] for line in peer_lines)  # ratio and bound: none
    result = bench(capsys, "targets", "--skip", skip)
    peers = [r for r in result["rows"] if "kvpool ns" in r["measure"]]
    assert len(peers) == 6 and all(r["ratio"] is None and r["met"] is None for r in peers)
    assert main(["bench", "alloc", "--sizes", "256", "--ops", "256", "--repeat", "1"]) == 0
    table = capsys.readouterr().out
    table = table[table.index("Peers timed in this run"):]
    assert table.count("peer not installed") == 6 and "stored: ~1,550 ns (DESIGN.md's peer table" in table


def test_a_peer_whose_script_fails_gets_no_ratio(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    # a "vLLM venv" whose python has no vllm: its side fails at import, its rows say so; SGLang: not installed
    import sys

    from kvpool.bench.peers import live_rows

    (tmp_path / "vllm-venv" / "bin").mkdir(parents=True)
    (tmp_path / "vllm-venv" / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PEER_VENVS", str(tmp_path))
    rows = live_rows(1, 1)
    vllm = [r for r in rows if r["peer"].startswith("vLLM")]
    assert len(vllm) == 4 and all(r["peer_over_kvpool"] is None for r in rows)
    assert all(r["status"].startswith("peer failed: ") and "vllm" in r["status"] for r in vllm)
    assert all(r["status"].startswith("peer not installed") for r in rows if r["peer"].startswith("SGLang"))


def test_a_peer_ratio_is_the_median_of_the_rounds_ratios() -> None:
    # by hand: peer 1000, 1200, 900 ns and kvpool 100, 200, 100 ns in three rounds: ratios 10, 6, 9 -> 9
    # (not 1000 / 100 = 10, the ratio of the medians); the ns columns are each side's median
    from kvpool.bench.peers import ROWS, Side, _row

    op = ROWS[0].op
    peer, ours = Side.__new__(Side), Side.__new__(Side)
    for side, ns, version in ((peer, [1000, 1200, 900], "0.33.0"), (ours, [100, 200, 100], "0.1.0")):
        side.error, side.version, side.rounds = "", version, [{op: v} for v in ns]
    row = _row(ROWS[0], ours, peer, 3)
    assert (row["peer_ns"], row["kvpool_ns"], row["peer_over_kvpool"], row["rounds"]) == (1000, 100, 9.0, 3)
    assert row["peer"] == "vLLM 0.33.0 BlockPool" and row["status"] == "timed in this run"


def test_storage_rows_and_ratios(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "storage", "--tokens", "1,16", "--num-blocks", "8", "--repeat", "1")
    rows = result["rows"]
    expected = {(pattern, t) for pattern in ("random", "paged") for t in (1, 16)}
    assert {(r["pattern"], r["tokens"]) for r in rows} == expected
    for row in rows:
        assert row["bytes"] == 2 * row["tokens"] * 8 * 128 * 2  # K and V, H=8, D=128, float16
        assert row["ratio"] == pytest.approx(row["copy_us"] / row["store_kv_us"])


def test_attention_rows_ratios_and_agreement(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "attention", "--contexts", "8,20", "--requests", "2", "--repeat", "1")
    rows = result["rows"]
    assert [(r["phase"], r["context"], r["query_tokens"]) for r in rows] == [
        ("decode", 8, 2), ("decode", 20, 2), ("prefill", 8, 8), ("prefill", 20, 20)]
    for row in rows:  # one repetition: each ratio is the quotient of the two times it reports
        assert row["paged_vs_contiguous"] == pytest.approx(row["contiguous_us"] / row["paged_us"])
        assert row["paged_vs_gather"] == pytest.approx(row["gather_us"] / row["paged_us"])
        assert row["max_abs_diff"] < 1e-5 and row["max_abs_diff_contiguous"] < 1e-5  # the same attention


def test_replay_ops_per_second(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "replay", "--max-requests", "20")
    for block_size in (512, 16):
        run = result["results"][f"block_size_{block_size}"]
        assert run["requests"] == 20
        assert run["block_ops_per_s"] == pytest.approx(run["block_ops"] / run["wall_s"])


def test_alloc_against_a_tree_times_both_trees_on_the_same_rows(capsys: pytest.CaptureFixture) -> None:
    # this checkout against itself: both subprocesses import this tree's kvpool, each row gets both
    # figures and the ratio is the median of the per-round ratios, recomputed here from the JSON (one
    # round: that round's this / against, up to the rounding of the two figures)
    tree = Path(__file__).resolve().parents[1]
    result = bench(capsys, "alloc", "--against", str(tree), "--sizes", "256", "--ops", "256", "--repeat", "1",
                   "--rounds", "1")
    assert result["rounds"] == 1 and str(tree) in result["this"] and str(tree) in result["against"]
    ops = {row["op"] for row in result["rows"]}
    # rows `kvpool bench alloc` prints for the pool (n = 1 and 256) and for each eviction policy
    assert {"allocate(1)+free", "free (n=256)", "evicting allocate(256)", "evicting allocate(1) [fifo]",
            "touch(1) on a cached free block [lru]"} <= ops
    for row in result["rows"]:
        assert row["pool_blocks"] == 256 and row["this_ns"] > 0 and row["against_ns"] > 0
        assert row["ratio"] == pytest.approx(row["this_ns"] / row["against_ns"], rel=0.01, abs=2e-3)


def test_alloc_against_a_folder_that_is_no_kvpool_tree_is_one_line_error(capsys: pytest.CaptureFixture,
                                                                         tmp_path) -> None:
    assert main(["bench", "alloc", "--against", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "not a kvpool source tree" in err


def test_alloc_sizes_too_small_is_one_line_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "alloc", "--sizes", "64"]) == 2  # allocate(256) cannot run on 64 blocks
    assert "--sizes must be >= 256" in capsys.readouterr().err


def test_bad_counts_are_one_line_errors(capsys: pytest.CaptureFixture) -> None:
    # checked before any model loads or any row is timed: exit 2, one line on stderr, no traceback
    assert main(["bench", "engine", "--model", "tiny-llama", "--threads", "-1"]) == 2
    cap = 4 * (os.cpu_count() or 1)  # at most 4 threads per CPU
    assert capsys.readouterr().err == ("kvpool bench engine: error: argument --threads: '-1' must be an "
                                       f"integer in [0, {cap}]\n")
    assert main(["bench", "replay", "--max-requests", "0"]) == 2  # used to time zero requests
    assert "max_requests must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "why"), [
    # 8 blocks x 16 tokens = 128 slots: 256 tokens cannot be distinct slots (was dropped, exit 0, no rows)
    (["storage", "--num-blocks", "8", "--tokens", "16,256"],
     "--tokens 256 is more than the cache's 128 slots"),
    (["storage", "--seed", str(2**70)], "--seed must be an integer in [0, 18446744073709551615]"),
    (["engine", "--model", "tiny-llama", "--num-blocks", "10"], "cannot hold the longest prompt"),
])
def test_bench_refuses_what_it_cannot_time(capsys: pytest.CaptureFixture, argv: list[str], why: str) -> None:
    assert main(["bench", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and why in err


def test_engine_bench_on_a_tiny_model_sizes_the_pool_from_its_prompts(capsys: pytest.CaptureFixture) -> None:
    """Issue 9, item 12: tiny-llama's byte-tokenized built-in prompts never fit the peer's 64 blocks."""
    from kvpool.engine.models import DEFAULT_PROMPTS

    pytest.importorskip("transformers")
    warnings = _Records()
    logging.getLogger("ContinuousBatchingLogger").addHandler(warnings)  # transformers' own, not propagated
    try:
        result = bench(capsys, "engine", "--model", "tiny-llama", "--max-new-tokens", "2", "--skip-padded")
    finally:
        logging.getLogger("ContinuousBatchingLogger").removeHandler(warnings)
    assert warnings.messages == []  # generate_batch is told EOS is off, so it does not warn that it is unset
    longest = max(len(text.encode("utf-8")) for text in DEFAULT_PROMPTS)  # bytes are the tiny models' tokens
    assert result["prompt_tokens"] == [len(text.encode("utf-8")) for text in DEFAULT_PROMPTS]
    assert result["num_blocks"] == -(-(longest + 2 - 1) // 16) > 64
    assert result["threads"] == 1  # the default of every command
    runs = result["results"]
    assert runs["kvpool generate"]["generated_tokens"] == 4 * 2
    assert runs["transformers generate_batch"]["same_tokens_as_kvpool"]  # greedy: the same tokens
    assert runs["kvpool generate, attention=paged"]["same_tokens_as_kvpool"]  # both attention paths


def test_groups_rows_and_ratios(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "groups", "--requests", "4", "--steps", "64", "--repeat", "1",
                   "--max-requests", "20")
    assert [row["groups"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["ratio"] == pytest.approx(row["coordinator_ns"] / row["plain_pool_ns"])
    replay = result["replay"]
    assert replay["requests"] == 20 and replay["kv_cache_groups"] == 2
    assert replay["mean_memory_saving"] == pytest.approx(
        1 - replay["mean_bytes_used"] / replay["all_full_mean_bytes_used"], abs=1e-6)


def test_tiers_rows_and_ratios(capsys: pytest.CaptureFixture, redis_single) -> None:
    result = bench(capsys, "tiers", "--batch", "2", "--repeat", "1", "--block-shapes", "smollm2-135m",
                   "--remote", redis_single.url, "--max-requests", "5")
    rows = result["rows"]
    assert {(r["tier"], r["op"]) for r in rows} == {(t, op) for t in ("host", "disk", "remote")
                                                    for op in ("store", "load")}
    for row in rows:
        assert row["blocks_bytes"] == 2 * 2 * 30 * 16 * 3 * 64 * 2  # 2 blocks: K and V, 30 layers, bf16
        assert row["gb_s"] == pytest.approx(row["blocks_bytes"] / row["s"] / 1e9)
        assert row["ratio"] == pytest.approx(row["s"] and row["baseline_s"] / row["s"])  # one repetition
        if row["tier"] == "host":  # no MAC: no second baseline
            assert row["mac_baseline"] is None and row["ratio_vs_mac"] is None
        else:
            assert row["mac_baseline"] == row["baseline"] + " + MAC"
            assert row["ratio_vs_mac"] == pytest.approx(row["mac_baseline_s"] / row["s"])
    (mac,) = result["mac"]
    assert mac["block_bytes"] == 2 * 30 * 16 * 3 * 64 * 2
    assert all(mac[k] > 0 for k in ("blake3_gb_s", "blake3_threads_gb_s", "blake2b_gb_s"))
    replay = result["replay"]
    assert replay["block_ops_per_s"] == pytest.approx(replay["block_ops"] / replay["wall_s"])


def test_targets_collects_each_suites_ratio_with_its_bound(capsys: pytest.CaptureFixture,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.bench import targets

    monkeypatch.setitem(targets.SUITE_ARGS, "groups", ["--requests", "4", "--steps", "32", "--repeat", "1",
                                                       "--max-requests", "0"])
    monkeypatch.setitem(targets.SUITE_ARGS, "replay", ["--block-sizes", "16", "--max-requests", "20"])
    result = bench(capsys, "targets", "--skip", "tiers,alloc,attention,engine")
    groups, replay = ({r["suite"]: r for r in result["rows"]}[s] for s in ("groups", "replay"))
    assert replay["ratio"] * 10_000_000 == pytest.approx(  # the replay suite's ops/s over the 10M target
        float(replay["measure"].split("(")[1].split("M")[0]) * 1e6, rel=0.01)
    assert groups["bound"] == 1.1 and groups["higher_is_better"] is False
    assert groups["met"] is (groups["ratio"] <= 1.1)
    assert result["skipped"] == ["tiers", "alloc", "attention", "engine"]
    assert result["met"] + result["missed"] == 2


def test_targets_rows_follow_from_the_suites_figures() -> None:
    from kvpool.bench.targets import ROWS

    replay = ROWS["replay"]({"results": {"block_size_16": {"block_ops_per_s": 5_000_000.0}}})
    assert (replay[0]["ratio"], replay[0]["met"]) == (0.5, False)  # 5M / 10M
    tiers = ROWS["tiers"]({"rows": [
        {"tier": "host", "op": "store", "block": "b", "baseline": "copy_", "ratio": 0.5},
        {"tier": "disk", "op": "load", "block": "b", "baseline": "file", "ratio": 0.95}],
        "chain_replay": {"block_ops_per_s": 720_000.0}})
    assert [(r["ratio"], r["met"]) for r in tiers] == [(0.95, True), (2.0, True)]  # no host row; 720k / 360k
    alloc = ROWS["alloc"]({"rows": [
        {"op": "evicting allocate(1), events on", "ratio": 1.4, "target_ratio": 1.3},
        {"op": "allocate(1)+free", "ratio": 0.2, "target_ratio": None}],
        "peers": [{"peer": "vLLM", "op": "x", "peer_over_kvpool": 4.8, "status": "timed in this run"},
                  {"peer": "SGLang", "op": "y", "peer_over_kvpool": None, "status": "peer not installed"}]})
    assert [(r["ratio"], r["met"]) for r in alloc] == [(1.4, False), (4.8, None), (None, None)]
    assert alloc[2]["measure"].endswith("(peer not installed)")


def test_targets_refuses_an_unknown_suite_in_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "targets", "--skip", "nope"]) == 2
    assert "'nope' is not one of replay" in capsys.readouterr().err


def test_memory_rows_ratios_and_layout_units_by_hand(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "memory", "--pages", "4", "--page-kib", "4", "--repeat", "1",
                   "--pool-gib", "0", "--configs", "smollm2-135m", "--tokens", "4", "--layout-blocks", "8")
    assert [r["what"] for r in result["per_page"]] == [
        "commit, one call a page", "commit, 4 pages in one call", "release, one call a page"]
    for row in result["per_page"]:
        assert row["ratio"] == pytest.approx(row["us_per_page"] / row["baseline_us"])
    assert result["rss"] is None
    (layout,) = result["layout"]
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x bf16, B 16: 6 KiB per strip block, 2 x 30 strips; a block
    # is 360 KiB. 8 blocks: a strip is 48 KiB = 12 pages of 4 KiB, so block 1 (bytes 6-12 KiB of each strip)
    # touches pages 1 and 2 of each of the 60 strips: 120 pages; block-major it is bytes 360-720 KiB: 90 pages
    assert layout["bytes_per_block"] == 360 * 1024
    assert layout["strips_pages_per_block"] == 120 and layout["block_major_pages_per_block"] == 90
    assert layout["strips_unit_bytes"] == 60 * 2 * 4096 and layout["block_major_unit_bytes"] == 360 * 1024
    assert layout["ratio"] == pytest.approx(layout["block_major_step_us"] / layout["strips_step_us"])
    # kvcached's eviction shape (tests/test_page_aware.py by hand): at stride 8 LRU frees no page, page-aware
    # frees 28 of 2 MiB
    last = result["eviction"][-1]
    assert (last["stride"], last["freed_lru"], last["freed_page_aware"]) == (8, 0, 28 * 2 * 2**20)
