"""``kvpool replay [TRACE]``: replay a serving trace through the block pool (hit ratio, blocks, preemptions).

Without TRACE it replays the shipped Mooncake conversation trace (``--format azure``: the shipped Azure code
trace). Pool size: ``--num-blocks N``, or what ``kvpool plan`` gives a model in a memory budget
(``--model-config PATH --gpu-memory BYTES``), or by default unbounded (every request's blocks at once, so
nothing is evicted or preempted). ``--policy NAME`` picks the eviction policy (``belady``: the offline
farthest-next-use bound); ``--sweep SIZES --policies NAMES`` replays every pool size with every policy and
prints the hit-ratio table, with the offline bound added (each policy's share of it; ``--no-bound``: not);
``--report FILE.html`` writes a self-contained page of the runs. Tiers below
the pool (``--host-blocks``, ``--disk-dir`` + ``--disk-blocks``, ``--remote``) keep the evicted blocks'
hashes; ``tier_hits`` says where the hits were found, and ``--sweep`` with ``--plot`` draws them by tier.
A recurrent hybrid's ``--model-config`` (Qwen3-Next, Nemotron-H, ...) replays its attention layers' KV and
a state slot per running request; a prefix is a hit only up to a state checkpoint, saved by
``--state-save`` (``tail``, the default for such a model, ``dense``, ``interval=N``, ``tail+junction``) into
at most ``--state-checkpoints N`` checkpoints (least recently used evicted; default unbounded);
``--state-split`` puts KV blocks and state slots in one budget, split statically or rebalanced
(:mod:`kvpool.cli._budget`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvpool.cli._args import (
    add_json_argument,
    id_list,
    non_negative_float,
    positive_int,
    positive_int_list,
    word_list,
)
from kvpool.cli._budget import (
    add_budget_arguments,
    budget_configs,
    check_budget_arguments,
    run_splits,
    split_table,
)
from kvpool.cli._observe import Observers, add_event_arguments
from kvpool.cli._tiers import add_tier_arguments, build_tiers, check_tier_targets, tier_chain, wants_tiers
from kvpool.cli.plan import add_memory_arguments, memory_from_args, plan_from_args
from kvpool.errors import ConfigError, TraceFormatError
from kvpool.spec import KVCacheSpec
from kvpool.spec.memory import ModelMemory
from kvpool.spec.planner import PoolPlan
from kvpool.spec.state_kind import NO_STATE_SPEC
from kvpool.tiers.auth import redact_url
from kvpool.trace.loaders import FORMATS, load_trace
from kvpool.trace.replay import HIT_RATIO_BASIS, REPLAY_POLICIES, TIMINGS, ReplayConfig, compare_all_full
from kvpool.trace.sessions import parse_session_modes, usage_lines
from kvpool.trace.sweep import SweepRun, hit_ratio_table, rejected_table, result_table, run_sweep
from kvpool.units import plural

#: Requests (over every run) from which progress is shown on stderr, unless --no-progress: a bar at a
#: terminal, one line per finished run elsewhere (a log, a pipe).
PROGRESS_MIN_REQUESTS = 1000



def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("replay", help="replay a serving trace through the block pool",
                                   description="Replay a serving trace through the block pool: hit ratio, "
                                               "blocks used, preemptions.")
    parser.add_argument("trace", nargs="?", metavar="TRACE", help="trace file (default: the shipped one)")
    parser.add_argument("--format", choices=FORMATS, help="trace format (default: from the file suffix)")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="B",
                        help="tokens per block; must divide 512 for Mooncake (default: 16)")
    parser.add_argument("--match-unit", type=positive_int, metavar="U",
                        help="prefix-match unit in tokens, dividing the block size: a hit may end inside a "
                             "block, its units copied from a cached block (default: whole blocks)")
    parser.add_argument("--timing", choices=TIMINGS, default="instant",
                        help="instant: one at a time; trace: arrivals at timestamps (default: instant)")
    parser.add_argument("--max-requests", type=positive_int, metavar="N", help="replay the first N requests")
    parser.add_argument("--skip-malformed", action="store_true", help="skip and count malformed rows")
    add_json_argument(parser)
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw blocks in use / cached / free over time; with tiers and --sweep, the hit "
                             "ratio by tier against the pool size")
    parser.add_argument("--report", metavar="FILE.html",
                        help="write one self-contained HTML page: hit ratio per pool size and policy, the "
                             "pool over time, a heat map of the pool, the parameters")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress on stderr (on long runs: a bar at a terminal, else a line per run)")
    _capacity_arguments(parser.add_argument_group("pool size"))
    _policy_arguments(parser.add_argument_group("eviction"))
    _state_arguments(parser.add_argument_group("recurrent state (hybrids of attention and Mamba / linear "
                                               "attention)"))
    add_tier_arguments(parser)
    _engine_arguments(parser.add_argument_group("engine model (step times; budgets apply to trace timing)"))
    add_event_arguments(parser)
    parser.set_defaults(func=run)


def _capacity_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--num-blocks", type=positive_int, metavar="N", help="pool size in blocks")
    group.add_argument("--model-config", metavar="PATH", help="size the pool as `kvpool plan` does")
    add_memory_arguments(group, gpu_memory_default="none; required with --model-config")
    group.add_argument("--elastic", action="store_true",
                       help="with --model-config: replay on a model of an elastic pool (2 MiB pages "
                            "committed as blocks are used and cached) and report the bytes it committed")
    group.add_argument("--no-compact", dest="compact", action="store_false",
                       help="with --elastic: do not compact the pool after each step")


def _policy_arguments(group: argparse._ArgumentGroup) -> None:
    names = ", ".join(REPLAY_POLICIES)
    group.add_argument("--policy", choices=REPLAY_POLICIES, default="lru", metavar="NAME",
                       help=f"eviction policy: {names} (belady: the offline bound; default: lru)")
    group.add_argument("--sweep", type=positive_int_list, metavar="N,...",
                       help="replay once per pool size (blocks), e.g. 5000,10000,20000,40000")
    group.add_argument("--policies", type=word_list, metavar="NAME,...",
                       help=f"replay once per policy ({names}), e.g. lru,lfu,slru,belady")
    group.add_argument("--no-bound", action="store_true",
                       help="a sweep adds the offline bound (belady) to its policies, so that each is shown "
                            "as a share of it: leave it out")
    group.add_argument("--pin-prefix", type=id_list, metavar="ID,...", default=[],
                       help="pin the prefix of these trace hash ids (512-token blocks) once it is cached, "
                            "e.g. 0: the system prompt every Mooncake request starts with")
    group.add_argument("--sessions", type=word_list, metavar="POLICY,...",
                       help="keep each session's turns (a trace row's session_id) pinned while it is open: "
                            "session (every turn) or last=N (the last N); several, with none (no sessions), "
                            "replay once each, e.g. none,session,last=1")


def _state_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--state-save", metavar="POLICY",
                       help="where a request's recurrent state is saved for prefix caching: tail (the end of "
                            "its prompt and sequence; the default for a recurrent --model-config), dense "
                            "(every block), interval=N (every N blocks), tail+junction (also where prefixes "
                            "diverge)")
    group.add_argument("--state-checkpoints", type=positive_int, metavar="N",
                       help="state checkpoints held at most, least recently used evicted "
                            "(default: unbounded)")
    add_budget_arguments(group)


def _engine_arguments(group: argparse._ArgumentGroup) -> None:
    defaults = ReplayConfig()
    group.add_argument("--max-batched-tokens", type=positive_int, default=defaults.max_batched_tokens,
                       metavar="N", help=f"token budget per step (default: {defaults.max_batched_tokens})")
    group.add_argument("--max-running", type=positive_int, default=defaults.max_running, metavar="N",
                       help=f"requests in flight at most (default: {defaults.max_running})")
    group.add_argument("--step-s", type=non_negative_float, default=defaults.step_s, metavar="S",
                       help=f"fixed seconds per step (default: {defaults.step_s})")
    group.add_argument("--prefill-token-s", type=non_negative_float,
                       default=defaults.prefill_token_s, metavar="S",
                       help=f"seconds per uncached prompt token (default: {defaults.prefill_token_s})")
    group.add_argument("--decode-token-s", type=non_negative_float,
                       default=defaults.decode_token_s, metavar="S",
                       help=f"seconds per decoded token (default: {defaults.decode_token_s})")


def run(args: argparse.Namespace) -> int:
    config, sizes, policies, spec, pool_plan = _plan_runs(args)  # bad input fails before the replay
    rule = check_budget_arguments(args, config, pool_plan)
    if wants_tiers(args):
        check_tier_targets(args)  # a bad URL or folder, or no tier secret: before the trace loads
    trace = _load(args)
    if rule is not None:
        return _run_splits(args, trace, budget_configs(args, config, args.model_memory, pool_plan,
                                                       trace.requests, rule))
    policies = with_bound(policies, sizes, args, trace)
    with Observers(args) as observers:
        total = len(trace.requests) * len(sizes) * len(policies) * len(args.session_modes)
        long = total >= PROGRESS_MIN_REQUESTS and not args.no_progress
        bar = _progress_bar(total) if long and sys.stderr.isatty() else None
        try:
            runs = run_sweep(trace.requests, config, sizes, policies, record=bool(args.plot or args.report),
                             progress=bar and bar.update,
                             event_sink=observers.event_sink(block_size=args.block_size),
                             tiers=_tier_factory(args, trace) if wants_tiers(args) else None,
                             write_through=args.write_through, tier_admission=args.tier_admission,
                             on_run=_print_run if long and bar is None else None,
                             sessions=args.session_modes if len(args.session_modes) > 1 else None)
        finally:
            if bar is not None:
                bar.close()
    head = {"trace": trace.path, "format": trace.format, "skipped_rows": trace.skipped,
            "hit_ratio_basis": HIT_RATIO_BASIS}
    if not any(r.hash_ids for r in trace.requests):
        head["note"] = NO_PREFIX_NOTE
    report = {**head, **runs[0].result.to_dict()} if len(runs) == 1 else _sweep_report(head, config, runs)
    if config.groups and pool_plan is not None:  # a hybrid model's one run, beside the same memory all full
        report.update(compare_all_full(trace.requests, config, spec, pool_plan.available_kv_bytes,
                                       runs[0].result))
    if args.plot:
        from kvpool.trace.plot import plot_tier_sweep, plot_timeline

        title = f"kvpool replay {trace.format}"
        drawn = plot_timeline(runs[0].result, args.plot, title=title) if len(runs) == 1 else \
            plot_tier_sweep([run.result for run in runs], args.plot, title=title)
        report["plot"] = str(drawn)
    if args.report:
        from kvpool.trace.report import write_report

        parameters = _report_parameters(args, trace, config, sizes, policies)
        report["report"] = str(write_report(args.report, runs, parameters))
    if args.json:
        print(json.dumps(report))
    else:
        print(_human(report) if len(runs) == 1 else _sweep_text(runs, report))
        if "note" in report:
            print(f"note: {report['note']}")
    return 0


def _run_splits(args: argparse.Namespace, trace: Any, configs: list[ReplayConfig]) -> int:
    """``--state-split``: each split replayed on the trace's requests, printed as one table (or JSON)."""
    rows = run_splits(trace.requests, configs)
    if args.json:
        print(json.dumps({"trace": trace.path, "hit_ratio_basis": HIT_RATIO_BASIS, "runs": rows}))
    else:
        print(f"trace {trace.path}, {len(trace.requests):,} requests, {configs[0].timing} timing, budget "
              f"{rows[0]['budget_bytes']:,} B ({rows[0]['block_bytes']:,} B a KV block, "
              f"{rows[0]['state_bytes']:,} B a state)\n" + split_table(rows))
    return 0


