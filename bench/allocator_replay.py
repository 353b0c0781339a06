"""How long one replay of a trial's allocation log through the caching-allocator model takes.

    python bench/allocator_replay.py                  # GPT-2 124M stand-in, bf16, seq 1024
    python bench/allocator_replay.py --model tiny_gpt_bf16

The planner replays a phase's log at every batch size its search tries (about log2 of the
effective batch, per train and eval phase), so a replay must be cheap next to the trace it
comes from. The model is traced once (fake CPU tensors, CUDA emulated, as a head node does);
then each row is the median of ``--repeat`` replays of its train log (the model's states, two
train steps of two micro-batches) and its eval log (train, then an eval step). Goal: well
under 0.5 s per replay of a GPT-2-sized step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.zoo import CPU_ZOO, GPU_ZOO, describe_bytes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_standin_bf16_seq1024", help="a bench zoo name")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    from orchestrator.allocator_conf import parse_alloc_conf
    from orchestrator.memory import Settings
    from orchestrator.memory.trace import trace_profile

    entry = next(e for e in (*GPU_ZOO, *CPU_ZOO) if e.name == args.model)
    started = time.perf_counter()
    profile = trace_profile(entry.make(), Settings(entry.precision), target="cuda", fragmentation=0.1, trace_on="cpu")
    print(f"# {entry.name}: traced in {time.perf_counter() - started:.1f}s; "
          + ", ".join(f"{p.name}: {p.sequence.describe()['events']} events" for p in profile.phases if p.sequence))
    print(f"{'allocator':<26} {'phase':<6} {'b':>4} {'capacity':>9} {'allocated':>10} {'reserved':>10} {'fits':>5} "
          f"{'replay':>9}")
    for conf in ("", "expandable_segments:True"):
        config = parse_alloc_conf(conf)
        for phase in profile.phases:
            for b in entry.batches:
                for capacity in (None, _tight(phase, config, b)):
                    seconds = []
                    for _ in range(args.repeat):
                        t = time.perf_counter()
                        result = _uncached(phase, config, b, capacity)
                        seconds.append(time.perf_counter() - t)
                    print(f"{conf or 'default':<26} {phase.name:<6} {b:>4} "
                          f"{describe_bytes(capacity) if capacity else '-':>9} {describe_bytes(result.peak_allocated):>10} "
                          f"{describe_bytes(result.peak_reserved):>10} {'yes' if result.fits else 'no':>5} "
                          f"{statistics.median(seconds) * 1e3:>7.0f}ms", flush=True)
    return 0


def _tight(phase, config, b: int) -> int:
    """A capacity 5 % under the unpressured peak: the replay has to free its cache on the way."""
    return int(_uncached(phase, config, b, None).peak_reserved * 0.95)


def _uncached(phase, config, b: int, capacity):
    from orchestrator.memory.sequence import replay_trial

    return replay_trial(phase.sequence, config, b, b if phase.kind == "eval" else None, capacity)


if __name__ == "__main__":
    raise SystemExit(main())
