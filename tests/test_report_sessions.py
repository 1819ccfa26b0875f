"""Sessions in ``kvpool replay --sweep`` and its HTML report: each session policy a row beside the plain
eviction policy (``lru+last=1``), the cached-token accounting and session counters as a table, the page
checked in a real headless Chromium (as tests/test_report.py does).

Expected values come from the trace file itself (its session ids, its prompt tokens) and from single
replays of the same settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_report import open_report

from kvpool.cli import main
from kvpool.errors import ConfigError
from kvpool.trace.loaders import TraceRequest, load_trace
from kvpool.trace.replay import ReplayConfig, run_replay
from kvpool.trace.report import write_report
from kvpool.trace.sessions import parse_session_modes
from kvpool.trace.sweep import hit_ratio_table, run_sweep
from kvpool.trace.synthetic import WorkloadShape, generate

SIZES, MODES = [2000, 5000], [None, "session", "last=1"]


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sessions") / "syn.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in generate(0, WorkloadShape(requests=150))))
    return path


@pytest.fixture(scope="module")
def requests(trace_file: Path) -> list[TraceRequest]:
    return load_trace(trace_file).requests


@pytest.fixture(scope="module")
def sweep(requests: list[TraceRequest]):
    return run_sweep(requests, ReplayConfig(block_size=16), SIZES, ["lru", "belady"], record=True,
                     sessions=MODES)


def test_each_session_policy_is_a_row_and_matches_a_single_replay(requests, sweep) -> None:
    # sizes outermost, then policies, then modes; the offline bound once per size, without sessions
    assert [(r.num_blocks, r.policy) for r in sweep] == [
        (n, p) for n in SIZES for p in ("lru", "lru+session", "lru+last=1", "belady")]
    for run in sweep:
        mode = {"lru+session": "session", "lru+last=1": "last=1"}.get(run.policy)
        policy = "belady" if run.policy == "belady" else "lru"
        alone = run_replay(requests, ReplayConfig(block_size=16, num_blocks=run.num_blocks, policy=policy,
                                                  sessions=mode))
        assert alone.hit_blocks == run.result.hit_blocks and alone.evictions == run.result.evictions
    sessions = {r.session_id for r in requests if r.session_id is not None}
    prompt_tokens = sum(r.input_tokens for r in requests)
    for run in sweep:
        usage = run.result.cache["usage"]
        assert run.result.requests_rejected == 0  # so the accounting covers every prompt of the trace
        assert usage["cache_read_tokens"] + usage["cache_creation_tokens"] + usage["uncached_tokens"] == \
            prompt_tokens
        counters = run.result.cache.get("sessions")
        if "+" in run.policy:  # every session of the trace opened and closed, nothing left pinned
            assert counters["opened"] == counters["closed"] == len(sessions) and counters["kept_blocks"] == 0
        else:
            assert counters is None
    assert list(hit_ratio_table(sweep)) == ["lru", "lru+session", "lru+last=1", "belady"]


def test_session_modes_parse_and_refuse() -> None:
    assert parse_session_modes(None) == [None]
    assert parse_session_modes(["none", "session", "last=2"]) == [None, "session", "last=2"]
    for bad in (["bogus"], ["last=-1"], ["session", "session"], ["last=1", "last=01"]):
        with pytest.raises(ConfigError):
            parse_session_modes(bad)


def test_cli_sweep_prints_the_session_rows(trace_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["replay", str(trace_file), "--block-size", "16", "--sweep", "2000,5000", "--policies", "lru",
            "--sessions", "none,session,last=1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["block_hit_ratio"]) == ["lru", "lru+session", "lru+last=1", "belady"]
    assert set(report["share_of_bound"]) == {"lru", "lru+session", "lru+last=1", "belady"}
    assert main(argv) == 0
    rows = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    # hit ratio, p90 prefill and share of the bound
    assert rows.count("lru+session") == 3 and rows.count("lru+last=1") == 3
    for bad, why in (("none,none", "distinct"), ("last=1,last=01", "twice"), ("last=-1", "last=N")):
        assert main([*argv[:-1], bad]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err


def test_report_shows_sessions_in_headless_chromium(sweep, tmp_path: Path) -> None:
    page = write_report(tmp_path / "report.html", sweep, {"trace": "syn.jsonl", "block_size": 16})
    text = page.read_text()
    assert 'id="sessions"' in text and 'id="curves-curve-lru-last-1"' in text
    with open_report(page) as (tab, problems):
        rows = tab.locator("#sessions tbody tr")
        assert rows.count() == len(sweep)
        first = rows.nth(1).locator("td")  # lru+session at 2,000 blocks
        assert first.nth(0).inner_text() == "lru+session" and first.nth(1).inner_text() == "2,000"
        opened = sweep[1].result.cache["sessions"]["opened"]
        assert first.nth(6).inner_text() == f"{opened:,}"
        assert rows.nth(0).locator("td").nth(6).inner_text() == "-"  # plain lru keeps no session
        for box in tab.locator("div.table").all():  # every table fits the page
            assert box.evaluate("d => d.scrollWidth <= d.clientWidth"), box.inner_text()[:60]
        for curve in ("lru", "lru-session", "lru-last-1", "belady"):
            length = tab.eval_on_selector(f"#curves-curve-{curve} path", "p => p.getTotalLength()")
            assert length > 10
        other = f"run-lru-last-1-{SIZES[-1]}"
        tab.select_option("#run-picker", other)
        assert tab.locator(f"#{other}").is_visible()
        assert problems == []
