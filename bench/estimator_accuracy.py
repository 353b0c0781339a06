"""How close each estimator's predicted peak is to the true one, per model, batch size and phase.

    python bench/estimator_accuracy.py            # the GPU zoo on a GPU; the CPU zoo without one
    python bench/estimator_accuracy.py --allocator-conf ""   # on a GPU: PyTorch's default allocator
    python bench/estimator_accuracy.py --cpu      # the CPU zoo even where there is a GPU
    python bench/estimator_accuracy.py --models resnet50,gpt2_bf16_seq1024 --json out.json
    python bench/estimator_accuracy.py --truth $GPU_TRUTH/zoo_h100_default.json  # any machine
    python bench/estimator_accuracy.py --zoo library        # timm, torchvision, transformers, torch.nn
    python bench/estimator_accuracy.py --list [--zoo NAME]  # each model: traced, or why it falls back

On a GPU the truth is a trial's sequence run for real, per batch size ``b`` from a fresh model:
the model moved to the GPU, a first and a second train step of two micro-batches of ``b``
(``trainables.step``; the first creates the optimizer's state), then an eval step of ``b`` in the
cache training left; peak allocated and reserved from PyTorch's CUDA allocator over the train
steps (from the model's creation) and over the eval step, with the allocator configured by
``--allocator-conf`` (default: the orchestrator's, ``expandable_segments:True``; ``""``: PyTorch's
default). Without a GPU the truth is the CPU tensor tracker's peak of a step after a warm-up
(``orchestrator.device.CpuDevice``), which counts tensors, not an allocator.

Estimators, each profiled once per model and read at every ``b``:
    static      analytic upper bound (``memory.static``)
    trace       fake tensors on the GPU's own device type (``memory.trace``)
    trace-cpu   fake *cpu* tensors with CUDA emulated: what a head node without a GPU predicts
    measured    probe steps on the device (``memory.measured``)

Predicted reserved is the caching allocator's part (without the CUDA context and the workspace
allowance, which PyTorch's statistics do not see): the replay of the trace's allocation log
through the allocator model, or allocated x (1 + fragmentation) for ``static`` and ``measured``.
Goals: trace and measured within 3 % of true peak allocated; predicted reserved never under the
truth and at most 10 % over at the median; static never under.

``--truth`` needs no GPU: it predicts, with fake CPU tensors and CUDA emulated (the ``trace-cpu``
path), the H100 measurements in the JSON it names for the four models of ``GPU_ZOO``
that have them, under that file's own protocol (a fresh model, one batch of ``b`` made on the
GPU, three steps without accumulation, PyTorch's default allocator): peak allocated and reserved
per batch size, and the largest batch that fits its 24 GiB cap, from the allocator model under
that capacity and, for contrast, from peak reserved without one. It also prints the range of
safety margins that keeps the model's largest batch within [95 %, 100 %] of the true one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.zoo import GPU_ZOO, ZOOS, Entry, StepRunner, describe_bytes, initial_carry, relative  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU zoo and the CPU tracker, even on a GPU machine")
    parser.add_argument("--zoo", choices=sorted(ZOOS), help="which zoo (default: gpu on a GPU, else cpu; --list: all)")
    parser.add_argument("--models", help="comma-separated zoo names (default: all available)")
    parser.add_argument("--json", help="also write every row to this file")
    parser.add_argument("--allocator-conf", default=None,
                        help="PYTORCH_CUDA_ALLOC_CONF for the GPU run and the predictions ('' = PyTorch's default; "
                             "default: the orchestrator's)")
    parser.add_argument("--truth", metavar="JSON",
                        help="a ground-truth JSON written by gpu-truth/measure_zoo.py on a GPU machine, to predict "
                             "here (no GPU needed), e.g. $GPU_TRUTH/zoo_h100_default.json")
    parser.add_argument("--list", action="store_true",
                        help="only trace each model for a CUDA target and say whether it traced or why it fell back")
    args = parser.parse_args(argv)
    if args.list:
        return list_zoo([args.zoo] if args.zoo else list(ZOOS), args.models)

    from orchestrator.allocator_conf import DEFAULT_ALLOC_CONF, effective_allocator_conf
    from orchestrator.device import configure_allocator

    if args.truth:
        if not os.path.isfile(args.truth):
            parser.error(f"--truth {args.truth}: no such file; expected a ground-truth JSON written by "
                         "gpu-truth/measure_zoo.py (e.g. zoo_h100_default.json)")
        rows = compare_with_truth(args.truth, set(args.models.split(",")) if args.models else None)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    if args.allocator_conf is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.allocator_conf  # before CUDA initialises
    configure_allocator(DEFAULT_ALLOC_CONF)
    conf = effective_allocator_conf(DEFAULT_ALLOC_CONF)
    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    zoo = ZOOS[args.zoo or ("gpu" if on_gpu else "cpu")]
    wanted = set(args.models.split(",")) if args.models else None
    entries = [e for e in zoo if (wanted is None or e.name in wanted)]
    print(f"# estimator accuracy on {describe_machine(on_gpu)}; allocator: {conf or 'PyTorch default'}", flush=True)
    rows = []
    for entry in entries:
        if not entry.available():
            print(f"# {entry.name}: skipped, needs {', '.join(entry.needs)}", flush=True)
            continue
        rows += run_entry(entry, on_gpu, conf)
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


def run_entry(entry: Entry, on_gpu: bool, conf: str | None) -> list[dict]:
    import torch

    from orchestrator.allocator_conf import parse_alloc_conf
    from orchestrator.device import CpuDevice, CudaDevice
    from orchestrator.memory import Settings, estimate
    from orchestrator.memory.trace import trace_profile

    settings = Settings(entry.precision)
    target = "cuda" if on_gpu else "cpu"
    make_device = (lambda: CudaDevice(torch.cuda.current_device())) if on_gpu else CpuDevice
    profiles, seconds = {}, {}
    common = {"target": target, "allocator_conf": conf}
    estimators = {
        "static": lambda: estimate(entry.make(), "static", settings, **common),
        "trace": lambda: estimate(entry.make(), "trace", settings, **common),
        "measured": lambda: estimate(entry.make(), "measured", settings, device=make_device(), **common),
    }
    if on_gpu:
        estimators["trace-cpu"] = lambda: trace_profile(entry.make(), settings, target="cuda", fragmentation=0.10,
                                                        allocator=parse_alloc_conf(conf), trace_on="cpu")
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

    if on_gpu:
        readings = ((b, measure_trial(entry, b, make_device())) for b in entry.batches)
    else:
        runner = StepRunner(entry.make(), entry.precision, make_device())
        runner.train(entry.batches[0], micro_batches=1)  # warm-up: the optimizer's state exists from step 2 on
        readings = ((b, (runner.train(b), runner.eval(b))) for b in entry.batches)
    rows = []
    for b, (train, evaluation) in readings:
        for kind, reading in (("train", train), ("eval", evaluation)):
            row = {"model": entry.name, "b": b, "phase": kind, "true_allocated": reading.peak_allocated,
                   "true_reserved": reading.peak_reserved}
            for name, profile in profiles.items():
                phase = profile.phases_of(kind)[0]  # stage 0: the zoo models have no schedule
                if phase.sequence is not None:  # the allocator model: its replay of the same sequence
                    replay = phase.replay(b, micro_batch=b)
                    row[f"{name}_allocated"], row[f"{name}_reserved"] = replay.peak_allocated, replay.peak_reserved
                else:
                    row[f"{name}_allocated"] = phase.allocated_at(b)
                    row[f"{name}_reserved"] = phase.reserved_at(b) - phase.overhead
                row[f"{name}_seconds"] = seconds[name]
            rows.append(row)
            print_row(row, list(profiles), on_gpu)
    if on_gpu:
        torch.cuda.empty_cache()
    return rows


def measure_trial(entry: Entry, b: int, device):
    """The train and eval readings of a trial's sequence at micro-batch ``b``, run for real from a
    fresh model: moved to the device, two train steps of two micro-batches, then an eval step in
    the cache training left (the sequence the allocator model replays, ``memory.sequence``)."""
    import gc

    import torch

    from trainables.step import eval_step, make_grad_scaler, train_step
    from trainables.workload import optimizer_for, sample_batch

    gc.collect()
    torch.cuda.empty_cache()
    device.reset_peak()
    torch.manual_seed(0)
    workload, dev = entry.make(), device.torch_device
    model = workload.build_model().to(dev)
    optimizer = optimizer_for(workload, model, dev.type)
    scaler = make_grad_scaler(entry.precision, device)
    train_data, eval_data = workload.train_data(), workload.eval_data()
    model.train()
    for _ in range(2):
        batches = (sample_batch(workload, train_data, b) for _ in range(2))  # taken one at a time, as in the loop
        train_step(workload, model, optimizer, batches, [b, b], dev, entry.precision, scaler,
                   carry=initial_carry(workload, 2 * b, dev))
    torch.cuda.synchronize(dev)
    train = device.reading()
    device.reset_peak()
    model.eval()
    eval_step(workload, model, sample_batch(workload, eval_data, b), b, dev, entry.precision)
    torch.cuda.synchronize(dev)
    evaluation = device.reading()
    del model, optimizer, scaler
    return train, evaluation


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


# -- the H100 ground truth, predicted without a GPU ------------------------------------------------------

#: The ground truth's protocol (gpu-truth/measure_zoo.py): steps on one batch, no accumulation.
TRUTH_STEPS = 3
TRUTH_PROBES = (2, 16, 128)
GiB, MiB = 2**30, 2**20
#: cuBLAS workspaces the truth's allocator holds and a trace cannot see: PyTorch allocates one per
#: (cuBLAS handle, stream) from the caching allocator at the first matmul, 32 MiB on an H100
#: (sm90; 8 MiB + 128 KiB elsewhere), and backward runs on the autograd engine's own thread, whose
#: handle is another one. Only models that multiply matrices have them (not a pure conv net).
#: Plans budget them in their workspace allowance instead.
H100_CUBLAS_WORKSPACES = (32 * MiB, 32 * MiB)
CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "_scaled_mm"})


def compare_with_truth(path: str, wanted: set[str] | None) -> list[dict]:
    """Predict every measurement of the truth file for the zoo's models that have one; print a table."""
    import re

    from orchestrator.allocator_conf import AllocatorConfig

    with open(path) as f:
        truth = json.load(f)
    capacity = int(re.search(r"(\d+(?:\.\d+)?) GiB", truth["budget"]).group(1)) * GiB  # its per-process cap
    measured = {w["name"]: w for w in truth["workloads"]}
    config = AllocatorConfig()  # the truth ran PyTorch's default allocator
    print(f"# predicted on {describe_machine(False)} (fake CPU tensors, CUDA emulated, allocator model: "
          f"PyTorch default, with the H100's two 32 MiB cuBLAS workspaces) vs {truth['machine']}; "
          f"cap {capacity / GiB:g} GiB", flush=True)
    rows = []
    for entry in GPU_ZOO:
        if entry.truth not in measured or (wanted and not wanted & {entry.name, entry.truth}):
            continue
        if not entry.available():
            print(f"# {entry.name}: skipped, needs {', '.join(entry.needs)}", flush=True)
            continue
        started = time.perf_counter()
        log, cublas = truth_log(entry)
        seconds = time.perf_counter() - started
        if log is None:
            print(f"# {entry.name}: its allocations change with the batch size beyond their sizes; no prediction")
            continue
        held = H100_CUBLAS_WORKSPACES if cublas else ()
        print(f"# {entry.name}: {len(log)} allocator events per run, traced in {seconds:.1f}s; "
              f"{'matmuls: two 32 MiB cuBLAS workspaces' if cublas else 'no matmul: no cuBLAS workspace'}", flush=True)
        print(f"{'model':<18} {'b':>4}  {'allocated: true':>15} {'predicted':>10} {'err':>7}  "
              f"{'reserved: true':>14} {'predicted':>10} {'err':>7}  {'unpressured':>11}")
        for point in sorted(measured[entry.truth]["curve"], key=lambda p: p["b"]):
            # the truth was measured under its cap: the allocator freed its cache where it had to
            result = _truth_replay(log, config, point["b"], capacity, held)
            free = _truth_replay(log, config, point["b"], held=held)
            row = {"model": entry.name, "b": point["b"], "true_allocated": point["alloc"],
                   "true_reserved": point["reserved"], "predicted_allocated": result.peak_allocated,
                   "predicted_reserved": result.peak_reserved, "predicted_oom": not result.fits,
                   "unpressured_reserved": free.peak_reserved}
            rows.append(row)
            flag = " (out of memory)" if not result.fits else (" (cache flushed)" if result.retries else "")
            print(f"{entry.name:<18} {point['b']:>4}  {describe_bytes(point['alloc']):>15} "
                  f"{describe_bytes(result.peak_allocated):>10} {relative(result.peak_allocated, point['alloc']):>+7.1%}  "
                  f"{describe_bytes(point['reserved']):>14} {describe_bytes(result.peak_reserved):>10} "
                  f"{relative(result.peak_reserved, point['reserved']):>+7.1%}  "
                  f"{describe_bytes(free.peak_reserved):>11}{flag}", flush=True)
        true_max = measured[entry.truth]["max_b"]
        fits = lambda b, cap=capacity: _truth_replay(log, config, b, cap, held).fits  # noqa: E731
        modelled = _largest(fits)
        unpressured = _largest(lambda b: _truth_replay(log, config, b, held=held).peak_reserved <= capacity)
        low, high = _margins(fits, capacity, true_max)
        rows.append({"model": entry.name, "true_max_b": true_max, "predicted_max_b": modelled,
                     "unpressured_max_b": unpressured, "margin_low": low, "margin_high": high})
        span = f"[{low:.3f}, {high:.3f}]" if low is not None and high is not None and low <= high else \
            f"none (>= 95 % from {low}, <= 100 % up to {high})"
        print(f"{entry.name}: largest batch under {capacity / GiB:g} GiB: true {true_max}, allocator model {modelled} "
              f"({modelled / true_max:.0%}), unpressured peak reserved <= cap {unpressured} ({unpressured / true_max:.0%}); "
              f"allocator-capacity margins giving 95-100 % of the true batch: {span}", flush=True)
    return rows


