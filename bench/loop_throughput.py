"""Does the orchestrator's training loop train as fast as a hand-written PyTorch loop?

    python bench/loop_throughput.py                      # CPU: num_workers 0 and 2, 5 interleaved repeats
    python bench/loop_throughput.py --device cuda        # a GPU: the CUDA device (allocator statistics only)
    python bench/loop_throughput.py --model lstm         # the stateful LSTM (truncated BPTT), CPU

Samples per second of the same model on the same data, three ways:

* ``plain``: a ``DataLoader(shuffle=True, drop_last=True)`` and an optimizer loop, written as
  one would by hand (forward, backward, step, zero_grad; the loss summed on the device);
* ``trainer``: ``trainables.loop.Trainer`` as a trial runs it, memory measurement on: on the
  CPU its device's tensor tracker is on for the whole run and counts the steps a trial samples
  (``orchestrator.device.cpu``: every op of those goes through it, their batches are admitted to
  it), on a GPU the CUDA device reads the allocator's statistics at milestones and nothing per op;
* ``trainer-untracked`` (CPU only): the same trainer without the tracker active, which splits
  the trainer's cost into the loop's own and the measurement's.

Each run trains ``--steps`` optimizer steps of ``--batch`` samples (one epoch, no
accumulation) and evaluates the eval set once at the end, timed from the first batch to the
end of that evaluation; model and data are built outside the timing. The dataset does real
per-sample work: every sample is a JPEG decoded with Pillow, then cropped, flipped, resized
and colour-jittered with torch ops (about 1 ms on one core). Runs are interleaved (the order
of the variants rotates every repeat) so that other work on the machine slows each alike; the
table gives the median per variant and the median of the per-repeat ratios trainer / plain.
The first use of a ``TorchDispatchMode`` in a process imports ``torch._dynamo``; that one-time
cost of a trial process on the CPU is measured apart, in fresh interpreters.

``--model lstm`` runs the stateful example instead (``trainables/examples/lstm_lm.py`` as
``configs/lstm_tbptt_cpu.yaml`` trains it: 32 streams, 16 tokens a step, 128 steps, clipping at
0.25, an evaluation every 32 steps) against the usual PyTorch TBPTT loop (``word_language_model``'s
shape: the stream batchified into 32 rows, walked 16 tokens at a time, the hidden state detached
between steps and reset each epoch; its evaluations over the same windows, each from zeros, as
the loop's eval is). Optimizer steps per second, the same interleaving and medians, and the two
loops' losses side by side (per step, from separate untimed runs with a report after every step).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from PIL import Image  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from orchestrator.config import DataLoading, Every, Stop  # noqa: E402
from orchestrator.device import open_device  # noqa: E402
from orchestrator.table import format_table  # noqa: E402
from trainables.cnn import SmallCNN  # noqa: E402
from trainables.examples.lstm_lm import LSTMLanguageModelWorkload  # noqa: E402
from trainables.loop import LoopPlan, LoopSettings, Trainer  # noqa: E402
from trainables.workload import Workload  # noqa: E402

STORED, CROP, SIDE = 96, 80, 48  # stored JPEG side, random crop side, side the model sees
CLASSES = 10


class JpegImages(Dataset):
    """JPEG-encoded images; each ``__getitem__`` decodes one and augments it (train) or not (eval)."""

    def __init__(self, count: int, augment: bool, seed: int):
        generator = torch.Generator().manual_seed(seed)
        patterns = F.interpolate(torch.randn(CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(0)),
                                 size=(STORED, STORED), mode="bicubic")
        self.labels = torch.randint(0, CLASSES, (count,), generator=generator).tolist()
        self.encoded = []
        for label in self.labels:
            pixels = (128 + 48 * patterns[label] + 40 * torch.randn(3, STORED, STORED, generator=generator)).clamp(0, 255)
            buffer = io.BytesIO()
            Image.fromarray(pixels.to(torch.uint8).permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=90)
            self.encoded.append(buffer.getvalue())
        self.augment = augment

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = torch.from_numpy(np.array(Image.open(io.BytesIO(self.encoded[index]), formats=["JPEG"]).convert("RGB")))
        image = image.permute(2, 0, 1).float().div_(255)
        if self.augment:
            top, left = torch.randint(0, STORED - CROP + 1, (2,)).tolist()
            image = image[:, top : top + CROP, left : left + CROP]
            if torch.rand(()) < 0.5:
                image = image.flip(2)
            jitter = 1 + 0.2 * (torch.rand(2) - 0.5)
            image = (image - image.mean()) * jitter[0] + image.mean() * jitter[1]
        image = F.interpolate(image.unsqueeze(0), size=(SIDE, SIDE), mode="bilinear", antialias=True).squeeze(0)
        return (image - 0.5) / 0.25, self.labels[index]


@functools.cache
def _dataset(count: int, augment: bool) -> JpegImages:
    return JpegImages(count, augment, seed=1 if augment else 2)


@dataclasses.dataclass
class JpegWorkload(Workload):
    """The bench's workload: the project's small CNN on the decoded images."""

    width: int = 16
    depth: int = 3
    train_samples: int = 1024
    eval_samples: int = 64

    def build_model(self):
        return SmallCNN(self.width, self.depth, CLASSES, 3)

    def train_data(self):
        return _dataset(self.train_samples, True)

    def eval_data(self):
        return _dataset(self.eval_samples, False)

    def loss(self, model, batch):
        images, labels = batch
        return F.cross_entropy(model(images), labels)


class Clock:
    """Wall seconds and CPU seconds of this process and its finished children (the DataLoader's
    workers, joined when their iterator ends): CPU time is what other work on the machine
    disturbs least."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), _cpu_seconds()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, _cpu_seconds() - self.cpu


