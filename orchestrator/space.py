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


def search_algorithm(spec: SweepSpec):
    """The Tuner's search algorithm: Tune's own grid and random search, seeded by the sweep's
    ``seed``, so two runs of one YAML train the same configs and :func:`trial_configs` (what
    ``plan`` shows) is exactly what ``run`` trains."""
    from ray.tune.search import BasicVariantGenerator

    return BasicVariantGenerator(random_state=spec.seed)


def trial_configs(spec: SweepSpec) -> list[dict[str, Any]]:
    """The configs the sweep trains, in Tune's order: grids expanded, random parameters sampled.

    The draw is :func:`search_algorithm`'s: a generator seeded by ``seed`` (Tune makes it with
    ``numpy.random.default_rng``), asked for one variant set per sample, as Tune asks.
    """
    import numpy as np
    from ray.tune.search.variant_generator import generate_variants

    random_state = np.random.default_rng(spec.seed)
    configs = []
    for _ in range(spec.num_samples):
        for _, config in generate_variants(tune_param_space(spec), random_state=random_state):
            configs.append(config)
    return configs


def memory_configs(spec: SweepSpec, limit: int = 256) -> list[dict[str, Any]]:
    """Configs that cover every memory signature the sweep's trials can have, where that is finite.

    Only memory-relevant parameters make signatures, and a ``choice`` or ``grid`` of them has
    finitely many values: every combination is listed (memory-neutral parameters take their first
    value). A continuous one gives each trial a signature of its own (the seeded draw,
    :func:`trial_configs`, knows them, but estimating each in the driver would hold the sweep's
    start for as long as the trials it plans). A workload with a memory-relevant ``uniform``/``randint`` parameter, or with more than
    ``limit`` combinations, is left to its trials' workers to estimate.
    """
    import itertools

    from trainables.workload import resolve_workload

    space: dict[str, Any] = {"workload": spec.workload, **spec.params, "seed": spec.seed, **spec.search_space}
    names = spec.workload_names()
    configs = []
    for name in names:
        cls = resolve_workload(name)
        fields = set(cls.parameter_names())
        choices: dict[str, list] = {}
        for key, value in space.items():
            if key == "workload" or key not in fields:
                continue
            if not isinstance(value, Domain):
                choices[key] = [value]
            elif key in cls.memory_neutral:
                choices[key] = [_representative(value)]
            elif value.kind in ("choice", "grid"):
                choices[key] = list(value.args[0])
            else:
                break  # a continuous memory-relevant parameter: the workers estimate this workload
        else:
            combinations = list(itertools.islice(itertools.product(*choices.values()), limit + 1))
            if len(combinations) <= limit:
                configs += [{"workload": name, **dict(zip(choices, values))} for values in combinations]
    return configs


def _representative(domain: Domain) -> Any:
    return domain.args[0][0] if domain.kind in ("choice", "grid") else domain.args[0]
