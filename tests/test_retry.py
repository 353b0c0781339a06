"""The Tune-level failure handling: which failures shrink the plan, and which end the trial."""

import os
from types import SimpleNamespace

import cloudpickle
import pytest
from ray.exceptions import ActorDiedError
from ray.tune.schedulers import FIFOScheduler

from orchestrator.contract import (
    NOT_RETRIED_KEY,
    OOM_EVIDENCE_FILE,
    OOM_GAVE_UP_KEY,
    OOM_SHRINKS_KEY,
    OTHER_FAILURES_KEY,
    RESTART_REASON_KEY,
    OomEvent,
)
from orchestrator.failures import classify, exception_line, last_failure, pickled_failure
from orchestrator.retry import OomAwareScheduler
from orchestrator.trial.evidence import write_oom_evidence


def _trial(tmp_path, text, config=None, failures=1, max_failures=3, error=None):
    """What the scheduler reads of a Tune trial that just failed: its error text, the pickled Ray
    exception when Tune wrote one, and its folder on the storage path."""
    error_file = tmp_path / "error.txt"
    error_file.write_text(text)
    pickled = tmp_path / "error.pkl"
    if error is not None:
        pickled.write_bytes(cloudpickle.dumps(error))
    trial = SimpleNamespace(
        error_file=str(error_file), pickled_error_file=str(pickled) if error is not None else None,
        trial_id="t1", path=str(tmp_path), config=dict(config or {"lr": 0.1}), max_failures=max_failures,
        run_metadata=SimpleNamespace(num_failures=failures),
    )
    trial.set_config = lambda c: setattr(trial, "config", c)
    return trial


def test_the_newest_failure_block_is_read(tmp_path):
    trial = _trial(tmp_path, "Failure # 1 (occurred at x)\nValueError: old\nFailure # 2 (occurred at y)\nRayActorError: died\n")
    assert "died" in last_failure(trial.error_file) and "old" not in last_failure(trial.error_file)
    assert last_failure(str(tmp_path / "missing")) == ""


#: What Ray 2.60 says, in the trial's error.txt, after its memory monitor killed the worker (no exception name).
MEMORY_MONITOR_TEXT = (
    "1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.2, ID: 87ea) "
    "was 22.81GB used / 23.54GB limit (0.968896)\nOOM kill reason: Memory usage 24013062144B exceeded threshold"
)
#: What a worker killed with `kill -9` (or on a lost node) leaves: the kernel's OOM killer is only a guess here.
KILLED_TEXT = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: ImplicitFunc\n\tpid: 4242\n"
    "Worker exit detail: ... Some common causes include: (1) the process was killed by the OOM killer due to high "
    "memory usage, (2) ray stop --force was called, or (3) the worker crashed unexpectedly due to SIGSEGV"
)


def test_failures_are_classified():
    assert classify("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB") == "oom"
    assert classify("RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate") == "oom"
    assert classify("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED") == "oom"  # as the worker's is_oom
    assert classify(MEMORY_MONITOR_TEXT) == "oom"
    assert classify("ray.exceptions.RayActorError: The actor died unexpectedly") == "worker_died"
    assert classify(KILLED_TEXT, ActorDiedError()) == "worker_died"  # "OOM killer" is Ray's guess, not evidence
    assert classify(KILLED_TEXT, ActorDiedError(), oom_evidence=True) == "oom"
    assert classify("orchestrator.trial.errors.OomRetriesExhausted: out of memory in train and no smaller plan") == "gave_up"
    assert classify("ValueError: a bug in the model") == "other"
    assert classify(UNREACHABLE_TEXT) == "node_unreachable"
    assert classify(KILLED_TEXT + "\nThe actor died because its node has died. Node Id: 6872") == "node_died"


