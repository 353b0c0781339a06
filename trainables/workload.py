"""The contract between a model and the orchestrator.

A workload is everything the generic training loop, the memory estimators and the planner
need to know about one model: how to build it and its optimizer, where its data come from and
how they are batched, how to compute its loss and what to measure on the eval set.
Hyper-parameters are dataclass fields, so a sweep's YAML can be checked against them before
anything starts, and a user's own model plugs in by subclassing :class:`Workload` and naming it
as ``my_package.my_module:MyWorkload``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import numbers
import traceback
import types
import typing
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from orchestrator.users_code import installed, shown, standard_library, users

#: A batch is whatever :meth:`Workload.collate` makes of a list of samples: usually a tuple or
#: dict of tensors, but anything the workload's ``loss`` understands (a graph batch, say).
Batch = Any


@dataclasses.dataclass
class Workload:
    """Base class of every workload; subclasses add their hyper-parameters as fields.

    ``lr`` and ``optimizer`` live here because every workload has them and sweeps search them.
    Field annotations are checked against the sweep's values (:meth:`parameter_error`), so a
    subclass whose ``build_optimizer`` knows more optimizers redeclares ``optimizer``.

    A workload that picks its optimizer by device (``fused=True`` AdamW on CUDA, as nanoGPT's
    ``configure_optimizers(..., device_type)`` does) declares a keyword ``device_type`` in its
    ``build_optimizer(self, model, device_type="cpu")``: it is then told the torch device type
    the trial trains on (``"cuda"`` | ``"cpu"``), by the trial and by the memory estimate made
    for that trial alike (which builds the model on fake CPU tensors even for a GPU), so the
    optimizer planned for is the one that trains (:func:`optimizer_for`).
    """

    lr: float = 1e-3
    optimizer: Literal["sgd", "adam", "adamw"] = "adamw"
    seed: int = 0

    #: Whether :meth:`set_activation_checkpointing` does anything (the planner may then use it).
    supports_activation_checkpointing: ClassVar[bool] = False
    #: What :meth:`summarize_metrics` reports, each as ``eval_<name>``. Declared, so that a
    #: sweep's ``metric: eval_accuracy`` is checked before anything starts.
    metrics: ClassVar[tuple[str, ...]] = ("loss",)
    #: Truncated BPTT: ordered batches of parallel streams and a state carried between steps.
    #: The rows of a step's batch are ``effective_batch`` streams: the training set is cut into
    #: that many contiguous runs of samples, and step ``s`` takes sample ``s`` of each run, so row
    #: ``j`` of a step continues row ``j`` of the step before (the batchify layout); nothing is
    #: shuffled. ``loss(model, batch, state)`` then receives the state of the micro-batch's rows
    #: and returns ``(loss, new_state)``; the loop detaches it after each step, gives each
    #: micro-batch its own rows of it (the streams it computes; an OOM's smaller micro-batch
    #: re-cuts the same rows), saves it in checkpoints, and starts every epoch from
    #: :meth:`initial_state`. Eval batches each start from :meth:`initial_state`.
    stateful: ClassVar[bool] = False
    #: The dimension of every state tensor along which its rows (streams) lie: 1 for the
    #: ``(layers, rows, hidden)`` hidden state of ``nn.LSTM``/``nn.GRU``.
    state_dim: ClassVar[int] = 0
    #: Hyper-parameters that cannot change memory: trials differing only in these share one
    #: estimate. Extend it for such fields of your own (``Workload.memory_neutral + ("dropout",)``).
    memory_neutral: ClassVar[tuple[str, ...]] = ("lr", "seed")
    #: Whether a trial checks its plan on the device in its first steps and switches to the
    #: corrected plan (``memory.verify`` turns it off for a whole sweep). False for a workload
    #: whose first steps say nothing of its later ones (memory that grows as it trains): it then
    #: trusts the estimate until an OOM.
    verify_plan: ClassVar[bool] = True

    # -- what a subclass must provide ---------------------------------------------------------
    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def train_data(self) -> Dataset:
        """A map-style dataset (``len`` and ``[i]``); the loop batches it through a DataLoader."""
        raise NotImplementedError

    def eval_data(self) -> Dataset:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean loss over the batch, as a tensor of one element (the loop weights it by the
        batch's share of the step, and ``backward()`` starts from it; anything else is refused
        before a sweep starts: :func:`one_number`).

        A :attr:`stateful` workload's is ``loss(model, batch, state) -> (loss, new_state)``."""
        raise NotImplementedError

    def initial_state(self, rows: int) -> Any:
        """A :attr:`stateful` workload's state for ``rows`` streams (zeros, usually): a tensor,
        or a tuple, list or dict of tensors, each with ``rows`` rows along :attr:`state_dim`.
        Made on the CPU; the loop moves it to the device."""
        raise NotImplementedError(f"{type(self).__name__} is stateful, and must define initial_state(rows): "
                                  "its state for that many streams")

    # -- what a subclass may override ---------------------------------------------------------
    def collate(self, samples: list) -> Batch:
        """Samples -> one batch, in the DataLoader's worker processes. Override for batches that
        stacking cannot make: padded variable-length sequences, graphs, dicts of ragged data."""
        return default_collate(samples)

    def largest_sample(self) -> Any:
        """One sample at least as large as any the training data holds.

        The estimators build every batch they measure from copies of it, so memory is planned
        for the worst batch. The first sample is right for fixed-size data; with variable-length
        sequences, return the longest (or one padded to the maximum length).
        """
        return self.train_data()[0]

    def largest_eval_sample(self) -> Any:
        """One sample at least as large as any the eval data holds: the eval phases are planned
        from it. :meth:`largest_sample` by default; override where evaluation sees larger samples
        than training (a longer context, full-resolution validation images), or the eval batch is
        planned too large and its first evaluation runs out of memory."""
        return self.largest_sample()

    def eval_metrics(self, model: nn.Module, batch: Batch, samples: int) -> dict[str, torch.Tensor]:
        """Sums over the ``samples`` samples of an eval ``batch``, keyed by name.

        The loop adds each over the eval set and hands the totals to :meth:`summarize_metrics`.
        The default is the loss; a workload that reports accuracy computes both from one
        forward pass, e.g. ``{"loss": F.cross_entropy(logits, y, reduction="sum"),
        "accuracy": (logits.argmax(-1) == y).sum()}``, and declares ``metrics``. Return tensors,
        not Python numbers: the loop reads them once per eval, not once per batch.
        """
        if self.stateful:
            state = to_device(self.initial_state(samples), next(model.parameters()).device)
            return {"loss": self.loss(model, batch, state)[0] * samples}
        return {"loss": self.loss(model, batch) * samples}

    def summarize_metrics(self, totals: dict[str, float], samples: int) -> dict[str, float]:
        """The eval set's totals -> what is reported (``eval_<name>``); by default, per-sample means.

        Override for metrics that are not means, e.g. perplexity ``exp(totals["loss"] / samples)``.
        """
        return {name: total / samples for name, total in totals.items()}

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer of ``model``'s trainable parameters. PyTorch's own default picks its
        implementation (foreach on CUDA, a per-parameter loop on the CPU), which the estimate
        follows; an override may declare ``device_type`` to choose one itself (see the class)."""
        params = [p for p in model.parameters() if p.requires_grad]
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=self.lr)
        if self.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.lr)
        raise ValueError(f"optimizer: expected one of sgd, adam, adamw, got {self.optimizer!r}")

    def build_scheduler(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler | None:
        """A learning-rate scheduler stepped once per optimizer step, or None for the sweep's
        ``schedule`` (warm-up and decay written in YAML; constant when there is none).

        One whose ``step`` takes a value (``ReduceLROnPlateau``) is stepped once after each
        evaluation with the sweep's ``metric`` instead (``trainables.schedule``)."""
        return None

    def activation_schedule(self) -> dict[str, int]:
        """Epoch at which each optional module switches on (none by default).

        The estimators take a profile of every stage, so a module that appears at epoch 3 is
        planned for from epoch 0 instead of crashing the trial when it arrives.
        """
        return {}

    def set_epoch(self, model: nn.Module, epoch: int) -> None:
        """Switch on the modules of :meth:`activation_schedule` whose epoch has come.

        The default calls ``model.set_active(name, bool)`` for each scheduled module, which is
        what the built-in staged workload implements; override for other mechanisms.
        """
        for name, start in self.activation_schedule().items():
            model.set_active(name, epoch >= start)

    def set_activation_checkpointing(self, model: nn.Module, enabled: bool) -> None:
        if enabled:
            raise NotImplementedError(f"{type(self).__name__} does not support activation checkpointing")

    def stage_epochs(self) -> list[int]:
        """First epoch of every distinct module-activation stage (0 included)."""
        return sorted({0, *self.activation_schedule().values()})

    @classmethod
    def overrides(cls, method: str) -> bool:
        """Whether this workload defines ``method`` itself rather than inheriting the base's."""
        return getattr(cls, method) is not getattr(Workload, method)

    @classmethod
    def varies_in_size(cls) -> bool:
        """Whether its samples may differ in size: it names its largest (the estimators plan for
        that one), so a measured batch may be smaller than the largest."""
        return cls.overrides("largest_sample") or cls.overrides("largest_eval_sample")

    @classmethod
    def parameter_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def parameter_error(cls, name: str, value: Any) -> str | None:
        """What ``value`` should have been for the hyper-parameter ``name``; None when it fits.

        Read from the field's annotation (``int``, ``float``, ``str``, ``bool``, ``Literal[...]``,
        unions of those), so ``lr: fast`` in a sweep fails before Ray starts instead of in every
        trial. Annotations this does not know are not checked.
        """
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # a user's annotation that does not resolve: nothing to check against
            return None
        return None if name not in hints else _mismatch(hints[name], value)


