"""``kvpool replay ... --report out.html``: one self-contained HTML page of a replay or a sweep.

The page shows a summary line (the runs, the best hit ratio, the requests rejected, the tiers), then
(1) the block hit ratio against the pool size, one line per eviction policy, with the offline bound
(``belady``) dashed (the axis starts at 0 unless that would squeeze curves that differ by little: then it
spans their range, and says so); (2) the hit ratios as a table with the requests each run rejected (their
prompts count as misses), and each policy's share of the bound; (3) with tiers below the pool, the hit
ratio split by where the blocks were found (the stacked chart ``--plot`` draws) and its table; (4) for
each run, picked from a list, the blocks in use / cached / free over simulated time above a heat map of
the pool: block id against time, each cell coloured by the state of its blocks (free, in use, cached,
pinned), and for an elastic replay its committed bytes against the blocks holding KV; (5) where runs
kept sessions (``--sessions``), each run's cached-token accounting and session counters, its row named by
its eviction and session policies (``lru+last=1``); (6) every run's numbers and the parameters of the
replay (lists and mappings spelled out).

How it is drawn: matplotlib (the ``replay`` extra, which already draws ``--plot``) renders each figure as
SVG, written into the page; the heat map is a raster image inside its SVG (a PNG data URI). Nothing is
fetched at view time and no charting code runs in the browser: the only script switches which run is
shown. A vendored JavaScript charting library would add hover read-outs, but also a third-party file to
keep current and license, and a second charting stack beside the PNG plot; hand-written SVG would be
charting code of our own to maintain. Exact values are in the page's tables instead.

:class:`PoolHeatmap` records the heat map during a replay: pass it as ``run_replay(..., observer=...)``;
:class:`SweepRun` is one replay with its heat map, what :func:`write_report` draws (``run_sweep`` makes them).
"""

from __future__ import annotations

import html
import io
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool.allocators.block_pool import BLOCK_STATES, BlockPool
from kvpool.trace.plot import COLORS, draw_memory_timeline, draw_tier_sweep, draw_timeline, rejected_label
from kvpool.trace.replayer import HIT_RATIO_BASIS
from kvpool.trace.sessions import run_label, session_rows
from kvpool.units import plural

if TYPE_CHECKING:
    from kvpool.trace.replayer import ReplayResult

#: Tie order when a heat-map cell's blocks are in several states equally often: the rarer, more telling
#: state wins (codes of :data:`BLOCK_STATES`).
_PRECEDENCE = tuple(BLOCK_STATES.index(s) for s in ("pinned", "in use", "cached", "free", "null"))