def truth_log(entry: Entry):
    """The truth's protocol (a fresh model moved to the GPU, one batch of ``b`` made there, three
    steps) as an allocation log at every batch size, traced on fake CPU tensors at three batch
    sizes like the trace estimator (None when the logs are not affine in ``b``), and whether the
    steps multiply matrices (so that cuBLAS allocates its workspaces)."""
    import gc

    from orchestrator.memory.fake import Untraceable, fake_setup, running
    from orchestrator.memory.sequence import fit_log, states_in_creation_order
    from orchestrator.memory.trace import gc_paused
    from trainables.step import autocast
    from trainables.workload import to_device

    workload = entry.make()
    try:
        setup = fake_setup(workload, "cuda", trace_on="cpu")
    except Untraceable:  # an initialisation fake tensors cannot run (torchvision's ViT on torch 2.14)
        setup = _setup_from_real_model(workload)
    model, optimizer, device = setup.model, setup.optimizer, setup.device
    tracker, matmuls = setup.tracker(), _ops_seen_mode()
    logs = {}
    with running(setup), tracker, matmuls, gc_paused():
        for b in TRUTH_PROBES:
            optimizer.state.clear()  # a fresh optimizer per batch size, as the truth's
            gc.collect()
            tracker.record(states_in_creation_order(model))
            batch = to_device(setup.batch(b), device)
            for _ in range(TRUTH_STEPS):
                with autocast(entry.precision, device):
                    loss = workload.loss(model, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            del loss, batch
            logs[b] = tracker.stop_recording()
    b1, b2, b3 = TRUTH_PROBES
    cublas = bool(matmuls.seen & CUBLAS_OPS)
    fitted = fit_log(logs[b1], logs[b2], b1, b2)
    if fitted is None:
        print(f"# {entry.name}: logs at b={b1} and b={b2} differ at event {_first_difference(logs[b1], logs[b2])}")
        return None, cublas
    if fitted.events(b3) != logs[b3]:
        print(f"# {entry.name}: the log at b={b3} differs from the fit at event {_first_difference(fitted.events(b3), logs[b3])}")
        return None, cublas
    return fitted, cublas


def _ops_seen_mode():
    from orchestrator.device.torch_internals import TorchDispatchMode, op_schema

    class OpsSeen(TorchDispatchMode):
        """The names of the aten ops that ran (``aten.addmm.default`` -> ``addmm``)."""

        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(op_schema(func).name.split("::")[-1])
            return func(*args, **(kwargs or {}))

    return OpsSeen()


def _first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if (x < 0) != (y < 0) or (x < 0 and x != y)), min(len(a), len(b)))
    return f"{i} of {len(a)}/{len(b)}: {a[max(i - 2, 0):i + 3]} vs {b[max(i - 2, 0):i + 3]}"


