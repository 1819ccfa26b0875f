"""``kvpool replay [TRACE]``: replay a serving trace through the block pool (hit ratio, blocks, preemptions).

Without TRACE it replays the shipped Mooncake conversation trace (``--format azure``: the shipped Azure code
trace). Pool size: ``--num-blocks N``, or what ``kvpool plan`` gives a model in a memory budget
(``--model-config PATH --gpu-memory BYTES``), or by default unbounded (every request's blocks at once, so
nothing is evicted or preempted).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvpool.cli._args import non_negative_float, positive_int
from kvpool.cli._observe import Observers, add_event_arguments
from kvpool.cli.plan import add_memory_arguments, plan_from_args
from kvpool.errors import ConfigError
from kvpool.planner import PoolPlan
from kvpool.spec import KVCacheSpec
from kvpool.trace.group_replay import compare_all_full
from kvpool.trace.loaders import FORMATS, load_trace
from kvpool.trace.replay import TIMINGS, ReplayConfig, run_replay

#: Requests above which a progress bar is drawn (on a terminal, without --json).
PROGRESS_MIN_REQUESTS = 1000



def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("replay", help="replay a serving trace through the block pool",
                                   description="Replay a serving trace through the block pool: hit ratio, "
                                               "blocks used, preemptions.")
    parser.add_argument("trace", nargs="?", metavar="TRACE", help="trace file (default: the shipped one)")
    parser.add_argument("--format", choices=FORMATS, help="trace format (default: from the file suffix)")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="B",
                        help="tokens per block; must divide 512 for Mooncake (default 16)")
    parser.add_argument("--timing", choices=TIMINGS, default="instant",
                        help="instant: one at a time; trace: arrivals at timestamps (default instant)")
    parser.add_argument("--max-requests", type=positive_int, metavar="N", help="replay the first N requests")
    parser.add_argument("--skip-malformed", action="store_true", help="skip and count malformed rows")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE.png", help="draw blocks in use / cached / free over time")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _capacity_arguments(parser.add_argument_group("pool size"))
    _engine_arguments(parser.add_argument_group("engine model (step times; budgets apply to trace timing)"))
    add_event_arguments(parser)
    parser.set_defaults(func=run)


def _capacity_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--num-blocks", type=positive_int, metavar="N", help="pool size in blocks")
    group.add_argument("--model-config", metavar="PATH", help="size the pool as `kvpool plan` does")
    add_memory_arguments(group, gpu_memory_default="none; required with --model-config")


def _engine_arguments(group: argparse._ArgumentGroup) -> None:
    defaults = ReplayConfig()
    group.add_argument("--max-batched-tokens", type=positive_int, default=defaults.max_batched_tokens,
                       metavar="N", help=f"token budget per step (default {defaults.max_batched_tokens})")
    group.add_argument("--max-running", type=positive_int, default=defaults.max_running, metavar="N",
                       help=f"requests in flight at most (default {defaults.max_running})")
    group.add_argument("--step-s", type=non_negative_float, default=defaults.step_s, metavar="S",
                       help=f"fixed seconds per step (default {defaults.step_s})")
    group.add_argument("--prefill-token-s", type=non_negative_float,
                       default=defaults.prefill_token_s, metavar="S",
                       help=f"seconds per uncached prompt token (default {defaults.prefill_token_s})")
    group.add_argument("--decode-token-s", type=non_negative_float,
                       default=defaults.decode_token_s, metavar="S",
                       help=f"seconds per decoded token (default {defaults.decode_token_s})")


def run(args: argparse.Namespace) -> int:
    # a bad --plot path fails before the replay, not after it
    if args.plot and (Path(args.plot).suffix.lower() != ".png" or not Path(args.plot).parent.is_dir()):
        raise ConfigError(f"--plot needs a FILE.png in an existing folder, got {args.plot!r}")
    trace = load_trace(args.trace, args.format, skip_malformed=args.skip_malformed,
                       max_requests=args.max_requests)
    num_blocks, spec, plan = sizing_from_args(args)
    hybrid = spec is not None and (spec.has_windows or len(spec.groups) > 1)
    config = ReplayConfig(
        block_size=args.block_size, num_blocks=num_blocks, timing=args.timing,
        max_batched_tokens=args.max_batched_tokens, max_running=args.max_running, step_s=args.step_s,
        prefill_token_s=args.prefill_token_s, decode_token_s=args.decode_token_s,
        groups=spec.groups if hybrid else ())
    with Observers(args) as observers:
        bar = _progress_bar(len(trace.requests), off=args.json or args.no_progress)
        try:
            result = run_replay(trace.requests, config, progress=bar and bar.update,
                                record_timeline=bool(args.plot),
                                event_sink=observers.event_sink(block_size=args.block_size))
        finally:
            if bar is not None:
                bar.close()
    report = {"trace": trace.path, "format": trace.format, "skipped_rows": trace.skipped, **result.to_dict()}
    if hybrid:
        report.update(compare_all_full(trace.requests, config, spec, plan.available_kv_bytes, result))
    if args.plot:
        from kvpool.trace.plot import plot_timeline

        report["plot"] = str(plot_timeline(result, args.plot, title=f"kvpool replay {trace.format}"))
    print(json.dumps(report) if args.json else _human(report))
    return 0


def sizing_from_args(args: argparse.Namespace) -> tuple[int | None, KVCacheSpec | None, PoolPlan | None]:
    """The pool size: ``--num-blocks``; or, with ``--model-config`` and ``--gpu-memory``, the planner's
    num_blocks with the spec and plan (a hybrid spec is replayed per KV cache group); or None (unbounded)."""
    if args.model_config is None:
        if args.gpu_memory is not None:
            raise ConfigError("--gpu-memory needs --model-config (or give --num-blocks)")
        return args.num_blocks, None, None
    if args.num_blocks is not None:
        raise ConfigError("give either --num-blocks or --model-config, not both")
    if args.gpu_memory is None:
        raise ConfigError("--model-config needs --gpu-memory BYTES (the device memory per rank)")
    spec, plan = plan_from_args(args.model_config, args)
    return plan.num_blocks, spec, plan


def _progress_bar(total: int, *, off: bool) -> Any:
    """A tqdm bar on stderr for long runs on a terminal, else None."""
    if off or total < PROGRESS_MIN_REQUESTS or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, desc="replay")


#: The human report: field name and how to print it, in order.
_FORMATS = {
    "trace": "", "format": "", "timing": "", "block_size": ",", "num_blocks": ",", "skipped_rows": ",",
    "requests_completed": ",", "requests_rejected": ",", "prompt_blocks": ",", "hit_blocks": ",",
    "block_hit_ratio": ".6f", "token_hit_ratio": ".6f", "peak_blocks_used": ",", "mean_blocks_used": ",.1f",
    "preemptions": ",", "evictions": ",", "block_ops": ",", "block_ops_per_s": ",.0f", "wall_s": ",.3f",
    "simulated_s": ",.3f", "plot": "", "kv_cache_groups": ",", "bytes_per_block": ",",
    "peak_bytes_used": ",", "mean_bytes_used": ",", "mean_memory_saving": ".4f",
}


def _human(report: dict[str, Any]) -> str:
    lines = [f"{name:<20} {report[name]:{spec}}" for name, spec in _FORMATS.items() if name in report]
    for name, value in report.get("all_full", {}).items():
        lines.append(f"all full: {name:<20} {value:{_FORMATS.get(name, ',')}}")
    return "\n".join(lines)