def with_bound(policies: list[str], sizes: list[int | None], args: argparse.Namespace, trace: Any
               ) -> list[str]:
    """``policies`` with the offline bound (``belady``) added last when several runs are compared (a sweep
    of sizes or of policies) on a trace with prefix information, so that the table, ``--json`` and
    ``--report`` give every policy as a share of the bound; ``--no-bound`` leaves it out."""
    several = len(sizes) > 1 or len(policies) > 1 or len(getattr(args, "session_modes", ())) > 1
    if not several or args.no_bound or "belady" in policies or not any(r.hash_ids for r in trace.requests):
        return policies
    return [*policies, "belady"]


#: Said beside a trace's hit ratios when it carries no prefix information (Azure's rows: counts only).
NO_PREFIX_NOTE = ("the trace has no prefix information (no block hash ids, as in Azure's rows): no prompt "
                  "can share a cached block, so every hit ratio is 0 by construction; the replay still "
                  "measures blocks in use, preemptions and evictions")


def _load(args: argparse.Namespace) -> Any:
    """The trace the arguments name; a malformed row's error says how to skip such rows."""
    try:
        return load_trace(args.trace, args.format, skip_malformed=args.skip_malformed,
                          max_requests=args.max_requests)
    except TraceFormatError as exc:
        if not exc.skippable:
            raise
        raise TraceFormatError(f"{exc} (--skip-malformed skips and counts malformed rows)") from None


