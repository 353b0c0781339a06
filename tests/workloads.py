"""Workloads that exist to put memory under pressure (or fail) in tests (importable by Ray workers as
``tests.workloads:Name``: the runner puts the working directory on the workers' path)."""

import dataclasses
import os
import signal
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from trainables.cnn import CNNWorkload
from trainables.examples.lstm_lm import LSTMLanguageModelWorkload
from trainables.mlp import MLPWorkload
from trainables.workload import Workload


@dataclasses.dataclass
class HeavyEvalWorkload(MLPWorkload):
    """Validation averages over ``views`` noisy copies of each sample (test-time augmentation),
    so its footprint is larger than training's: the third user story's 'training fit,
    validation OOM'd'."""

    views: int = 32

    def loss(self, model, batch):
        x, y = batch
        if model.training:
            return F.cross_entropy(model(x), y)
        copies = x.unsqueeze(1) + 0.01 * x.new_ones(1, self.views, 1)  # (b, views, features)
        logits = model(copies).mean(dim=1)
        return F.cross_entropy(logits, y)


@dataclasses.dataclass
class HiddenScratchWorkload(MLPWorkload):
    """Its training loss makes a scratch buffer of ``scratch`` floats a sample on real tensors
    only: the trace cannot see it, so the plan's estimate is short and the trial runs out of memory."""

    scratch: int = 4096

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        if model.training and not isinstance(x, torch._subclasses.FakeTensor):
            logits = logits + 0 * x.new_ones(x.shape[0], self.scratch).mean(dim=1, keepdim=True)
        return F.cross_entropy(logits, y)


#: Set by :class:`DiesOnOomWorkload` when a training step of this process ran out of memory.
_TRAIN_OOM_IN_THIS_PROCESS = False


@dataclasses.dataclass
class DiesOnOomWorkload(CNNWorkload):
    """A CNN whose worker dies while recovering from an out-of-memory error in training, as one
    does when a CUDA OOM left its context unusable: it dies building the next attempt's model.
    The trial wrote the OOM event down before it started the recovery, which is the evidence that
    this death was about memory, so Tune's restart shrinks the plan. Eval OOMs are recovered in
    the same process."""

    def build_model(self):
        if _TRAIN_OOM_IN_THIS_PROCESS:
            os._exit(1)
        return super().build_model()

    def loss(self, model, batch):
        global _TRAIN_OOM_IN_THIS_PROCESS
        try:
            return super().loss(model, batch)
        except torch.OutOfMemoryError:
            _TRAIN_OOM_IN_THIS_PROCESS = _TRAIN_OOM_IN_THIS_PROCESS or model.training
            raise


@dataclasses.dataclass
class NeedsALibraryWorkload(MLPWorkload):
    """A model built with a library this environment lacks."""

    def build_model(self):
        from transformers_of_nowhere import AutoModel  # noqa: F401 - never installed

        return super().build_model()


@dataclasses.dataclass
class BuggyWorkload(MLPWorkload):
    """A model with a bug that no retry fixes; every attempt to train it leaves a line in
    ``attempts_file`` (counted where a trial builds its optimizer: the pre-flight and the
    estimators build the model, and are no attempt)."""

    attempts_file: str = ""

    def build_optimizer(self, model):
        if self.attempts_file:
            with open(self.attempts_file, "a") as f:
                f.write("attempt\n")
        return super().build_optimizer(model)

    def loss(self, model, batch):
        raise ValueError("mat1 and mat2 shapes cannot be multiplied (64x32 and 31x16)")


@dataclasses.dataclass
class PredictionMaskedWorkload(MLPWorkload):
    """A loss over the samples the model predicts a class for: its shape depends on the model's
    output, which no estimate knows before the step runs, so the trace falls back."""

    def loss(self, model, batch):
        x, y = batch
        logits = model(x)
        keep = torch.nonzero(logits.argmax(-1) >= 0).squeeze(1)
        return F.cross_entropy(logits[keep], y[keep])


