"""The sweep, ``kvpool replay --policy/--sweep/--policies/--report``, the heat map recorder, and the HTML
report opened in a real headless Chromium (Debian's ``chromium``, driven by Playwright).

The browser test saves its screenshot to ``$KVPOOL_SCREENSHOT_DIR`` when set (else the test's tmp folder).
It skips when Chromium or Playwright is missing, except under CI (``CI`` set), where it fails instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpool.allocators.block_pool import BLOCK_STATES, BlockPool
from kvpool.cli import main
from kvpool.trace.loaders import TraceRequest, load_trace
from kvpool.trace.replay import ReplayConfig, run_replay
from kvpool.trace.report import PoolHeatmap, write_report
from kvpool.trace.sweep import hit_ratio_table, run_sweep

CHROMIUM = "/usr/bin/chromium"
#: Flags for Chromium as root on a machine with no network (DESIGN.md): no sandbox, no GPU, no background
#: connections.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                 "--disable-component-update", "--disable-sync", "--disable-quic"]


@pytest.fixture(scope="module")
def requests() -> list[TraceRequest]:
    return load_trace(max_requests=400).requests


@pytest.fixture(scope="module")
def sweep(requests: list[TraceRequest]):
    return run_sweep(requests, ReplayConfig(block_size=128), [300, 600], ["lru", "lfu", "arc", "belady"],
                     record=True)


# ---- sweep ----------------------------------------------------------------------------------------------


def test_sweep_runs_every_size_and_policy_like_single_replays(requests: list[TraceRequest], sweep) -> None:
    assert [(r.num_blocks, r.policy) for r in sweep] == [
        (n, p) for n in (300, 600) for p in ("lru", "lfu", "arc", "belady")]
    for run in sweep:
        config = ReplayConfig(block_size=128, num_blocks=run.num_blocks, policy=run.policy)
        alone = run_replay(requests, config)
        assert alone.hit_blocks == run.result.hit_blocks and alone.evictions == run.result.evictions
        assert run.result.timeline and run.heatmap is not None and run.heatmap.columns
    table = hit_ratio_table(sweep)
    assert list(table) == ["lru", "lfu", "arc", "belady"]
    for size in (300, 600):  # the offline bound is not beaten by an online policy on this trace
        assert all(table["belady"][size] >= table[p][size] for p in table)


def test_offline_bound_beats_every_policy_on_a_mooncake_slice() -> None:
    requests = load_trace(max_requests=1500).requests
    runs = run_sweep(requests, ReplayConfig(block_size=64), [800], ["lru", "fifo", "lfu", "slru", "priority",
                                                                    "arc", "belady"])
    table = hit_ratio_table(runs)
    assert max(table[p][800] for p in table if p != "belady") <= table["belady"][800]
    assert table["priority"] == table["lru"]  # the trace has no priorities: priority order is LRU's


# ---- heat map recorder ----------------------------------------------------------------------------------


def test_heatmap_bins_by_majority_and_thins_evenly() -> None:
    pool = BlockPool(4)
    heat = PoolHeatmap(max_columns=4, max_rows=2)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks[:1], ["a"])
    pool.free(blocks[:1])  # states: cached, in use, in use, free
    heat(0.0, pool)
    assert heat.row_edges == [0, 2, 4]
    # row 0 = blocks 0, 1: cached + in use, a tie: in use wins; row 1 = blocks 2, 3: in use + free: in use
    assert list(heat.columns[0]) == [BLOCK_STATES.index("in use")] * 2
    pool.free(blocks[1:])  # cached, free, free, free
    for t in range(1, 10):
        heat(float(t), pool)
    # 10 calls, at most 4 columns: stride 1 -> 2 (after 5 columns) -> 4 (after the 5th again)
    assert heat.times == [0.0, 4.0, 8.0]
    assert list(heat.columns[-1]) == [BLOCK_STATES.index("cached"), BLOCK_STATES.index("free")]


# ---- the page -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory, sweep) -> Path:
    path = tmp_path_factory.mktemp("report") / "report.html"
    return write_report(path, sweep, {"trace": "conversation_trace.jsonl", "block_size": 128})


def test_report_is_one_self_contained_file(page: Path, sweep) -> None:
    text = page.read_text()
    assert re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", text) is None  # nothing to fetch
    assert "<link" not in text and "<script src" not in text and "url(http" not in text
    assert text.count('<figure class="run"') == len(sweep) and text.count(" hidden>") == len(sweep) - 1
    for policy in ("lru", "lfu", "arc", "belady"):
        assert f'id="curves-curve-{policy}"' in text
    assert 'id="hit-ratios"' in text and 'id="bound-share"' in text and 'id="parameters"' in text
    rejected = [f"<td>{r.result.requests_rejected:,}</td>" for r in sweep if r.policy == "lru"]
    assert "<tr><td>requests rejected</td>" + "".join(rejected) + "</tr>" in text
    assert "count as misses" in text and "31 rejected" in text  # beside the table's ratios and the curves'
    assert '<p id="summary">8 runs of 400 requests' in text
    # element ids must be unique across the inline SVGs (clip paths would point into another figure)
    ids = re.findall(r'\bid="([^"]+)"', text)
    assert len(ids) == len(set(ids))


def _browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is missing") if os.environ.get("CI") else pytest.skip("chromium is missing")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("playwright is missing")
    return sync_playwright


@contextlib.contextmanager
def open_report(page: Path) -> Iterator[tuple[Any, list[str]]]:
    """``page`` loaded in headless Chromium: its tab, and the console errors and warnings and the page errors
    seen (a list that fills as the test goes on)."""
    sync_playwright = _browser()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            tab = browser.new_page(viewport={"width": 1200, "height": 900})
            problems: list[str] = []
            tab.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            tab.on("pageerror", lambda e: problems.append(str(e)))
            tab.goto(page.as_uri(), wait_until="load")
            yield tab, problems
        finally:
            browser.close()


def test_report_renders_in_headless_chromium(page: Path, sweep, tmp_path: Path) -> None:
    shots = Path(os.environ.get("KVPOOL_SCREENSHOT_DIR", tmp_path))
    with open_report(page) as (tab, problems):
        assert tab.title() == "kvpool replay report"
        # the summary line comes first; every table fits the page (no sideways scrolling)
        summary = tab.locator("#summary")
        assert summary.inner_text().startswith("8 runs of 400 requests")
        assert summary.bounding_box()["y"] < tab.locator("h2").first.bounding_box()["y"]
        for box in tab.locator("div.table").all():
            assert box.evaluate("d => d.scrollWidth <= d.clientWidth"), box.inner_text()[:60]
        body = tab.evaluate("document.body.getBoundingClientRect().right")
        runs = tab.locator("#runs").bounding_box()
        assert runs["x"] + runs["width"] <= body
        # the curves: one line per policy, each a drawn path of non-zero length
        for policy in ("lru", "lfu", "arc", "belady"):
            length = tab.eval_on_selector(f"#curves-curve-{policy} path", "p => p.getTotalLength()")
            assert length > 10
        shown = tab.locator("figure.run:not([hidden])")
        assert shown.count() == 1
        first = shown.get_attribute("id")
        assert _heatmap_decodes(tab, f"#{first}")
        assert tab.locator(f"#{first} svg").bounding_box()["height"] > 300
        tab.screenshot(path=str(shots / "kvpool-report.png"), full_page=True)
        # pick another run: its figure shows, the first hides
        other = f"run-belady-{sweep[-1].num_blocks}"
        tab.select_option("#run-picker", other)
        assert tab.locator(f"#{other}").is_visible() and not tab.locator(f"#{first}").is_visible()
        assert _heatmap_decodes(tab, f"#{other}")
        tab.locator(f"#{other}").screenshot(path=str(shots / "kvpool-report-run.png"))
        assert problems == []
        assert (shots / "kvpool-report.png").stat().st_size > 20_000


def _heatmap_decodes(tab, figure: str) -> bool:
    """The heat map's raster (a PNG data URI inside the SVG) decodes in the browser to a real image."""
    return tab.eval_on_selector(f"{figure} [id$='-heatmap'] image", """async img => {
        const probe = new Image();
        probe.src = img.getAttribute("xlink:href") || img.getAttribute("href");
        await probe.decode();
        return probe.naturalWidth > 50 && probe.naturalHeight > 50;
    }""")


