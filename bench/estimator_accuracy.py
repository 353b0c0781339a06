"""How close each estimator's predicted peak is to the true one, per model, batch size and phase.

    python bench/estimator_accuracy.py            # the GPU zoo on a GPU; the CPU zoo without one
    python bench/estimator_accuracy.py --cpu      # the CPU zoo even where there is a GPU
    python bench/estimator_accuracy.py --models resnet50,gpt2_bf16_seq1024 --json out.json
    python bench/estimator_accuracy.py --zoo library        # timm, torchvision, transformers, torch.nn
    python bench/estimator_accuracy.py --list [--zoo NAME]  # each model: traced, or why it falls back

Truth is what the loop's own steps use (``trainables.step``, via ``bench.zoo.StepRunner``): a
train step of two micro-batches of ``b`` and an eval step of ``b``, after a warm-up step, each
read as peak allocated and peak reserved from PyTorch's CUDA allocator (allocator settings as the
orchestrator sets them: ``expandable_segments:True``). Without a GPU the truth is the CPU tensor
tracker's peak (``orchestrator.device.CpuDevice``), which counts tensors, not an allocator.

Estimators, each profiled once per model and read at every ``b``:
    static      analytic upper bound (``memory.static``)
    trace       fake tensors on the GPU's own device type (``memory.trace``)
    trace-cpu   fake *cpu* tensors with CUDA emulated: what a head node without a GPU predicts
    measured    probe steps on the device (``memory.measured``)

Predicted reserved is compared without the CUDA context, which PyTorch's statistics do not see.
Goals: trace and measured within 3 % of true peak allocated; predicted reserved never under the
truth and at most 10 % over at the median; static never under.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.zoo import ZOOS, Entry, StepRunner, describe_bytes, relative  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU zoo and the CPU tracker, even on a GPU machine")
    parser.add_argument("--zoo", choices=sorted(ZOOS), help="which zoo (default: gpu on a GPU, else cpu; --list: all)")
    parser.add_argument("--models", help="comma-separated zoo names (default: all available)")
    parser.add_argument("--json", help="also write every row to this file")
    parser.add_argument("--list", action="store_true",
                        help="only trace each model for a CUDA target and say whether it traced or why it fell back")
    args = parser.parse_args(argv)
    if args.list:
        return list_zoo([args.zoo] if args.zoo else list(ZOOS), args.models)

    from orchestrator.device import DEFAULT_ALLOC_CONF, configure_allocator

    configure_allocator(DEFAULT_ALLOC_CONF)  # before CUDA initialises
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    zoo = ZOOS[args.zoo or ("gpu" if on_gpu else "cpu")]
    wanted = set(args.models.split(",")) if args.models else None
    entries = [e for e in zoo if (wanted is None or e.name in wanted)]
    print(f"# estimator accuracy on {describe_machine(on_gpu)}", flush=True)
    rows = []
    for entry in entries:
        if not entry.available():
            print(f"# {entry.name}: skipped, needs {', '.join(entry.needs)}", flush=True)
            continue
        rows += run_entry(entry, on_gpu)
    print_summary(rows, on_gpu)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def list_zoo(zoos: list[str], models: str | None) -> int:
    """Trace every available model of ``zoos`` for a CUDA target, as ``orchestrator plan`` does
    for a GPU sweep from this machine, and print whether it traced or why it fell back."""
    import torch

    from orchestrator.memory import Settings, estimate

    wanted = set(models.split(",")) if models else None
    where = "fake cuda tensors" if torch.cuda.is_available() else "fake cpu tensors, CUDA emulated"
    print(f"# the zoo, traced for a CUDA target on {where} (torch {torch.__version__})")
    print(f"{'zoo':<8} {'model':<28} {'workload':<30} {'precision':<9} {'seconds':>7}  status")
    failures = 0
    for zoo in zoos:
        for entry in ZOOS[zoo]:
            if wanted is not None and entry.name not in wanted:
                continue
            head = f"{zoo:<8} {entry.name:<28} {entry.import_path.split(':')[1]:<30} {entry.precision:<9}"
            if not entry.available():
                print(f"{head} {'-':>7}  not installed here (needs {', '.join(entry.needs)})", flush=True)
                continue
            started = time.perf_counter()
            try:
                profile = estimate(entry.make(), "trace", Settings(entry.precision), target="cuda")
            except Exception as exc:  # a model that no estimator can run here: say so, list the rest
                failures += 1
                status = f"no estimate: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            else:
                fell_back = profile.estimator != "trace"
                failures += fell_back != (entry.untraceable is not None)
                status = profile.notes[0] if fell_back else "traced" + "".join(
                    f"; {n}" for n in profile.notes[1:] if "math kernel" in n or "not counted" in n
                )
            print(f"{head} {time.perf_counter() - started:>7.1f}  {status}", flush=True)
    print(f"# {failures} model(s) not as expected (traced, or the expected reason for the untraceable ones)")
    return 1 if failures else 0


def describe_machine(on_gpu: bool) -> str:
    import torch

    if on_gpu:
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA allocator)"
    return f"CPU (torch {torch.__version__}, CPU tensor tracker: tensor bytes, no allocator)"


def run_entry(entry: Entry, on_gpu: bool) -> list[dict]:
    import torch

    from orchestrator.device import CpuDevice, CudaDevice
    from orchestrator.memory import Settings, estimate
    from orchestrator.memory.trace import trace_profile

    settings = Settings(entry.precision)
    target = "cuda" if on_gpu else "cpu"
    make_device = (lambda: CudaDevice(torch.cuda.current_device())) if on_gpu else CpuDevice
    profiles, seconds = {}, {}
    estimators = {
        "static": lambda: estimate(entry.make(), "static", settings, target=target),
        "trace": lambda: estimate(entry.make(), "trace", settings, target=target),
        "measured": lambda: estimate(entry.make(), "measured", settings, target=target, device=make_device()),
    }
    if on_gpu:
        estimators["trace-cpu"] = lambda: trace_profile(entry.make(), settings, target="cuda", fragmentation=0.10, trace_on="cpu")
    for name, run in estimators.items():
        started = time.perf_counter()
        try:
            profiles[name] = run()
        except Exception as exc:  # one estimator failing must not hide the others' results
            print(f"# {entry.name}: {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        seconds[name] = time.perf_counter() - started
        if on_gpu:
            torch.cuda.empty_cache()
    for name, profile in profiles.items():
        print(f"# {entry.name}: {name} in {seconds[name]:.1f}s; " + "; ".join(profile.notes), flush=True)

    runner = StepRunner(entry.make(), entry.precision, make_device())
    runner.train(entry.batches[0], micro_batches=1)  # warm-up: the optimizer's state exists from here on
    rows = []
    for b in entry.batches:
        for kind, reading in (("train", runner.train(b)), ("eval", runner.eval(b))):
            row = {"model": entry.name, "b": b, "phase": kind, "true_allocated": reading.peak_allocated,
                   "true_reserved": reading.peak_reserved}
            for name, profile in profiles.items():
                phase = profile.phases_of(kind)[0]  # stage 0: the zoo models have no schedule
                row[f"{name}_allocated"] = phase.allocated_at(b)
                row[f"{name}_reserved"] = phase.reserved_at(b) - phase.context
                row[f"{name}_seconds"] = seconds[name]
            rows.append(row)
            print_row(row, list(profiles), on_gpu)
    del runner
    if on_gpu:
        torch.cuda.empty_cache()
    return rows


def print_row(row: dict, names: list[str], on_gpu: bool) -> None:
    parts = [f"{row['model']:<20} b={row['b']:<4} {row['phase']:<5} true {describe_bytes(row['true_allocated'])}"]
    if on_gpu:
        parts.append(f"(reserved {describe_bytes(row['true_reserved'])})")
    for name in names:
        err = relative(row[f"{name}_allocated"], row["true_allocated"])
        text = f"{name} {describe_bytes(row[f'{name}_allocated'])} {err:+.1%}"
        if on_gpu:
            text += f" / reserved {relative(row[f'{name}_reserved'], row['true_reserved']):+.1%}"
        parts.append(text)
    print("  ".join(parts), flush=True)


def print_summary(rows: list[dict], on_gpu: bool) -> None:
    if not rows:
        print("# nothing ran")
        return
    names = sorted({k[: -len("_allocated")] for r in rows for k in r if k.endswith("_allocated") and k != "true_allocated"})
    print("\n# summary: relative error of predicted peak allocated (and reserved) vs truth, over every row")
    for name in names:
        alloc = [relative(r[f"{name}_allocated"], r["true_allocated"]) for r in rows if f"{name}_allocated" in r]
        line = f"{name:<10} allocated: worst {max(alloc, key=abs):+.1%}, median {statistics.median(alloc):+.1%}, " \
               f"under in {sum(e < 0 for e in alloc)}/{len(alloc)}"
        if on_gpu:
            reserved = [relative(r[f"{name}_reserved"], r["true_reserved"]) for r in rows if f"{name}_reserved" in r]
            line += f"; reserved: median {statistics.median(reserved):+.1%}, under in {sum(e < 0 for e in reserved)}/{len(reserved)}"
        print(line)
    print("# goals: trace, measured within 3 % (allocated); reserved never under, <= +10 % median; static never under")


if __name__ == "__main__":
    raise SystemExit(main())
