"""The replay's clock of a lone request's decode steps, run in one go (:meth:`Replayer._decode_alone
<kvpool.trace.replayer.Replayer>`): pure arithmetic, the same sums as stepping one step at a time."""

from __future__ import annotations


def lone_decode_clock(now: float, area: float, peak: int, *, used: int, room: int, steps: int,
                      block_size: int, groups: int, dt: float) -> tuple[float, float, int]:
    """``(now, area, peak)`` after ``steps`` decode steps of one request alone: ``min(room, steps)`` pure
    decode steps (``dt`` seconds each, ``used`` blocks in use), then per block the step that allocates it
    (``groups`` more blocks in use, ``dt`` seconds: one decode token, no prefill) and the
    ``block_size - 1`` pure decode steps that fill it. ``area`` accumulates blocks in use x seconds;
    ``peak`` the most blocks in use."""
    k = min(room, steps)
    while True:
        if k > 0:  # pure decode steps in one tick
            span = k * dt
            peak = max(peak, used)
            area += used * span
            now += span
            steps -= k
        if steps <= 0:
            return now, area, peak
        used += groups  # the step that allocates the next block
        peak = max(peak, used)
        area += used * dt
        now += dt
        steps -= 1
        k = min(block_size - 1, steps)
