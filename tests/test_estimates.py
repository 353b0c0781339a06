"""One estimate per memory signature: what makes a signature, which configs cover a sweep, and the
profiles the driver hands the trials."""

import dataclasses
import multiprocessing
import os

import pytest

from orchestrator.config import parse_spec
from orchestrator.cores import usable_cores
from orchestrator.estimates import estimate_trials, memory_signature
from orchestrator.memory import Settings
from orchestrator.memory.cache import ProfileCache
from orchestrator.planner import plan_with_profile
from orchestrator.space import memory_configs
from trainables.mlp import MLPWorkload

SWEEP = {
    "experiment": "sig", "workload": {"name": "mlp", "params": {"depth": 1}},
    "search_space": {"lr": {"loguniform": [1e-4, 1e-2]}, "width": {"grid": [16, 32]}, "seed": {"choice": [0, 1]}},
    "effective_batch_size": 64, "stop": {"epochs": 1},
}


def spec(**changes):
    return parse_spec({**SWEEP, **changes})


@dataclasses.dataclass
class DropoutMLP(MLPWorkload):
    dropout: float = 0.1
    memory_neutral = MLPWorkload.memory_neutral + ("dropout",)


def test_what_changes_memory_changes_the_signature():
    policy = spec().memory
    base = {"workload": "mlp", "width": 16, "lr": 0.1, "seed": 0, "depth": 1}
    same = memory_signature(base, policy, "cuda")
    assert memory_signature({**base, "lr": 0.001, "seed": 7, "_oom_shrinks": 1}, policy, "cuda") == same
    # How many samples the datasets hold changes how long a trial runs, not a step's memory.
    assert memory_signature({**base, "train_samples": 99_999, "eval_samples": 7}, policy, "cuda") == same
    assert memory_signature({**base, "width": 32}, policy, "cuda") != same
    assert memory_signature(base, policy, "cpu") != same
    assert memory_signature(base, dataclasses.replace(policy, precision="bf16"), "cuda") != same


def test_a_workload_declares_its_own_memory_neutral_parameters(monkeypatch):
    import trainables.workload as workload_module

    monkeypatch.setitem(workload_module.BUILTIN_WORKLOADS, "dropout_mlp", f"{__name__}:DropoutMLP")
    policy = spec().memory
    a = memory_signature({"workload": "dropout_mlp", "dropout": 0.1}, policy, "cuda")
    assert memory_signature({"workload": "dropout_mlp", "dropout": 0.5}, policy, "cuda") == a


def test_memory_configs_list_every_signature_a_sweep_can_have():
    configs = memory_configs(spec())
    assert sorted(c["width"] for c in configs) == [16, 32]  # lr and seed are neutral: one value each
    assert all(c["depth"] == 1 for c in configs)
    grid = memory_configs(spec(search_space={**SWEEP["search_space"], "workload": {"grid": ["mlp", "cnn"]}}))
    assert sorted((c["workload"], c["width"]) for c in grid) == [("cnn", 16), ("cnn", 32), ("mlp", 16), ("mlp", 32)]
    # A continuous memory-relevant parameter: the trials' own workers estimate.
    assert memory_configs(spec(search_space={"width": {"randint": [8, 64]}})) == []


@pytest.mark.parametrize("processes", [1, 2])
def test_sixteen_trials_of_two_widths_are_estimated_twice(processes):
    sweep = spec(search_space={"lr": {"grid": [0.001 * i for i in range(1, 9)]}, "width": {"grid": [16, 32]}})
    from orchestrator.space import trial_configs

    configs = trial_configs(sweep)
    seen = []
    estimates = estimate_trials(configs, sweep.memory, "cuda", 2**30, 64, processes=processes,
                                on_done=lambda sig, trials, s: seen.append(trials))
    assert len(configs) == 16 and len(estimates.by_signature) == 2 and not estimates.errors
    assert sorted(len(trials) for trials in seen) == [8, 8]
    profiles = estimates.known(configs[0], "cuda")
    assert Settings("fp32", False) in profiles and estimates.known(configs[0], "cpu") == {}


