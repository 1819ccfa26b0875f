"""Smoke tests of `kvpool bench`: each suite runs at toy sizes and its derived columns follow from the raw
timings it reports (the ratios are the suites' own definitions, recomputed here). No timing is asserted."""

import json

import pytest

from kvpool.cli import main


def bench(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert main(["bench", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_alloc_rows_and_ratios(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "alloc", "--sizes", "256", "--ops", "256", "--repeat", "1")
    ops = {row["op"] for row in result["rows"]}
    assert {"allocate(1)+free", "allocate(256)+free", "evicting allocate(1)", "token alloc(1)+free(1)"} <= ops
    for row in result["rows"]:
        assert row["kvpool_ns"] > 0
        if row["baseline_ns"]:
            assert row["ratio"] == pytest.approx(row["kvpool_ns"] / row["baseline_ns"], abs=5e-4)


def test_storage_rows_and_ratios(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "storage", "--tokens", "1", "16", "--num-blocks", "8", "--repeat", "1")
    rows = result["rows"]
    expected = {(pattern, t) for pattern in ("random", "paged") for t in (1, 16)}
    assert {(r["pattern"], r["tokens"]) for r in rows} == expected
    for row in rows:
        assert row["bytes"] == 2 * row["tokens"] * 8 * 128 * 2  # K and V, H=8, D=128, float16
        assert row["ratio"] == pytest.approx(row["copy_us"] / row["store_kv_us"])


def test_replay_ops_per_second(capsys: pytest.CaptureFixture) -> None:
    result = bench(capsys, "replay", "--max-requests", "20")
    for block_size in (512, 16):
        run = result["results"][f"block_size_{block_size}"]
        assert run["requests"] == 20
        assert run["block_ops_per_s"] == pytest.approx(run["block_ops"] / run["wall_s"])


def test_alloc_sizes_too_small_is_one_line_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "alloc", "--sizes", "64"]) == 2  # allocate(256) cannot run on 64 blocks
    assert "--sizes must be >= 256" in capsys.readouterr().err


def test_bad_counts_are_one_line_errors(capsys: pytest.CaptureFixture) -> None:
    # checked before any model loads or any row is timed: exit 2, one line on stderr, no traceback
    assert main(["bench", "engine", "--model", "tiny-llama", "--threads", "-1"]) == 2
    assert capsys.readouterr().err == "kvpool bench: error: --threads must be >= 0, got -1\n"
    assert main(["bench", "replay", "--max-requests", "0"]) == 2  # used to time zero requests
    assert "max_requests must be an integer >= 1" in capsys.readouterr().err
