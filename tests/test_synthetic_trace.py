"""kvpool.trace.synthetic: a seeded chat + agent-loop trace in the Mooncake format, checked against its own
rules (module docstring) by reading the written file back with kvpool's loader."""

from __future__ import annotations

from pathlib import Path

from kvpool.trace.loaders import load_trace
from kvpool.trace.synthetic import WorkloadShape, generate, main


def test_written_trace_loads_and_repeats_with_its_seed(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    assert main([str(out), "--seed", "3", "--requests", "400"]) == 0
    trace = load_trace(out)
    assert len(trace.requests) == 400 and trace.skipped == 0
    assert generate(3, WorkloadShape(requests=400)) == generate(3, WorkloadShape(requests=400))
    assert generate(3, WorkloadShape(requests=400)) != generate(4, WorkloadShape(requests=400))
    times = [r.arrival_s for r in trace.requests]
    assert times == sorted(times)
    for r in trace.requests:  # one hash id per started 512-token block (the last one partial or full)
        assert len(r.hash_ids) == -(-r.input_tokens // 512)


def test_a_follow_up_extends_an_earlier_prompt() -> None:
    rows = generate(0, WorkloadShape(requests=2000))
    seen: dict[tuple[int, ...], int] = {}
    follow_ups = 0
    for i, row in enumerate(rows):
        ids = tuple(row["hash_ids"])
        full = row["input_length"] // 512
        # some earlier prompt's full blocks are a prefix of this one's, longer than any system prompt
        if any(ids[:k] in seen for k in range(9, full + 1)):
            follow_ups += 1
        for k in range(1, len(ids) + 1):
            seen.setdefault(ids[:k], i)
    # sessions average 4 chat turns or 4-30 agent steps: most requests follow up an earlier one
    assert follow_ups > len(rows) // 2
    system = [tuple(r["hash_ids"][:1]) for r in rows]
    assert len(set(system)) <= WorkloadShape.system_prompts  # every prompt starts with a shared one
