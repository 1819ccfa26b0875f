"""PNGs of replays: one replay's timeline (blocks in use, cached and free over simulated time), and a sweep's
hit ratio by tier against the device pool size.

Needs matplotlib (the ``replay`` extra), imported only when a plot is drawn. :func:`draw_timeline` draws
the chart on any matplotlib axes; the HTML report (:mod:`kvpool.trace.report`) uses it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.trace.replayer import ReplayResult

#: Colours of the pool states, shared by the timeline and the report's heat map.
COLORS = {"in use": "#d62728", "cached": "#1f77b4", "free": "#d9d9d9", "pinned": "#ff7f0e", "null": "#000000"}


def rejected_label(result: ReplayResult) -> str:
    """``"42 requests rejected, counted as misses"`` (or ``"no request rejected"``): what stands beside a
    replay's hit ratio."""
    n = result.requests_rejected
    if not n:
        return "no request rejected"
    return f"{n:,} request{'s' if n != 1 else ''} rejected, counted as misses"


def draw_timeline(ax: Any, result: ReplayResult, *, max_points: int | None = None) -> None:
    """Stack blocks in use / cached (evictable) / free over simulated time on ``ax`` (``max_points``: keep
    about that many samples, evenly spaced in sample order, plus the last). Raises ValueError when the
    result holds no timeline (replay with ``record_timeline=True``)."""
    if not result.timeline:
        raise ValueError("the replay recorded no timeline; run it with record_timeline=True")
    samples = result.timeline
    if max_points is not None and len(samples) > max_points:
        stride = -(-len(samples) // max_points)
        samples = samples[::stride] + ([samples[-1]] if (len(samples) - 1) % stride else [])
    t, used, cached, free = zip(*samples, strict=True)
    ax.stackplot(t, used, cached, free, labels=("in use", "cached (evictable)", "free"),
                 colors=(COLORS["in use"], COLORS["cached"], COLORS["free"]), step="post")
    ax.set_xlim(t[0], max(t[-1], t[0] + 1e-9))
    ax.set_ylim(0, result.num_blocks)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel(f"blocks ({result.block_size} tokens each)")
    ax.legend(loc="upper right", fontsize=8)


def draw_memory_timeline(ax: Any, result: ReplayResult) -> None:
    """Plot an elastic replay's committed bytes against the bytes of the blocks holding KV (in use +
    cached) over simulated time on ``ax``, in MiB (``result.memory_timeline``: replay with
    ``elastic_block_bytes`` and ``record_timeline=True``). Raises ValueError without it."""
    if not result.memory_timeline:
        raise ValueError("the replay recorded no memory timeline: replay elastic with record_timeline=True")
    t, committed, used, cached = zip(*result.memory_timeline, strict=True)
    mib = 2.0**20
    ax.step(t, [c / mib for c in committed], where="post", label="committed", color="black")
    ax.stackplot(t, [u / mib for u in used], [c / mib for c in cached], labels=("in use", "cached"),
                 colors=(COLORS["in use"], COLORS["cached"]), step="post")
    ax.set_ylabel("KV memory (MiB)")
    ax.set_xlabel("simulated time (s)")
    ax.legend(loc="upper right", fontsize=8)


def plot_timeline(result: ReplayResult, path: str | Path, *, title: str = "kvpool replay") -> Path:
    """Draw ``result.timeline`` as a stacked area chart (in use / cached / free blocks) into ``path``.

    The title gives the block and token hit ratios (a rejected request's prompt counted as misses), the
    requests rejected, the pool size and the block size. Returns the path.
    Raises ValueError when the result holds no timeline (replay with ``record_timeline=True``).
    """
    if not result.timeline:
        raise ValueError("the replay recorded no timeline; run it with record_timeline=True")
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    fig = Figure(figsize=(10, 4.5), dpi=100)
    ax = fig.subplots()
    draw_timeline(ax, result)
    ax.set_title(f"{title}: block hit ratio {result.block_hit_ratio:.4f}, token hit ratio "
                 f"{result.token_hit_ratio:.4f} ({rejected_label(result)})\n"
                 f"{result.num_blocks:,} blocks, {result.timing} timing, "
                 f"{result.policy} eviction, {result.preemptions:,} preemptions, {result.evictions:,} "
                 "evictions", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def plot_tier_sweep(results: Sequence[ReplayResult], path: str | Path, *, title: str = "kvpool replay"
                    ) -> Path:
    """Draw the block hit ratio of each replay of a sweep, stacked by where the blocks were found (device,
    host, disk, remote), against the device pool size (one bar per run, in the given order, labelled with
    the requests it rejected: their prompts count as misses). Returns the path. Raises ValueError for an
    empty sweep."""
    if not results:
        raise ValueError("a sweep of no runs has nothing to draw")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=100)
    ax = fig.subplots()
    draw_tier_sweep(ax, results)
    ax.set_title(f"{title}: block hit ratio by tier, {results[0].timing} timing", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


#: Colours of the places a prefix hit is found.
TIER_COLORS = {"device": "#d62728", "host": "#1f77b4", "disk": "#2ca02c", "remote": "#9467bd"}


def draw_tier_sweep(ax: Any, results: Sequence[ReplayResult], *, policies: bool = False) -> None:
    """Stack each replay's block hit ratio by where the blocks were found on ``ax``, one bar per result in
    order, labelled with its pool size, its requests rejected and (``policies``) its policy."""
    places = list(dict.fromkeys(p for r in results for p in r.tier_hits))
    x = range(len(results))
    bottom = [0.0] * len(results)
    for place in places:
        share = [r.tier_hits.get(place, 0) / r.prompt_blocks if r.prompt_blocks else 0.0 for r in results]
        ax.bar(x, share, bottom=bottom, label=place, color=TIER_COLORS.get(place))
        bottom = [b + s for b, s in zip(bottom, share, strict=True)]
    ax.set_xticks(list(x), [f"{r.num_blocks:,}\n" + (f"{r.policy}\n" if policies else "")
                            + f"{r.requests_rejected:,} rejected" for r in results])
    ax.set_xlabel(f"device pool size (blocks of {results[0].block_size} tokens)")
    ax.set_ylabel("block hit ratio")
    ax.set_ylim(0, max(1e-9, max(bottom)) * 1.15)
    ax.legend(loc="upper left", fontsize=8)
