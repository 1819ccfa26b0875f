"""The feature matrix of a recurrent hybrid's state: every combination of {tail, dense} saves x {lru, arc} x
{no pin, pin} x {events off, on} x {no tier, host, host+disk} x {TP 1, TP 2} (96 cells) on tiny-qwen3-next
and on tiny-lfm2 (see ``_state_matrix_helpers`` for the requests).

Each cell's tokens equal transformers' own greedy generate (logits within 1e-3); Y again hits on the device
(its own tail checkpoint, or densely the pinned one); with tiers, Y's KV and its state came back from a
tier (the two checkpoint slots hold U's saves by then); pins hold the prefix's 2 blocks (and, saved densely,
1 checkpoint: half of 2); the KV events rebuild the pool's index and the state group's events the
checkpoints held; the pool, the states and every rank's tiers pass check_integrity. The default run takes a
covering array of the TP 1 cells on Qwen3-Next; the rest, and the TP 2 cells (one launch of two ranks per
tier setup), are slow.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

import _matrix_helpers  # noqa: E402
import _state_matrix_helpers as matrix  # noqa: E402

from kvpool.engine.launch import launch  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QWEN, LFM2 = matrix.MODELS
ONE_PROCESS = matrix.cells(QWEN, tp=1) + matrix.cells(LFM2, tp=1)
DEFAULT = [{"model": QWEN, **c} for c in _matrix_helpers.pairwise_cells({**matrix.FACTORS, "tp": (1,)})]
SLOW = [c for c in ONE_PROCESS if c not in DEFAULT]


def test_the_matrix_has_every_combination() -> None:
    cells = matrix.cells()
    assert len(cells) == 2 * 2 * 2 * 2 * 3 * 2 == len({matrix.cell_id(c) for c in cells})
    assert all(c in ONE_PROCESS for c in DEFAULT) and len(DEFAULT) < 12  # every pair of the TP 1 factors


@pytest.fixture(scope="module")
def references() -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    out = {}
    for name in matrix.MODELS:
        model = load_model(name, seed=3).model
        refs = {id(p): reference_greedy(model, p, matrix.NEW) for p in (matrix.X, matrix.U, matrix.Y)}
        out[name] = [refs[id(p)] for p in matrix.PROMPTS]
    return out


def _rebuilt(events: list, group: int) -> set:
    """The hashes of ``group`` that the device-side events leave stored, counted per block (a prefix
    restored from a tier beside a copy still on the device is two blocks of one hash, each announced and
    removed on its own)."""
    held: Counter = Counter()
    for kind, medium, g, hashes in events:
        if medium not in (None, "GPU") or g != group:
            continue
        if kind == "BlockStored":
            held.update(hashes)
        elif kind == "BlockRemoved":
            held.subtract(hashes)
        else:
            held.clear()
    assert min(held.values(), default=0) >= 0  # nothing removed that was not stored
    return {h for h, n in held.items() if n > 0}


def check_cell(cell: dict, outcome: dict, refs: list) -> None:
    for (tokens, logits), got_tokens, got_logits in zip(refs + refs, outcome["tokens"], outcome["logits"],
                                                        strict=True):
        assert got_tokens == tokens
        torch.testing.assert_close(got_logits, logits, atol=1e-3, rtol=0)
    states = outcome["states"]
    assert outcome["cached"][3] > 0 and states["checkpoint_hits"] > 0  # Y again: a hit on the device
    if cell["tiers"] != "none":  # U pushed X's KV and checkpoints down: Y's came back from a tier
        assert outcome["kv_tier_hits"]["host"] > 0 and states["checkpoint_tier_hits"] > 0
        assert outcome["cached"][2] > 0
    else:
        assert states["checkpoint_tier_hits"] == 0
    # PINNED: 8 tokens, 2 blocks of the one KV cache group; its checkpoints: dense saves one at 4 and 8
    # tokens, the pin cap holds half of the 2 slots; tail saves none there
    assert outcome["pinned"] == (2 if cell["pin"] else 0)
    assert states["checkpoints_pinned"] == (1 if cell["pin"] and cell["save"] == "dense" else 0)
    if cell["events"]:
        assert outcome["state_group"] == 1  # after the KV cache group 0
        kv = _rebuilt(outcome["events"], 0)
        assert {(0, h) for h in kv} == outcome["index"] and kv
        held = _rebuilt(outcome["events"], 1)
        assert held and all(outcome["in_checkpoints"][h] for h in held)
        assert len(held) == outcome["checkpoints_held"]


@pytest.mark.parametrize("cell", DEFAULT, ids=matrix.cell_id)
def test_state_matrix_cell_one_process(cell: dict, references: dict, tmp_path) -> None:
    (outcome,) = matrix.run_cells(None, [cell], str(tmp_path))
    check_cell(cell, outcome, references[cell["model"]])


@pytest.mark.slow
@pytest.mark.parametrize("cell", SLOW, ids=matrix.cell_id)
def test_state_matrix_cell_one_process_rest(cell: dict, references: dict, tmp_path) -> None:
    (outcome,) = matrix.run_cells(None, [cell], str(tmp_path))
    check_cell(cell, outcome, references[cell["model"]])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", matrix.MODELS)
@pytest.mark.parametrize("tiers", matrix.FACTORS["tiers"])
def test_state_matrix_cells_on_two_ranks(tiers: str, model: str, references: dict, tmp_path) -> None:
    """The 16 TP 2 cells of one tier setup in one launch: each rank its own shard of every state (Qwen3-Next's
    heads, LFM2's channels), its own tiers (a checkpoint rank 0 restores from a tier, each rank restores its
    shard from its own)."""
    cells = [c for c in matrix.cells(model, tp=2) if c["tiers"] == tiers]
    outcomes = launch(matrix.run_cells, 2, cells, str(tmp_path))
    for cell, outcome in zip(cells, outcomes, strict=True):
        check_cell(cell, outcome, references[cell["model"]])