def _plan_runs(args: argparse.Namespace
               ) -> tuple[ReplayConfig, list[int | None], list[str], KVCacheSpec | None, PoolPlan | None]:
    """The shared config, the pool sizes and the policies the arguments ask for, all checked, and with
    ``--model-config`` the spec and the plan that sized the pool."""
    _check_output(args.plot, "--plot", ".png")
    _check_output(args.report, "--report", ".html")
    if args.sweep and args.num_blocks is not None:
        raise ConfigError("give either --sweep or one pool size (--num-blocks), not both")
    if args.policies and args.policy != "lru":
        raise ConfigError("give either --policy or --policies, not both")
    if args.sweep:  # pool sizes in blocks; --model-config then gives the KV cache groups only
        _refuse_unused_memory_options(args, allowed=("--tp-size", "--kv-cache-dtype"))
        num_blocks, pool_plan = None, None
        memory = None if args.model_config is None else memory_from_args(args.model_config, args)
        spec = None if memory is None else memory.require_kv()
    else:
        num_blocks, memory, pool_plan = sizing_from_args(args)
        spec = None if memory is None else memory.require_kv()
    args.model_memory = memory
    sizes: list[int | None] = [*args.sweep] if args.sweep else [num_blocks]
    # windows or several KV cache groups (hybrid attention, not a recurrent state): blocks counted per group
    per_group = spec is not None and (spec.has_windows or len(spec.groups) > 1)
    policies: list[str] = args.policies or [args.policy]
    args.session_modes = parse_session_modes(args.sessions)
    runs = len(sizes) * len(policies) * len(args.session_modes)
    if args.plot and runs > 1 and (len(policies) * len(args.session_modes) > 1 or not wants_tiers(args)):
        raise ConfigError("--plot draws one run, or a sweep of pool sizes by tier; use --report for a sweep")
    if args.kv_events and runs > 1:
        raise ConfigError("--kv-events follows one run: drop --sweep / --policies / several --sessions")
    for policy in policies:  # every name now, not after the first runs
        ReplayConfig(policy=policy)
    state_save = _state_save(args, memory)
    config = ReplayConfig(
        block_size=args.block_size, num_blocks=sizes[0], timing=args.timing,
        max_batched_tokens=args.max_batched_tokens, max_running=args.max_running, step_s=args.step_s,
        prefill_token_s=args.prefill_token_s, decode_token_s=args.decode_token_s, policy=policies[0],
        pin_prefix=tuple(args.pin_prefix), groups=spec.groups if per_group else (),
        state_save=state_save, state_checkpoints=args.state_checkpoints,
        elastic_block_bytes=_elastic_block_bytes(args, spec), elastic_compact=args.compact,
        match_unit=args.match_unit,
        sessions=args.session_modes[0])
    return config, sizes, policies, spec, pool_plan