#: What the driver read, in error.txt, when the raylet of the trial's node was SIGKILLed (Ray 2.60,
#: tests/test_multinode.py): the connection is gone before Ray declares the node dead.
UNREACHABLE_TEXT = (
    "The actor 69f3e4bc2ac82b6740a9fead03000000 is unavailable: The actor is temporarily unavailable: RpcError: "
    "RPC error: Socket closed rpc_code: 14. The task may or may not have been executed on the actor."
)


def test_a_worker_killed_without_evidence_of_memory_restarts_with_the_same_plan(tmp_path):
    scheduler = OomAwareScheduler(FIFOScheduler())
    trial = _trial(tmp_path, f"Failure # 1\n{KILLED_TEXT}\n", error=ActorDiedError())
    scheduler.on_trial_error(None, trial)
    # Restarted with its plan (no shrink), told why, should it resume on another node.
    assert trial.config == {"lr": 0.1, RESTART_REASON_KEY: "worker_died"} and trial.run_metadata.num_failures == 1


def test_a_trial_whose_node_stopped_answering_restarts_with_the_same_plan(tmp_path):
    scheduler = OomAwareScheduler(FIFOScheduler())
    trial = _trial(tmp_path, f"Failure # 1 (occurred at x)\n{UNREACHABLE_TEXT}\n")
    scheduler.on_trial_error(None, trial)
    assert trial.config == {"lr": 0.1, RESTART_REASON_KEY: "node_unreachable"}


def test_a_worker_that_died_of_memory_restarts_with_one_more_reduction(tmp_path):
    scheduler = OomAwareScheduler(FIFOScheduler())
    event = OomEvent("train", 0, 3, 64, 64, 2**20, 2**22, None, "out of memory")
    write_oom_evidence(str(tmp_path), event)  # written by the trial before the recovery killed it
    trial = _trial(tmp_path, f"Failure # 1\n{KILLED_TEXT}\n", error=ActorDiedError())
    scheduler.on_trial_error(None, trial)
    assert trial.config[OOM_SHRINKS_KEY] == 1
    assert not (tmp_path / OOM_EVIDENCE_FILE).exists()  # taken: a later death needs its own
    trial = _trial(tmp_path, f"Failure # 2\n{MEMORY_MONITOR_TEXT}\n", config=trial.config)
    scheduler.on_trial_error(None, trial)
    assert trial.config[OOM_SHRINKS_KEY] == 2


def test_a_pickled_error_from_an_earlier_failure_is_not_read_as_this_one(tmp_path):
    """Tune pickles only Ray's task and actor errors: the memory monitor's leaves the older pickle in place."""
    trial = _trial(tmp_path, f"Failure # 2\n{MEMORY_MONITOR_TEXT}\n", error=ValueError("an earlier bug"))
    assert pickled_failure(trial.pickled_error_file, last_failure(trial.error_file)) is None
    trial = _trial(tmp_path, f"Failure # 1\n{KILLED_TEXT}\n", error=ActorDiedError())
    assert isinstance(pickled_failure(trial.pickled_error_file, last_failure(trial.error_file)), ActorDiedError)


def test_a_trial_that_gave_up_is_not_trained_again(tmp_path):
    scheduler = OomAwareScheduler(FIFOScheduler())
    trial = _trial(tmp_path, (
        "Failure # 1\nTraceback (most recent call last):\n  File x\n"
        "orchestrator.trial.errors.OomRetriesExhausted: out of memory in train and no smaller plan is left; 1 OOM event(s):\n"
        "  epoch 0 train step 3: micro-batch 1, eval batch 8, asked 10 B with 20 B allocated -> gave up\n"
    ))
    scheduler.on_trial_error(None, trial)
    assert trial.config[OOM_GAVE_UP_KEY] == (
        "out of memory in train and no smaller plan is left; 1 OOM event(s):\n"
        "  epoch 0 train step 3: micro-batch 1, eval batch 8, asked 10 B with 20 B allocated -> gave up"
    )
    assert trial.run_metadata.num_failures == trial.max_failures  # its next failure is its last


