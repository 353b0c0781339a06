"""What the CPU tensor tracker costs per op, on the stateful LSTM example (``--model lstm`` of
``bench/loop_throughput.py``):

    python bench/tensor_tracker_cost.py --repeats 7

Runs the example's 128 steps through the ``Trainer`` on the CPU device three ways, interleaved:
every step tracked (``all``), every step through a dispatch mode that only runs the op
(``bare mode``: the cost of any Python ``TorchDispatchMode``, which the tracker cannot go
under), and no step tracked (``none``). Per op = the difference in CPU seconds over the ops the
tracker saw; ``tracker's own`` = ``all`` - ``bare mode``, the part the tracker's Python decides.
A trial samples steps (``orchestrator.device.cpu``), so its cost is this per op times the ops of
its sampled steps, printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import loop_throughput as lt
import torch

from orchestrator.device import cpu
from orchestrator.device.tensor_tracker import StorageTracker

TRACKED = StorageTracker.__torch_dispatch__


def _bare(self, func, types, args=(), kwargs=None):
    return func(*args, **(kwargs or {}))


def _timed(run: lt.Tbptt, sampled: str, dispatch=TRACKED) -> float:
    """CPU seconds of one run; ``sampled``: all | none | shipped (the device's own sampling)."""
    policy = cpu.CPU_SAMPLED_STEPS, cpu.CPU_SAMPLE_EVERY_S
    if sampled != "shipped":
        cpu.CPU_SAMPLED_STEPS, cpu.CPU_SAMPLE_EVERY_S = (10**9, 0.0) if sampled == "all" else (0, 1e9)
    StorageTracker.__torch_dispatch__ = dispatch
    try:
        started = time.process_time()
        lt.run_trainer_tbptt(run, tracked=True)
        return time.process_time() - started
    finally:
        cpu.CPU_SAMPLED_STEPS, cpu.CPU_SAMPLE_EVERY_S = policy
        StorageTracker.__torch_dispatch__ = TRACKED


def _ops(run: lt.Tbptt, sampled: str) -> int:
    seen = [0]

    def counting(self, *args, **kwargs):
        seen[0] += 1
        return TRACKED(self, *args, **kwargs)

    _timed(run, sampled, counting)
    return seen[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = lt.Tbptt.of_config()
    ops_all, ops_shipped = _ops(run, "all"), _ops(run, "shipped")
    variants = {"all": lambda: _timed(run, "all"), "bare mode": lambda: _timed(run, "all", _bare),
                "none": lambda: _timed(run, "none")}
    for variant in variants.values():
        variant()
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        names = list(variants)
        for name in names[repeat % 3:] + names[: repeat % 3]:
            seconds[name].append(variants[name]())
    median = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"torch {torch.__version__}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"medians of {args.repeats} interleaved repeats, CPU ms per run of {run.steps} steps")
    for name, value in median.items():
        print(f"  {name:9s} {value * 1000:7.1f}")
    per_op = (median["all"] - median["none"]) / ops_all * 1e6
    own = (median["all"] - median["bare mode"]) / ops_all * 1e6
    print(f"ops per run: {ops_all} every step tracked, {ops_shipped} as a trial samples them")
    print(f"per op: {per_op:.1f} us, of which the tracker's own Python {own:.1f} us; "
          f"as sampled: {per_op * ops_shipped / 1000:.1f} ms a run, {per_op * ops_shipped / run.steps / 1000:.3f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