def _elastic_block_bytes(args: argparse.Namespace, spec: KVCacheSpec | None) -> int | None:
    """``--elastic``: the model's bytes per block; ConfigError without ``--model-config``."""
    if not args.elastic:
        return None
    if spec is None:
        raise ConfigError("--elastic needs --model-config (the bytes of a block)")
    return spec.bytes_per_block


def _state_save(args: argparse.Namespace, memory: ModelMemory | None) -> str | None:
    """``--state-save`` (``tail`` for a recurrent ``--model-config`` without it: ``memory``, the config's
    :class:`ModelMemory`, has a state); ConfigError when given for a model without recurrent state."""
    kind = NO_STATE_SPEC if memory is None else memory.state_kind  # no --model-config: no state
    return kind.save_policy(args.state_save, args.state_checkpoints)


def _tier_factory(args: argparse.Namespace, trace: Any) -> Any:
    """Fresh hash-only tiers for each run, in a namespace of this trace and block size, emptied first (a
    run starts cold; :func:`run_sweep` empties them again after it, leaving nothing in a shared Redis)."""
    from kvpool.tiers.backend import Namespace

    ns = Namespace(f"replay:{Path(str(trace.path)).name}", "none", f"hash-only/block_size={args.block_size}",
                   hash_scheme="trace-block-ids")

    def tiers() -> list[Any]:
        built = build_tiers(args, ns, block_bytes=0)
        for tier in built:
            tier.clear()
        return built

    return tiers