def test_other_errors_are_not_retried_by_default(tmp_path):
    """As with Tune's own default (max_failures=0): a bug in the model fails its trial once."""
    scheduler = OomAwareScheduler(FIFOScheduler())
    trial = _trial(tmp_path, "Failure # 1\nTraceback\n  File x\nmy_models.wide.ShapeError: bad width 17\n")
    scheduler.on_trial_error(None, trial)
    assert trial.config == {"lr": 0.1, OTHER_FAILURES_KEY: 1, NOT_RETRIED_KEY: "ShapeError: bad width 17"}
    assert trial.run_metadata.num_failures == trial.max_failures  # the restart Tune makes is the last


def test_other_errors_are_retried_up_to_max_failures(tmp_path):
    scheduler = OomAwareScheduler(FIFOScheduler(), max_failures=1)
    trial = _trial(tmp_path, "Failure # 1\nOSError: stale file handle\n")
    scheduler.on_trial_error(None, trial)
    assert trial.config == {"lr": 0.1, OTHER_FAILURES_KEY: 1} and trial.run_metadata.num_failures == 1
    trial = _trial(tmp_path, "Failure # 2\nOSError: stale file handle\n", config=trial.config, failures=2)
    scheduler.on_trial_error(None, trial)
    assert trial.config[NOT_RETRIED_KEY] == "OSError: stale file handle"


def test_a_data_error_is_not_retried(tmp_path):
    """The trial reports its data error before it raises it: its retry budget is what it has
    spent, so Tune does not restart it, and the failure needs no restart keys."""
    scheduler = OomAwareScheduler(FIFOScheduler(), max_failures=2)
    trial = _trial(tmp_path, "DataError: train_data sample 13: ...", failures=0, max_failures=5)
    decision = scheduler.on_trial_result(None, trial, {"data_error": "train_data sample 13: ..."})
    assert decision == FIFOScheduler.CONTINUE
    trial.run_metadata.num_failures += 1  # Tune counts the failure, then asks whether to recover
    assert trial.run_metadata.num_failures > trial.max_failures  # Trial.should_recover() is False
    scheduler.on_trial_error(None, trial)
    assert trial.config == {"lr": 0.1}


def test_the_exception_line_is_the_innermost_without_its_module():
    text = (
        "ray.exceptions.RayTaskError(OomRetriesExhausted): \x1b[36mray::ImplicitFunc.train()\x1b[39m\n"
        "  File x, in run\n    raise ValueError(f'a: {b}')\n"
        "orchestrator.trial.errors.OomRetriesExhausted: out of memory in train; 2 OOM event(s):\n  epoch 0 ...\n"
    )
    assert exception_line(text) == "OomRetriesExhausted: out of memory in train; 2 OOM event(s):"
    assert exception_line("Traceback\n  File x\nKeyboardInterrupt\n") == "KeyboardInterrupt"
    # A restart that fails at once names the earlier error; our wrapper's name is not news.
    assert exception_line("orchestrator.trial.errors.NotRetriedError: ValueError: bad (failed 2 time(s))\n") == (
        "ValueError: bad (failed 2 time(s))")


def test_the_exception_line_says_where_the_user_s_own_code_raised_it(tmp_path, monkeypatch):
    """The innermost frame that is neither an installed package's, the standard library's nor
    the orchestrator's own, relative to the working directory; a chained exception's cause is not it."""
    from orchestrator import failures

    ours = os.path.join(os.path.dirname(failures.__file__), "trial", "run.py")
    user = tmp_path / "my_models" / "wide.py"
    text = (
        "ray::ImplicitFunc.train() (pid=1)\n"
        '  File "/venv/lib/python3.11/site-packages/ray/tune/trainable/util.py", line 134, in inner\n'
        f'  File "{ours}", line 116, in run\n'
        f'  File "{user}", line 14, in loss\n'
        "    return F.linear(x, self.w)\n"
        '  File "/venv/lib/python3.11/site-packages/torch/nn/functional.py", line 9, in linear\n'
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x32 and 16x8)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert exception_line(text) == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x32 and 16x8) (at my_models/wide.py:14)"
    chained = text + (
        "\nThe above exception was the direct cause of the following exception:\n\n"
        f'  File "{ours}", line 120, in run\n'
        "orchestrator.trial.errors.DataError: sample 3 could not be loaded\n"
    )
    assert exception_line(chained) == "DataError: sample 3 could not be loaded"
    assert exception_line(text.replace(str(user), ours)) == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (64x32 and 16x8)"


