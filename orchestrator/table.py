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


def split_text(micro_batch: int, accum_steps: int, effective_batch: int | None = None, ranks: int = 1) -> str:
    """``64 x 2``: micro-batch x accumulation, as every table and line shows a plan; ``x 2 ranks``
    for a data-parallel trial; ``(last 28)`` where the micro-batches do not divide a rank's share
    of the effective batch (128 as 100 + 28: ``100 x 2 (last 28)``), so that the product is not
    read as the samples of a step."""
    text = f"{micro_batch} x {accum_steps}" + (f" x {ranks} ranks" if ranks > 1 else "")
    last = last_micro_batch(micro_batch, accum_steps, effective_batch, ranks)
    return f"{text} (last {last})" if last else text


def last_micro_batch(micro_batch: int, accum_steps: int, effective_batch: int | None, ranks: int = 1) -> int | None:
    """The last micro-batch of a step where it is smaller than the others (a rank's share of
    ``effective_batch`` that ``micro_batch`` does not divide), else None."""
    if not effective_batch:
        return None
    last = effective_batch // max(ranks, 1) - micro_batch * (accum_steps - 1)
    return last if 0 < last < micro_batch else None


def value_text(value: Any) -> str:
    """A config value as ``run`` and ``plan`` print it: a float to 4 significant digits (a sampled
    ``lr=0.0018789852661499496`` reads ``lr=0.001879`` in both), the rest as ``str``; MLflow's
    params and ``plan --json`` keep the exact value, and ``report``'s plot labels are shorter
    still (``report.short_value``)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)
