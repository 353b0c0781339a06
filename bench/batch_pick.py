"""Which micro-batch each tool picks for a memory budget, how long it takes, and how often it OOMs.

    python bench/batch_pick.py                    # GPU: a 24 GiB card emulated on the GPU
    python bench/batch_pick.py --budget 16GiB --models resnet50,gpt2_bf16_seq1024   # any zoo's names (library too)
    python bench/batch_pick.py --cpu              # no GPU: an emulated device on the CPU tracker

Per workload of the zoo (``bench.zoo``), with the budget enforced by
``torch.cuda.set_per_process_memory_fraction`` and the orchestrator's allocator settings:

* true max: the largest micro-batch whose train step (the loop's: two accumulated micro-batches
  and the optimizer step) runs, by doubling then binary search on the device;
* ours: ``orchestrator.planner.make_plan`` with the ``trace`` estimator (fake tensors: no GPU
  memory used, so no OOM while planning), and with ``measured``; planning time, OOMs;
* Accelerate's ``find_executable_batch_size`` and Lightning's ``Tuner.scale_batch_size``
  (``power`` and ``binsearch``) on the same step, in the same process; their batch, time, OOMs;
* then ``--steps`` train steps (and an eval pass every 50) at our planned sizes, counting OOMs.

Goals: ours >= 97 % of the true max, 0 OOMs planning with trace, planning time < 1/3 of
Lightning binsearch's, and 0 OOMs in the 200 steps.

The plan budgets the CUDA context too, but ``set_per_process_memory_fraction`` caps only what
the allocator reserves (the context is outside it), so the planner is given budget + context.
The plan is made for an effective batch so large (a prime near 10^9) that spreading it evenly
over its passes (``planner.even_split``) leaves the largest micro-batch the profile says fits
as it is: the micro-batch asks the same question as the search, whatever the step's
accumulation. With ``--cpu`` (a smoke run of this script where there is no GPU) the device is
``EmulatedDevice``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.zoo import CPU_ZOO, GPU_ZOO, LIBRARY_ZOO, Entry, StepRunner  # noqa: E402
from orchestrator.device import release  # noqa: E402

EFFECTIVE_BATCH = 1_000_000_007  # prime: spread over its passes, the largest micro-batch below ~30,000 that fits stays whole
ACCELERATE_START = {"gpt2_bf16_seq1024": 64}  # starting batch for Accelerate (default 1024)
PICK_MODELS = ("resnet50", "vit_b16_bf16", "gpt2_bf16_seq1024", "tcn_eeg")
CPU_PICK_MODELS = ("cnn", "resnet_ish", "tiny_gpt_bf16")


@dataclass
class Pick:
    tool: str
    batch: int | None
    seconds: float
    ooms: int
    note: str = ""


@dataclass
class Result:
    model: str
    true_max: int
    picks: list[Pick] = field(default_factory=list)
    run_ooms: int | None = None
    run_note: str = ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default=None, help="memory budget (default 24GiB on a GPU, 96MiB with --cpu)")
    parser.add_argument("--models", help="comma-separated zoo names")
    parser.add_argument("--steps", type=int, default=200, help="train steps at the planned size (default 200)")
    parser.add_argument("--safety-margin", type=float, default=0.97, help="planner safety margin (default 0.97)")
    parser.add_argument("--fragmentation", type=float, default=0.05,
                        help="assumed allocator fragmentation for trace (default 0.05: expandable segments)")
    parser.add_argument("--cpu", action="store_true", help="emulated device on the CPU tracker (no GPU needed)")
    args = parser.parse_args(argv)

    from orchestrator.allocator_conf import DEFAULT_ALLOC_CONF
    from orchestrator.device import configure_allocator
    from orchestrator.units import parse_bytes

    configure_allocator(DEFAULT_ALLOC_CONF)  # before CUDA initialises, as the orchestrator does
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    budget = parse_bytes(args.budget or ("24GiB" if on_gpu else "96MiB"))
    zoo = [e for e in GPU_ZOO if e.name in PICK_MODELS] if on_gpu else [e for e in CPU_ZOO if e.name in CPU_PICK_MODELS]
    if args.models:
        zoo = [e for e in (*GPU_ZOO, *CPU_ZOO, *LIBRARY_ZOO) if e.name in args.models.split(",")]
    print(f"# batch pick, budget {args.budget or budget} on {_machine(on_gpu)}", flush=True)
    results = []
    for entry in zoo:
        if not entry.available():
            print(f"# {entry.name}: skipped, needs {', '.join(entry.needs)}", flush=True)
            continue
        results.append(run_entry(entry, budget, on_gpu, args))
        release()
    print_table(results)
    return 0


def _machine(on_gpu: bool) -> str:
    import torch

    if on_gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        return f"{torch.cuda.get_device_name()} ({total / 2**30:.0f} GiB, torch {torch.__version__})"
    return f"CPU, emulated device (torch {torch.__version__})"


def _device(budget: int, on_gpu: bool):
    import torch

    from orchestrator.device import CudaDevice, EmulatedDevice

    if on_gpu:
        total = torch.cuda.get_device_properties(0).total_memory
        return CudaDevice(torch.cuda.current_device(), memory_fraction=budget / total)
    return EmulatedDevice(budget)


def run_entry(entry: Entry, budget: int, on_gpu: bool, args) -> Result:
    device = _device(budget, on_gpu)
    runner = StepRunner(entry.make(), entry.precision, device)
    runner.fits(1)  # warm-up: the optimizer's state exists from here on, as in training
    true_max = largest_fitting(runner.fits)
    print(f"# {entry.name}: true max micro-batch {true_max}", flush=True)
    del runner
    release()
    result = Result(entry.name, true_max)
    for estimator in ("trace", "measured"):
        result.picks.append(ours(entry, estimator, budget, device, on_gpu, args, EFFECTIVE_BATCH))
        release()
    result.picks.append(accelerate_pick(entry, device))
    release()
    for mode in ("power", "binsearch"):
        result.picks.append(lightning_pick(entry, mode, on_gpu))
        release()
    for pick in result.picks:
        print(f"# {entry.name}: {pick.tool}: {pick.batch} in {pick.seconds:.1f}s, {pick.ooms} OOMs {pick.note}", flush=True)
    plan = result.picks[0]
    if plan.batch:
        result.run_ooms, result.run_note = run_steps(entry, device, plan.batch, plan.note, args.steps)
    return result


def largest_fitting(fits) -> int:
    """Doubling from 1 until a step fails, then binary search between the last two sizes."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def ours(entry: Entry, estimator: str, budget: int, device, on_gpu: bool, args, effective: int) -> Pick:
    from orchestrator.config import MemoryPolicy
    from orchestrator.device.nvml import cuda_context_bytes
    from orchestrator.planner import plan_with_profile

    policy = MemoryPolicy(
        device="cuda" if on_gpu else "emulated", estimator=estimator, safety_margin=args.safety_margin,
        fragmentation=args.fragmentation, allow_activation_checkpointing=False, precision=entry.precision,
        lower_precision=None,
    )
    target = "cuda" if on_gpu else "emulated"
    planner_budget = budget + (cuda_context_bytes() if on_gpu else 0)  # the fraction caps the allocator only
    started = time.perf_counter()
    try:
        plan, profile = plan_with_profile(entry.make(), policy, effective, planner_budget, target=target, device=device)
    except Exception as exc:  # report, do not hide the other tools' results
        return Pick(f"ours ({estimator})", None, time.perf_counter() - started, 0, f"failed: {type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - started
    if plan.refusal:
        return Pick(f"ours ({estimator})", None, seconds, 0, f"refused: {plan.refusal}")
    # trace runs on fake tensors: it cannot run out of memory; measured's probes say so in its notes
    ooms = sum("out-of-memory" in n for n in profile.notes) if profile else 0
    return Pick(f"ours ({estimator})", plan.micro_batch, seconds, ooms, f"eval batch {plan.eval_batch}")


def accelerate_pick(entry: Entry, device) -> Pick:
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return Pick("accelerate", None, 0.0, 0, "not installed")
    runner = StepRunner(entry.make(), entry.precision, device)
    calls = []

    @find_executable_batch_size(starting_batch_size=ACCELERATE_START.get(entry.name, 1024))
    def train(batch_size):
        calls.append(batch_size)
        runner.recover()  # what ``accelerator.free_memory()`` does at the top of such a function
        for _ in range(3):  # a few steps, as a training loop under the decorator would run
            runner.train(batch_size)
        return batch_size

    started = time.perf_counter()
    try:
        picked = train()
    except RuntimeError as exc:  # "No executable batch size found"
        return Pick("accelerate", None, time.perf_counter() - started, len(calls), str(exc)[:100])
    return Pick("accelerate", picked, time.perf_counter() - started, len(calls) - 1)


def lightning_pick(entry: Entry, mode: str, on_gpu: bool) -> Pick:
    try:
        import lightning.pytorch as pl
        from lightning.pytorch.tuner import Tuner, batch_size_scaling
    except ImportError:
        return Pick(f"lightning {mode}", None, 0.0, 0, "not installed")
    import torch
    from torch.utils.data import DataLoader

    workload = entry.make()

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2
            self.model = workload.build_model()

        def training_step(self, batch, _):
            return workload.loss(self.model, batch)

        def configure_optimizers(self):
            return workload.build_optimizer(self.model)

        def train_dataloader(self):
            data = workload.train_data()
            indices = [i % len(data) for i in range(self.batch_size * 4)]
            return DataLoader(torch.utils.data.Subset(data, indices), batch_size=self.batch_size)

    ooms = []
    is_oom = batch_size_scaling.is_oom_error

    def counting(exc):
        hit = is_oom(exc)
        ooms.append(hit)
        return hit

    batch_size_scaling.is_oom_error = counting
    precision = {"bf16": "bf16-mixed", "fp16": "16-mixed"}.get(entry.precision, "32-true")
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(
            accelerator="gpu" if on_gpu else "cpu", devices=1, precision=precision, max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        )
        started = time.perf_counter()
        try:
            picked = Tuner(trainer).scale_batch_size(Module(), mode=mode, init_val=2, max_trials=25, steps_per_trial=3)
        finally:
            batch_size_scaling.is_oom_error = is_oom
        seconds = time.perf_counter() - started
    return Pick(f"lightning {mode}", picked, seconds, sum(ooms))


def run_steps(entry: Entry, device, micro: int, note: str, steps: int) -> tuple[int, str]:
    """``steps`` train steps at the planned micro-batch (x2 accumulated), eval every 50; OOMs counted."""
    eval_batch = int(note.split()[-1]) if note.startswith("eval batch") else micro
    runner = StepRunner(entry.make(), entry.precision, device)
    ooms, started = 0, time.perf_counter()
    for step in range(steps):
        try:
            runner.train(micro)
            if step % 50 == 49:
                runner.eval(eval_batch)
        except Exception as exc:
            import torch

            if not isinstance(exc, torch.OutOfMemoryError):
                raise
            exc.__traceback__ = None
            runner.recover()
            ooms += 1
    return ooms, f"{steps} steps at {micro} x 2 (eval {eval_batch}) in {time.perf_counter() - started:.0f}s"


def print_table(results: list[Result]) -> None:
    from orchestrator.table import format_table

    tools = [p.tool for p in results[0].picks] if results else []
    headers = ["model", "true max"] + [f"{t} (b / s / OOMs)" for t in tools] + ["steps at ours: OOMs"]
    rows = []
    for r in results:
        cells = [r.model, r.true_max]
        for p in r.picks:
            share = f" {p.batch / r.true_max:.0%}" if p.batch and r.true_max else ""
            cells.append("-" if p.batch is None else f"{p.batch}{share} / {p.seconds:.1f} / {p.ooms}")
        cells.append("-" if r.run_ooms is None else f"{r.run_ooms} ({r.run_note})")
        rows.append(cells)
    print()
    print(format_table(headers, rows))
    print("# goals: ours (trace) >= 97 % of true max, 0 OOMs planning, planning time < 1/3 of lightning "
          "binsearch, 0 OOMs in the steps at the planned size")
    for r in results:
        for p in r.picks:
            if p.note and p.note.startswith(("refused", "failed", "not installed")):
                print(f"# {r.model}: {p.tool}: {p.note}")


if __name__ == "__main__":
    raise SystemExit(main())