@dataclasses.dataclass
class ValueInitWorkload(MLPWorkload):
    """A model that reads a value of its own weights as it is built (a norm to rescale them by):
    it builds on a device, not on ``meta``, where a tensor has no values."""

    def build_model(self):
        model = super().build_model()
        scale = next(model.parameters()).norm().item()
        with torch.no_grad():
            for p in model.parameters():
                p.div_(scale)
        return model


@dataclasses.dataclass
class ScoredWorkload(MLPWorkload):
    """Reports accuracy next to the loss, from one forward pass, for sweeps tuned on accuracy."""

    metrics = ("loss", "accuracy")

    def eval_metrics(self, model, batch, samples):
        x, y = batch
        logits = model(x)
        return {"loss": F.cross_entropy(logits, y, reduction="sum"), "accuracy": (logits.argmax(-1) == y).sum()}


@dataclasses.dataclass
class DiesOnceWorkload(MLPWorkload):
    """Its worker process dies once, at the ``die_at_call``-th micro-batch of the first attempt (a node
    lost, a process killed); every training micro-batch leaves a line in ``calls_file``."""

    calls_file: str = ""
    die_at_call: int = 0

    def loss(self, model, batch):
        if model.training:
            with open(self.calls_file, "a") as f:
                f.write("call\n")
            marker = self.calls_file + ".died"
            if not os.path.exists(marker) and open(self.calls_file).read().count("call") == self.die_at_call:
                open(marker, "w").close()
                os._exit(1)
        return super().loss(model, batch)


@dataclasses.dataclass
class GroupedMLPWorkload(MLPWorkload):
    """An MLP whose layers split into groups of 8 units: a width that is no multiple of 8 is a
    mistake its constructor reports, as a user's model does."""

    def build_model(self):
        if self.width % 8:
            raise ValueError(f"width must be a multiple of 8, got {self.width}")
        return super().build_model()


@dataclasses.dataclass
class RankDiesOnceWorkload(MLPWorkload):
    """In a data-parallel trial, rank ``die_on_rank``'s process dies once, at its ``die_at_call``-th
    training micro-batch (a node lost, a process killed); each rank's training micro-batches leave
    lines in ``calls_file`` + ``.rank<r>``."""

    calls_file: str = ""
    die_at_call: int = 0
    die_on_rank: int = 1

    def loss(self, model, batch):
        if model.training:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            calls = f"{self.calls_file}.rank{rank}"
            with open(calls, "a") as f:
                f.write("call\n")
            marker = self.calls_file + ".died"
            if rank == self.die_on_rank and not os.path.exists(marker) and open(calls).read().count("call") == self.die_at_call:
                open(marker, "w").close()
                os._exit(1)
        return super().loss(model, batch)


class _LosesItsWorker(torch.utils.data.Dataset):
    """A training set that, read in a DataLoader worker, fails once (``marker`` says it did) at
    its ``at``-th sample: the worker SIGKILLs itself (the kernel's OOM killer), or bounds its
    address space near what it holds and then needs more (a real ``MemoryError`` in the worker)."""

    def __init__(self, inner, how: str, marker: str, at: int):
        self.inner, self.how, self.marker, self.at, self.fetched = inner, how, marker, at, 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None and not os.path.exists(self.marker):
            self.fetched += 1
            if self.fetched == self.at:
                open(self.marker, "w").close()
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                import resource

                with open("/proc/self/status") as status:
                    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
                resource.setrlimit(resource.RLIMIT_AS, (size + (16 << 20), resource.RLIM_INFINITY))
                bytearray(256 << 20)  # the data this sample needs: more than the bound leaves
        return self.inner[index]