CORRUPT_DATA = """\
import dataclasses

from trainables.mlp import MLPWorkload


class Corrupt:
    def __init__(self, data, bad):
        self.data, self.bad = data, bad

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        if index == self.bad:
            raise ValueError(f"cannot decode sample {index}")
        return self.data[index]


@dataclasses.dataclass
class CorruptAt(MLPWorkload):
    bad_index: int = 200

    def train_data(self):
        return Corrupt(super().train_data(), self.bad_index)
"""

CORRUPT_SWEEP = """
experiment: corrupt
workload: {name: "my_data.corrupt:CorruptAt", params: {depth: 1, width: 16, train_samples: 512, eval_samples: 64}}
search_space:
  lr: {grid: [0.01]}
effective_batch_size: 64
stop: {epochs: 2}
memory: {estimator: static}
"""


@pytest.mark.integration
def test_a_sample_that_cannot_be_loaded_ends_its_trial_once_in_one_line(tmp_path):
    """The installed command, from the user's folder: exit 1, the sample and the user's line named
    in the table, no traceback on the console (it is in the trial's log file the line names), and
    the trial not restarted (Tune's error file holds one failure)."""
    import glob
    import re
    import subprocess

    from tests.conftest import command_env, installed_command

    (tmp_path / "my_data").mkdir()
    (tmp_path / "my_data" / "__init__.py").write_text("")
    (tmp_path / "my_data" / "corrupt.py").write_text(CORRUPT_DATA)
    (tmp_path / "sweep.yaml").write_text(CORRUPT_SWEEP)
    done = subprocess.run([installed_command(), "run", "sweep.yaml", "--num-cpus", "1"], cwd=tmp_path,
                          env=command_env(), capture_output=True, text=True, timeout=600)
    console = done.stdout + done.stderr
    assert done.returncode == 1, console[-3000:]
    assert "Traceback" not in console, console[-3000:]
    [row] = [line for line in done.stdout.splitlines() if "ERROR: " in line]
    assert re.search(r"ERROR: DataError: train_data sample 200: \S*my_data/corrupt\.py:15: ValueError: cannot decode "
                     r"sample 200 \(epoch 1, step \d+\); not retried \(a data error\); traceback in (\S+trial\.log)$", row), row
    log = row.rsplit("traceback in ", 1)[1]
    assert "Traceback" in open(log).read()
    [error_file] = glob.glob(str(tmp_path / "orchestrator_results" / "corrupt_*" / "*" / "error.txt"))
    assert open(error_file).read().count("Failure # ") == 1


def test_asha_ranks_a_diverged_trials_infinite_metric_last_without_a_numpy_warning():
    import warnings

    from ray.tune.experiment import Trial
    from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler

    from orchestrator.retry import OomAwareScheduler

    scheduler = OomAwareScheduler(AsyncHyperBandScheduler(metric="eval_loss", mode="min", time_attr="epoch", max_t=4))
    trials = [Trial("__fake", stub=True, trial_id=f"t{i}") for i in range(3)]
    for trial in trials:
        scheduler.on_trial_add(None, trial)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decisions = [scheduler.on_trial_result(None, trial, {"epoch": 1, "eval_loss": loss})
                     for trial, loss in zip(trials, (0.5, float("inf"), 0.4))]
    assert decisions == [TrialScheduler.CONTINUE, TrialScheduler.STOP, TrialScheduler.CONTINUE]