def _cpu_seconds() -> float:
    """This process's CPU time from the kernel's clock (``os.times`` counts 10 ms ticks, 2-3 % of
    a 0.4 s run), plus its finished children's, which only ``os.times`` gives."""
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def run_plain(workload: JpegWorkload, batch: int, steps: int, workers: int, device: torch.device) -> tuple[float, float]:
    """(wall, CPU) seconds for ``steps`` steps and one eval pass, by hand."""
    torch.manual_seed(0)
    model = workload.build_model().to(device)
    optimizer = workload.build_optimizer(model)
    on_gpu = device.type == "cuda"
    train = DataLoader(workload.train_data(), batch_size=batch, shuffle=True, drop_last=True,
                       num_workers=workers, pin_memory=on_gpu)
    evaluate = DataLoader(workload.eval_data(), batch_size=batch, num_workers=workers, pin_memory=on_gpu)
    clock = Clock()
    clock.start()
    model.train()
    loss_sum = torch.zeros((), device=device)
    batches = iter(train)
    for _ in range(steps):
        images, labels = next(batches)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
    del batches
    model.eval()
    eval_sum = torch.zeros((), device=device)
    with torch.no_grad():
        for images, labels in evaluate:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            eval_sum += F.cross_entropy(model(images), labels, reduction="sum")
    loss_sum.item(), eval_sum.item()  # the loop reads both once at the end, too
    return clock.stop()


def run_trainer(
    workload: JpegWorkload, batch: int, steps: int, workers: int, device_kind: str, tracked: bool
) -> tuple[float, float]:
    """(wall, CPU) seconds for the same steps and eval pass through ``Trainer``, as a trial runs it."""
    device = open_device(device_kind)
    settings = LoopSettings(Stop(steps=steps), eval_every=Every("steps", 10**9), data=DataLoading(num_workers=workers))
    plan = LoopPlan(micro_batch=batch, effective_batch=batch, eval_batch=batch)
    measuring = device.measuring() if tracked else _Untracked()
    with measuring:
        trainer = Trainer(workload, device, plan, settings)
        clock = Clock()
        clock.start()
        milestones = list(trainer.run())  # to the end: the epoch's DataLoader iterator is closed
        elapsed = clock.stop()
    assert milestones[-1].final and milestones[-1].progress.step == steps
    return elapsed


