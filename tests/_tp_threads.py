"""Tensor-parallel ranks as threads of one process (no launch): each rank's shard of a model, their
all-reduces summed across the threads, for tests that compare a sharded forward with the whole model's."""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import torch

from kvpool.engine.sharding import shard_model


def threaded_ranks(model: Any, tp_size: int) -> list[Any]:
    """``tp_size`` shards of ``model`` whose all-reduces sum across threads (one thread per rank)."""
    barrier, parts = threading.Barrier(tp_size), [None] * tp_size

    def all_reduce_of(rank: int) -> Any:
        def all_reduce(tensor: torch.Tensor) -> None:
            parts[rank] = tensor.clone()
            barrier.wait()
            total = sum(parts[1:], parts[0])
            barrier.wait()
            tensor.copy_(total)
        return all_reduce

    return [shard_model(copy.deepcopy(model), r, tp_size, all_reduce_of(r)) for r in range(tp_size)]


def forward_on_threads(shards: list[Any], ids: torch.Tensor) -> list[torch.Tensor]:
    out: list[Any] = [None] * len(shards)

    def run(rank: int) -> None:
        with torch.no_grad():
            out[rank] = shards[rank](ids).logits

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def shards_match_whole(model: Any, length: int = 23) -> tuple[list[Any], torch.Tensor, torch.Tensor]:
    """Two threaded ranks of ``model``, checked to compute its whole logits (within 1e-4) on ``length``
    seeded byte ids; returns (shards, ids, whole logits) for the test's own checks and controls."""
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = model(ids).logits
    shards = threaded_ranks(model, 2)
    for logits in forward_on_threads(shards, ids):
        torch.testing.assert_close(logits, whole, atol=1e-4, rtol=0)
    return shards, ids, whole


def cli_tp1_tp2(model: str, prompts: list[str], *extra: str) -> tuple[dict, dict]:
    """``kvpool generate --model MODEL --check --json`` on ``prompts`` in one process and with ``--tp-size
    2`` (run side by side); both reports, after checking both exited 0."""
    from test_tp import cli

    args = ["--model", model, "--max-new-tokens", "8", "--block-size", "4", "--json", "--check",
            *extra, *(a for p in prompts for a in ("--prompt", p))]
    one, two = cli(*args), cli(*args, "--tp-size", "2")
    (out1, err1), (out2, err2) = (p.communicate(timeout=300) for p in (one, two))
    assert one.returncode == 0 and two.returncode == 0, (err1[-2000:], err2[-2000:])
    return json.loads(out1), json.loads(out2)


def assert_same_tokens_as_transformers(report1: dict, report2: dict) -> None:
    """Every request of the tp 2 report matches transformers' own generate (``--check``) and the one-process
    report's tokens."""
    assert all(r["matches_reference"] for r in report2["requests"])
    assert [r["output_token_ids"] for r in report2["requests"]] == \
        [r["output_token_ids"] for r in report1["requests"]]
    assert report2["stats"]["tp_size"] == 2
