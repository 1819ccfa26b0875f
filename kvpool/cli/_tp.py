"""Tensor parallelism for the subcommands: ``--tp-size``, then one run per rank (launched, or torchrun's).

``kvpool generate --tp-size N`` starts N ranks itself (:func:`kvpool.engine.launch.launch`); under
``torchrun --nproc-per-node N -m kvpool generate ...`` every process is a rank already (``WORLD_SIZE`` is
the TP size). Either way the command's rank function runs on every rank and rank 0's result comes back.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from kvpool.cli._args import positive_int
from kvpool.errors import ConfigError, RankFailedError


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp-size", type=positive_int, metavar="N",
                        help="tensor-parallel ranks: N worker processes, gloo on CPU, NCCL on CUDA "
                             "(default: 1; under torchrun: its WORLD_SIZE)")


def torchrun_world() -> int | None:
    """torchrun's WORLD_SIZE when this process is one of its workers, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= os.environ.keys():
        return int(os.environ["WORLD_SIZE"])
    return None


def tp_size_of(args: argparse.Namespace, model: str, config: dict[str, Any] | None = None) -> int:
    """The TP size asked for, checked against ``model``'s config before any process starts. ``config``: what
    the caller has read, whose ModelMemory at the TP size it makes next (``kvpool generate``: that making
    checks the KV and recurrent heads, so none is made here); None: read and checked whole here.

    Raises:
        ConfigError: ``--tp-size`` differs from torchrun's WORLD_SIZE, or the model cannot be sharded over
            it (:func:`kvpool.engine.sharding.check_shardable`: heads, intermediate size, model type).
    """
    world = torchrun_world()
    if world is not None and args.tp_size not in (None, world):
        raise ConfigError(f"--tp-size {args.tp_size}, but torchrun started {world} processes")
    tp_size = world or args.tp_size or 1
    if tp_size > 1:
        from kvpool.engine.models import config_before_load, load_config
        from kvpool.engine.sharding import check_shardable

        check_shardable(config or config_before_load(model) or load_config(model), tp_size,
                        check_heads=config is None)
    return tp_size


def run_ranks(target: Callable[..., Any], tp_size: int, *args: Any, command: str) -> Any:
    """``target(tp, *args)`` on every rank (``tp`` None without TP); rank 0's result, None on the others."""
    if torchrun_world() is not None:
        from kvpool.engine.distributed import TPGroup

        tp = TPGroup.from_env()
        result = target(tp, *args)
        tp.close()
        return result
    if tp_size == 1:
        return target(None, *args)
    from kvpool.engine.launch import launch

    backend = "nccl" if torch.cuda.is_available() else "gloo"

    def announce(pids: list[int]) -> None:
        print(f"kvpool {command}: {tp_size} tensor-parallel ranks ({backend}), pids "
              f"{', '.join(map(str, pids))}", file=sys.stderr, flush=True)

    return launch(target, tp_size, *args, backend=backend, on_ready=announce)


def report_rank_failure(command: str, exc: RankFailedError) -> int:
    """Print a failed rank's traceback (when it raised) and one error line on stderr; returns 1."""
    if exc.traceback:
        print(exc.traceback.rstrip(), file=sys.stderr)
    print(f"kvpool {command}: error: {exc}", file=sys.stderr)
    return 1
