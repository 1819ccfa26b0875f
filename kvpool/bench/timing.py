"""Timing helpers shared by the benchmark suites: medians of repeated runs, and a plain-text table."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

from kvpool.errors import ConfigError


def median_ns(fn: Callable[[], object], *, ops: int, repeat: int = 5,
              setup: Callable[[], object] | None = None) -> float:
    """Median over ``repeat`` runs of ``fn`` of nanoseconds per operation (``fn`` does ``ops`` operations).

    ``setup`` runs before each repetition, outside the timed region.
    """
    samples = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / ops)
    return statistics.median(samples)


def alternated_ns(cases: Mapping[str, tuple[Callable[[], object], Callable[[], object] | None]], *, ops: int,
                  repeat: int = 5) -> dict[str, float]:
    """:func:`median_ns` of each ``name: (fn, setup)`` of ``cases``, the cases run in turn within each
    repetition (A, B, A, B, ...), so that a ratio of two of them sees the same machine load."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, (fn, setup) in cases.items():
            if setup is not None:
                setup()
            start = time.perf_counter_ns()
            fn()
            samples[name].append((time.perf_counter_ns() - start) / ops)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print an aligned table; floats get 1 decimal (3 for ratios below 10), None prints ``-``."""

    def fmt(value: object) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 10 else f"{value:,.1f}"
        return str(value)

    cells = [list(header), *[[fmt(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(title)
    for row in cells:
        print("  " + "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=False)))


def require_at_least(args: argparse.Namespace, minimum: Mapping[str, int]) -> None:
    """Raise ConfigError naming the option when an integer option (or any item of a list option) of ``args``
    is below its ``minimum``."""
    for name, least in minimum.items():
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < least:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {least}, got {values}")