def _mismatch(annotation: Any, value: Any) -> str | None:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        options = typing.get_args(annotation)
        return None if value in options else "one of " + ", ".join(map(str, options))
    if origin in (typing.Union, types.UnionType):
        wanted = [_mismatch(arg, value) for arg in typing.get_args(annotation)]
        return None if None in wanted else " or ".join(w for w in wanted if w)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    checks = {
        bool: (isinstance(value, bool), "true or false"),
        int: (is_number and isinstance(value, int), "an integer"),
        float: (is_number, "a number"),
        str: (isinstance(value, str), "a string"),
        type(None): (value is None, "null"),
    }
    fits, expected = checks.get(annotation, (True, ""))
    return None if fits else expected


BUILTIN_WORKLOADS: dict[str, str] = {
    "mlp": "trainables.mlp:MLPWorkload",
    "cnn": "trainables.cnn:CNNWorkload",
    "staged_mlp": "trainables.staged:StagedMLPWorkload",
}


class WorkloadNotFound(ValueError):
    pass


def resolve_workload(name: str) -> type[Workload]:
    """A built-in name or ``package.module:Class`` -> the workload class."""
    target = BUILTIN_WORKLOADS.get(name, name)
    if ":" not in target:
        raise WorkloadNotFound(
            f"unknown workload {name!r}: expected one of {', '.join(sorted(BUILTIN_WORKLOADS))} "
            "or an import path 'package.module:Class'"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module runs here: a syntax error, a missing dependency, a bug
        advice = "" if _missing_root(exc) == module_name.split(".")[0] else install_advice(exc)
        raise WorkloadNotFound(
            f"workload {name!r}: cannot import module {module_name!r} ({_import_failure(exc)}){advice}"
        ) from None
    if not hasattr(module, attr):
        found = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and issubclass(v, Workload) and v.__module__ == module.__name__)
        offer = f"its workloads: {', '.join(found)}" if found else "it defines no subclass of trainables.Workload"
        raise WorkloadNotFound(f"workload {name!r}: module {module_name!r} has no {attr!r} ({offer})")
    cls = getattr(module, attr)
    if not (isinstance(cls, type) and issubclass(cls, Workload)):
        raise WorkloadNotFound(f"workload {name!r}: {target} is not a subclass of trainables.Workload")
    return cls


