"""The config layer: valid sweeps parse; every class of mistake is one line naming its key, exit 2."""

import glob
import itertools
import re
import subprocess
import sys

import pytest

from orchestrator.config import (
    CheckpointPolicy,
    DataLoading,
    Domain,
    Every,
    LrSchedule,
    Stop,
    folder_name,
    load_spec,
    read_yaml,
    storage_folder,
)
from orchestrator.errors import ConfigError
from orchestrator.space import trial_configs
from tests.conftest import command_env, installed_command

VALID = """
experiment: t
workload: {name: mlp, params: {depth: 1}}
search_space:
  lr: {loguniform: [0.0001, 0.1]}
  width: {choice: [16, 32]}
effective_batch_size: 32
stop: {epochs: 2}
"""


def write(tmp_path, text, name="sweep.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_every_shipped_config_parses(path):
    spec = load_spec(path)
    assert spec.experiment and spec.effective_batch_size > 0


def test_a_valid_file_gives_a_typed_spec_with_defaults(tmp_path):
    spec = load_spec(write(tmp_path, VALID))
    assert spec.workload == "mlp" and spec.params == {"depth": 1}
    assert spec.search_space["lr"] == Domain("loguniform", (0.0001, 0.1))
    assert spec.stop == Stop(epochs=2) and spec.num_samples == 1 and spec.metric == "eval_loss" and spec.mode == "min"
    assert spec.eval_every == Every("epochs", 1) and spec.checkpoint == CheckpointPolicy(every=None, keep=2)
    assert spec.data == DataLoading() and spec.schedule is None and spec.max_grad_norm is None
    assert spec.memory.estimator == "trace" and spec.memory.safety_margin == 0.98
    assert spec.memory.allocator_conf == "expandable_segments:True"


def test_sizes_are_read_with_units(tmp_path):
    spec = load_spec(write(tmp_path, VALID), ["memory.device=emulated", "memory.capacity=8MiB", "memory.budget=24GiB"])
    assert spec.memory.capacity == 8 * 2**20 and spec.memory.budget == 24 * 2**30


def test_a_data_parallel_trial_with_a_capacity_per_rank(tmp_path):
    spec = load_spec(write(tmp_path, VALID), ["resources={workers: 2, cpu: 1}", "memory={device: emulated, capacity: [64MiB, 8MiB]}"])
    assert spec.resources.workers == 2
    assert spec.memory.rank_capacities == (64 * 2**20, 8 * 2**20) and spec.memory.capacity == 8 * 2**20
    assert spec.memory.capacity_of(0) == 64 * 2**20 and spec.memory.capacity_of(1) == 8 * 2**20


def test_a_storage_path_under_home_is_the_home_folders(tmp_path, monkeypatch):
    """As Tune's ``~/ray_results``: no shell expands ``~`` in a YAML file or after ``--storage-path=``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = load_spec(write(tmp_path, VALID), ["storage_path=~/sweeps"])
    assert spec.storage_path == str(tmp_path / "home" / "sweeps")
    assert storage_folder("~/elsewhere", "--storage-path") == str(tmp_path / "home" / "elsewhere")


def test_set_overrides_a_key_as_yaml(tmp_path):
    spec = load_spec(write(tmp_path, VALID), ["stop.epochs=5", "search_space.width={grid: [8, 16]}", "resources.gpu=0.25"])
    assert spec.stop.epochs == 5
    assert spec.search_space["width"] == Domain("grid", ((8, 16),))
    assert spec.resources.gpu == 0.25


def test_set_extends_a_section_the_yaml_gives_in_its_short_form(tmp_path):
    """``scheduler: fifo`` is ``scheduler: {type: fifo}``, ``workload: mlp`` is ``{name: mlp}`` and
    ``eval_every: 50`` is ``{steps: 50}``: a key set under them extends that mapping."""
    short = VALID.replace("workload: {name: mlp, params: {depth: 1}}", "workload: mlp\nscheduler: fifo\neval_every: 50")
    spec = load_spec(write(tmp_path, short), ["scheduler.type=asha", "scheduler.grace_period=2",
                                              "workload.params.depth=3", "eval_every.max_batches=4"])
    assert spec.scheduler.type == "asha" and spec.scheduler.grace_period == 2
    assert spec.workload == "mlp" and spec.params == {"depth": 3}
    assert (spec.eval_every.unit, spec.eval_every.count, spec.eval_every.max_batches) == ("steps", 50, 4)


def test_set_under_a_value_that_is_not_a_section_says_what_it_is(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set stop\.epochs\.max=3: stop\.epochs is 2 in the config, not a mapping; "
                                          r"set it whole \(--set stop\.epochs=VALUE\)$"):
        load_spec(write(tmp_path, VALID), ["stop.epochs.max=3"])


def test_exponent_floats_are_numbers_as_in_yaml_1_2(tmp_path):
    """PyYAML alone reads ``1e-4`` as a string; every sweep writes learning rates that way."""
    spec = load_spec(write(tmp_path, VALID.replace("[0.0001, 0.1]", "[1e-4, 1E-1]")), ["workload.params.lr=3e-4"])
    assert spec.search_space["lr"] == Domain("loguniform", (0.0001, 0.1))
    assert spec.params["lr"] == 0.0003


def test_grid_and_samples_expand_to_trial_configs(tmp_path):
    spec = load_spec(write(tmp_path, VALID), ["num_samples=3"])
    configs = trial_configs(spec)
    assert len(configs) == 3
    assert all(1e-4 <= c["lr"] <= 0.1 and c["width"] in (16, 32) and c["workload"] == "mlp" for c in configs)


def test_a_workload_field_without_a_default_must_be_given(tmp_path):
    """Else every distinct model fails to construct, naming the orchestrator's line, not the key."""
    needs = VALID.replace("name: mlp, params: {depth: 1}", "name: 'tests.workloads:NeedsBlocks', params: {depth: 1}")
    with pytest.raises(ConfigError, match=r"^workload\.params\.blocks: workload tests\.workloads:NeedsBlocks needs a "
                                          r"value for it \(its field has no default\); give it in workload\.params or search_space$"):
        load_spec(write(tmp_path, needs))
    assert load_spec(write(tmp_path, needs), ["workload.params.blocks=2"]).params["blocks"] == 2
    assert "blocks" in load_spec(write(tmp_path, needs), ["search_space.blocks={grid: [1, 2]}"]).search_space


BAD = [
    ("unknown top-level key", ["epocs=3"], "epocs: unknown key"),
    ("unknown nested key", ["memory.budgett=1GiB"], "memory.budgett: unknown key (did you mean budget? expected one of: "),
    ("wrong type", ["effective_batch_size=lots"], "effective_batch_size: expected a positive integer, got 'lots'"),
    ("zero size", ["effective_batch_size=0"], "effective_batch_size: expected a positive integer, got 0"),
    ("negative epochs", ["stop.epochs=-1"], "stop.epochs: expected a positive integer, got -1"),
    ("bad memory size", ["memory.budget=-3GiB"], "memory.budget: expected a size"),
    ("margin out of range", ["memory.safety_margin=1.5"], "memory.safety_margin: expected a number in (0, 1]"),
    ("unknown workload", ["workload.name=resnet9000"], "workload.name: unknown workload 'resnet9000'"),
    ("unimportable workload", ["workload.name=nope.module:Thing"], "workload.name: workload 'nope.module:Thing': cannot import"),
    ("empty search space", ["search_space={}"], "search_space: expected at least one hyper-parameter"),
    ("empty choice", ["search_space.width={choice: []}"], "search_space.width.choice: expected a non-empty list"),
    ("bad bounds", ["search_space.lr={uniform: [1, 0]}"], "search_space.lr.uniform: expected low < high"),
    ("unknown primitive", ["search_space.lr={normal: [0, 1]}"], "search_space.lr: expected a constant or one of"),
    ("typo in a hyper-parameter", ["search_space.widht=3"],
     "search_space.widht: not a parameter of workload mlp (did you mean width? expected one of: "),
    ("bad estimator", ["memory.estimator=guess"], "memory.estimator: expected one of static, trace, measured, none"),
    ("negative gpu", ["resources.gpu=-1"], "resources.gpu: expected a GPU count"),
    ("emulated without capacity", ["memory.device=emulated"], "memory.capacity: memory.device 'emulated' needs a capacity"),
    ("a date where a name goes", ["experiment=2024-01-01"],
     "experiment: expected a non-empty string, got 2024-01-01, which YAML reads as a date; quote it to make it text"),
    ("a boolean where a name goes", ["experiment=on"],
     "experiment: expected a non-empty string, got True, which YAML reads as a boolean; quote it to make it text"),
    ("a GPU device with no GPU asked of Ray", ["memory.device=cuda", "resources.gpu=0"],
     "memory.device: 'cuda' trains on a GPU, but resources.gpu is 0 (Ray gives such a trial no GPU); ask for one "
     "(resources.gpu: 1) or use memory.device: auto"),
    ("bad scheduler", ["scheduler=pbt"], "scheduler: expected one of fifo, asha"),
    ("bad on_nan", ["on_nan=ignore"], "on_nan: expected one of stop, fail, continue, got 'ignore'"),
    ("allocator setting typo", ["memory.allocator_conf=expandible_segments:True"],
     "memory.allocator_conf: unknown key 'expandible_segments'"),
    ("allocator setting value", ["memory.allocator_conf=expandable_segments:true,max_split_size_mb:64"],
     "memory.allocator_conf: expandable_segments: expected True or False, got 'true'"),
    ("hyper-parameter of the wrong type", ["search_space.lr=fast"], "search_space.lr: workload mlp's lr expects a number, got 'fast'"),
    ("a list of values to try, without a primitive", ["search_space.lr=[0.1, 0.01]"],
     "search_space.lr: workload mlp's lr expects a number, got [0.1, 0.01] (to try each, write {grid: [0.1, 0.01]} "
     "or {choice: [0.1, 0.01]})"),
    ("a list of values to try, as a fixed parameter", ["workload.params.lr=[0.1, 0.01]"],
     "(to try each, write search_space.lr: {grid: [0.1, 0.01]} or {choice: [0.1, 0.01]})"),
    ("wrong type inside a choice", ["search_space.width={choice: [16, wide]}"],
     "search_space.width.choice: workload mlp's width expects an integer, got 'wide'"),
    ("floats for an integer", ["search_space.width={uniform: [8, 64]}"],
     "search_space.width.uniform: workload mlp's width expects an integer, uniform samples floats"),
    ("value outside a Literal", ["workload.params.optimizer=lion"],
     "workload.params.optimizer: workload mlp's optimizer expects one of sgd, adam, adamw, got 'lion'"),
    ("no budget", ["stop={}"], "stop: expected epochs, steps or both"),
    ("a budget of nothing", ["stop={epochs: null}"], "stop: expected epochs, steps or both"),
    ("a derived field is not a key", ["memory.rank_capacities=[8MiB]"], "memory.rank_capacities: unknown key"),
    ("params belong under workload", ["params={depth: 2}"], "params: unknown key"),
    ("a capacity list with a bad size", ["memory={device: emulated, capacity: [8MiB, lots]}"],
     "memory.capacity[1]: expected a size such as 24GiB or 512MB, got 'lots'"),
    ("unknown key in the workload section", ["workload.param={depth: 2}"],
     "workload.param: unknown key (did you mean params? expected one of: name, params)"),
    ("unknown budget", ["stop.hours=3"], "stop.hours: unknown key (expected one of: epochs, steps)"),
    ("fractional steps", ["stop.steps=2.5"], "stop.steps: expected a positive integer, got 2.5"),
    ("eval cadence unit", ["eval_every={hours: 1}"], "eval_every: expected one of {steps: N}, {minutes: N}, {epochs: N}"),
    ("negative eval cadence", ["eval_every.minutes=-5"], "eval_every.minutes: expected a positive number, got -5"),
    ("eval batches of nothing", ["eval_every={steps: 5, max_batches: 0}"], "eval_every.max_batches: expected a positive integer, got 0"),
    ("eval batches on a checkpoint", ["checkpoint.every={steps: 5, max_batches: 2}"], "checkpoint.every: expected one of {steps: N}"),
    ("checkpoint cadence", ["checkpoint.every={steps: 0}"], "checkpoint.every.steps: expected a positive integer, got 0"),
    ("checkpoints kept", ["checkpoint.keep=0"], "checkpoint.keep: expected a positive integer, got 0"),
    ("negative workers", ["data.num_workers=-1"], "data.num_workers: expected an integer >= 0, got -1"),
    ("prefetch without workers", ["data.prefetch_factor=4"],
     "data.prefetch_factor: needs worker processes (data.num_workers > 0), got num_workers 0"),
    ("unknown data key", ["data.shuffle=false"], "data.shuffle: unknown key"),
    ("unknown lr decay", ["schedule.decay=exponential"], "schedule.decay: expected one of constant, linear, cosine, got 'exponential'"),
    ("negative warm-up", ["schedule.warmup_steps=-10"], "schedule.warmup_steps: expected an integer >= 0, got -10"),
    ("final lr above lr", ["schedule.final_lr=2"], "schedule.final_lr: expected a fraction of lr in [0, 1], got 2"),
    ("negative max_grad_norm", ["max_grad_norm=-1"], "max_grad_norm: expected a positive number, got -1"),
    ("metric not reported", ["metric=eval_accuracy"],
     "metric: workload mlp does not report 'eval_accuracy' (it reports: train_loss, eval_loss)"),
    ("a storage path that is a URI", ["storage_path=s3://bucket/sweeps"],
     "storage_path: expected a folder, not a URI, got 's3://bucket/sweeps'"),
    ("experiment name climbing out of the storage path", ["experiment=../../x"],
     "experiment: expected a name, not a path (no '/', '\\', '..' or leading '.'), got '../../x'"),
    ("experiment name that is an absolute path", ["experiment=/tmp/x"], "experiment: expected a name, not a path"),
    ("experiment name Ray's metric tags cannot encode", ["experiment=café"],
     "experiment: expected a name of ASCII letters, digits, '_', '.' and '-' (not first), got 'café'"),
    ("experiment name with a space", ["experiment=my sweep"], "experiment: expected a name of ASCII letters"),
    ("experiment name read as an option", ["experiment=-x"], "experiment: expected a name of ASCII letters"),
    ("experiment name too long for a folder", [f"experiment={'x' * 250}"],
     "experiment: expected a name of at most 112 characters (the sweep's folder adds its start time), got 250"),
    ("a random search of half a million trials", ["num_samples=500001"],
     "num_samples: makes 500,001 trials (num_samples x grid sizes: 500,001), more than max_trials: 10,000"),
    ("missing workload class", ["workload.name=trainables.mlp:MLPWorkloadd"],
     "workload.name: workload 'trainables.mlp:MLPWorkloadd': module 'trainables.mlp' has no 'MLPWorkloadd' "
     "(its workloads: MLPWorkload)"),
    ("ASHA in steps without a step budget", ["scheduler={type: asha, time_attr: step}"],
     "scheduler.time_attr: step needs stop.steps (ASHA's last rung), which is not set"),
    ("effective batch not divisible by the ranks", ["resources.workers=3"],
     "effective_batch_size: 32 does not split evenly over resources.workers: 3; use 30 or 33, or workers: 2"),
    ("several GPUs per worker", ["resources={workers: 2, gpu: 2}"],
     "resources.gpu: with resources.workers: 2 each worker is one rank on one GPU; expected 0 or 1 (per worker), got 2"),
    ("a capacity list of the wrong length", ["resources.workers=2", "memory={device: emulated, capacity: [8MiB]}"],
     "memory.capacity: expected one capacity per worker (resources.workers: 2), got 1"),
    ("a clock cadence in a group", ["resources.workers=2", "eval_every={minutes: 5}"],
     "eval_every: minutes are not supported with resources.workers > 1"),
    ("plan verification on or off", ["memory.verify=sometimes"], "memory.verify: expected true or false, got 'sometimes'"),
    ("an estimator nobody registered", ["memory.estimator=flat"],
     "memory.estimator: expected one of static, trace, measured, none, got 'flat'"),
    ("a negative seed", ["seed=-1"], "seed: expected an integer from 0 to 4294967295, got -1"),
    ("a seed past 32 bits", ["seed=4294967296"], "seed: expected an integer from 0 to 4294967295, got 4294967296"),
    # A trial's seed from the search space or the params: each value it can draw is a seed.
    ("a searched seed past 32 bits", ["search_space.seed={randint: [0, 4611686018427387904]}"],
     "search_space.seed: expected an integer from 0 to 4294967295, got 4611686018427387903"),
    ("a searched negative seed", ["search_space.seed={choice: [1, -3]}"],
     "search_space.seed: expected an integer from 0 to 4294967295, got -3"),
    ("a seed drawn from a distribution of reals", ["search_space.seed={uniform: [0, 10]}"],
     "search_space.seed: expected integers (a randint, choice or grid of them), got a uniform distribution"),
    ("a negative seed in the params", ["workload.params.seed=-1"],
     "workload.params.seed: expected an integer from 0 to 4294967295, got -1"),
    # A trial's learning rate: torch's optimizers refuse a negative one only once the trial builds them.
    ("a negative learning rate in a grid", ["search_space.lr={grid: [0.01, -0.01]}"],
     "search_space.lr: expected a finite number >= 0, got -0.01"),
    ("a uniform learning rate below 0", ["search_space.lr={uniform: [-0.01, 0.01]}"],
     "search_space.lr: expected a finite number >= 0, got -0.01"),
    ("an infinite learning rate", ["search_space.lr={grid: [.inf]}"],
     "search_space.lr: expected a finite number >= 0, got inf"),
    ("a negative learning rate in the params", ["workload.params.lr=-1"],
     "workload.params.lr: expected a finite number >= 0, got -1"),
    ("an infinite upper bound", ["search_space.lr={uniform: [0, .inf]}"],
     "search_space.lr.uniform: expected finite bounds, got [0, inf]"),
    ("an infinite lower bound", ["search_space.lr={uniform: [-.inf, 0]}"],
     "search_space.lr.uniform: expected finite bounds, got [-inf, 0]"),
    ("an infinite log bound", ["search_space.lr={loguniform: [1e-4, .inf]}"],
     "search_space.lr.loguniform: expected finite bounds, got [0.0001, inf]"),
    ("a bound past a float", ["search_space.lr={loguniform: [1e-4, 1e400]}"],
     "search_space.lr.loguniform: expected finite bounds, got [0.0001, inf]"),
    ("a bound that is not a number", ["search_space.lr={uniform: [.nan, 1]}"],
     "search_space.lr.uniform: expected finite bounds, got [nan, 1]"),
    ("an infinite integer bound", ["search_space.width={randint: [1, .inf]}"],
     "search_space.width.randint: expected finite bounds, got [1, inf]"),
    ("bounds further apart than a float", ["search_space.lr={uniform: [-1e308, 1e308]}"],
     "search_space.lr.uniform: expected high - low within a float's range (at most 1.8e308), got [-1e+308, 1e+308]"),
    ("an integer bound past a float", [f"search_space.lr={{uniform: [0, {10**400}]}}"],
     "search_space.lr.uniform: expected high - low within a float's range (at most 1.8e308), got [0, 1000"),
    ("an integer bound past int64", ["search_space.width={randint: [1, 99999999999999999999999]}"],
     "search_space.width.randint: expected integers from -2**63 to 2**63 (Tune samples randint as numpy's int64), "
     "got [1, 99999999999999999999999]"),
    ("a negative integer bound past int64", [f"search_space.width={{randint: [{-2**63 - 1}, 0]}}"],
     "search_space.width.randint: expected integers from -2**63 to 2**63 (Tune samples randint as numpy's int64), "
     "got [-9223372036854775809, 0]"),
    ("an infinite budget", ["memory.budget=1e400GiB"],
     "memory.budget: expected a size of at most 2**63 - 1 bytes (8 EiB), got '1e400GiB'"),
    ("a budget past 64 bits", [f"memory.budget={2**63}"],
     "memory.budget: expected a size of at most 2**63 - 1 bytes (8 EiB), got 9223372036854775808"),
    ("a fraction of a byte", ["memory.budget=1.5"],
     "memory.budget: expected a whole number of bytes, or a larger unit such as 1.5GiB, got 1.5"),
    ("an infinite capacity", ["memory={device: emulated, capacity: .inf}"],
     "memory.capacity: expected a size of at most 2**63 - 1 bytes (8 EiB), got inf"),
    # A trial's workload is a name: never drawn from a distribution, never a number or a list.
    ("a workload drawn from a distribution", ["search_space.workload={uniform: [0, 1]}"],
     "search_space.workload: expected a workload name, or {grid: [...]} or {choice: [...]} of names, got {uniform: ...}"),
    ("a number among the workloads", ["search_space.workload={grid: [mlp, 3]}"],
     "search_space.workload: expected a workload name, or {grid: [...]} or {choice: [...]} of names, got 3"),
    ("a list among the workloads", ["search_space.workload={choice: [[mlp], cnn]}"],
     "search_space.workload: expected a workload name, or {grid: [...]} or {choice: [...]} of names, got ['mlp']"),
    ("a number as the workload", ["search_space.workload=7"],
     "search_space.workload: expected a workload name, or {grid: [...]} or {choice: [...]} of names, got 7"),
    ("ASHA that stops no trial", ["scheduler={type: asha, reduction_factor: 1}"],
     "scheduler.reduction_factor: expected an integer >= 2, got 1"),
    ("ASHA's first rung past its last", ["scheduler={type: asha, grace_period: 5}", "stop.epochs=1"],
     "scheduler.grace_period: expected at most stop.epochs (1, ASHA's last rung), got 5"),
    ("ASHA's first rung past its last in steps", ["scheduler={type: asha, time_attr: step, grace_period: 100}",
                                                  "stop={steps: 50}"],
     "scheduler.grace_period: expected at most stop.steps (50, ASHA's last rung), got 100"),
    ("a grace period FIFO ignores", ["scheduler={type: fifo, grace_period: 2}"],
     "scheduler.grace_period: needs type: asha (FIFO runs every trial to its stop), got type: fifo"),
    ("a reduction factor FIFO ignores", ["scheduler=fifo", "scheduler.reduction_factor=3"],
     "scheduler.reduction_factor: needs type: asha (FIFO runs every trial to its stop), got type: fifo"),
    ("ASHA's time attribute without ASHA", ["scheduler={time_attr: step}"],
     "scheduler.time_attr: needs type: asha (FIFO runs every trial to its stop), got type: fifo"),
    ("an ASHA config switched to FIFO by one key", ["scheduler={type: asha, grace_period: 1}", "scheduler.type=fifo"],
     "scheduler.grace_period: needs type: asha (FIFO runs every trial to its stop), got type: fifo; for FIFO, set the "
     "scheduler whole (--set scheduler=fifo)"),
    ("an empty key part", [".stop=3"], "--set .stop=3: expected KEY.PATH=VALUE with no empty key part"),
    ("an empty key part inside", ["stop..epochs=3"], "--set stop..epochs=3: expected KEY.PATH=VALUE with no empty key part"),
    ("an empty last key part", ["stop.=3"], "--set stop.=3: expected KEY.PATH=VALUE with no empty key part"),
    ("a value that is not YAML", ["stop={epochs: 1"],
     "--set stop={epochs: 1: value is not valid YAML at line 1, column 11: expected ',' or '}', but got '<stream end>' "
     "(while parsing a flow mapping at line 1, column 1)"),
]


@pytest.mark.parametrize("case,overrides,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_key_and_what_was_expected(tmp_path, case, overrides, message):
    with pytest.raises(ConfigError) as err:
        load_spec(write(tmp_path, VALID), overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_misspelt_key_is_named_before_the_key_it_leaves_missing(tmp_path):
    """``effective_batch_sise`` both is an unknown key and leaves ``effective_batch_size`` missing:
    the misspelling is the mistake to name (pydantic lists the missing key first)."""
    with pytest.raises(ConfigError) as err:
        load_spec(write(tmp_path, VALID.replace("effective_batch_size:", "effective_batch_sise:")))
    assert str(err.value).startswith(
        "effective_batch_sise: unknown key (did you mean effective_batch_size? expected one of: checkpoint, data, ")
    with pytest.raises(ConfigError) as err:  # nothing near: no guess
        load_spec(write(tmp_path, VALID), ["stop.hours=3"])
    assert str(err.value) == "stop.hours: unknown key (expected one of: epochs, steps)"


def test_the_longest_names_are_taken_as_they_are(tmp_path):
    """A sweep's folder is at most 128 characters: ``--name`` names it, an experiment's gets its start time added."""
    experiment = "a-Z_0." + "x" * 106
    assert load_spec(write(tmp_path, VALID), [f"experiment={experiment}"]).experiment == experiment
    with pytest.raises(ConfigError, match=r"^experiment: expected a name of at most 112 characters \(the sweep's folder "
                                          r"adds its start time\), got 113$"):
        load_spec(write(tmp_path, VALID), [f"experiment={experiment}x"])
    name = experiment + "_20261126-120000"
    assert folder_name(name, "--name") == name
    with pytest.raises(ConfigError, match=r"^--name: expected a name of at most 128 characters, got 129$"):
        folder_name(name + "x", "--name")


# -- bounded input: refused in one line before it costs memory or time --------------------------


GRID_OF_A_MILLION = VALID.replace("width: {choice: [16, 32]}", """\
width: {grid: [%s]}
  depth: {grid: [%s]}
  seed: {grid: [%s]}""" % ((", ".join(str(n) for n in range(1, 101)),) * 3))


def test_the_trial_count_is_bounded_before_the_space_is_expanded(tmp_path):
    path = write(tmp_path, GRID_OF_A_MILLION)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert str(err.value) == (
        "search_space: makes 1,000,000 trials (num_samples x grid sizes: 1 x 100 x 100 x 100), more than "
        "max_trials: 10,000; raise max_trials (--set max_trials=1000000) to run a sweep this large"
    )
    assert load_spec(path, ["max_trials=1000000"]).trial_count() == 1_000_000  # counted, never expanded
    assert load_spec(path, ["num_samples=2", "search_space.seed=0", "search_space.depth=1"]).trial_count() == 200


def laughs(levels: int = 9) -> str:
    """"Billion laughs" in YAML's flow style: each level a list of nine aliases of the one before."""
    names = "abcdefghijklmnop"[:levels]
    parts = [f"{names[0]}: &{names[0]} [{', '.join(['lol'] * 9)}]"]
    parts += [f"{n}: &{n} [{', '.join(['*' + p] * 9)}]" for p, n in itertools.pairwise(names)]
    return "{" + ", ".join(parts) + "}"


@pytest.mark.parametrize("text,message", [
    (f"experiment: t\nbomb: {laughs()}\n",
     (r"its aliases \(\*name\) expand to 490,329,036 more YAML nodes, past the 100,000 a sweep file's aliases may add; "
      "write the values out, or nest fewer aliases$")),
    ("experiment: t\nloop: &loop [1, *loop]\n",
     r"an alias \(\*name\) refers to a node that contains it; a sweep file cannot be recursive$"),
    ("experiment: t\nv: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than a sweep file can be read$"),
], ids=["billion laughs", "recursive alias", "deep nesting"])
def test_a_yaml_bomb_is_one_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert re.match(re.escape(path) + ": " + message, str(err.value)), str(err.value)


def test_a_bomb_in_an_override_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set workload\.params\.tags: its aliases \(\*name\) expand to [\d,]+ more"):
        load_spec(write(tmp_path, VALID), [f"workload.params.tags={laughs()}"])


def test_aliases_that_repeat_a_little_are_read(tmp_path):
    """Anchors, aliases and merge keys are YAML a sweep may use: only their expansion is bounded."""
    text = VALID.replace("width: {choice: [16, 32]}", "width: &sizes {choice: [16, 32]}\n  depth: {<<: *sizes}")
    spec = load_spec(write(tmp_path, text))
    assert spec.search_space["width"] == spec.search_space["depth"] == Domain("choice", ((16, 32),))
    assert read_yaml(laughs(4), "four levels")["d"][8][8][8][8] == "lol"  # 8,302 nodes from 4 levels


def test_a_file_past_1_mib_is_refused_before_it_is_read(tmp_path):
    text = VALID + "# " + "x" * 2**20 + "\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert str(err.value).startswith(f"{path}: {len(text):,} bytes, more than the 1,048,576 (1.0 MiB) a sweep file may be")
    with pytest.raises(ConfigError, match=r"cannot read the config file \(Is a directory\)"):
        load_spec(str(tmp_path))


@pytest.mark.parametrize("verb,text,flags,message", [
    ("run", VALID.replace("experiment: t", "experiment: café"), [],
     "error: experiment: expected a name of ASCII letters, digits, '_', '.' and '-' (not first), got 'café'"),
    ("run", VALID, ["--name", "x" * 250], "error: --name: expected a name of at most 128 characters, got 250"),
    ("run", VALID.replace("experiment: t", f"experiment: {'x' * 250}"), [],
     "error: experiment: expected a name of at most 112 characters (the sweep's folder adds its start time), got 250"),
    ("run", VALID, ["--name", "café"],
     "error: --name: expected a name of ASCII letters, digits, '_', '.' and '-' (not first), got 'café'"),
    ("plan", f"experiment: t\nbomb: {laughs()}\n", [], "error: sweep.yaml: its aliases (*name) expand to 490,329,036"),
    ("plan", VALID + "# " + "x" * 54 * 2**20 + "\n", [],
     f"error: sweep.yaml: {len(VALID) + 54 * 2**20 + 3:,} bytes, more than the 1,048,576"),
    ("plan", GRID_OF_A_MILLION, [], "error: search_space: makes 1,000,000 trials"),
    ("run", GRID_OF_A_MILLION, ["--set", "num_samples=3"], "error: search_space: makes 3,000,000 trials"),
    ("run", VALID, ["--set", "seed=-1"], "error: seed: expected an integer from 0 to 4294967295, got -1"),
    ("plan", VALID, ["--device-memory", "1e400GiB"],
     "error: --device-memory: expected a size of at most 2**63 - 1 bytes (8 EiB), got '1e400GiB'"),
    ("run", VALID, ["--host-memory", "1e400GiB"],
     "error: --host-memory: expected a size of at most 2**63 - 1 bytes (8 EiB), got '1e400GiB'"),
    ("plan", "experiment: [unclosed\n", [],
     "error: sweep.yaml: not valid YAML at line 2, column 1: expected ',' or ']', but got '<stream end>'"),
], ids=["non-ASCII experiment", "long --name", "long experiment", "non-ASCII --name", "billion laughs", "54 MB file",
        "grid of a million", "run's grid", "negative seed", "infinite --device-memory", "infinite --host-memory",
        "broken YAML"])
def test_the_installed_command_refuses_hostile_input_in_one_line(tmp_path, verb, text, flags, message):
    """The user's path: ``.venv/bin/orchestrator`` from a folder outside the repository, each in
    one line and exit 2, before Ray starts (nothing is made where results or records would go)."""
    write(tmp_path, text)
    proc = subprocess.run(
        [installed_command(), verb, "sweep.yaml", *flags,
         *(["--storage-path", "results", "--tracking-uri", "sqlite:///m.db"] if verb == "run" else [])],
        capture_output=True, text=True, cwd=tmp_path, env=command_env(), timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists() and not (tmp_path / "m.db").exists()


def test_training_settings_are_read(tmp_path):
    spec = load_spec(write(tmp_path, VALID), [
        "stop={steps: 500}", "eval_every={minutes: 2.5}", "checkpoint={every: 100, keep: 3}",
        "data={num_workers: 2, prefetch_factor: 4, persistent_workers: true}",
        "schedule={warmup_steps: 50, decay: cosine, final_lr: 0.1}", "max_grad_norm=1",
        "scheduler={type: asha, time_attr: step, grace_period: 100}",
    ])
    assert spec.stop == Stop(epochs=None, steps=500) and spec.eval_every == Every("minutes", 2.5)
    assert spec.checkpoint == CheckpointPolicy(every=Every("steps", 100), keep=3)
    assert spec.data == DataLoading(num_workers=2, pin_memory=None, prefetch_factor=4, persistent_workers=True)
    assert spec.schedule == LrSchedule(50, "cosine", 0.1) and spec.max_grad_norm == 1.0
    assert spec.scheduler.time_attr == "step" and spec.scheduler.grace_period == 100


def test_eval_every_may_cap_the_batches_of_an_evaluation(tmp_path):
    assert load_spec(write(tmp_path, VALID), ["eval_every={steps: 200, max_batches: 50}"]).eval_every == Every("steps", 200, 50)
    assert load_spec(write(tmp_path, VALID), ["eval_every.max_batches=8"]).eval_every == Every("epochs", 1, 8)
    assert Every("steps", 200, 50).describe() == "every 200 steps on at most 50 batches"


def test_a_metric_the_workload_declares_and_a_schedule_it_does_not_build_itself(tmp_path, monkeypatch):
    (tmp_path / "accuracy_models.py").write_text(
        "import dataclasses\n"
        "from trainables.mlp import MLPWorkload\n"
        "@dataclasses.dataclass\n"
        "class Scored(MLPWorkload):\n"
        "    metrics = ('loss', 'accuracy')\n"
        "    def build_scheduler(self, optimizer, total_steps):\n"
        "        return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_spec(write(tmp_path, VALID), ["workload.name=accuracy_models:Scored", "metric=eval_accuracy", "mode=max"])
    assert spec.metric == "eval_accuracy"
    with pytest.raises(ConfigError) as err:  # min would name the worst trial best
        load_spec(write(tmp_path, VALID), ["workload.name=accuracy_models:Scored", "metric=eval_accuracy"])
    assert str(err.value) == ("mode: metric 'eval_accuracy' is not a loss; say whether a better trial has a higher "
                              "value (mode: max) or a lower one (mode: min)")
    with pytest.raises(ConfigError, match="^schedule: workload accuracy_models:Scored builds its own scheduler"):
        load_spec(write(tmp_path, VALID), ["workload.name=accuracy_models:Scored", "schedule={decay: linear}"])


def test_the_widest_settings_the_bounds_allow_are_taken(tmp_path):
    """Each bound above refuses only what is past it: its edge is a valid sweep."""
    spec = load_spec(write(tmp_path, VALID), [
        "seed=4294967295", f"search_space.width={{randint: [{-2**63}, {2**63}]}}",
        "search_space.lr={uniform: [0, 1.7e308]}", f"memory.budget={2**63 - 1}", "memory.capacity=1.5KB",
        "scheduler={type: asha, grace_period: 2, reduction_factor: 2}",
    ])
    assert spec.seed == 2**32 - 1 and spec.search_space["width"] == Domain("randint", (-2**63, 2**63))
    assert spec.memory.budget == 2**63 - 1 and spec.memory.capacity == 1500
    assert spec.scheduler.grace_period == spec.stop.epochs == 2
    assert load_spec(write(tmp_path, VALID), ["scheduler=none"]).scheduler.type == "fifo"


@pytest.mark.parametrize("text,message", [
    ("experiment: [unclosed\nstop: {epochs: 1}\n",
     "not valid YAML at line 2, column 5: expected ',' or ']', but got ':' "
     "(while parsing a flow sequence at line 1, column 13)"),
    ("experiment: t\n  stop: 1\n", "not valid YAML at line 2, column 7: mapping values are not allowed here"),
    ("experiment: t\x07\n", "not valid YAML at position 13: unacceptable character #x0007: special characters are not allowed"),
    # PyYAML would keep the second without a word; YAML 1.2 forbids it.
    ("search_space:\n  lr: {grid: [0.1]}\n  lr: {grid: [0.2]}\n",
     "not valid YAML at line 3, column 3: duplicate key 'lr' (first at line 2, column 3)"),
], ids=["unclosed list", "bad indentation", "control character", "a key twice"])
def test_broken_yaml_names_the_file_and_where_in_it(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_spec(path)
    assert str(err.value) == f"{path}: {message}"


def test_a_merged_mapping_may_be_overridden_by_the_keys_beside_it():
    """``<<: *base`` then a key of base's: YAML's merge, not a key twice; also where the merged
    mapping merges and overrides in turn (construction flattens it in place: checked before)."""
    assert read_yaml("base: &b {epochs: 1, steps: 5}\nstop: {<<: *b, epochs: 2}\n", "t")["stop"] == {"epochs": 2, "steps": 5}
    nested = "a: &a {lr: 0.1}\nsweep: {base: &b {<<: *a, lr: 1}}\nother: {<<: *b, lr: 2}\n"
    assert read_yaml(nested, "t")["other"] == {"lr": 2}
    read_yaml("{1: x, 1.0: y, true: z}", "t")  # an int, a float and a bool: three YAML keys, not one twice


def test_a_file_that_is_not_utf_8_names_the_file(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_bytes(b"experiment: \xff\n")
    with pytest.raises(ConfigError) as err:
        load_spec(str(path))
    assert str(err.value) == f"{path}: not valid YAML at position 12: unacceptable character #x00ff: invalid start byte"


def test_missing_file_and_broken_yaml(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_spec(str(tmp_path / "absent.yaml"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(write(tmp_path, "experiment: [unclosed"))
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        load_spec(write(tmp_path, VALID), ["no-equals-sign"])


def test_the_cli_prints_one_line_and_exits_2_without_starting_anything(tmp_path):
    config = write(tmp_path, VALID)
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", config, "--set", "search_space.lr={uniform: [1, 0]}",
         "--storage-path", str(tmp_path / "results"), "--tracking-uri", f"sqlite:///{tmp_path}/m.db"],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: search_space.lr.uniform: expected low < high, got [1, 0]"
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists() and not (tmp_path / "m.db").exists()


def test_the_readme_examples_are_valid(tmp_path, monkeypatch, own_model_project):
    """The sweep file and the own-model example a newcomer copies from the README, as written."""
    readme = open("README.md").read()
    blocks = re.findall(r"```(yaml|python)\n(.*?)```", readme, re.S)
    sweep = next(text for lang, text in blocks if lang == "yaml" and text.startswith("experiment: my_sweep"))
    spec = load_spec(write(tmp_path, sweep))
    assert spec.workload == "cnn" and spec.search_space["lr"] == Domain("loguniform", (0.0001, 0.1))

    monkeypatch.syspath_prepend(str(own_model_project.folder))
    own = load_spec(str(own_model_project.folder / own_model_project.config))
    assert own.workload == "my_models.wide:WideNet"
    assert own.search_space["lr"] == Domain("loguniform", (0.0001, 0.01))
