"""An elastic replay's committed bytes against the blocks holding KV over time (issue 32, item 2), under the
shipped Mooncake trace, and the replay report's chart of them.

Hand bounds, 512 KiB blocks on 2 MiB pages (4 a page, block b on page b // 4): the committed bytes are at
least the bytes of the blocks holding KV (used + cached) and at most one page per such block; packed, those
blocks need ceil(blocks / 4) pages, and page-aware allocation keeps the committed bytes at that plus one
page in most samples (the pages beyond it hold blocks freed since the last allocation: a request's last,
unhashed blocks). After the trace and a trim every page is given back (>= 95% of the peak).
"""

from __future__ import annotations

import pytest

from kvpool.trace.loaders import load_trace
from kvpool.trace.replay import ReplayConfig, run_replay

MiB = 2**20
BLOCK = MiB // 2
PAGE = 2 * MiB


@pytest.fixture(scope="module")
def result():
    requests = load_trace().requests[:200]
    config = ReplayConfig(block_size=16, num_blocks=4000, timing="trace", elastic_block_bytes=BLOCK)
    return run_replay(requests, config, record_timeline=True)


def test_committed_follows_the_blocks_holding_kv(result) -> None:
    samples = result.memory_timeline
    assert len(samples) == len(result.timeline) > 100
    within = 0
    for (t, committed, used, cached), (t2, used_blocks, cached_blocks, _) in zip(samples, result.timeline,
                                                                                 strict=True):
        assert t == t2 and (used, cached) == (used_blocks * BLOCK, cached_blocks * BLOCK)
        live = used_blocks + cached_blocks
        assert live * BLOCK <= committed <= live * PAGE
        within += committed <= (-(-live // 4) + 1) * PAGE
    assert within >= 0.8 * len(samples), within / len(samples)
    assert result.peak_committed_bytes >= max(s[1] for s in samples) > 0
    assert result.trimmed_committed_bytes <= 0.05 * result.peak_committed_bytes
    assert result.trimmed_committed_bytes == 0


def test_the_report_draws_committed_against_used(result, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from kvpool.trace.report import SweepRun, write_report

    page = write_report(tmp_path / "r.html", [SweepRun(result)], {"elastic_block_bytes": BLOCK}).read_text()
    assert "KV memory (MiB)" in page and "committed" in page
    assert "memory_timeline" not in result.to_dict()