def _check_output(path: str | None, option: str, suffix: str) -> None:
    if path and (Path(path).suffix.lower() != suffix or not Path(path).parent.is_dir()):
        raise ConfigError(f"{option} needs a FILE{suffix} in an existing folder, got {path!r}")


def _report_parameters(args: argparse.Namespace, trace: Any, config: ReplayConfig, sizes: list[int | None],
                       policies: list[str]) -> dict[str, object]:
    """The report's parameters, for people: the trace by its file name (not the folder it lies in), the
    tiers below the pool, the KV cache groups and pins spelled out."""
    name = Path(str(trace.path)).name + (" (shipped with kvpool)" if args.trace is None else "")
    shared = _shared_settings(config)
    groups = [g.describe() for g in config.kv_cache_groups]
    shared["groups"] = ", ".join(groups) if config.groups else "one full-attention group"
    pins = ", ".join(map(str, config.pin_prefix))
    shared["pin_prefix"] = f"hash ids {pins}" if pins else "none"
    return {"trace": name, "format": trace.format, "requests": args.max_requests or "all",
            "skipped rows": trace.skipped, "hit ratio basis": HIT_RATIO_BASIS,
            "tiers": tier_descriptions(args) if wants_tiers(args) else "none",
            "write through": args.write_through, "tier admission": args.tier_admission, **shared,
            "pool sizes": ", ".join("unbounded" if n is None else f"{n:,}" for n in sizes),
            "policies": ", ".join(policies),
            **({"note": NO_PREFIX_NOTE} if not any(r.hash_ids for r in trace.requests) else {})}


def tier_descriptions(args: argparse.Namespace) -> list[str]:
    """The tiers below the pool, fastest first: ``host 100,000 blocks``, ``disk 4,294,967,296 B in DIR``,
    ``remote redis://HOST:PORT``."""
    out = []
    for tier in tier_chain(args):
        size = f"{tier.blocks:,} blocks" if tier.blocks is not None else \
            f"{tier.bytes:,} B" if tier.bytes is not None else ""
        remote = f" {redact_url(tier.url)}" if tier.medium == "remote" else ""
        where = f" in {tier.path}" if tier.path else remote
        out.append(f"{tier.medium} {size}{where}".replace("  ", " ").strip())
    return out


def _shared_settings(config: ReplayConfig) -> dict[str, object]:
    """The settings every run of a sweep shares (all but the pool size and the policy)."""
    return {k: v for k, v in asdict(config).items() if k not in ("num_blocks", "policy")}


def _sweep_report(head: dict[str, Any], config: ReplayConfig, runs: list[SweepRun]) -> dict[str, Any]:
    """The ``--json`` object of a sweep: every run's fields, and the hit ratios by policy and size."""
    table = hit_ratio_table(runs)
    rejected = rejected_table(runs)
    return {**head, **_shared_settings(config), "runs": [run.result.to_dict() for run in runs],
            "block_hit_ratio": {policy: {str(n): r for n, r in row.items()} for policy, row in table.items()},
            "requests_rejected": {policy: {str(n): k for n, k in row.items()}
                                  for policy, row in rejected.items()},
            "share_of_bound": {policy: {str(n): r / table["belady"][n] for n, r in row.items()
                                        if table["belady"].get(n)}
                               for policy, row in table.items()} if "belady" in table else {}}