class PoolHeatmap:
    """Per-block states of a pool over time, binned to at most ``max_rows`` rows of consecutive block ids
    and thinned to at most ``max_columns`` snapshots (every k-th call, k doubling as needed, so columns
    stay evenly spaced in call order). Each cell holds the most common state among its blocks at that
    snapshot (ties: pinned, in use, cached, free). Use it as a replay observer: ``pool`` is read with
    :meth:`BlockPool.block_states`, O(num_blocks) per snapshot taken.

    ``times[c]`` is the simulated time of column ``c``; ``columns[c][r]`` the state code (an index into
    :data:`BLOCK_STATES`) of row ``r``; row ``r`` covers block ids ``row_edges[r]`` to
    ``row_edges[r + 1] - 1``.
    """

    def __init__(self, max_columns: int = 240, max_rows: int = 256) -> None:
        self.max_columns, self.max_rows = max_columns, max_rows
        self.times: list[float] = []
        self.columns: list[bytes] = []
        self.row_edges: list[int] = []
        self._stride = 1
        self._calls = 0

    def __call__(self, now: float, pool: BlockPool) -> None:
        take = self._calls % self._stride == 0
        self._calls += 1
        if not take:
            return
        if not self.row_edges:
            n = pool.num_blocks
            rows = min(n, self.max_rows)
            self.row_edges = [r * n // rows for r in range(rows + 1)]
        self.times.append(now)
        self.columns.append(self._bin(pool.block_states()))
        if len(self.columns) > self.max_columns:
            self.times, self.columns = self.times[::2], self.columns[::2]
            self._stride *= 2

    def _bin(self, states: bytes) -> bytes:
        edges, out = self.row_edges, bytearray(len(self.row_edges) - 1)
        for r in range(len(out)):
            cell = states[edges[r]:edges[r + 1]]
            out[r] = max(_PRECEDENCE, key=cell.count)
        return bytes(out)


@dataclass(frozen=True)
class SweepRun:
    """One replay of a sweep: its result (with a timeline when recorded) and its heat map, if recorded."""

    result: ReplayResult
    heatmap: PoolHeatmap | None = None

    @property
    def policy(self) -> str:
        """The run's row: its eviction policy, with its session policy after a ``+`` where it kept
        sessions (``lru+last=1``; the offline bound stays ``belady``)."""
        return run_label(self.result.policy, self.result.cache.get("session_policy"))

    @property
    def num_blocks(self) -> int:
        return self.result.num_blocks



def write_report(path: str | Path, runs: Sequence[SweepRun], parameters: Mapping[str, object], *,
                 title: str = "kvpool replay report") -> Path:
    """Write the page for ``runs`` (each with a timeline; a heat map where recorded) and ``parameters``
    (shown in order: numbers with separators, lists comma-joined or ``none``, mappings as ``key value``;
    a ``tiers`` entry also goes into the summary) to ``path`` and return it. Needs matplotlib. Raises
    ValueError for no runs or a run without a timeline."""
    if not runs:
        raise ValueError("a report needs at least one run")
    if any(not run.result.timeline for run in runs):
        raise ValueError("every run of a report needs its timeline: replay with record_timeline=True")
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p id="summary">{html.escape(summary(runs, parameters))}</p>',
        _section("Hit ratio against pool size", _curves_svg(runs) + _ratio_table(runs)),
        *([_section("Hit ratio by tier", _tier_svg(runs) + _tier_table(runs))] if _has_tiers(runs) else []),
        _section("Pool over time", _run_picker(runs)),
        *([_section("Sessions and cached tokens", _table(*session_rows([r.result for r in runs]),
                                                          "sessions"))]
          if any(r.result.cache.get("sessions") for r in runs) else []),
        _section("Runs", _runs_table(runs)),
        _section("Parameters", _parameters_table(parameters)),
    ]
    page = _PAGE.format(title=html.escape(title), style=_STYLE, body="\n".join(sections), script=_SCRIPT)
    Path(path).write_text(page, encoding="utf-8")
    return Path(path)


# ---- figures ----------------------------------------------------------------------------------------


def _svg(fig: Any, prefix: str) -> str:
    """The figure as an inline ``<svg>`` element whose element ids (and the references to them) all start
    with ``prefix-``: matplotlib numbers ids per figure (``axes_1``, glyph paths), and the page holds many
    figures, some hidden, so each must point at its own definitions."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": prefix, "svg.fonttype": "path"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return _ID_REFERENCE.sub(lambda m: f"{m.group(1)}{prefix}-{m.group(2)}", text[text.index("<svg"):])


#: An element id, or a reference to one (``href="#id"``, ``url(#id)``), in matplotlib's SVG.
_ID_REFERENCE = re.compile(r"""(\bid="|href="#|url\(#)([^")]+)""")


def _policies(runs: Sequence[SweepRun]) -> list[str]:
    return list(dict.fromkeys(run.policy for run in runs))


def _curves_svg(runs: Sequence[SweepRun]) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.2), dpi=100)
    ax = fig.subplots()
    sizes = sorted({run.num_blocks for run in runs})
    for policy in _policies(runs):
        points = sorted((run.num_blocks, run.result.block_hit_ratio) for run in runs if run.policy == policy)
        x, y = zip(*points, strict=True)
        bound = policy == "belady"
        label, color = ("offline bound (belady)", "black") if bound else (policy, None)
        (line,) = ax.plot(x, y, marker="o", linestyle="--" if bound else "-", color=color, label=label)
        line.set_gid(f"curve-{_slug(policy)}")
        for run in runs:
            if run.policy == policy and run.result.requests_rejected:
                ax.annotate(f"{run.result.requests_rejected:,} rejected", (run.num_blocks,
                            run.result.block_hit_ratio), textcoords="offset points", xytext=(4, -12),
                            fontsize=7, color=line.get_color())
    if len(sizes) > 1 and sizes[-1] > 2 * sizes[0]:
        ax.set_xscale("log")
    ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
    ax.minorticks_off()
    low, high = ratio_axis([run.result.block_hit_ratio for run in runs])
    ax.set_ylim(low, high)
    ax.set_xlabel("pool size (blocks)")
    ax.set_ylabel("block hit ratio")
    zoomed = low > 0
    if zoomed:  # said on the figure and under it: the eye reads a bar's height from 0
        ax.text(0.005, 1.01, f"axis from {low:.4f}, not from 0", transform=ax.transAxes, fontsize=8,
                color="#a00")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    note = (f'<p class="note" id="ratio-axis">The hit-ratio axis spans {low:.4f} to {high:.4f}, not from 0: '
            "the curves differ by little.</p>" if zoomed else "")
    return _svg(fig, "curves") + note


