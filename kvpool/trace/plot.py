"""A PNG of a replay's timeline: blocks in use, cached (free, evictable) and free, over simulated time.

Needs matplotlib (the ``replay`` extra), imported only when a plot is drawn.
"""

from __future__ import annotations

from pathlib import Path

from kvpool.trace.replay import ReplayResult


def plot_timeline(result: ReplayResult, path: str | Path, *, title: str = "kvpool replay") -> Path:
    """Draw ``result.timeline`` as a stacked area chart (in use / cached / free blocks) into ``path``.

    The title gives the block and token hit ratios, the pool size and the block size. Returns the path.
    Raises ValueError when the result holds no timeline (replay with ``record_timeline=True``).
    """
    if not result.timeline:
        raise ValueError("the replay recorded no timeline; run it with record_timeline=True")
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    t, used, cached, free = zip(*result.timeline, strict=True)
    fig = Figure(figsize=(10, 4.5), dpi=100)
    ax = fig.subplots()
    ax.stackplot(t, used, cached, free, labels=("in use", "cached (evictable)", "free"),
                 colors=("#d62728", "#1f77b4", "#d9d9d9"), step="post")
    ax.set_xlim(t[0], t[-1])
    ax.set_ylim(0, result.num_blocks)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel(f"blocks ({result.block_size} tokens each)")
    ax.set_title(f"{title}: block hit ratio {result.block_hit_ratio:.4f}, token hit ratio "
                 f"{result.token_hit_ratio:.4f}\n{result.num_blocks:,} blocks, {result.timing} timing, "
                 f"{result.preemptions:,} preemptions, {result.evictions:,} evictions", fontsize=10)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)