def sizing_from_args(args: argparse.Namespace) -> tuple[int | None, ModelMemory | None, PoolPlan | None]:
    """The pool size: ``--num-blocks``; or, with ``--model-config`` and ``--gpu-memory``, the planner's
    num_blocks with the config's :class:`ModelMemory` and the plan (a hybrid spec is replayed per KV cache
    group); or None (unbounded)."""
    if args.model_config is None:
        _refuse_unused_memory_options(args)
        return args.num_blocks, None, None
    if args.num_blocks is not None:
        raise ConfigError("give either --num-blocks or --model-config, not both")
    if args.gpu_memory is None:
        raise ConfigError("--model-config needs --gpu-memory BYTES (the device memory per rank)")
    memory = memory_from_args(args.model_config, args)
    _, plan = plan_from_args(memory, args)
    return plan.num_blocks, memory, plan


def _refuse_unused_memory_options(args: argparse.Namespace, allowed: tuple[str, ...] = ()) -> None:
    """The options that size a pool from a model config do nothing without ``--model-config`` (nor with
    ``--sweep``, which gives the sizes, but for ``allowed``, which shape the spec): refused rather than
    ignored (ConfigError naming the first one given)."""
    given = [option for option, value, default in (
        ("--gpu-memory", args.gpu_memory, None), ("--tp-size", args.tp_size, 1),
        ("--kv-cache-dtype", args.kv_cache_dtype, "auto"), ("--non-kv-memory", args.non_kv_memory, 0),
        ("--gpu-memory-utilization", args.gpu_memory_utilization, 0.9))
        if value != default and not (option in allowed and args.model_config is not None)]
    if given:
        if args.sweep and args.model_config is not None:
            raise ConfigError(f"{given[0]} sizes one pool from a model config, but --sweep gives the sizes")
        raise ConfigError(f"{given[0]} sizes the pool from a model config: give --model-config with it")


def _progress_bar(total: int) -> Any:
    """A tqdm bar on stderr (at a terminal) of ``total`` requests."""
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, desc="replay")


def _print_run(run: SweepRun, i: int, n: int) -> None:
    """Progress off a terminal (a log, a pipe): one line on stderr as each run finishes, e.g. ``replay: run
    2 of 8 done (20,000 blocks, lru): block hit ratio 0.0433, 22.1 s``."""
    print(f"replay: run {i} of {n} done ({plural(run.num_blocks, 'block')}, {run.policy}): block hit ratio "
          f"{run.result.block_hit_ratio:.4f}, {run.result.wall_s:.1f} s", file=sys.stderr, flush=True)


#: The human report: field name and how to print it, in order.
_FORMATS = {
    "trace": "", "format": "", "timing": "", "block_size": ",", "num_blocks": ",", "skipped_rows": ",",
    "requests_completed": ",", "requests_rejected": ",", "prompt_blocks": ",", "hit_blocks": ",",
    "block_hit_ratio": ".6f", "token_hit_ratio": ".6f",
    "hit_ratio_basis": "", "peak_blocks_used": ",", "mean_blocks_used": ",.1f",
    "preemptions": ",", "evictions": ",", "block_ops": ",", "block_ops_per_s": ",.0f", "wall_s": ",.3f",
    "simulated_s": ",.3f", "policy": "", "pinned_blocks": ",", "plot": "", "report": "",
    "kv_cache_groups": ",", "bytes_per_block": ",", "peak_bytes_used": ",", "mean_bytes_used": ",",
    "mean_memory_saving": ".4f", "memory_compared_requests": ",", "state_save": "", "state_slots_peak": ",",
    "checkpoints_saved": ",", "checkpoints_peak": ",", "checkpoint_hits": ",", "checkpoint_evictions": ",",
    "checkpoint_tier_hits": ",", "kv_only_tokens": ",", "peak_committed_bytes": ",",
    "final_committed_bytes": ",", "trimmed_committed_bytes": ",", "blocks_moved": ",", "compaction_s": ".3f",
    "match_unit": ",", "partial_hits": ",", "partial_tokens": ",", "partial_copied_blocks": ",",
    "partial_copied_tokens": ",", "prefill_tokens_p50": ",", "prefill_tokens_p90": ",",
    "prefill_tokens_p95": ",", "prefill_tokens_p99": ",",
}
#: Report fields of a finer match unit (hits inside a block), printed only with one (--match-unit).
_PARTIAL_FIELDS = ("match_unit", "partial_hits", "partial_tokens", "partial_copied_blocks",
                   "partial_copied_tokens")
