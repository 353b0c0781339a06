"""What ``run`` checks before Ray starts: each mistake is one line naming what is wrong, exit 2,
and nothing started or written (no Ray, no MLflow run, no sweep folder)."""

from __future__ import annotations

import pytest
from ports import free_port

from orchestrator.cli import main
from orchestrator.config import load_spec
from orchestrator.errors import UserError
from orchestrator.preflight import check_storage, check_workloads

SWEEP = """
experiment: preflight
workload: {name: mlp, params: {depth: 1}}
search_space:
  lr: {grid: [0.01, 0.1]}
  width: {grid: [16, 32]}
effective_batch_size: 64
stop: {epochs: 1}
"""


@pytest.fixture
def sweep_file(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP)
    return str(path)


def spec(sweep_file, *overrides):
    return load_spec(sweep_file, list(overrides))


def test_a_good_sweep_passes(sweep_file):
    check_workloads(spec(sweep_file))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["workload.params.train_samples=0"],
         "workload mlp (width=16): train_data has 0 samples, fewer than one optimizer step (effective_batch_size 64)"),
        (["workload.params.train_samples=40"], "workload mlp (width=16): train_data has 40 samples, fewer than one"),
        (["workload.params.eval_samples=0"], "workload mlp (width=16): eval_data has no samples"),
    ],
    ids=["empty training set", "less than one step", "empty eval set"],
)
def test_a_workload_without_data_is_one_line(sweep_file, overrides, message):
    with pytest.raises(UserError) as err:
        check_workloads(spec(sweep_file, *overrides))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_an_asha_first_rung_past_where_a_step_budget_ends_the_trials_is_one_line(sweep_file):
    """The mlp's 2,048 samples make 32 steps an epoch at 64: ``stop.steps: 40`` ends every trial
    in its second epoch, before a rung at epoch 2, which ASHA would then never reach."""
    asha = ["scheduler={type: asha, grace_period: 2}", "stop={epochs: 4, steps: 40}"]
    with pytest.raises(UserError) as err:
        check_workloads(spec(sweep_file, *asha))
    assert str(err.value) == (
        "workload mlp (width=16): scheduler.grace_period: the trials stop at step 40 (32 steps an epoch, "
        "stop: {epochs: 4, steps: 40}), before ASHA's first rung at epoch 2, so ASHA would stop no trial; "
        "expected at most 1")
    check_workloads(spec(sweep_file, "scheduler={type: asha, grace_period: 1}", "stop={epochs: 4, steps: 40}"))
    within_an_epoch = ["scheduler={type: asha, grace_period: 1}", "stop={epochs: 4, steps: 20}"]
    with pytest.raises(UserError, match=r"first rung at epoch 1, .*; expected stop\.steps of at least 32$"):
        check_workloads(spec(sweep_file, *within_an_epoch))
    by_steps = ["scheduler={type: asha, time_attr: step, grace_period: 80}", "stop={epochs: 2, steps: 1000}"]
    with pytest.raises(UserError, match=r"the trials stop at step 64 .* first rung at step 80, .* at most 64$"):
        check_workloads(spec(sweep_file, *by_steps))


def test_a_stateful_workload_in_a_data_parallel_group_is_one_line():
    lstm = load_spec("configs/lstm_tbptt_cpu.yaml", ["resources.workers=2"])
    with pytest.raises(UserError) as err:
        check_workloads(lstm)
    assert "resources.workers: a stateful workload (truncated BPTT) trains in one process; expected 1, got 2" in str(
        err.value)
    check_workloads(load_spec("configs/lstm_tbptt_cpu.yaml"))


def test_a_module_scheduled_before_the_first_epoch_is_one_line(sweep_file):
    staged = ["workload={name: staged_mlp, params: {aux_start_epoch: -1}}", "search_space={lr: 0.01}"]
    with pytest.raises(UserError, match=r"activation_schedule\(\): aux at -1; expected the epoch each module switches "
                                        r"on, counted from 0 \(0: from the start\)$"):
        check_workloads(spec(sweep_file, *staged))