@pytest.mark.parametrize("processes", [1, 2])
def test_once_stopped_no_further_signature_is_estimated(processes):
    """A Ctrl-C while the driver estimates: the estimate under way ends, and no other starts."""
    import threading

    sweep = spec(search_space={"width": {"grid": [16, 32, 48]}})
    stop = threading.Event()
    estimates = estimate_trials(memory_configs(sweep), sweep.memory, "cuda", 2**30, 64, processes=processes,
                                on_done=lambda *_: stop.set(), stop=stop)
    assert len(estimates.by_signature) == 1 and not estimates.errors


def test_on_two_cores_the_estimates_are_made_in_this_process_and_beyond_them_in_processes_beside_it(tmp_path, monkeypatch):
    """One core stays the driver's; with one left, spawning a process (its import and first trace
    cost a core seconds) would be slower than estimating here. Spawned processes import a user's
    workload from where the driver does."""
    (tmp_path / "user_widths.py").write_text(
        "import dataclasses\nfrom trainables.mlp import MLPWorkload\n"
        "@dataclasses.dataclass\nclass Wide(MLPWorkload):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sweep = spec(workload={"name": "user_widths:Wide", "params": {"depth": 1}}, search_space={"width": {"grid": [16, 32, 48]}})
    from orchestrator.space import trial_configs

    def children_while_estimating(cores: set[int], processes: int | None = None) -> list[int]:
        """The processes this one had as each estimate came in, with ``cores`` its usable ones."""
        everywhere = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores)
        try:
            assert usable_cores() == len(cores)
            seen = []
            estimates = estimate_trials(trial_configs(sweep), sweep.memory, "cpu", None, 64, processes=processes,
                                        on_done=lambda *_: seen.append(len(multiprocessing.active_children())))
        finally:
            os.sched_setaffinity(0, everywhere)
        assert len(estimates.by_signature) == 3 and not estimates.errors
        return seen

    two = set(sorted(os.sched_getaffinity(0))[:2])
    assert children_while_estimating(two) == [0, 0, 0]
    assert all(children_while_estimating(two, processes=2))  # asked for: two spawned, even so


def test_a_trial_plans_from_the_profiles_it_was_handed():
    sweep = spec()
    config = {"workload": "mlp", "width": 16, "depth": 1, "lr": 0.01, "seed": 0}
    estimates = estimate_trials([config], sweep.memory, "cpu", None, 64)
    known = estimates.known({**config, "lr": 0.5}, "cpu")
    workload = MLPWorkload(width=16, depth=1, lr=0.5)
    cache = ProfileCache(workload, sweep.memory, "cpu", known=known)
    _, profile = plan_with_profile(workload, sweep.memory, 64, None, target="cpu", profiles=cache)
    assert profile is known[Settings("fp32", False)]


def test_a_model_that_cannot_be_estimated_is_an_error_of_its_signature(tmp_path):
    sweep = spec()
    config = {"workload": "tests.workloads:BuggyWorkload", "width": 16, "attempts_file": str(tmp_path / "attempts")}
    estimates = estimate_trials([config], sweep.memory, "cpu", None, 64)
    (error,) = estimates.errors.values()
    assert error.startswith("ValueError: mat1 and mat2 shapes cannot be multiplied")


def test_a_model_the_trace_cannot_run_is_handed_to_no_trial_and_says_why():
    """The ``static`` fallback is this process's; a trial estimates again on its own device."""
    config = {"workload": "tests.workloads:PredictionMaskedWorkload", "width": 16}
    estimates = estimate_trials([config], spec().memory, "cpu", None, 64)
    assert not estimates.errors and list(estimates.by_signature.values()) == [{}]
    (why,) = estimates.fell_back.values()
    assert why.startswith("trace impossible (aten.nonzero") and why.endswith("fell back to static")


def test_a_model_that_needs_a_missing_library_says_how_to_install_it():
    """`plan` shows this line; `run`'s pre-flight refuses the same model with the same advice."""
    estimates = estimate_trials([{"workload": "tests.workloads:NeedsALibraryWorkload", "width": 16}], spec().memory, "cpu", None, 64)
    (error,) = estimates.errors.values()
    assert error.startswith("ModuleNotFoundError: No module named 'transformers_of_nowhere'")
    assert error.endswith("; install it in this environment: pip install transformers_of_nowhere")
