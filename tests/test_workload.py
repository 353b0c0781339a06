"""The workload contract: names resolve to classes, and hyper-parameters are checked by their annotations."""

import dataclasses
from typing import Literal

import pytest
import torch

from trainables.mlp import MLPWorkload
from trainables.workload import Workload, WorkloadNotFound, build_workload, optimizer_for, resolve_workload


@dataclasses.dataclass
class Annotated(Workload):
    heads: int = 4
    dropout: float = 0.1
    norm: Literal["layer", "rms"] = "layer"
    warmup: int | None = None
    tied: bool = True
    schedule: "list[int]" = dataclasses.field(default_factory=list)  # not a checked kind


@pytest.mark.parametrize(
    "name,value,expected",
    [
        ("heads", 8, None),
        ("heads", 8.0, "an integer"),
        ("heads", True, "an integer"),  # YAML's true is not a count
        ("dropout", 0, None),  # an integer is a number
        ("dropout", "0.1", "a number"),
        ("norm", "rms", None),
        ("norm", "batch", "one of layer, rms"),
        ("warmup", None, None),
        ("warmup", 100, None),
        ("warmup", "soon", "an integer or null"),
        ("tied", 1, "true or false"),
        ("schedule", [1, 2], None),
        ("not_a_field", "anything", None),  # unknown keys are the config layer's check
    ],
)
def test_parameter_error_reads_the_annotation(name, value, expected):
    assert Annotated.parameter_error(name, value) == expected


def test_builtin_names_and_import_paths_resolve():
    assert resolve_workload("mlp") is MLPWorkload
    assert resolve_workload("trainables.mlp:MLPWorkload") is MLPWorkload
    with pytest.raises(WorkloadNotFound, match="unknown workload 'resnet'"):
        resolve_workload("resnet")
    with pytest.raises(WorkloadNotFound, match="not a subclass of trainables.Workload"):
        resolve_workload("trainables.workload:build_workload")


def test_build_workload_keeps_only_its_own_fields():
    """A sweep over two workloads carries hyper-parameters only one of them has."""
    workload = build_workload({"workload": "mlp", "width": 16, "channels": 8, "lr": 0.1})
    assert (workload.width, workload.lr) == (16, 0.1)


@pytest.mark.parametrize(
    "source,line,message",
    [
        ("import torch\nimport a_dependency_not_installed\n", 2, "No module named 'a_dependency_not_installed'"),
        ("x = 1\nraise RuntimeError('no data\\nfound')\n", 2, "RuntimeError: no data found"),
        # Raised inside torch: the line shown is the user's call into it.
        ("import torch\n\ntorch.load('/no/such/weights.pt')\n", 3, "FileNotFoundError: [Errno 2] No such file"),
        ("class Broken(\n", 1, "SyntaxError: '(' was never closed"),
    ],
    ids=["missing dependency", "error at import", "error inside a library", "syntax error"],
)
def test_a_broken_user_module_is_one_line_naming_its_file_and_line(tmp_path, monkeypatch, request, source, line, message):
    package = f"user_models_{request.node.callspec.id.replace(' ', '_')}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "wide.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadNotFound) as err:
        resolve_workload(f"{package}.wide:WideNet")
    text = str(err.value)
    prefix = f"workload '{package}.wide:WideNet': cannot import module '{package}.wide' ({tmp_path}/{package}/wide.py:{line}: "
    assert text.startswith(prefix + message), text
    assert "\n" not in text


