"""How long one distinct model takes to plan: ``make_plan`` with the default ``trace`` estimator.

    .venv-zoo/bin/python bench/planning_time.py                      # GPT-2 124M, its stand-in, ResNet-50, the 1-d conv net
    .venv-zoo/bin/python bench/planning_time.py --models gpt2_bf16_seq1024 --repeats 3

Each model is planned in a fresh Python process, as a sweep's driver or a trial's worker plans
it: the process imports torch, the orchestrator and the model's library (transformers' import
alone is seconds), builds the model on fake tensors, traces its steps and searches the plan
for a 24 GiB CUDA budget at an effective batch of 64. The table gives the child's CPU time
(user + system: what an idle machine would take, the trace being single-threaded) and its wall
time (which other load on the machine stretches), median over ``--repeats``. Aim (the estimator
issue): under 15 s for a 100M-parameter model on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODELS = ("gpt2_bf16_seq1024", "gpt2_standin_bf16_seq1024", "resnet50", "tcn_eeg")

CHILD = """
import json, sys
sys.path.insert(0, {bench!r})
from dataclasses import replace
from orchestrator.config import MemoryPolicy
from orchestrator.planner import make_plan
from zoo import ZOOS
entry = next(e for zoo in ZOOS.values() for e in zoo if e.name == {name!r})
plan = make_plan(entry.make(), replace(MemoryPolicy(), precision=entry.precision), 64, 24 * 2**30, target="cuda")
print(json.dumps({{"plan": f"{{plan.micro_batch}} x {{plan.accum_steps}}", "peak": plan.predicted_peak_bytes,
                  "estimator": plan.estimator}}))
"""


def plan_once(name: str) -> tuple[float, float, dict]:
    """CPU and wall seconds of one child process that plans ``name``, and what it planned."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD.format(bench=str(Path(__file__).parent), name=name)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{name}: planning failed\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu, wall, json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated bench/zoo.py entry names")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        runs = [plan_once(name) for _ in range(args.repeats)]
        cpu, wall = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        planned = runs[-1][2]
        peak = f"{planned['peak'] / 2**30:.2f} GiB" if planned["peak"] else "-"
        rows.append((name, f"{cpu:.1f} s", f"{wall:.1f} s", f"{planned['plan']} ({planned['estimator']})", peak))
    header = ("model", "CPU time", "wall", "plan at 24 GiB", "predicted peak")
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
