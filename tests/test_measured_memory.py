"""Sizing a pool after the model's warm-up (``kvpool generate --kv-memory auto``, issue 32): the margin rule
against hand arithmetic, the CPU measurement against a warm-up whose peak is known, the command end to end
on a tiny model against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.errors import InvalidArgumentError
from kvpool.spec.planner import measure_free_memory, measured

GiB, MiB = 2**30, 2**20


def test_the_margin_is_one_gib_or_three_quarters_of_the_transient_peak() -> None:
    # vLLM 0.34's rule: margin = max(1 GiB, 0.75 x peak)
    assert measured("cpu", 10 * GiB, 4 * GiB).margin_bytes == 3 * GiB
    assert measured("cpu", 10 * GiB, 4 * GiB).kv_bytes == 7 * GiB
    assert measured("cpu", 10 * GiB, 100 * MiB).margin_bytes == GiB
    assert measured("cpu", 10 * GiB, 100 * MiB).kv_bytes == 9 * GiB
    assert measured("cpu", 512 * MiB, 0).kv_bytes == 0  # less free than the margin: nothing
    assert measured("cpu", 8 * GiB, 3).margin_bytes == GiB


def test_the_cpu_measurement_sees_the_warm_up_peak() -> None:
    pytest.importorskip("psutil")

    def warmup() -> None:  # 256 MiB written, then freed: the transient peak
        torch.ones(64 * MiB, dtype=torch.float32)

    got = measure_free_memory("cpu", warmup)
    assert got.device == "cpu" and got.free_bytes > 0
    assert 0.9 * 256 * MiB <= got.transient_peak_bytes
    assert got.margin_bytes == max(GiB, -(-3 * got.transient_peak_bytes // 4))


def test_bad_input_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="warmup"):
        measure_free_memory("cpu", 3)
    with pytest.raises(InvalidArgumentError, match="CPU or CUDA"):
        measure_free_memory("meta", lambda: None)


def test_generate_kv_memory_auto_matches_transformers(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("psutil")
    from kvpool.cli import main

    code = main(["generate", "--model", "tiny-llama", "--kv-memory", "auto", "--max-new-tokens", "6",
                 "--check", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and all(r["matches_reference"] for r in result["requests"])
    memory, stats = result["stats"]["kv_memory"], result["stats"]
    m = memory["measured"]
    # tiny-llama, fp32, 16-token blocks: 2 layers x K and V x 2 heads x 16 x 4 B x 16 = 8 KiB a block
    assert memory["elastic"] and stats["num_blocks"] == m["kv_bytes"] // 8192 == memory["reserved"] // 8192
    assert 0 < memory["peak_committed"] < memory["reserved"]