class _Untracked:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _ratio(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def first_dispatch_mode_seconds(repeats: int) -> list[tuple[float, float]]:
    """(import of the tracker module, first tracked op) in fresh interpreters, in seconds."""
    code = (
        "import time, torch\n"
        "t0 = time.perf_counter()\n"
        "from orchestrator.device.tensor_tracker import StorageTracker\n"
        "t1 = time.perf_counter()\n"
        "with StorageTracker():\n"
        "    torch.ones(4) + 1\n"
        "t2 = time.perf_counter()\n"
        "print(t1 - t0, t2 - t1)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root).stdout
        module, first = map(float, out.split())
        results.append((module, first))
    return results


def per_sample_ms(samples: int = 256) -> float:
    data = _dataset(1024, True)
    started = time.perf_counter()
    for i in range(samples):
        data[i]
    return (time.perf_counter() - started) / samples * 1000


# -- the stateful LSTM: the trainer against a plain truncated-BPTT loop --------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TBPTT_CONFIG = os.path.join(ROOT, "configs", "lstm_tbptt_cpu.yaml")


@dataclasses.dataclass(frozen=True)
class Tbptt:
    """What both loops train: the workload, and the sweep's steps, streams, evaluations and clipping."""

    workload: LSTMLanguageModelWorkload
    streams: int  # the effective batch: parallel streams, the rows of every step
    steps: int
    eval_every: int  # steps
    max_grad_norm: float

    @classmethod
    def of_config(cls, path: str = TBPTT_CONFIG, lr: float | None = None, steps: int | None = None) -> Tbptt:
        """The sweep of ``path`` (its first learning rate, unless ``lr``), ``steps`` steps if given."""
        from orchestrator.config import load_spec

        spec = load_spec(path)
        assert spec.eval_every.unit == "steps" and spec.stop.steps, "a config that evaluates and stops in steps"
        lr = lr if lr is not None else spec.search_space["lr"].args[0][0]
        workload = LSTMLanguageModelWorkload(**spec.params, lr=lr)
        return cls(workload, spec.effective_batch_size, steps or spec.stop.steps, spec.eval_every.count,
                   spec.max_grad_norm)


def run_plain_tbptt(run: Tbptt, losses: list[float] | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of the usual PyTorch TBPTT loop over ``run``'s steps and evaluations;
    each step's loss is appended to ``losses`` (read with ``.item()``, as that loop does)."""
    workload, rows, bptt = run.workload, run.streams, run.workload.bptt
    torch.manual_seed(workload.seed)
    model = workload.build_model()
    optimizer = workload.build_optimizer(model)
    tokens = workload.tokens(workload.train_tokens, "train")
    steps_per_epoch = (len(tokens) - 1) // bptt // rows
    length = rows * steps_per_epoch * bptt
    inputs, targets = tokens[:length].view(rows, -1), tokens[1 : length + 1].view(rows, -1)  # batchify
    windows = workload.eval_data()
    eval_inputs = torch.stack([windows[i][0] for i in range(len(windows))])
    eval_targets = torch.stack([windows[i][1] for i in range(len(windows))])
    losses = [] if losses is None else losses
    clock = Clock()
    clock.start()
    model.train()
    for step in range(run.steps):
        i = step % steps_per_epoch * bptt
        if i == 0:
            hidden = workload.initial_state(rows)
        hidden = tuple(h.detach() for h in hidden)
        logits, hidden = model(inputs[:, i : i + bptt], hidden)
        loss = F.cross_entropy(logits.flatten(0, 1), targets[:, i : i + bptt].flatten())
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % run.eval_every == 0 or step + 1 == run.steps:
            model.eval()
            total = 0.0
            with torch.no_grad():
                for start in range(0, len(eval_inputs), rows):
                    x, y = eval_inputs[start : start + rows], eval_targets[start : start + rows]
                    logits, _ = model(x, workload.initial_state(len(x)))
                    total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item() / bptt
            model.train()
    return clock.stop()


def run_trainer_tbptt(run: Tbptt, tracked: bool, every_step: bool = False) -> tuple[tuple[float, float], list]:
    """(wall, CPU) seconds of the same through ``Trainer`` on the CPU device, and its milestones
    (``every_step``: a milestone, so a train loss, after every step)."""
    device = open_device("cpu")
    settings = LoopSettings(Stop(steps=run.steps), eval_every=Every("steps", run.eval_every),
                            checkpoint_every=Every("steps", 1) if every_step else None,
                            max_grad_norm=run.max_grad_norm)
    plan = LoopPlan(micro_batch=run.streams, effective_batch=run.streams, eval_batch=run.streams)
    with device.measuring() if tracked else _Untracked():
        trainer = Trainer(run.workload, device, plan, settings)
        clock = Clock()
        clock.start()
        milestones = list(trainer.run())
        elapsed = clock.stop()
    assert milestones[-1].final and milestones[-1].progress.step == run.steps
    return elapsed, milestones


def tbptt_losses(run: Tbptt) -> tuple[list[float], list[float]]:
    """Each step's train loss, from the plain loop and from the trainer (untimed)."""
    plain: list[float] = []
    run_plain_tbptt(run, plain)
    _, milestones = run_trainer_tbptt(run, tracked=False, every_step=True)
    return plain, [m.train_loss for m in milestones]


def main_lstm(args) -> int:
    run = Tbptt.of_config(steps=args.steps)
    variants = {
        "plain TBPTT": lambda: run_plain_tbptt(run),
        "trainer": lambda: run_trainer_tbptt(run, tracked=True)[0],
        "trainer-untracked": lambda: run_trainer_tbptt(run, tracked=False)[0],
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    w = run.workload
    print(f"{os.path.relpath(TBPTT_CONFIG, ROOT)}: LSTM {w.layers}x{w.hidden}, vocab {w.vocab}, lr {w.lr}; "
          f"{run.streams} streams x {w.bptt} tokens a step, {run.steps} steps, an evaluation every {run.eval_every} "
          f"steps ({len(w.eval_data())} windows), clipping at {run.max_grad_norm}")
    for variant in variants.values():  # warm-up: thread pools, the token streams, the allocator
        variant()
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for repeat in range(args.repeats):
        names = list(variants)
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            timings[name].append(variants[name]())
    print(f"\n{args.repeats} interleaved repeats. steps/s: optimizer steps / wall time of the run (evaluations "
          f"included); ratio: the variant's steps/s over plain TBPTT's in the same repeat, median (min-max)\n")
    plain = timings["plain TBPTT"]
    rows = []
    for name, runs in timings.items():
        rates = [run.steps / wall for wall, _ in runs]
        rows.append([
            name, f"{statistics.median(rates):.1f}", f"{min(rates):.1f}-{max(rates):.1f}",
            "" if name == "plain TBPTT" else _ratio([p[0] / r[0] for p, r in zip(plain, runs)]),
            f"{statistics.median(r[1] for r in runs) / run.steps * 1000:.2f}",
            "" if name == "plain TBPTT" else _ratio([p[1] / r[1] for p, r in zip(plain, runs)]),
        ])
    print(format_table(["loop", "steps/s", "min-max", "ratio (wall)", "CPU ms/step", "ratio (CPU)"], rows))
    plain_losses, trainer_losses = tbptt_losses(run)
    shown = [*range(4), *range(run.steps - 2, run.steps)]
    print("\ntrain loss per step, both loops:\n")
    print(format_table(["step", "plain TBPTT", "trainer", "difference"], [
        [i + 1, f"{plain_losses[i]:.6f}", f"{trainer_losses[i]:.6f}", f"{trainer_losses[i] - plain_losses[i]:+.1e}"]
        for i in shown
    ]))
    print(f"largest difference over all {run.steps} steps: "
          f"{max(abs(a - b) for a, b in zip(plain_losses, trainer_losses)):.1e}")
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": {k: [list(r) for r in v] for k, v in timings.items()},
                       "losses": {"plain": plain_losses, "trainer": trainer_losses}}, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("cnn", "lstm"), default="cnn",
                        help="cnn: the JPEG images (default); lstm: the stateful LSTM of configs/lstm_tbptt_cpu.yaml")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="default: 30 (cnn), the config's (lstm)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in the training process")
    parser.add_argument("--json", help="write the raw timings here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "lstm":
        if args.device != "cpu":
            parser.error("--model lstm: the comparison runs on the CPU")
        return main_lstm(args)
    args.steps = args.steps or 30
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: PyTorch sees no GPU here")

    workload = JpegWorkload(train_samples=args.steps * args.batch)
    workload.train_data(), workload.eval_data()  # encoded once, outside every timing
    variants = {"plain": lambda w: run_plain(workload, args.batch, args.steps, w, torch.device(args.device))}
    variants["trainer"] = lambda w: run_trainer(workload, args.batch, args.steps, w, args.device, tracked=True)
    if args.device == "cpu":
        variants["trainer-untracked"] = lambda w: run_trainer(workload, args.batch, args.steps, w, "cpu", tracked=False)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, device {args.device}; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"per-sample data work: {per_sample_ms():.2f} ms (decode + augment, one process)")
    cold = first_dispatch_mode_seconds(3)
    print("first TorchDispatchMode in a fresh process (imports torch._dynamo): "
          + ", ".join(f"{first:.2f} s" for _, first in cold) + f" (tracker module import: {cold[0][0]:.2f} s)")

    timings: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for workers in args.workers:
        for run in variants.values():  # warm-up: thread pools, first worker fork, allocator
            run(workers)
        for repeat in range(args.repeats):
            names = list(variants)
            names = names[repeat % len(names):] + names[: repeat % len(names)]
            for name in names:
                timings.setdefault((name, workers), []).append(variants[name](workers))

    samples = args.steps * args.batch + len(workload.eval_data())
    print(f"\n{args.steps} steps x {args.batch} samples + eval of {len(workload.eval_data())}, "
          f"{args.repeats} interleaved repeats. samples/s: (train + eval samples) / wall time of the run;"
          f" CPU ms/sample: CPU time of the process and its DataLoader workers per sample; ratios: plain's"
          f" time / the variant's, per repeat, median (min-max)\n")
    headers = ["num_workers", "variant", "samples/s", "min-max", "ratio (wall)", "CPU ms/sample", "ratio (CPU)"]
    rows, summary = [], {}
    for workers in args.workers:
        plain = timings[("plain", workers)]
        for name in variants:
            runs = timings[(name, workers)]
            rates = [samples / wall for wall, _ in runs]
            wall_ratios = [p[0] / r[0] for p, r in zip(plain, runs)]  # same repeat, same load
            cpu_ratios = [p[1] / r[1] for p, r in zip(plain, runs)]
            summary[f"{name}@{workers}"] = {"wall_s": [r[0] for r in runs], "cpu_s": [r[1] for r in runs]}
            rows.append([
                workers, name, f"{statistics.median(rates):.0f}", f"{min(rates):.0f}-{max(rates):.0f}",
                "" if name == "plain" else _ratio(wall_ratios),
                f"{statistics.median(r[1] for r in runs) / samples * 1000:.2f}",
                "" if name == "plain" else _ratio(cpu_ratios),
            ])
    print(format_table(headers, rows))
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cold_dispatch_mode_s": cold, "results": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