def ratio_axis(ratios: Sequence[float]) -> tuple[float, float]:
    """The hit-ratio axis (low, high) for ``ratios``: from 0 to a little above the largest, unless the
    ratios span less than half of the largest (curves that differ in the third decimal would overlap):
    then the range of the ratios with 15% margins (at least 0.0005 each side), never below 0."""
    lo, hi = min(ratios), max(ratios)
    if hi <= 0:
        return 0.0, 1.0
    if hi - lo >= 0.5 * hi:
        return 0.0, hi * 1.08
    pad = max((hi - lo) * 0.15, 0.0005)
    return max(0.0, lo - pad), hi + pad


def _has_tiers(runs: Sequence[SweepRun]) -> bool:
    return any(place != "device" for run in runs for place in run.result.tier_hits)


def _tier_svg(runs: Sequence[SweepRun]) -> str:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.2), dpi=100)
    ax = fig.subplots()
    draw_tier_sweep(ax, [run.result for run in runs], policies=len(_policies(runs)) > 1)
    ax.set_gid("tiers")
    fig.tight_layout()
    return _svg(fig, "tiers")


def _tier_table(runs: Sequence[SweepRun]) -> str:
    places = list(dict.fromkeys(p for run in runs for p in run.result.tier_hits))
    rows = [[run.policy, run.num_blocks, *[run.result.tier_hits.get(p, 0) / (run.result.prompt_blocks or 1)
                                           for p in places], run.result.block_hit_ratio,
             run.result.requests_rejected] for run in runs]
    return _table(["policy", "pool blocks", *places, "total", "requests rejected"], rows, "tier-hits")


def summary(runs: Sequence[SweepRun], parameters: Mapping[str, object] = {}) -> str:
    """One line for the top of the page: how many runs of how many requests, the best block hit ratio (its
    policy, pool size and share of the offline bound), the requests rejected, and the tiers."""
    first = runs[0].result
    requests = first.requests_completed + first.requests_rejected
    online = [run for run in runs if run.policy != "belady"] or list(runs)
    best = max(online, key=lambda run: (run.result.block_hit_ratio, -run.num_blocks))
    n_policies, n_sizes = len(_policies(runs)), len({run.num_blocks for run in runs})
    text = (f"{plural(len(runs), 'run')} of {plural(requests, 'request')} "
            f"({n_policies} polic{'ies' if n_policies != 1 else 'y'}, {plural(n_sizes, 'pool size')}): "
            "best block hit ratio "
            f"{best.result.block_hit_ratio:.4f} ({best.policy} at {best.num_blocks:,} blocks")
    bound = next((run for run in runs if run.policy == "belady" and run.num_blocks == best.num_blocks), None)
    if bound is not None and bound is not best and bound.result.block_hit_ratio:
        text += f", {best.result.block_hit_ratio / bound.result.block_hit_ratio:.1%} of the offline bound"
    rejected = {run.num_blocks: run.result.requests_rejected for run in runs if run.result.requests_rejected}
    text += "); " + ("no request rejected" if not rejected else "requests rejected (counted as misses): " +
                     ", ".join(f"{n:,} at {size:,} blocks" for size, n in sorted(rejected.items())))
    tiers = parameters.get("tiers")
    if tiers in (None, "none", [], ()):  # not given: the places the runs found hits in, if any below
        tiers = [p for p in dict.fromkeys(p for run in runs for p in run.result.tier_hits) if p != "device"]
    text += f"; tiers below the pool: {_fmt_parameter(tiers)}" if tiers else "; no tier below the pool"
    return text + "."