def _setup_from_real_model(workload):
    """The fake setup of ``workload`` from a model built for real on the CPU, its parameters and
    buffers then made fake (same shapes, no data): for models whose initialisation reads values."""
    import torch
    from torch import nn

    from orchestrator.device.tensor_tracker import CUDA_BLOCK
    from orchestrator.device.torch_internals import FakeTensorMode, buffer_slots, parameter_slots
    from orchestrator.memory.fake import FakeSetup
    from orchestrator.memory.optimizer import build_for_target

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, fakes = workload.build_model(), {}
    for module in model.modules():
        parameters, buffers = parameter_slots(module), buffer_slots(module)
        for name, p in list(parameters.items()):
            if p is not None:
                parameters[name] = fakes.setdefault(id(p), nn.Parameter(mode.from_tensor(p.detach()), p.requires_grad))
        for name, b in list(buffers.items()):
            if b is not None:
                buffers[name] = mode.from_tensor(b)
    with mode:
        optimizer = build_for_target(workload, model, "cuda")  # as fake_setup builds it for a CUDA target
    return FakeSetup(mode, torch.device("cpu"), model, optimizer, workload, workload.largest_sample(), CUDA_BLOCK, True)


def _truth_replay(log, config, b: int, capacity: int | None = None, held: tuple[int, ...] = ()):
    """Replay the log at ``b``, after allocations ``held`` for good (the log is renumbered after them)."""
    from orchestrator.memory.allocator import replay

    events = [*held, *(e if e > 0 else ~(~e + len(held)) for e in log.events(b))]
    return replay(events, config, capacity)