def test_a_stateful_workload_whose_loss_takes_no_state_is_told_what_it_takes():
    lstm = load_spec("configs/lstm_tbptt_cpu.yaml", ["workload.name=tests.workloads:StatelessLossLSTMWorkload"])
    with pytest.raises(UserError, match=r"StatelessLossLSTMWorkload is stateful: its loss takes \(model, batch, state\) "
                                        r"and returns \(loss, new_state\); it is defined as loss\(model, batch\)$"):
        check_workloads(lstm)


def test_a_state_whose_rows_are_not_along_state_dim_is_one_line_even_where_a_dimension_has_two():
    """Two layers: at two streams, the layer dimension also has two; at three it does not."""
    lstm = load_spec("configs/lstm_tbptt_cpu.yaml", ["workload.name=tests.workloads:LayerRowsLSTMWorkload"])
    with pytest.raises(UserError, match=r"initial_state\(3\).*\(2, 3, 64\) does not have 3 rows \(one per stream\) along state_dim 0"):
        check_workloads(lstm)


def test_a_model_that_does_not_build_is_one_line_naming_the_users_line(sweep_file):
    """Each distinct model is built (on ``meta``) before Ray starts, the estimator set or not."""
    grouped = spec(sweep_file, "workload.name=tests.workloads:GroupedMLPWorkload", "search_space.width=12",
                   "memory.estimator=none")
    with pytest.raises(UserError) as err:
        check_workloads(grouped)
    message = str(err.value)
    assert message.startswith("workload tests.workloads:GroupedMLPWorkload (width=12): build_model() failed "
                              "(tests/workloads.py:"), message
    assert "ValueError: width must be a multiple of 8, got 12" in message and "\n" not in message
    assert "estimator" not in message  # no setting of the sweep builds this model


def test_an_estimate_that_fails_in_the_models_code_says_only_fixing_it_helps():
    from orchestrator.runner import _estimate_advice

    assert "memory.estimator: none" not in _estimate_advice("AttributeError: 'Net' has no 'widht' (in my/net.py:3)")
    assert "memory.estimator: none" in _estimate_advice("RuntimeError: x (aten.nonzero.default in my/net.py:9 (loss))")
    lstm = "RuntimeError: could not create a primitive descriptor for the LSTM ... (aten.mkldnn_rnn_layer.default)"
    assert _estimate_advice(lstm, "fp16", "emulated").startswith("the CPU has no fp16 kernel for some ops, and this "
                                                                  "emulated device runs the CPU's: set memory.precision: bf16")
    assert "memory.estimator: none" in _estimate_advice(lstm, "fp16", "cuda")  # CUDA's kernels differ


def test_a_collate_that_fails_is_one_line_naming_the_users_line(sweep_file):
    broken = spec(sweep_file, "workload.name=tests.workloads:BrokenCollateWorkload")
    with pytest.raises(UserError) as err:
        check_workloads(broken)
    message = str(err.value)
    assert message.startswith("workload tests.workloads:BrokenCollateWorkload (width=16): collate() of two "
                              "train_data samples failed (tests/workloads.py:"), message
    assert "RuntimeError: shape '[2, -1, 2]' is invalid" in message and "\n" not in message


