"""How long a sweep's estimates take in the driver's thread and in spawned processes, and how long
the process pool then takes to end.

    .venv/bin/python bench/estimate_processes.py configs/demo_cpu.yaml --processes 1 2 --repeats 3

Each run is a fresh Python process that loads the config and calls ``estimate_trials`` as ``run``
and ``plan`` do, with ``processes`` given (one: the driver's own thread, which is what two cores
get by default; more: a spawned pool, what a machine with more cores, or any trace on a GPU,
gets). "last estimate" is when the last signature's estimate came back, "pool ended" how long
``estimate_trials`` then took to return: the pool waits for each process's exit. Medians over
``--repeats``, the process counts alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import json, sys, time
from orchestrator.config import load_spec
from orchestrator.device.target import resolve_target
from orchestrator.estimates import estimate_trials
from orchestrator.space import memory_configs

if __name__ == "__main__":
    spec = load_spec(sys.argv[1])
    planned = resolve_target(spec)
    done = []
    started = time.perf_counter()
    estimates = estimate_trials(memory_configs(spec), spec.memory, planned.kind, planned.budget,
                                spec.effective_batch_size, processes=int(sys.argv[2]),
                                on_done=lambda *_: done.append(time.perf_counter()))
    ended = time.perf_counter()
    print(json.dumps({"signatures": len(estimates.by_signature), "errors": len(estimates.errors),
                      "last": done[-1] - started, "ended": ended - done[-1]}))
"""


def measure(config: str, processes: int) -> dict:
    """One fresh process's estimates of ``config`` in ``processes`` processes."""
    done = subprocess.run([sys.executable, "-c", CHILD, config, str(processes)], capture_output=True, text=True,
                          cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"processes={processes}: failed\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a sweep YAML, e.g. configs/demo_cpu.yaml")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    config = str(Path(args.config).resolve())
    runs: dict[int, list[dict]] = {p: [] for p in args.processes}
    for _ in range(args.repeats):
        for processes in args.processes:
            runs[processes].append(measure(config, processes))
    print("| processes | signatures | last estimate | pool ended | estimate_trials in all |")
    print("|---|---|---|---|---|")
    for processes, results in runs.items():
        last = statistics.median(r["last"] for r in results)
        ended = statistics.median(r["ended"] for r in results)
        whole = statistics.median(r["last"] + r["ended"] for r in results)
        where = "the driver's thread" if processes == 1 else f"{processes} spawned"
        print(f"| {where} | {results[0]['signatures']} | {last:.2f} s | {ended:.2f} s | {whole:.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