def test_plots_put_the_rejected_count_beside_the_ratio(sweep) -> None:
    from matplotlib.figure import Figure

    from kvpool.trace.plot import draw_tier_sweep, rejected_label

    results = [run.result for run in sweep if run.policy == "lru"]
    ax = Figure().subplots()
    draw_tier_sweep(ax, results)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["300\n31 rejected", "600\n9 rejected"]
    assert rejected_label(results[0]) == "31 requests rejected, counted as misses"
    assert rejected_label(run_replay([TraceRequest(0.0, 16, 1)], ReplayConfig())) == "no request rejected"


def test_ratio_axis_by_hand() -> None:
    from kvpool.trace.report import ratio_axis

    # far apart (the smallest under half the largest): from 0, 8% above the top
    assert ratio_axis([0.01, 0.2]) == (0.0, pytest.approx(0.216))
    # 0.0739 and 0.0792 differ in the third decimal: their range, 15% of 0.0053 (0.000795) each side
    low, high = ratio_axis([0.0792, 0.0739])
    assert (low, high) == (pytest.approx(0.073105), pytest.approx(0.079995))
    assert ratio_axis([0.05, 0.05]) == (pytest.approx(0.0495), pytest.approx(0.0505))  # at least 0.0005
    assert ratio_axis([0.0, 0.0]) == (0.0, 1.0)


