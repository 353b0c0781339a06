"""The YAML search space -> Ray Tune's search primitives, and the trial configs they produce."""

from __future__ import annotations

from typing import Any

from orchestrator.config import Domain, SweepSpec


def tune_param_space(spec: SweepSpec) -> dict[str, Any]:
    """The ``param_space`` of the Tuner: fixed workload params, then the searched ones."""
    from ray import tune

    def to_tune(value):
        if not isinstance(value, Domain):
            return value
        if value.kind == "grid":
            return tune.grid_search(list(value.args[0]))
        if value.kind == "choice":
            return tune.choice(list(value.args[0]))
        return getattr(tune, value.kind)(*value.args)

    space: dict[str, Any] = {"workload": spec.workload, **spec.params}
    space.update({key: to_tune(value) for key, value in spec.search_space.items()})
    space.setdefault("seed", spec.seed)
    return space


def trial_configs(spec: SweepSpec) -> list[dict[str, Any]]:
    """The configs Tune would run: grids expanded, random parameters sampled (seeded).

    Used by ``orchestrator plan`` to show every trial's plan before anything runs; the sweep
    itself lets Tune sample, so random values there may differ from these.
    """
    import numpy as np
    from ray.tune.search.variant_generator import generate_variants

    random_state = np.random.default_rng(spec.seed)
    configs = []
    for _ in range(spec.num_samples):
        for _, config in generate_variants(tune_param_space(spec), random_state=random_state):
            configs.append(config)
    return configs