def _import_failure(exc: Exception) -> str:
    """Why importing a user's module failed, on one line (see :func:`failure_line`).

    The first frame is resolve_workload's own; the import machinery's are frozen or stdlib. A
    module that does not exist ran no code: its message stands alone, ``No module named 'my_models'``.
    """
    return failure_line(exc, skip=1)


#: Import names whose package on PyPI is named otherwise.
_PIP_NAMES = {"PIL": "pillow", "cv2": "opencv-python", "sklearn": "scikit-learn", "yaml": "pyyaml",
              "skimage": "scikit-image", "google.protobuf": "protobuf", "attr": "attrs"}


def _missing_root(exc: BaseException) -> str | None:
    """The top-level name of the module a ``ModuleNotFoundError`` did not find, else None."""
    name = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    return name.split(".")[0] if name else None


def install_advice(exc: BaseException) -> str:
    """``; install it: pip install transformers`` for a library that is not installed, else ''.

    What fits a missing library: no setting of the sweep makes a model build without it."""
    root = _missing_root(exc)
    if root is None:
        return ""
    return f"; install it in this environment: pip install {_PIP_NAMES.get(root, root)}"


def failure_line(exc: BaseException, skip: int = 0) -> str:
    """Why a user's code failed, on one line: ``FILE:LINE: Type: what``.

    The line is the innermost one of the user's own code (see :func:`failure_location`). ``skip``
    leaves out the caller's own outermost frames.
    """
    if isinstance(exc, SyntaxError):  # raised by the compiler, outside any frame of the module
        what = f"{type(exc).__name__}: {exc.msg}"
    else:
        what = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
    what = " ".join(what.split())
    where = failure_location(exc, skip)
    return f"{where}: {what}" if where else what


