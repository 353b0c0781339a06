"""Turning what a step allocated at two batch sizes into its peak at every batch size.

Every op of a step runs at any batch size, in the same order, and each live tensor's size is
affine in the batch size ``b`` (batch-major activations, fixed weights and states). So the
bytes alive after op ``k`` are a line ``c_k + s_k * b``, read off two runs at ``b1`` and
``b2``, and the step's peak is the upper envelope ``max_k (c_k + s_k * b)``: exact at every
``b``, including where the peak moves from one op to another (a fixed temporary at tiny
batches, the activations at large ones), which a line through two peaks gets wrong.

The envelope is convex and piecewise linear; it is handed to ``PhaseProfile`` as integer
points around each kink, between which it is exactly linear.
"""

from __future__ import annotations

import math
from fractions import Fraction

Line = tuple[Fraction, Fraction]  # (slope, intercept)


def event_lines(events_1: list[int], events_2: list[int], b1: int, b2: int) -> list[Line]:
    """The line of every op's allocated bytes, from the same ops run at ``b1`` and ``b2``."""
    best: dict[Fraction, Fraction] = {}  # of lines with one slope, only the highest can be a peak
    for a1, a2 in zip(events_1, events_2):
        slope = Fraction(a2 - a1, b2 - b1)
        intercept = a1 - slope * b1
        if intercept > best.get(slope, -math.inf):
            best[slope] = intercept
    return list(best.items())


def envelope_points(lines: list[Line], start: int = 1) -> tuple[tuple[int, int], ...]:
    """Integer points that describe ``max(lines)`` exactly for ``b >= start``.

    Walks the envelope from ``start``: at each step, the line that overtakes the current one
    soonest is the next piece. Points are put on both integers around each kink and one
    further on, so the last segment carries the final slope.
    """
    x = Fraction(start)
    current = max(lines, key=lambda line: (line[1] + line[0] * x, line[0]))
    kinks: list[Fraction] = []
    while True:
        steeper = [line for line in lines if line[0] > current[0]]
        crossings = [((current[1] - c) / (s - current[0]), (s, c)) for s, c in steeper]
        crossings = [(at, line) for at, line in crossings if at >= x]
        if not crossings:
            break
        at = min(at for at, _ in crossings)
        current = max((line for a, line in crossings if a == at), key=lambda line: line[0])
        kinks.append(at)
        x = at
    value = lambda b: math.ceil(max(c + s * b for s, c in lines))  # noqa: E731
    xs = {start}
    for kink in kinks:
        xs.update((max(math.floor(kink), start), max(math.ceil(kink), start)))
    last = max(xs)
    xs.add(last + 1024)  # far enough that the last segment's slope is read without rounding
    return tuple((b, value(b)) for b in sorted(xs))


def line_through(points: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """(slope, intercept) of the last segment of ``points``: the line that extrapolates."""
    (b0, m0), (b1, m1) = points[-2], points[-1]
    slope = math.ceil((m1 - m0) / (b1 - b0))
    return slope, m1 - slope * b1