@dataclasses.dataclass
class RankLosesLoaderWorkerWorkload(MLPWorkload):
    """In a data-parallel trial, one of rank ``on_rank``'s DataLoader workers is lost once, at its
    ``at``-th training sample (``_LosesItsWorker``); ``marker``: the file that says it was."""

    on_rank: int = 1
    how: str = "rlimit"  # kill | rlimit
    marker: str = ""
    at: int = 100

    def train_data(self):
        import torch.distributed as dist

        data = super().train_data()
        rank = dist.get_rank() if dist.is_initialized() else 0  # built by each rank once its group is up
        return _LosesItsWorker(data, self.how, self.marker, self.at) if rank == self.on_rank else data


@dataclasses.dataclass
class RankBuggyWorkload(MLPWorkload):
    """A model whose construction fails on one rank only (a bug behind ``if rank == 1``, a
    library missing on one node): the others must not wait for it."""

    buggy_rank: int = 1

    def build_model(self):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == self.buggy_rank:
            raise ValueError(f"no such layer on rank {self.buggy_rank}")
        return super().build_model()


@dataclasses.dataclass
class BrokenCollateWorkload(MLPWorkload):
    """A ``collate`` with a bug: it fails on every batch, wherever it runs."""

    def collate(self, samples):
        features = torch.stack([x for x, _ in samples])
        return features, torch.tensor([y for _, y in samples]).view(len(samples), -1, 2)


#: Models built by this process (a rank's actor serves one attempt of one trial).
_BUILDS_IN_THIS_PROCESS = 0


@dataclasses.dataclass
class RankDiesOnOomWorkload(MLPWorkload):
    """In a data-parallel trial, rank ``die_on_rank``'s process dies while the group recovers from an
    out-of-memory error, as one does when a CUDA OOM left its context unusable: it dies building
    the next attempt's model (its second build in one process is always a recovery's)."""

    die_on_rank: int = 1

    def build_model(self):
        import torch.distributed as dist

        global _BUILDS_IN_THIS_PROCESS
        _BUILDS_IN_THIS_PROCESS += 1
        if _BUILDS_IN_THIS_PROCESS > 1 and dist.is_initialized() and dist.get_rank() == self.die_on_rank:
            os._exit(1)
        return super().build_model()


@dataclasses.dataclass
class LossFailsWorkload(MLPWorkload):
    """Its model builds and its data is fine; its loss fails, which only running a step (the
    driver's estimate, a trial) finds."""

    def loss(self, model, batch):
        raise ValueError("the loss is broken")


class _Scalar(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x.sum(dim=1) * 0 + self.w


@dataclasses.dataclass
class PlateauWorkload(Workload):
    """One weight ``w`` trained toward 1 under an L1 loss by plain SGD: at lr 0.25 it moves exactly
    0.25 a step, so the eval loss ``|w - 1|`` falls 0.75, 0.5, 0.25, 0 and then stops improving;
    ``ReduceLROnPlateau`` (patience 0) divides the lr by 4 at each evaluation after that. From
    epoch ``heavy_from_epoch`` on, each training micro-batch also holds ``views`` copies of its
    samples, so a small emulated device runs out of memory there and a smaller micro-batch fits
    (every sample is the same, so the update does not change)."""

    lr: float = 0.25
    optimizer: Literal["sgd"] = "sgd"
    samples: int = 24
    features: int = 64
    views: int = 0
    heavy_from_epoch: int = 1

    def __post_init__(self):
        self.epoch = 0

    def build_model(self):
        return _Scalar()

    def build_optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.lr)

    def build_scheduler(self, optimizer, total_steps):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.25, patience=0)

    def train_data(self):
        return TensorDataset(torch.zeros(self.samples, self.features))

    def eval_data(self):
        return self.train_data()

    def set_epoch(self, model, epoch):
        self.epoch = epoch

    def loss(self, model, batch):
        (x,) = batch
        out = model(x)
        if model.training and self.views and self.epoch >= self.heavy_from_epoch:
            copies = x.unsqueeze(1).expand(-1, self.views, -1) * 1.0  # (b, views, features), held to the end
            out = out + copies.sum(dim=(1, 2)) * 0
        return (out - 1).abs().mean()