def _slug(label: str) -> str:
    """``label`` as an element id part that CSS selectors take as is (``lru+last=1`` -> ``lru-last-1``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", label)


def _run_id(run: SweepRun) -> str:
    return f"run-{_slug(run.policy)}-{run.num_blocks}"


def _run_svg(run: SweepRun) -> str:
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    result, heat, memory = run.result, run.heatmap, bool(run.result.memory_timeline)
    fig = Figure(figsize=(10, 3.6 + 2.8 * bool(heat) + 2.4 * memory), dpi=100)
    axes = fig.subplots(1 + bool(heat) + memory, 1, sharex=True, squeeze=False)[:, 0]
    draw_timeline(axes[0], result, max_points=1500)
    if memory:  # an elastic replay: committed against the blocks holding KV
        draw_memory_timeline(axes[-1], result)
    axes[0].set_title(f"{result.policy}, {result.num_blocks:,} blocks: block hit ratio "
                      f"{result.block_hit_ratio:.4f} ({rejected_label(result)})", fontsize=10)
    if heat is not None and heat.columns:
        ax = axes[1]
        cmap = ListedColormap([COLORS[s] for s in BLOCK_STATES])
        norm = BoundaryNorm([i - 0.5 for i in range(len(BLOCK_STATES) + 1)], cmap.N)
        x_edges = [*heat.times, max(result.simulated_s, heat.times[-1] + 1e-9)]
        grid = [[col[r] for col in heat.columns] for r in range(len(heat.row_edges) - 1)]
        mesh = ax.pcolormesh(x_edges, heat.row_edges, grid, cmap=cmap, norm=norm, shading="flat")
        mesh.set_rasterized(True)  # one image in the SVG, not a rectangle per cell
        ax.set_gid("heatmap")
        ax.set_ylim(0, result.num_blocks)
        ax.set_ylabel("block id")
        ax.set_xlabel("simulated time (s)")
        null = BLOCK_STATES.index("null")
        shown = [s for s in BLOCK_STATES if s != "null" or any(null in column for column in heat.columns)]
        ax.legend(handles=[Patch(color=COLORS[s], label=s) for s in shown], fontsize=8, loc="upper right",
                  ncols=len(shown))
    for ax in axes[:-1]:
        ax.set_xlabel("")
    fig.tight_layout()
    return _svg(fig, _run_id(run))


# ---- tables and page ------------------------------------------------------------------------------------


def _section(heading: str, body: str) -> str:
    return f"<section><h2>{html.escape(heading)}</h2>\n{body}\n</section>"


def _table(header: Sequence[str], rows: Sequence[Sequence[object]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
                   for row in rows)
    return (f'<div class="table"><table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody>'
            "</table></div>")


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _ratio_table(runs: Sequence[SweepRun]) -> str:
    sizes = sorted({run.num_blocks for run in runs})
    ratio = {(run.policy, run.num_blocks): run.result.block_hit_ratio for run in runs}
    rejected = {(run.policy, run.num_blocks): run.result.requests_rejected for run in runs}
    rows: list[list[object]] = []
    for p in _policies(runs):
        rows += [[p, *[ratio.get((p, s), "") for s in sizes]],
                 ["requests rejected", *[rejected.get((p, s), "") for s in sizes]]]
    out = (f'<p class="basis">Hit ratios over {html.escape(HIT_RATIO_BASIS)}.</p>'
           + _table(["block hit ratio", *[f"{s:,} blocks" for s in sizes]], rows, "hit-ratios"))
    if any(run.policy == "belady" for run in runs):
        share = []
        for policy in _policies(runs):
            cells: list[object] = []
            for s in sizes:
                bound, got = ratio.get(("belady", s)), ratio.get((policy, s))
                cells.append(f"{got / bound:.1%}" if bound and got is not None else "")
            share.append([policy, *cells])
        out += _table(["share of the offline bound", *[f"{s:,} blocks" for s in sizes]], share, "bound-share")
    return out


def _run_picker(runs: Sequence[SweepRun]) -> str:
    shown = runs[len(runs) // 2]
    options = "".join(
        f'<option value="{_run_id(r)}"{" selected" if r is shown else ""}>{html.escape(r.policy)}, '
        f'{r.num_blocks:,} blocks</option>' for r in runs)
    figures = "".join(
        f'<figure class="run" id="{_run_id(r)}"{"" if r is shown else " hidden"}>{_run_svg(r)}</figure>'
        for r in runs)
    return (f'<p><label>Run: <select id="run-picker">{options}</select></label> '
            "Heat map: each cell is the most common state of its blocks at that moment.</p>" + figures)


#: The runs table: heading (words, so a narrow page wraps them) and the cell of a result.
_RUN_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("policy", lambda r: r.policy), ("pool blocks", lambda r: r.num_blocks),
    ("block hit ratio", lambda r: r.block_hit_ratio), ("token hit ratio", lambda r: r.token_hit_ratio),
    ("hit / prompt blocks", lambda r: f"{r.hit_blocks:,} / {r.prompt_blocks:,}"),
    ("requests done / rejected", lambda r: f"{r.requests_completed:,} / {r.requests_rejected:,}"),
    ("evictions", lambda r: r.evictions), ("preemptions", lambda r: r.preemptions),
    ("peak / mean blocks used", lambda r: f"{r.peak_blocks_used:,} / {r.mean_blocks_used:,.0f}"),
    ("prefill tokens p90 / p99", lambda r: f"{r.prefill_tokens_p90:,} / {r.prefill_tokens_p99:,}"),
    ("simulated s", lambda r: r.simulated_s), ("wall s", lambda r: r.wall_s),
)


def _runs_table(runs: Sequence[SweepRun]) -> str:
    rows = [[cell(run.result) for _, cell in _RUN_COLUMNS] for run in runs]
    return _table([heading for heading, _ in _RUN_COLUMNS], rows, "runs")


def _fmt_parameter(value: object) -> str:
    """A parameter for people: ints with separators, lists comma-joined (``none`` when empty), mappings as
    ``key value`` pairs, None as ``none``."""
    if value is None or isinstance(value, (list, tuple, dict)) and not value:
        return "none"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt_parameter(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt_parameter(v) for v in value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if type(value) is int:
        return f"{value:,}"
    return str(value) if isinstance(value, (str, float, bool)) else json.dumps(value, default=str)


def _parameters_table(parameters: Mapping[str, object]) -> str:
    rows = [[k.replace("_", " "), _fmt_parameter(v)] for k, v in parameters.items()]
    return _table(["parameter", "value"], rows, "parameters")


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
{body}
<script>{script}</script>
</body>
</html>
"""

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1100px; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
svg { max-width: 100%; height: auto; display: block; }
figure { margin: 0.5em 0; }
div.table { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.8em 0; font-variant-numeric: tabular-nums; }
table#runs { font-size: 12px; width: 100%; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; }
th { font-weight: 600; vertical-align: bottom; }
td { white-space: nowrap; }
table#parameters td { white-space: normal; overflow-wrap: anywhere; text-align: left; }
#summary { font-size: 1.05em; background: #f4f7fb; border-left: 4px solid #1f77b4; padding: 0.5em 0.8em; }
th:first-child, td:first-child { text-align: left; }
thead th { background: #f4f4f4; }
"""

_SCRIPT = """
document.getElementById("run-picker").addEventListener("change", function (event) {
  for (const figure of document.querySelectorAll("figure.run")) {
    figure.hidden = figure.id !== event.target.value;
  }
});
"""
