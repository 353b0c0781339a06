"""The sweep's configs are the sweep's ``seed``'s: ``plan`` shows exactly what ``run`` trains, and
two runs of one YAML train the same configs."""

from __future__ import annotations

import json
import subprocess

import pytest

from orchestrator.config import load_spec
from orchestrator.space import search_algorithm, trial_configs, tune_param_space
from tests.conftest import command_env, installed_command

SWEEP = """
experiment: seeded
workload: {name: mlp, params: {depth: 1, train_samples: 128, eval_samples: 64}}
search_space:
  lr: {loguniform: [0.0001, 0.01]}
  width: {grid: [16, 32]}
num_samples: 2
seed: 7
effective_batch_size: 64
stop: {epochs: 1}
memory: {estimator: static}
"""


@pytest.fixture
def sweep_file(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP)
    return path


def tune_draws(spec) -> list[dict]:
    """The configs of the trials Tune's search algorithm makes for the sweep, as the Tuner asks it."""
    from ray.tune.experiment import Experiment

    algorithm = search_algorithm(spec)
    algorithm.add_configurations([Experiment("seeded", lambda config: None, config=tune_param_space(spec),
                                             num_samples=spec.num_samples)])
    configs = []
    while (trial := algorithm.next_trial()) is not None:
        configs.append(trial.config)
    return configs


def test_the_search_draws_what_trial_configs_lists(sweep_file):
    spec = load_spec(str(sweep_file), [])
    assert tune_draws(spec) == trial_configs(spec)
    assert len({c["lr"] for c in trial_configs(spec)}) == 4  # random values, drawn once per trial


def test_the_seed_decides_the_draw(sweep_file):
    first, again = trial_configs(load_spec(str(sweep_file), [])), trial_configs(load_spec(str(sweep_file), []))
    other = trial_configs(load_spec(str(sweep_file), ["seed=8"]))
    assert first == again
    assert [c["lr"] for c in first] != [c["lr"] for c in other]


def test_the_widest_space_the_config_accepts_is_drawn(sweep_file):
    """The config's bounds are Tune's: a seed of 32 bits (a trial's own too), randint over all of
    int64, uniform over all a float's span are drawn, by the search and by ``plan``'s listing alike."""
    spec = load_spec(str(sweep_file), ["seed=4294967295", f"search_space.depth={{randint: [{-2**63}, {2**63}]}}",
                                       f"search_space.seed={{randint: [0, {2**32}]}}",
                                       "search_space.lr={uniform: [0, 1.7e308]}"])
    configs = trial_configs(spec)
    assert tune_draws(spec) == configs and len(configs) == 4
    assert all(-2**63 <= c["depth"] < 2**63 and 0 <= c["seed"] < 2**32 and 0 <= c["lr"] <= 1.7e308 for c in configs)


@pytest.mark.parametrize("overrides", [
    [], ["num_samples=3"], ["search_space.depth={grid: [1, 2, 3]}"], ["search_space.depth={choice: [1, 2, 3]}"],
    ["search_space={workload: {grid: [mlp, cnn]}, lr: {grid: [0.1, 0.01]}}", "num_samples=2"],
], ids=["grid and samples", "more samples", "two grids", "a choice adds none", "a grid of workloads"])
def test_the_trial_count_is_what_expanding_the_space_makes(sweep_file, overrides):
    """``max_trials`` bounds :meth:`SweepSpec.trial_count`, counted without expanding the space:
    it must be what Tune's expansion makes."""
    spec = load_spec(str(sweep_file), overrides)
    assert spec.trial_count() == len(trial_configs(spec)) == len(tune_draws(spec))


def mlflow_configs(database) -> list[dict]:
    """What MLflow recorded of each trial's hyper-parameters (``config.*`` params), in trial order."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{database}")
    experiment = client.get_experiment_by_name("seeded")
    runs = client.search_runs([experiment.experiment_id], "tags.`mlflow.parentRunId` != ''")
    configs = [{k[len("config."):]: v for k, v in run.data.params.items() if k.startswith("config.")} for run in runs]
    return sorted(configs, key=lambda c: (c["width"], c["lr"]))


@pytest.mark.integration
def test_plan_json_shows_the_configs_run_trains(sweep_file, tmp_path):
    """The installed command, from a folder outside the repository: ``plan --json``'s configs are
    the ones MLflow records for the following ``run``, and a second run trains the same."""
    def run(*words, cwd=tmp_path):
        return subprocess.run([installed_command(), *words], cwd=cwd, env=command_env(), capture_output=True,
                              text=True, timeout=600)

    planned = json.loads(run("plan", str(sweep_file), "--json").stdout)["trials"]
    expected = sorted(({k: str(v) for k, v in t["config"].items()} for t in planned), key=lambda c: (c["width"], c["lr"]))
    assert len(expected) == 4
    recorded = []
    for attempt in ("first", "second"):
        folder = tmp_path / attempt
        folder.mkdir()
        done = run("run", str(sweep_file), "--num-cpus", "2", cwd=folder)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        recorded.append(mlflow_configs(folder / "mlflow.db"))
    assert recorded[0] == expected
    assert recorded[1] == expected