def failure_location(exc: BaseException, skip: int = 0) -> str | None:
    """``FILE:LINE`` of the innermost line of the user's own code that ``exc`` passed through
    (:func:`orchestrator.users_code.users`: an error raised inside torch, or passed through the
    orchestrator's hooks, points at the user's call into it); failing that, of the orchestrator's,
    then of any package's."""
    if isinstance(exc, SyntaxError):
        return shown(exc.filename, exc.lineno) if exc.filename else None
    ran = [f for f in traceback.extract_tb(exc.__traceback__)[skip:]
           if not f.filename.startswith("<") and not standard_library(f.filename)]
    own = [f for f in ran if users(f.filename)] or [f for f in ran if not installed(f.filename)] or ran
    return shown(own[-1].filename, own[-1].lineno) if own else None


class MetricsMismatch(ValueError):
    """A workload reported other eval metrics than it declares in ``metrics``."""


class LossTypeError(TypeError):
    """A workload's ``loss`` returned something the loop cannot train on: not one number as a
    tensor (a per-sample vector, a Python float, a ``(loss, metrics)`` tuple), or, for a stateful
    workload, not ``(loss, new_state)``. Such a loss fails every trial at its first step whatever
    its tensors hold, so the estimators raise it before any trial starts rather than plan around it."""


class MetricTypeError(TypeError):
    """A workload's ``eval_metrics`` returned something other than one number per metric (a
    per-sample vector, a string, no dict at all): every trial would fail at its first evaluation,
    an epoch in, so the estimators raise it before any trial starts."""


def one_number(workload: Workload, loss: Any, samples: int | None = None) -> torch.Tensor:
    """``loss``, as ``workload.loss`` returned it for a batch of ``samples``, where ``backward()`` can
    start from it alone (a tensor of one element, as ``torch.autograd`` requires); else
    :class:`LossTypeError`, saying what it was and what would fix it."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    got, fix = _described(loss, samples, reduce="(.mean(), or reduction='mean')",
                          alone="return the loss alone (numbers to report go in eval_metrics)")
    raise LossTypeError(f"{_method(workload, 'loss')} returned {got}; expected the batch's mean loss as a "
                        f"one-element tensor: {fix}")


def metric_sums(workload: Workload, sums: Any, samples: int | None = None) -> dict[str, Any]:
    """``sums``, as ``workload.eval_metrics`` returned them for a batch of ``samples``, where each is
    one number the loop can add over the eval set (a tensor of one element, or a Python number);
    else :class:`MetricTypeError`."""
    if not isinstance(sums, dict):
        raise MetricTypeError(f"{_method(workload, 'eval_metrics')} returned {_described(sums)[0]}; expected a "
                              "dict of each metric's sum over the batch, e.g. {\"loss\": F.cross_entropy(logits, y, reduction=\"sum\")}")
    for name, value in sums.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, numbers.Real):  # numpy's too
            continue
        got, fix = _described(value, samples, reduce="(.sum(), or reduction='sum')", alone="return one number per name")
        raise MetricTypeError(f"{_method(workload, 'eval_metrics')} returned {name!r} as {got}; expected its sum over "
                              f"the batch as one number: {fix}")
    return sums


def _method(workload: Workload, name: str) -> str:
    """``Class.method (file:line)``: the workload's method a refusal is about, and where it is defined."""
    code = getattr(getattr(type(workload), name), "__code__", None)
    return f"{type(workload).__name__}.{name}" + (f" ({shown(code.co_filename, code.co_firstlineno)})" if code else "")


