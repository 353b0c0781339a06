"""Plain-text tables for the terminal: the run summary, ``plan`` and ``report`` all use this."""

from __future__ import annotations

from typing import Any, Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def trained_text(epochs: int, steps: int, stop_epochs: int | None, stop_steps: int | None, unit: str = "ep") -> str:
    """What a trial trained of the sweep's budget, as ``run``'s table and ``report``'s show it:
    ``3/3 ep``, ``1/3 ep`` for one the scheduler stopped early, ``1 ep, 500/500 steps`` where the
    budget counts steps (a trial that ends at its step budget mid-epoch is not one stopped early);
    ``unit="epochs"`` for the console's lines."""
    text = f"{epochs}/{stop_epochs} {unit}" if stop_epochs else f"{epochs} {unit}"
    return text if stop_steps is None else f"{text}, {steps}/{stop_steps} steps"


def value_text(value: Any) -> str:
    """A config value as ``run`` and ``plan`` print it: a float to 4 significant digits (a sampled
    ``lr=0.0018789852661499496`` reads ``lr=0.001879`` in both), the rest as ``str``; MLflow's
    params and ``plan --json`` keep the exact value, and ``report``'s plot labels are shorter
    still (``report.short_value``)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)