def test_summary_and_parameters_by_hand(sweep) -> None:
    from kvpool.trace.report import summary

    line = summary(sweep, {"tiers": ["host 400 blocks"]})
    online = [r for r in sweep if r.policy != "belady"]
    best = max(online, key=lambda r: (r.result.block_hit_ratio, -r.num_blocks))
    bound = next(r for r in sweep if r.policy == "belady" and r.num_blocks == best.num_blocks)
    share = best.result.block_hit_ratio / bound.result.block_hit_ratio
    assert line == (f"8 runs of 400 requests (4 policies, 2 pool sizes): best block hit ratio "
                    f"{best.result.block_hit_ratio:.4f} ({best.policy} at {best.num_blocks:,} blocks, "
                    f"{share:.1%} of the offline bound); "
                    "requests rejected (counted as misses): 31 at 300 blocks, 9 at 600 blocks; tiers below "
                    "the pool: host 400 blocks.")
    assert summary(sweep, {"tiers": "none"}).endswith("; no tier below the pool.")


def test_cli_report_names_the_tiers_and_no_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiers.html"
    assert main(["replay", "--max-requests", "300", "--block-size", "512", "--sweep", "60,120", "--policies",
                 "lru,belady", "--host-blocks", "400", "--report", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    text = out.read_text()
    params = text[text.index('id="parameters"'):]
    assert "<td>tiers</td><td>host 400 blocks</td>" in params and "<td>pin prefix</td><td>none</td>" in params
    assert "<td>trace</td><td>conversation_trace.jsonl (shipped with kvpool)</td>" in params
    assert str(Path(report["trace"]).parent) not in text and "[]" not in params
    assert 'id="tier-hits"' in text and 'id="tiers-tiers"' in text  # the by-tier chart and table
    for run in report["runs"]:  # the by-tier table: each place's share of the prompt blocks
        host = run["tier_hits"]["host"] / run["prompt_blocks"]
        assert f"<td>{run['policy']}</td><td>{run['num_blocks']:,}</td><td>" in text
        assert f"<td>{host:.4f}</td>" in text
    assert "tiers below the pool: host 400 blocks." in text


# ---- CLI ------------------------------------------------------------------------------------------------


def test_cli_sweep_json_and_table(capsys: pytest.CaptureFixture[str], sweep) -> None:
    argv = ["replay", "--max-requests", "400", "--block-size", "128", "--sweep", "300,600", "--policies",
            "lru,lfu,arc,belady"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["num_blocks"], r["policy"]) for r in report["runs"]] == [(r.num_blocks, r.policy)
                                                                        for r in sweep]
    assert report["block_hit_ratio"]["belady"]["600"] == sweep[-1].result.block_hit_ratio
    # like with like: every run's ratio is over all 400 prompts, the rejected ones' blocks as misses, and
    # the rejected count stands beside each ratio (the pools of 300 and 600 reject 31 and 9 requests)
    requests = load_trace(max_requests=400).requests
    assert {r["prompt_blocks"] for r in report["runs"]} == {sum(r.input_tokens // 128 for r in requests)}
    assert report["requests_rejected"] == {p: {"300": 31, "600": 9} for p in ("lru", "lfu", "arc", "belady")}
    assert "rejected request's prompt blocks count as misses" in report["hit_ratio_basis"]
    assert main(argv) == 0
    text = capsys.readouterr().out.splitlines()
    assert "count as misses" in text[1] and text[2].split() == ["hit", "ratio", "300", "600"]
    at = text.index(next(line for line in text if line.startswith("belady")))
    assert text[at].split()[1:] == [f"{sweep[i].result.block_hit_ratio:.4f}" for i in (3, 7)]
    assert text[at + 1].split() == ["rejected", "31", "9"]
    assert text[-1].split()[:2] == ["belady", "100.0%"]


def test_cli_sweep_adds_the_bound(capsys: pytest.CaptureFixture[str], sweep) -> None:
    # the same sweep without belady named: it is added last, and each policy's share of it is the ratio of
    # the runs' own hit ratios (the fixture's runs: lru, lfu, arc, belady at 300 and 600 blocks)
    argv = ["replay", "--max-requests", "400", "--block-size", "128", "--sweep", "300,600", "--policies",
            "lru,arc", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["block_hit_ratio"]) == ["lru", "arc", "belady"]
    ratio = {(r.policy, r.num_blocks): r.result.block_hit_ratio for r in sweep}
    assert report["share_of_bound"]["arc"]["600"] == ratio[("arc", 600)] / ratio[("belady", 600)]
    assert report["share_of_bound"]["belady"] == {"300": 1.0, "600": 1.0}
    assert main([*argv, "--no-bound"]) == 0
    assert list(json.loads(capsys.readouterr().out)["block_hit_ratio"]) == ["lru", "arc"]


def test_cli_single_policy_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "one.html"
    assert main(["replay", "--max-requests", "200", "--block-size", "512", "--num-blocks", "300", "--policy",
                 "belady", "--report", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["policy"] == "belady" and report["report"] == str(out)
    assert 'id="curves-curve-belady"' in out.read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (["--sweep", "100,200", "--num-blocks", "50"], "--sweep or one pool size"),
    (["--policies", "lru,mru"], "policy must be one of"),
    (["--policies", "lru,lru"], "distinct"),
    (["--sweep", "100,0"], "must be an integer >= 1"),
    (["--policy", "fifo", "--policies", "lru"], "--policy or --policies"),
    (["--policies", "lru,lfu", "--plot", "x.png"], "--plot draws one run"),
    (["--report", "x.txt"], "--report needs a FILE.html"),
    (["--policy", "mru"], "invalid choice"),
])
def test_cli_bad_eviction_options_exit_2_in_one_line(argv: list[str], message: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("x.png", str(tmp_path / "x.png")) for a in argv]
    try:
        status = main(["replay", "--max-requests", "5", *argv])
    except SystemExit as exc:  # argparse's own checks
        status = exc.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