def test_a_module_that_is_not_there_says_only_that(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(WorkloadNotFound) as err:
        resolve_workload("no_such_models.wide:WideNet")
    assert str(err.value) == ("workload 'no_such_models.wide:WideNet': cannot import module 'no_such_models.wide' "
                              "(No module named 'no_such_models')")


@dataclasses.dataclass
class TakesDeviceType(MLPWorkload):
    def build_optimizer(self, model, device_type="cpu"):
        self.told = device_type
        return super().build_optimizer(model)


@dataclasses.dataclass
class TakesKeywords(MLPWorkload):
    def build_optimizer(self, model, **options):
        self.told = options
        return super().build_optimizer(model)


def test_a_workload_is_told_the_device_type_where_its_build_optimizer_declares_it():
    """``device_type`` is an opt-in keyword: declared (or ``**kwargs``), it is given; the old
    ``build_optimizer(self, model)`` is called as before."""
    model = MLPWorkload().build_model()
    declared, keywords = TakesDeviceType(), TakesKeywords()
    optimizer_for(declared, model, "cuda")
    optimizer_for(keywords, model, "cuda")
    assert declared.told == "cuda" and keywords.told == {"device_type": "cuda"}
    assert isinstance(optimizer_for(MLPWorkload(), model, "cuda"), torch.optim.AdamW)


@dataclasses.dataclass
class ReturnsAnything(MLPWorkload):
    """A loss that returns whatever the test hands it, as a user's loss might."""

    returned: object = None

    def loss(self, model, batch):
        return self.returned


@pytest.mark.parametrize(
    "returned,said",
    [
        (torch.ones(8), "returned a tensor of shape (8,); expected the batch's mean loss as a one-element tensor: "
                        "reduce it over the batch (.mean(), or reduction='mean')"),
        ((torch.tensor(1.0), {"accuracy": 0.5}), "returned a tuple of 2; expected the batch's mean loss as a one-element "
                                                 "tensor: return the loss alone (numbers to report go in eval_metrics)"),
        (0.25, "returned a float; expected the batch's mean loss as a one-element tensor: compute it from the model's "
               "output with torch, as a tensor"),
    ],
    ids=["per-sample losses", "a (loss, metrics) tuple", "a Python float"],
)
def test_a_loss_that_is_not_one_number_is_refused_saying_what_it_was_and_what_fixes_it(returned, said):
    """``backward()`` starts only from one number: the refusal names the workload's ``loss`` and
    where it is defined, what it returned, and what would make it one."""
    from trainables.workload import LossTypeError, one_number

    workload = ReturnsAnything(returned=returned)
    with pytest.raises(LossTypeError) as refused:
        one_number(workload, workload.loss(None, None))
    line = ReturnsAnything.loss.__code__.co_firstlineno
    assert str(refused.value) == f"ReturnsAnything.loss (tests/test_workload.py:{line}) {said}"


@pytest.mark.parametrize("loss", [torch.tensor(0.5), torch.tensor([0.5]), torch.ones(1, 1)], ids=["0-d", "(1,)", "(1, 1)"])
def test_a_loss_of_one_element_is_taken_as_it_is(loss):
    """What ``torch.autograd`` takes without a gradient given: any tensor of one element."""
    from trainables.workload import one_number

    assert one_number(ReturnsAnything(), loss) is loss


def test_a_loss_per_sample_says_the_batch_it_was_computed_for():
    """The estimators' batches are small: a shape of (2,) is told as 2 samples' losses."""
    from trainables.workload import LossTypeError, one_number

    with pytest.raises(LossTypeError, match=r"returned a tensor of shape \(2,\) for a batch of 2; "):
        one_number(ReturnsAnything(), torch.ones(2), samples=2)


@dataclasses.dataclass
class SumsAnything(MLPWorkload):
    """An ``eval_metrics`` that returns whatever the test hands it."""

    returned: object = None

    def eval_metrics(self, model, batch, samples):
        return self.returned


@pytest.mark.parametrize(
    "returned,said",
    [
        ({"loss": torch.ones(4)}, "returned 'loss' as a tensor of shape (4,) for a batch of 4; expected its sum over the "
                                  "batch as one number: reduce it over the batch (.sum(), or reduction='sum')"),
        ({"loss": torch.tensor(1.0), "note": "fine"}, "returned 'note' as a str; expected its sum over the batch as one "
                                                      "number: compute it from the model's output with torch, as a tensor"),
        (torch.tensor(3.0), "returned a tensor of shape (); expected a dict of each metric's sum over the batch, "
                            "e.g. {\"loss\": F.cross_entropy(logits, y, reduction=\"sum\")}"),
    ],
    ids=["per-sample sums", "a string", "no dict"],
)
def test_eval_metrics_that_are_not_one_number_each_are_refused_by_name(returned, said):
    from trainables.workload import MetricTypeError, metric_sums

    workload = SumsAnything(returned=returned)
    with pytest.raises(MetricTypeError) as refused:
        metric_sums(workload, workload.eval_metrics(None, None, 4), samples=4)
    line = SumsAnything.eval_metrics.__code__.co_firstlineno
    assert str(refused.value) == f"SumsAnything.eval_metrics (tests/test_workload.py:{line}) {said}"


def test_eval_metrics_may_be_one_element_tensors_or_numbers_numpys_too():
    import numpy as np

    from trainables.workload import metric_sums

    sums = {"loss": torch.tensor(2.0), "correct": torch.tensor([3]), "seen": 4, "ratio": 0.5, "hits": np.int64(2)}
    assert metric_sums(SumsAnything(), sums) is sums
