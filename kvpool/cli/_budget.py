"""``kvpool replay --state-split``: one byte budget for a recurrent hybrid's KV blocks and state slots,
split as vLLM's one-pool plan or SGLang's ratio (static) or rebalanced at run time
(:mod:`kvpool.requests.budget`), each replayed on the same requests, compared side by side with ``all``."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvpool.cli._args import positive_int
from kvpool.errors import ConfigError
from kvpool.requests.budget import SPLITS, BudgetConfig, RebalanceRule
from kvpool.trace.replay import ReplayConfig, run_replay

#: ``--state-split`` choices: each split, or ``all`` to compare them.
CHOICES = (*SPLITS, "all")
#: The columns of the comparison: (report key, heading, format).
COLUMNS = (("block_hit_ratio", "hit ratio", ".4f"), ("mean_running", "mean running", ".1f"),
           ("peak_running", "peak running", ","), ("refusals_kv", "refused (KV)", ","),
           ("refusals_state", "refused (state)", ","), ("requests_rejected", "rejected", ","),
           ("preemptions", "preempted", ","), ("checkpoint_hits", "ckpt hits", ","),
           ("state_slots", "state slots", ""), ("moves", "moves", ","),
           ("constraint_refusals", "constraint refusals", ","))


def add_budget_arguments(group: argparse._ArgumentGroup) -> None:
    """The options of the budget split (with ``--model-config`` of a recurrent hybrid and
    ``--gpu-memory``)."""
    defaults = RebalanceRule()
    group.add_argument("--state-split", choices=CHOICES, metavar="SPLIT",
                       help="one budget (the KV memory of --gpu-memory) for KV blocks and state slots "
                            "(requests' and checkpoints'), split as vllm-one-pool (the state of the "
                            "requests vLLM's plan holds at --max-model-len), sglang-ratio (0.9 : 1), "
                            "rebalanced (moved at run time by sampled demand), or all (each, compared)")
    group.add_argument("--max-model-len", type=positive_int, metavar="N",
                       help="the context length vllm-one-pool sizes for (default: the trace's longest "
                            "request)")
    group.add_argument("--rebalance-threshold", type=float, default=defaults.threshold, metavar="F",
                       help="imbalance (a share of the budget) that moves capacity "
                            f"(default: {defaults.threshold})")
    group.add_argument("--rebalance-cooldown", type=int, default=defaults.cooldown, metavar="N",
                       help=f"steps between two moves (default: {defaults.cooldown})")
    group.add_argument("--rebalance-window", type=positive_int, default=defaults.window, metavar="N",
                       help=f"steps of demand averaged (default: {defaults.window})")
    group.add_argument("--rebalance-cache", type=float, default=defaults.cache, metavar="F",
                       help="the least share of the budget split between the caches (cached KV, checkpoints) "
                            f"by their reuse, however many requests run (default: {defaults.cache})")


def check_budget_arguments(args: argparse.Namespace, config: ReplayConfig, pool_plan: Any
                           ) -> RebalanceRule | None:
    """The rule of ``--state-split`` (None without it); ConfigError where the options do not go together."""
    if args.state_split is None:
        return None
    needs = "--state-split needs --model-config of a recurrent hybrid and --gpu-memory"
    if pool_plan is None:
        raise ConfigError(needs)
    config.state.require(needs)
    if args.state_checkpoints is not None or args.sweep or args.policies:
        raise ConfigError("--state-split sizes the checkpoints itself and replays one pool size and policy: "
                          "drop --state-checkpoints, --sweep and --policies")
    return RebalanceRule(args.rebalance_threshold, args.rebalance_cooldown, args.rebalance_window,
                         cache=args.rebalance_cache)


def budget_configs(args: argparse.Namespace, config: ReplayConfig, memory: Any, pool_plan: Any,
                   requests: list[Any], rule: RebalanceRule) -> list[ReplayConfig]:
    """One replay config per split asked for, the budget the plan's KV memory (``memory``: the model's
    :class:`~kvpool.spec.memory.ModelMemory`)."""
    context = args.max_model_len or max((r.input_tokens + r.output_tokens for r in requests), default=1)
    splits = SPLITS if args.state_split == "all" else (args.state_split,)
    budget = pool_plan.available_kv_bytes
    return [dataclasses.replace(config, state_budget=BudgetConfig.plan(
        split, memory.hybrid, budget, memory.kv.bytes_per_block, context, rule)) for split in splits]


def run_splits(requests: list[Any], configs: list[ReplayConfig]) -> list[dict[str, Any]]:
    """Replay ``requests`` once per config; each run's row (:data:`COLUMNS` and the whole result)."""
    rows = []
    for cfg in configs:
        result = run_replay(requests, cfg)
        budget = result.state_budget or {}
        rows.append({"split": budget.get("split"), **result.to_dict(), **budget,
                     "state_slots": f"{budget['state_slots_start']:,} -> {budget['state_slots_end']:,} "
                                    f"({budget['state_slots_min']:,}..{budget['state_slots_max']:,})"})
    return rows


def split_table(rows: list[dict[str, Any]]) -> str:
    """The runs side by side: one row per split, :data:`COLUMNS` across."""
    width = max(len(r["split"]) for r in rows) + 2
    cells = [[f"{r[key]:{fmt}}" for key, _, fmt in COLUMNS] for r in rows]
    widths = [max(len(head), *(len(c[i]) for c in cells)) + 2 for i, (_, head, _) in enumerate(COLUMNS)]
    def line(first: str, texts: list[str]) -> str:
        return f"{first:<{width}}" + "".join(f"{t:>{w}}" for t, w in zip(texts, widths, strict=True))

    out = [line("split", [head for _, head, _ in COLUMNS])]
    out += [line(row["split"], cell) for row, cell in zip(rows, cells, strict=True)]
    return "\n".join(out)