def _described(value: Any, samples: int | None = None, reduce: str = "", alone: str = "") -> tuple[str, str]:
    """What ``value`` is, for a refusal, and what would make one number of it. A tensor's shape
    comes with the batch it was computed for: the estimators' batches are small (2 samples), and
    a per-sample shape says so."""
    if isinstance(value, torch.Tensor):
        batch = "" if samples is None else f" for a batch of {samples}"
        return f"a tensor of shape {tuple(value.shape)}{batch}", f"reduce it over the batch {reduce}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}", alone
    return f"a {type(value).__name__}", "compute it from the model's output with torch, as a tensor"


def reported_metrics(workload: Workload, totals: dict[str, float], samples: int) -> dict[str, float]:
    """``summarize_metrics`` of the eval set's ``totals``, refused where its names are not the ones
    the workload declares (the sweep's ``metric`` was checked against the declared names)."""
    reported = workload.summarize_metrics(totals, samples)
    declared = type(workload).metrics
    if set(reported) != set(declared):
        name = type(workload).__name__
        raise MetricsMismatch(
            f"{name}.eval_metrics/summarize_metrics report {', '.join(sorted(reported)) or 'nothing'} but "
            f"{name}.metrics declares {', '.join(declared)}: make them the same"
        )
    return reported


def check_metric_names(workload: Workload, sums: dict[str, Any], samples: int) -> None:
    """The names an eval step's ``sums`` would report, checked before any trial runs: an estimate
    runs the eval step on tensors that hold no values, so placeholder totals stand in for the
    eval set's (an eval step returns the same names at every batch). Without it the mismatch ends
    every trial at its first evaluation, after an epoch.
    A ``summarize_metrics`` that fails on placeholders is left to the loop, which has the totals."""
    try:
        reported_metrics(workload, dict.fromkeys(sums, 1.0), samples)
    except MetricsMismatch:
        raise
    except Exception:  # noqa: BLE001 - a user's summary of real totals only
        return


def build_workload(config: dict[str, Any]) -> Workload:
    """A trial's config (``workload`` plus hyper-parameters) -> the workload instance.

    Keys that are not fields of the workload are ignored here: a sweep over two workloads may
    carry hyper-parameters that only one of them has (the config layer already checked each key
    belongs to at least one workload of the sweep).
    """
    cls = resolve_workload(config["workload"])
    names = set(cls.parameter_names())
    return cls(**{k: v for k, v in config.items() if k in names})


def optimizer_for(workload: Workload, model: nn.Module, device_type: str) -> torch.optim.Optimizer:
    """``workload.build_optimizer(model)``, told ``device_type`` (``"cuda"`` | ``"cpu"``: where
    the trial's tensors live) where it declares that keyword (or takes ``**kwargs``); every
    caller that builds a trial's optimizer, the loop and the estimators, builds it here."""
    parameters = inspect.signature(workload.build_optimizer).parameters.values()
    told = any(p.name == "device_type" and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD for p in parameters)
    return workload.build_optimizer(model, device_type=device_type) if told else workload.build_optimizer(model)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Move every tensor of a batch (nested tuples, lists, dicts) to ``device``; others stay."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), batch)


def map_tensors(fn, tree: Any) -> Any:
    """``tree`` (nested tuples, namedtuples, lists, dicts) with ``fn`` applied to every tensor; others stay."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(map_tensors(fn, b) for b in tree)
    if isinstance(tree, tuple):  # a namedtuple
        return type(tree)(*(map_tensors(fn, b) for b in tree))
    if isinstance(tree, dict):
        return {k: map_tensors(fn, v) for k, v in tree.items()}
    return tree


def sample_batch(workload: Workload, dataset: Dataset, size: int) -> Batch:
    """``size`` samples of ``dataset`` (cycling when it is shorter), collated as the loop does."""
    return workload.collate([dataset[i % len(dataset)] for i in range(size)])
