"""An elastic replay's committed bytes against the blocks holding KV over time (issue 32, item 2), under the
shipped Mooncake trace, and the replay report's chart of them.

Hand bounds, 512 KiB blocks on 2 MiB pages (4 a page, block b on page b // 4): the committed bytes are at
least the bytes of the blocks holding KV (used + cached) and at most one page per such block; packed, those
blocks need ceil(blocks / 4) pages. Page-aware allocation fills holes first, and the compaction after each
step (kvpool.requests.compaction) moves live blocks off the pages that finished requests' blocks left
sparse, so every sample is within one page of that (the model's reserve is 0 pages); without compaction
some are not (the pages holding blocks freed since the last allocation: a request's last, unhashed
blocks). Compaction changes no hit (moves keep each block's place in the LRU order). After the trace and
a trim every page is given back (>= 95% of the peak).
"""

from __future__ import annotations

import pytest

from kvpool.trace.loaders import load_trace
from kvpool.trace.replay import ReplayConfig, run_replay

MiB = 2**20
BLOCK = MiB // 2
PAGE = 2 * MiB


def replay(compact: bool):
    requests = load_trace().requests[:200]
    config = ReplayConfig(block_size=16, num_blocks=4000, timing="trace", elastic_block_bytes=BLOCK,
                          elastic_compact=compact)
    return run_replay(requests, config, record_timeline=True)


@pytest.fixture(scope="module")
def result():
    return replay(compact=True)


def share_within_one_page(result) -> float:
    """The share of samples whose committed pages are at most the live blocks packed plus one, after
    checking each sample against the timeline's block counts and the hand bounds."""
    samples = result.memory_timeline
    assert len(samples) == len(result.timeline) > 100
    within = 0
    for (t, committed, used, cached), (t2, used_blocks, cached_blocks, _) in zip(samples, result.timeline,
                                                                                 strict=True):
        assert t == t2 and (used, cached) == (used_blocks * BLOCK, cached_blocks * BLOCK)
        live = used_blocks + cached_blocks
        assert live * BLOCK <= committed <= live * PAGE
        within += committed <= (-(-live // 4) + 1) * PAGE
    return within / len(samples)


def test_committed_follows_the_blocks_holding_kv(result) -> None:
    assert share_within_one_page(result) == 1.0
    assert result.blocks_moved > 0 and result.compaction_s > 0
    samples = result.memory_timeline
    assert result.peak_committed_bytes >= max(s[1] for s in samples) > 0
    assert result.trimmed_committed_bytes <= 0.05 * result.peak_committed_bytes
    assert result.trimmed_committed_bytes == 0


@pytest.mark.slow
def test_without_compaction_some_samples_are_past_one_page(result) -> None:
    plain = replay(compact=False)
    assert share_within_one_page(plain) < 1.0 and plain.blocks_moved == 0
    assert (plain.hit_blocks, plain.evictions, plain.requests_completed) == \
        (result.hit_blocks, result.evictions, result.requests_completed)


def test_the_report_draws_committed_against_used(result, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from kvpool.trace.report import SweepRun, write_report

    page = write_report(tmp_path / "r.html", [SweepRun(result)], {"elastic_block_bytes": BLOCK}).read_text()
    assert "KV memory (MiB)" in page and "committed" in page
    assert "memory_timeline" not in result.to_dict()
