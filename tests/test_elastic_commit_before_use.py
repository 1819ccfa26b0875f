"""Issue 32's first figure: a pool planned for 4 GiB commits < 64 MiB before its first request, measured as
the process's RSS growth in a fresh process (psutil), the engine built around an already-loaded model.

By hand: 2 layers x K and V x 4 KV heads x 512 x fp32 x 16 tokens = 512 KiB a block, so 4 GiB is 8,192
blocks; the bookkeeping of 8,192 blocks (the pool's per-block arrays are grown as blocks are handed out,
the page map's live flags are 8 KiB) is far below 64 MiB, and no KV page is committed (there is no null
block without a sliding window). A fixed pool of the same plan is ``torch.empty`` of 4 GiB, whose pages the
OS commits only when written: its RSS growth at build is ~0 too, which is why the elastic figure that
matters is after use and release (``kvpool bench memory``'s RSS table).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("psutil")

MiB = 2**20

SCRIPT = r"""
import gc, json
import psutil, torch, transformers
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling import SamplingParams

torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=4, head_dim=512, intermediate_size=128,
                                  max_position_embeddings=4096)
model = transformers.AutoModelForCausalLM.from_config(config).eval()
rss = lambda: (gc.collect(), psutil.Process().memory_info().rss)[1]
before = rss()
engine = LLMEngine(model, num_blocks=(4 << 30) // (512 * 1024), block_size=16, elastic=True)
built = rss()
stats = engine.memory_stats()
engine.generate([[(7 * j) % 256 for j in range(40)]], SamplingParams(max_new_tokens=2))
print(json.dumps({"growth": built - before, "reserved": stats["reserved"], "committed": stats["committed"],
                  "after_one": engine.memory_stats()["committed"], "block": engine.cache.bytes_per_block}))
"""


def test_a_4_gib_pool_commits_under_64_mib_before_its_first_request() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                         check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["block"] == 512 * 1024 and got["reserved"] == 4 << 30
    assert got["committed"] == 0
    assert got["growth"] < 64 * MiB, got
    # one request of 40 + 2 tokens: 3 blocks of 512 KiB, on one 2 MiB page (blocks 0-3), cached at the end
    assert got["after_one"] == 2 * MiB
