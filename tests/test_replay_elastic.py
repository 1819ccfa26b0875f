"""A trace replay on a model of an elastic pool (issue 32): the pages a block-major elastic KV cache would
commit, counted without memory (``PageModel``), following the used and cached blocks under the shipped
Mooncake trace. Expected figures by hand: with 2 MiB blocks on 2 MiB pages every block is exactly one page,
so the committed bytes are (used + cached blocks) x 2 MiB at every sample; with 512 KiB blocks four share a
page, so they are between that sum x 512 KiB and one page per block.
"""

from __future__ import annotations

import pytest

from kvpool.allocators.block_pool import CACHED, IN_USE, PINNED
from kvpool.errors import ConfigError
from kvpool.storage.elastic import PageModel
from kvpool.trace.loaders import load_trace
from kvpool.trace.replay import ReplayConfig, run_replay

MiB = 2**20


@pytest.fixture(scope="module")
def mooncake():
    return load_trace().requests[:600]


def holding(pool) -> int:
    return sum(1 for s in pool.block_states() if s in (IN_USE, CACHED, PINNED))


@pytest.mark.parametrize("block_bytes", [2 * MiB, MiB // 2])
def test_committed_bytes_follow_the_blocks_and_trim_gives_them_back(mooncake, block_bytes: int) -> None:
    seen = []

    def observe(now, pool) -> None:
        seen.append(holding(pool))

    config = ReplayConfig(block_size=16, num_blocks=4000, timing="trace", elastic_block_bytes=block_bytes)
    result = run_replay(mooncake, config, observer=observe)  # its check_integrity: live == used + cached
    assert seen and result.peak_blocks_used > 0
    most = max(seen)
    if block_bytes == 2 * MiB:  # one block, one page
        assert result.peak_committed_bytes == most * block_bytes
    else:  # four blocks a page: at least their bytes, at most a page each
        assert most * block_bytes <= result.peak_committed_bytes <= most * 2 * MiB
    assert result.final_committed_bytes > 0  # the prefix cache holds pages at the end
    assert result.trimmed_committed_bytes <= 0.05 * result.peak_committed_bytes  # >= 95% given back
    assert result.trimmed_committed_bytes == 0


def test_without_the_model_nothing_is_counted(mooncake) -> None:
    result = run_replay(mooncake[:50], ReplayConfig(block_size=16, num_blocks=4000))
    assert (result.peak_committed_bytes, result.final_committed_bytes) == (0, 0)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ConfigError):
        ReplayConfig(elastic_block_bytes=0)
    with pytest.raises(ConfigError):
        PageModel(0, 1024)


@pytest.mark.slow  # ~90 s (300 requests on 80 GiB of 2 MiB blocks); the parametrized one above is default
def test_replay_elastic_on_the_command_line(capsys) -> None:
    import json

    from kvpool.cli import main

    argv = ["replay", "--model-config", "llama-3.1-8b", "--gpu-memory", "80GiB", "--non-kv-memory", "16GiB",
            "--max-requests", "300", "--no-progress"]
    assert main([*argv, "--elastic", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # Llama 3.1 8B: a 16-token block is 2 MiB (32 layers x K and V x 8 heads x 128 x 2 B x 16), one page:
    # the committed bytes cover the blocks in use (and the cached ones)
    assert report["peak_committed_bytes"] >= report["peak_blocks_used"] * 2 * MiB > 0
    assert report["trimmed_committed_bytes"] == 0
    assert main([*argv]) == 0 and "committed" not in capsys.readouterr().out  # printed only with --elastic
    assert main(["replay", "--elastic", "--max-requests", "5"]) == 2
    assert "--elastic needs --model-config" in capsys.readouterr().err
    # 4-token blocks are 512 KiB, 4 a 2 MiB page: the compactions move blocks, and --no-compact runs none
    moved = []
    for flag in ([], ["--no-compact"]):
        assert main([*argv, "--block-size", "4", "--elastic", "--json", *flag]) == 0
        moved.append(json.loads(capsys.readouterr().out)["blocks_moved"])
    assert moved[0] > 0 and moved[1] == 0
