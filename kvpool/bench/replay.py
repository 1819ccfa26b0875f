"""``kvpool bench replay``: block operations per second of an instant replay of the shipped Mooncake trace.

The replay drives the real :class:`BlockPool` (lookup, touch, allocate, publish, free); the target
(DESIGN.md / issue 6) is at least 1M block operations per second: the whole conversation trace in under
10 s at block size 512 and under 60 s at block size 16. ``x_target`` is block_ops_per_s / 1M.

``--match-unit U`` also replays each block size that ``U`` divides (and exceeds) with hits finer than a
block (:mod:`kvpool.requests.partial_hits`), right after its whole-block run: the unit index's cost is
``x_whole_blocks``, its block ops per second over the whole-block run's, and its gain the hit tokens beside
the whole-block run's (``hit_tokens``: full hit blocks x B plus the tokens of hits inside a block).
"""

from __future__ import annotations

import argparse

from kvpool.bench.timing import print_table
from kvpool.cli.options import positive_int
from kvpool.trace.loaders import load_trace
from kvpool.trace.replay import ReplayConfig, ReplayResult, run_replay

TARGET_OPS_PER_S = 1_000_000


def _block_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of block sizes") from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: block sizes must be >= 1")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-sizes", type=_block_sizes, default=[512, 16], metavar="B,...",
                        help="block sizes to replay at (default: 512,16)")
    parser.add_argument("--max-requests", type=int, default=None, metavar="N",
                        help="replay the first N requests (default: all 12,031)")
    parser.add_argument("--match-unit", type=positive_int, default=None, metavar="U",
                        help="also replay each block size U divides with a U-token match unit")


def run(args: argparse.Namespace) -> dict:
    """Replay once per block size (unbounded pool, instant timing); one row per block size."""
    trace = load_trace(max_requests=args.max_requests)
    rows, units = {}, {}
    unit = getattr(args, "match_unit", None)
    for block_size in args.block_sizes:
        result = run_replay(trace.requests, ReplayConfig(block_size=block_size, timing="instant"))
        if unit is not None and unit < block_size and block_size % unit == 0:
            units[f"block_size_{block_size}_unit_{unit}"] = _unit_row(trace.requests, result, unit)
        rows[f"block_size_{block_size}"] = {
            "block_size": block_size, "requests": result.requests_completed, "block_ops": result.block_ops,
            "wall_s": result.wall_s, "block_ops_per_s": result.block_ops_per_s,
            "ns_per_block_op": 1e9 / result.block_ops_per_s if result.block_ops_per_s else 0.0,
            "x_target": result.block_ops_per_s / TARGET_OPS_PER_S, "block_hit_ratio": result.block_hit_ratio,
            "hit_tokens": result.hit_blocks * block_size,
        }
    if not args.json:
        header = ["block size", "requests", "block ops", "wall s", "ops/s", "ns/op", "x 1M ops/s", "hits",
                  "hit tokens"]
        print_table(f"instant replay of {trace.path}", header, [list(row.values()) for row in rows.values()])
        if units:
            header = ["block size", "unit", "hit tokens", "whole blocks", "partial hits", "copied tokens",
                      "ops/s", "x whole blocks"]
            print_table("hits finer than a block (each against its block size's run above)", header,
                        [list(row.values()) for row in units.values()])
    return {"suite": "replay", "trace": trace.path, "results": rows, "match_unit": units}


def _unit_row(requests: list, whole: ReplayResult, unit: int) -> dict[str, float]:
    """The replay at ``whole``'s block size with a ``unit``-token match unit, against ``whole``."""
    bs = whole.block_size
    result = run_replay(requests, ReplayConfig(block_size=bs, timing="instant", match_unit=unit))
    ratio = result.block_ops_per_s / whole.block_ops_per_s if whole.block_ops_per_s else 0.0
    hit_tokens = result.hit_blocks * bs + result.partial_tokens
    return {"block_size": bs, "match_unit": unit, "hit_tokens": hit_tokens,
            "whole_block_hit_tokens": whole.hit_blocks * bs, "partial_hits": result.partial_hits,
            "copied_tokens": result.partial_copied_tokens, "block_ops_per_s": result.block_ops_per_s,
            "x_whole_blocks": ratio}
