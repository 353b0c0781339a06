"""Every GPU measurement ``bench/RESULTS.md`` lists as pending, in one command, for one lent GPU.

A GPU is lent rarely and for minutes, so this runs the whole list within 25 minutes, each
measurement a subprocess with its own timeout (one failure or hang does not sink the rest),
prints one table, and writes each measurement's output and a ``results.json`` to the folder
given on the command line:

    python bench/gpu_acceptance.py OUT_DIR            # on the GPU machine, from the project root
    python bench/gpu_acceptance.py --dry-run          # anywhere: what it would run; checks it imports

The GPU machine has torch, torchvision, transformers and timm but no Ray and no MLflow, and no
package registry: the sweeps need ``../shared/gpu/pack.sh .gpu-pkgs`` run here first (see
``../shared/gpu/README.md``) and ``.gpu-pkgs`` carried to the machine; this script unpacks it and
puts it on each measurement's ``PYTHONPATH``. The measurements:

* the estimator against the truth on the GPU zoo and the library zoo, under the project's
  allocator setting (``expandable_segments:True``) and PyTorch's default
  (``estimator_accuracy.py``), and the planned micro-batch against the true largest batch found
  by bisection on the device under a 24 GiB per-process cap, both settings (``batch_pick.py``);
* the demo sweep on CUDA with ``resources.gpu: auto`` (several trials packed on the one GPU),
  and the same sweep with no estimate and an eighth of the GPU per trial, so trials start at the
  full batch and meet real CUDA OOMs under that per-process memory fraction, and shrink;
* plan verification on real kernels (issue 24 item 1), where the config has ``memory.verify``;
* the driver's estimates leave it with no CUDA context (a one-signature sweep's trace is a
  spawned process's);
* a reused worker's memory: ``torch.cuda.memory_allocated`` back to its baseline after each of
  several trials run in one process (issue 25);
* a 2-rank NCCL trial where the machine has two GPUs (skipped, saying so, on one).

``scripts/test.sh`` runs ``--dry-run`` so that the list cannot rot while no GPU is around.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOTAL_SECONDS = 25 * 60
PACK = ROOT / ".gpu-pkgs" / "site.tar.xz"
PY = sys.executable
LIBRARY_PICK = "convnext,vit,resnet18,bert,gpt2,nn_encoder,lstm,unet"
SWEEP = "configs/gpu_sweep.yaml"
DEFAULT_CONF = "expandable_segments:False"  # PyTorch's own allocator setting


@dataclass
class Measurement:
    """One subprocess: its command, its time limit, and why it cannot run here (None: it can)."""

    name: str
    what: str
    command: list[str]
    timeout: int
    env: dict[str, str] = field(default_factory=dict)
    blocked: str | None = None


def measurements(out: Path, gpus: int) -> list[Measurement]:
    """The pending GPU measurements of bench/RESULTS.md, in the order they run."""
    sweep_args = ["--num-gpus", "1", "--set", f"storage_path={out / 'sweeps'}"]
    verify = _has_verify()
    return [
        Measurement("accuracy_gpu_zoo_expandable", "estimator vs truth, GPU zoo, expandable_segments:True",
                    [PY, "bench/estimator_accuracy.py", "--json", str(out / "accuracy_gpu_expandable.json")], 150),
        Measurement("accuracy_gpu_zoo_default", "estimator vs truth, GPU zoo, default allocator",
                    [PY, "bench/estimator_accuracy.py", "--allocator-conf", "", "--json",
                     str(out / "accuracy_gpu_default.json")], 150),
        Measurement("accuracy_library_expandable", "estimator vs truth, library zoo, expandable_segments:True",
                    [PY, "bench/estimator_accuracy.py", "--zoo", "library", "--json",
                     str(out / "accuracy_library_expandable.json")], 150),
        Measurement("accuracy_library_default", "estimator vs truth, library zoo, default allocator",
                    [PY, "bench/estimator_accuracy.py", "--zoo", "library", "--json",
                     str(out / "accuracy_library_default.json")], 150, env={"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_CONF}),
        Measurement("largest_batch_expandable", "planned vs true largest batch (bisection, 24 GiB cap), expandable",
                    [PY, "bench/batch_pick.py", "--budget", "24GiB", "--steps", "5", "--models", LIBRARY_PICK], 180),
        Measurement("largest_batch_default", "planned vs true largest batch (bisection, 24 GiB cap), default",
                    [PY, "bench/batch_pick.py", "--budget", "24GiB", "--steps", "5", "--models", LIBRARY_PICK], 180,
                    env={"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_CONF}),
        Measurement("sweep_packed", "demo sweep on CUDA, trials packed on one GPU by resources.gpu: auto",
                    [PY, "-m", "orchestrator", "run", SWEEP, *sweep_args, "--set", "stop.epochs=1"], 150),
        # an eighth of the card each: a per-process memory fraction that batch 64 overflows for real
        Measurement("sweep_oom", "the same sweep, no estimate, 1/8 GPU each: real CUDA OOMs at the memory cap",
                    [PY, "-m", "orchestrator", "run", SWEEP, *sweep_args, "--set", "stop.epochs=1",
                     "--set", "memory.estimator=none", "--set", "resources.gpu=0.125",
                     "--set", "experiment=gpu_sweep_oom"], 150),
        Measurement("plan_verification", "plan verification on real kernels (issue 24 item 1)",
                    [PY, "-m", "orchestrator", "run", SWEEP, *sweep_args, "--set", "stop.epochs=1",
                     "--set", "memory.verify=true", "--set", "experiment=gpu_sweep_verify"], 120,
                    blocked=None if verify else "needs plan verification (issue 24 item 1): no memory.verify in the config"),
        Measurement("driver_off_the_gpu", "the driver's estimates (one signature) leave it with no CUDA context",
                    [PY, __file__, "--step", "driver_off_the_gpu"], 90),
        Measurement("reused_worker_memory", "memory_allocated back to baseline between reused trials (issue 25)",
                    [PY, __file__, "--step", "reused_worker_memory"], 60),
        Measurement("nccl_two_ranks", "a 2-rank NCCL trial, one rank per GPU",
                    [PY, "bench/ddp_oom.py", "--device", "cuda", "--num-gpus", "2", "--workload", "bench.zoo:ResNet50",
                     "--params", '{"optimizer": "sgd"}', "--effective-batch", "1024", "--samples", "4096", "--epochs", "1"],
                    180, blocked=None if gpus >= 2 else f"skipped: needs 2 GPUs, this machine has {gpus}"),
    ]


def _has_verify() -> bool:
    import dataclasses

    from orchestrator.config import MemoryPolicy

    return any(f.name == "verify" for f in dataclasses.fields(MemoryPolicy))


def _site(dest: Path) -> str | None:
    """The packed Ray/MLflow site folder (``../shared/gpu/pack.sh``), unpacked; None without a pack."""
    if not PACK.exists():
        return None
    site = dest / "site"
    if not site.exists():
        with tarfile.open(PACK) as archive:
            archive.extractall(site, filter="data")
    return str(site)


def run(m: Measurement, out: Path, site: str | None, seconds: int) -> dict:
    if m.blocked:
        return {"name": m.name, "status": "skipped", "seconds": 0, "summary": m.blocked}
    path = os.pathsep.join(p for p in (site, str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "MLFLOW_DISABLE_TELEMETRY": "true", "RAY_USAGE_STATS_ENABLED": "0", **m.env}
    log = out / f"{m.name}.log"
    started = time.monotonic()
    with open(log, "w") as f:
        f.write("$ " + " ".join(m.command) + "\n")
        f.flush()
        try:
            done = subprocess.run(m.command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=seconds)
            status = "ok" if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timeout {seconds}s"
    lines = [line for line in log.read_text().splitlines()[1:] if line.strip()]
    return {"name": m.name, "status": status, "seconds": round(time.monotonic() - started, 1),
            "summary": lines[-1][:100] if lines else "", "log": str(log)}


def reused_worker_memory() -> int:
    """Three trials in one process, as a reused worker runs them: after each, and the release a
    reused worker makes before the next, the allocated memory is back at the baseline."""
    import torch

    from bench.zoo import ResNet
    from orchestrator.device import open_device
    from orchestrator.device.oom import release

    device = open_device("cuda")
    baseline = torch.cuda.memory_allocated()
    left = []
    for trial in range(3):
        from bench.zoo import StepRunner

        runner = StepRunner(ResNet(), "bf16", device)
        runner.train(16)
        del runner
        release()
        left.append(torch.cuda.memory_allocated() - baseline)
        print(f"trial {trial}: allocated {left[-1]} bytes above the baseline after release", flush=True)
    print("back to baseline after every trial" if not any(left) else f"LEAK: {left}")
    return 0 if not any(left) else 1


def driver_off_the_gpu() -> int:
    """The driver's estimates of a one-signature GPU sweep, as ``run`` makes them: a trace on the
    GPU makes its process a CUDA context, so it must be a spawned process's, never the driver's
    (whose context would hold GPU memory the trials plan with for the whole sweep)."""
    import torch

    from orchestrator.config import load_spec
    from orchestrator.runner import estimate_before_start

    spec = load_spec(str(ROOT / SWEEP), ["search_space.workload={grid: [bench.zoo:Conv1d]}"])
    estimates = estimate_before_start(spec)
    held = torch.cuda.is_initialized()
    print(f"{len(estimates.by_signature)} estimate(s) for {estimates.target}; the driver "
          f"{'HOLDS a CUDA context' if held else 'holds no CUDA context'}", flush=True)
    return 0 if estimates.by_signature and estimates.target == "cuda" and not held else 1


def dry_run(plan: list[Measurement]) -> int:
    """List each measurement and its command; import everything they import; check the sweep's
    overrides against the config schema. Exit 0 when all of that holds."""
    import importlib

    from orchestrator.config import load_spec

    problems = []
    for module in ("bench.estimator_accuracy", "bench.batch_pick", "bench.ddp_oom", "bench.zoo", "orchestrator.cli",
                   "orchestrator.device.cuda", "orchestrator.device.oom", "orchestrator.runner"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - reported, the dry run fails
            problems.append(f"import {module}: {exc}")
    for m in plan:
        if "orchestrator" in m.command and "run" in m.command and not m.blocked:
            overrides = [m.command[i + 1] for i, word in enumerate(m.command) if word == "--set"]
            try:
                load_spec(str(ROOT / SWEEP), overrides)
            except BaseException as exc:  # noqa: BLE001 - a UserError or SystemExit: reported
                problems.append(f"{m.name}: {SWEEP} with {overrides}: {exc}")
        status = m.blocked or "runs"
        print(f"{m.name} ({m.timeout}s): {m.what}\n    {status}\n    $ {' '.join(m.command)}")
    print(f"pack: {PACK.relative_to(ROOT)} {'found' if PACK.exists() else 'missing (run ../shared/gpu/pack.sh .gpu-pkgs here)'}")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", help="folder for each measurement's log and results.json")
    parser.add_argument("--dry-run", action="store_true", help="list the measurements and check that they import")
    parser.add_argument("--only", help="comma-separated measurement names")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # a measurement this script makes itself
    args = parser.parse_args(argv)
    if args.step:
        return {"reused_worker_memory": reused_worker_memory, "driver_off_the_gpu": driver_off_the_gpu}[args.step]()
    import torch

    gpus = torch.cuda.device_count()
    if args.out is None and not args.dry_run:
        parser.error("give the folder for the details (or --dry-run)")
    out = Path(args.out).resolve() if args.out else Path("OUT")
    plan = measurements(out, gpus)
    if args.only:
        plan = [m for m in plan if m.name in args.only.split(",")]
    if args.dry_run:
        return dry_run(plan)
    if gpus == 0:
        print("error: no CUDA GPU here; --dry-run lists what would run", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    site = _site(out)
    if site is None:
        print(f"note: no {PACK.relative_to(ROOT)}: the sweeps need Ray and MLflow (../shared/gpu/pack.sh .gpu-pkgs)")
    deadline = time.monotonic() + TOTAL_SECONDS
    results = []
    for m in plan:
        left = int(deadline - time.monotonic())
        if left < 10 and not m.blocked:
            results.append({"name": m.name, "status": "skipped", "seconds": 0, "summary": "out of the 25 minutes"})
            continue
        results.append(run(m, out, site, min(m.timeout, left)))
        print(f"{results[-1]['name']}: {results[-1]['status']} ({results[-1]['seconds']}s)", flush=True)
    (out / "results.json").write_text(json.dumps({"gpus": gpus, "device": torch.cuda.get_device_name(0),
                                                  "results": results}, indent=2))
    from orchestrator.table import format_table

    print(format_table(["measurement", "status", "s", "last line"],
                       [[r["name"], r["status"], r["seconds"], r["summary"]] for r in results]))
    print(f"details: {out}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