def _largest(fits, start: int = 1, ceiling: int = 1 << 14) -> int:
    """The largest batch that fits: doubling, then bisection (memory grows with the batch)."""
    if not fits(start):
        return 0
    lo = start
    while lo * 2 <= ceiling and fits(lo * 2):
        lo *= 2
    hi = min(lo * 2, ceiling + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _margins(fits, capacity: int, true_max: int) -> tuple[float | None, float | None]:
    """The smallest share of the capacity at which the model's largest batch reaches 95 % of the
    true one, and the largest at which it stays within it (to 0.001; None: not in [0.5, 1.2])."""
    def largest_at(margin: float) -> int:
        return _largest(lambda b: fits(b, int(capacity * margin)))

    def edge(ok, rising: bool) -> float | None:
        """Where ``ok`` (monotone in the margin) flips, on the side where it holds."""
        lo, hi = 500, 1200
        if ok(lo / 1000) == rising and ok(hi / 1000) == rising:
            return lo / 1000 if rising else None
        if ok(lo / 1000) != rising and ok(hi / 1000) != rising:
            return None if rising else hi / 1000
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid / 1000) == rising:
                hi = mid
            else:
                lo = mid
        return (hi if rising else lo) / 1000

    target = -(-95 * true_max // 100)
    return edge(lambda m: largest_at(m) >= target, True), edge(lambda m: largest_at(m) <= true_max, False)


if __name__ == "__main__":
    raise SystemExit(main())