#: Report fields of an elastic pool's model, printed only for one (--elastic).
_ELASTIC_FIELDS = ("peak_committed_bytes", "final_committed_bytes", "trimmed_committed_bytes", "blocks_moved",
                   "compaction_s")
#: Report fields of a recurrent hybrid's state, printed only for one.
_STATE_FIELDS = ("state_save", "state_slots_peak", "checkpoints_saved", "checkpoints_peak", "checkpoint_hits",
                 "checkpoint_evictions", "checkpoint_tier_hits", "kv_only_tokens")


def _human(report: dict[str, Any]) -> str:
    state, elastic = report.get("state_save") is not None, bool(report.get("peak_committed_bytes"))
    partial = report.get("match_unit") is not None
    lines = [f"{name:<20} {report[name]:{spec}}" for name, spec in _FORMATS.items()
             if name in report and (state or name not in _STATE_FIELDS) and
             (elastic or name not in _ELASTIC_FIELDS) and (partial or name not in _PARTIAL_FIELDS)]
    if report.get("tiers"):
        hits = ", ".join(f"{where} {n:,}" for where, n in report["tier_hits"].items())
        at = next(i for i, line in enumerate(lines) if line.startswith("hit_blocks ")) + 1
        lines.insert(at, f"{'tier_hits':<20} {hits}")
    lines += usage_lines(report.get("cache", {}))
    for name, value in report.get("all_full", {}).items():
        lines.append(f"all full: {name:<20} {value:{_FORMATS.get(name, ',')}}")
    return "\n".join(lines)


def _sweep_text(runs: list[SweepRun], report: dict[str, Any]) -> str:
    """The block hit ratio by policy (rows) and pool size (columns), the requests each run rejected, the
    90th percentile of the tokens a request prefilled (``prefill_tokens_p90``); with belady, each one's
    share of the bound's hit ratio."""
    table, rejected = hit_ratio_table(runs), rejected_table(runs)
    p90 = result_table(runs, "prefill_tokens_p90")
    sizes = sorted({run.num_blocks for run in runs})
    width = max(12, *(len(p) for p in table)) + 2

    def lines(title: str, cell: Any, under: Any = None) -> list[str]:
        out = [f"{title:<{width}}" + "".join(f"{s:>12,}" for s in sizes)]
        for policy, row in table.items():
            out.append(f"{policy:<{width}}" + "".join(f"{cell(policy, row, s):>12}" for s in sizes))
            if under is not None:
                out.append(f"{'  rejected':<{width}}" + "".join(f"{under(policy, s):>12}" for s in sizes))
        return out

    text = [f"trace {report['trace']} ({report['format']}), block size {report['block_size']}, "
            f"{report['timing']} timing", f"hit ratios over {HIT_RATIO_BASIS}",
            *lines("hit ratio", lambda p, row, s: f"{row[s]:.4f}",
                   lambda p, s: f"{rejected[p][s]:,}" if s in rejected[p] else "-"),
            *lines("p90 prefill", lambda p, row, s: f"{p90[p][s]:,}" if s in p90[p] else "-")]
    bound = table.get("belady")
    if bound:
        text += lines("of bound", lambda p, row, s: f"{row[s] / bound[s]:.1%}" if bound.get(s) else "-")
    if runs[0].result.tiers:
        text += _tier_lines(runs)
    if "report" in report:
        text.append(f"report {report['report']}")
    return "\n".join(text)


def _tier_lines(runs: list[SweepRun]) -> list[str]:
    """Block hit ratio by where the blocks were found (columns), per run (rows)."""
    places = list(dict.fromkeys(p for run in runs for p in run.result.tier_hits))
    out = ["by tier (block hit ratio):",
           f"{'pool blocks':>12}" + "".join(f"{p:>10}" for p in places) + f"{'rejected':>10}"]
    for run in runs:
        total = run.result.prompt_blocks or 1
        cells = "".join(f"{run.result.tier_hits.get(p, 0) / total:>10.4f}" for p in places)
        out.append(f"{run.num_blocks:>12,}{cells}{run.result.requests_rejected:>10,}  {run.policy}")
    return out