@dataclasses.dataclass
class NanLossWorkload(MLPWorkload):
    """Its loss becomes NaN from optimizer step ``nan_at_step`` on (counted from 1 by the trainer's
    own optimizer: the estimators' steps and accumulation do not move it); with ``infinite_gradient``
    the loss stays finite from there and its gradient is infinite instead; in a data-parallel trial,
    on rank ``nan_on_rank`` only (-1: every rank)."""

    nan_at_step: int = 3
    infinite_gradient: bool = False
    nan_on_rank: int = -1

    def build_optimizer(self, model):
        optimizer = super().build_optimizer(model)
        self._steps_done = 0

        def count(*_):
            self._steps_done += 1

        optimizer.register_step_post_hook(count)
        return optimizer

    def loss(self, model, batch):
        loss = super().loss(model, batch)
        if not model.training or getattr(self, "_steps_done", 0) + 1 < self.nan_at_step:
            return loss
        import torch.distributed as dist

        if self.nan_on_rank >= 0 and dist.is_initialized() and dist.get_rank() != self.nan_on_rank:
            return loss
        if self.infinite_gradient:
            weight = next(model.parameters())
            return loss + torch.sqrt(weight - weight.detach()).sum()  # 0, with an infinite derivative
        return loss * float("nan")


@dataclasses.dataclass
class DeviceOptimizerWorkload(MLPWorkload):
    """Picks its optimizer by the device it trains on, as nanoGPT's ``configure_optimizers`` does:
    fused AdamW on CUDA, the per-parameter loop elsewhere; ``implementation`` forces one."""

    implementation: Literal["by_device", "fused", "foreach", "for-loop"] = "by_device"

    def build_optimizer(self, model, device_type="cpu"):
        chosen = self.implementation
        if chosen == "by_device":
            chosen = "fused" if device_type == "cuda" else "for-loop"
        how = {"fused": True} if chosen == "fused" else {"foreach": chosen == "foreach"}
        return torch.optim.AdamW(model.parameters(), lr=self.lr, **how)


#: Every graph ``CompiledMLPWorkload``'s compiler was given in this process: dynamo ran.
COMPILED_GRAPHS: list = []


def recording_backend(graph, example_inputs):
    """A ``torch.compile`` backend that runs the captured graph eagerly and records that it was asked."""
    COMPILED_GRAPHS.append(graph)
    return graph.forward


@dataclasses.dataclass
class CompiledMLPWorkload(MLPWorkload):
    """An MLP whose ``build_model`` returns ``torch.compile(model)``, as a user's own code may
    (with a backend that needs no C compiler, and records each graph it is given)."""

    def build_model(self):
        return torch.compile(super().build_model(), backend=recording_backend)


#: The models every ``KeepsItsModelWorkload`` built in this process: a module-level cache that
#: outlives its trial, as a workload's own cache can.
_KEPT_MODELS: list = []


@dataclasses.dataclass
class KeepsItsModelWorkload(MLPWorkload):
    """Keeps each model it builds past its trial."""

    def build_model(self):
        model = super().build_model()
        _KEPT_MODELS.append(model)
        return model


@dataclasses.dataclass
class LayerRowsLSTMWorkload(LSTMLanguageModelWorkload):
    """Says its state's rows are along dimension 0, where nn.LSTM keeps its layers: with two
    layers, a state of two streams has two there as well."""

    state_dim = 0


@dataclasses.dataclass
class StatelessLossLSTMWorkload(LSTMLanguageModelWorkload):
    """Stateful, with the loss of a workload that is not: no state in, none out."""

    def loss(self, model, batch):
        inputs, targets = batch
        logits, _ = model(inputs, self.initial_state(inputs.shape[0]))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclasses.dataclass(kw_only=True)
class NeedsBlocks(MLPWorkload):
    """A hyper-parameter with no default: a sweep must give it (``workload.params`` or ``search_space``)."""

    blocks: int