def test_plan_checks_the_data_too(sweep_file, capsys):
    assert main(["plan", sweep_file, "--set", "workload.params.train_samples=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: workload mlp (width=16): train_data has 0 samples") and err.count("\n") == 1, err


def test_storage_that_takes_no_files(tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(UserError, match=r"storage_path: cannot write to .*/results/sweeps \(Not a directory\)"):
        check_storage(str(blocker / "sweeps"))
    check_storage(str(tmp_path / "new" / "sweeps"))
    assert list((tmp_path / "new" / "sweeps").iterdir()) == []  # the probe leaves nothing behind


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--set", "workload.params.train_samples=0"], "error: workload mlp (width=16): train_data has 0 samples"),
        (["--storage-path", "{blocker}/x"], "error: storage_path: cannot write to"),
        (["--tracking-uri", "http://127.0.0.1:{closed_port}"], "error: tracking_uri: MLflow at http://127.0.0.1:"),
        (["--name", "../elsewhere"], "error: --name: expected a name, not a path"),
    ],
    ids=["empty data", "storage", "tracking server", "name"],
)
def test_run_stops_before_ray_starts(sweep_file, tmp_path, capsys, monkeypatch, flags, message):
    import ray

    monkeypatch.chdir(tmp_path)
    (tmp_path / "blocker").write_text("")
    flags = [f.format(blocker=tmp_path / "blocker", closed_port=free_port()) for f in flags]
    assert main(["run", sweep_file, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not ray.is_initialized()
    assert not (tmp_path / "orchestrator_results").exists() or not any((tmp_path / "orchestrator_results").iterdir())


# A user's package, beside the sweep file in a folder outside the repository: one workload whose
# constructor has a typo, one that needs a library that is not installed, one whose own
# constructor refuses its parameters, one whose model torch refuses.
BROKEN_MODELS = """\
import dataclasses

from trainables.mlp import MLPWorkload


@dataclasses.dataclass
class Typo(MLPWorkload):
    def build_model(self):
        return self.widht


@dataclasses.dataclass
class NeedsALibrary(MLPWorkload):
    def build_model(self):
        from transformers_of_nowhere import AutoModel

        return AutoModel()


@dataclasses.dataclass
class OddWidth(MLPWorkload):
    def __post_init__(self):
        raise ValueError("width must be even")


@dataclasses.dataclass
class NegativeWidth(MLPWorkload):
    def build_model(self):
        from torch import nn

        return nn.Linear(4, -self.width)
"""


@pytest.mark.parametrize(
    "workload,message",
    [
        ("broken:Typo", "error: workload my_models.broken:Typo (width=16): build_model() failed (my_models/broken.py:9: "
                        "AttributeError: 'Typo' object has no attribute 'widht'"),
        ("broken:NeedsALibrary", "error: workload my_models.broken:NeedsALibrary (width=16): build_model() failed "
                                 "(my_models/broken.py:15: No module named 'transformers_of_nowhere'); install it in this "
                                 "environment: pip install transformers_of_nowhere"),
        ("broken_import:ImportsALibrary", "error: workload.name: workload 'my_models.broken_import:ImportsALibrary': "
                                          "cannot import module 'my_models.broken_import' (my_models/broken_import.py:1: No "
                                          "module named 'transformers_of_nowhere'); install it in this environment: pip install transformers_of_nowhere"),
        ("broken:OddWidth", "error: workload my_models.broken:OddWidth (width=16): its constructor failed "
                            "(my_models/broken.py:23: ValueError: width must be even)"),
        # Raised inside torch, through the pre-flight's meta-device hook: the user's line, not the hook's.
        ("broken:NegativeWidth", "error: workload my_models.broken:NegativeWidth (width=16): build_model() failed "
                                 "(my_models/broken.py:31: RuntimeError: Trying to create tensor with negative dimension -16"),
    ],
    ids=["constructor typo", "missing library", "missing library at import", "the workload's own constructor",
         "an error inside torch"],
)
def test_the_installed_run_refuses_a_model_that_does_not_build_before_ray_starts(tmp_path, workload, message):
    """``orchestrator run`` from the user's folder: one line, exit 2, nothing of Ray's printed."""
    import subprocess

    from tests.conftest import command_env, installed_command

    (tmp_path / "my_models").mkdir()
    (tmp_path / "my_models" / "__init__.py").write_text("")
    (tmp_path / "my_models" / "broken.py").write_text(BROKEN_MODELS)
    (tmp_path / "my_models" / "broken_import.py").write_text("import transformers_of_nowhere\n")
    (tmp_path / "sweep.yaml").write_text(SWEEP.replace("name: mlp", f"name: my_models.{workload}"))
    done = subprocess.run([installed_command(), "run", "sweep.yaml", "--set", "memory.estimator=static"], cwd=tmp_path,
                          env=command_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr
    assert "estimator" not in done.stderr
    assert not (tmp_path / "orchestrator_results").exists() and not (tmp_path / "mlflow.db").exists()
