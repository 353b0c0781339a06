"""From a memory profile and a budget to a plan: micro-batch, accumulation, eval batch, settings.

The planner is pure: the same profile, budget and policy always give the same plan, and nothing
here touches a GPU, Ray or MLflow, so every rule is unit-tested on its own.

* :func:`make_plan` finds the largest micro-batch at which every train phase fits the budget
  (times the safety margin), which sets the fewest passes a step can take, and spreads the
  effective batch evenly over them (128 as 64 + 64, not 100 + 28: the same passes at a lower
  peak); gradient accumulation keeps the effective batch. Then it picks the eval batch from
  the eval phases, after training at that micro-batch. "Fits" is what the profile
  says: where it models the CUDA caching allocator, that the replay of the phase's allocations
  within the limit does not run out of memory, freeing the allocator's cache on the way as
  PyTorch does (so a batch whose unpressured reserved memory is above the limit may still fit);
  elsewhere, that its reserved bytes are within the limit. When not even micro-batch 1 fits, it
  tries activation checkpointing and then the lower precision; when nothing fits it refuses,
  saying what the trial needs and what would make it fit.
* :func:`next_reduction` is what to try after an out-of-memory error: halve the micro-batch
  (spread evenly over the passes that takes), then activation checkpointing, then the lower
  precision, then give up. The effective batch is never changed: a reduced trial makes the
  same updates, only in more, smaller pieces.
* A trial that verifies its plan (``memory.verify``, ``orchestrator.trial.verify``) plans with
  ``error_bound`` first: every phase's prediction raised by the estimator's own error bound, so
  its first steps fit even where the estimate is that far too low; then with ``corrections``,
  each measured phase's prediction scaled by measured / predicted, interpolated between the
  batch sizes it was measured at, for the plan it switches to; ``micro_cap`` keeps the
  micro-batch below one that measured too much. Both keep the settings (``settings``):
  verification moves batch sizes, not precision.
* :func:`plan_for_ranks` plans a data-parallel group: each rank computes ``effective / ranks``
  samples of every step on its own device, so each rank is planned for its own budget (less
  what the gradient exchange holds, ``memory.parallel``) and the group runs the smallest rank's
  micro-batch: micro-batch x accumulation x ranks is the effective batch on every rank.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

from orchestrator.memory import EstimationError, MemoryProfile, Settings
from orchestrator.memory.cache import ProfileCache
from orchestrator.memory.parallel import DataParallel
from orchestrator.table import last_micro_batch, split_text
from orchestrator.units import GiB, apart, gib, human

#: The eval batch is a throughput knob, not a hyper-parameter; beyond this many times the
#: effective batch it buys nothing and only makes a large allocation.
EVAL_BATCH_CAP = 4


@dataclass(frozen=True)
class Plan:
    """How a trial runs. JSON-able (``to_dict``/``from_dict``): stored in Tune configs and checkpoints."""

    micro_batch: int
    accum_steps: int
    effective_batch: int
    eval_batch: int
    activation_checkpointing: bool
    precision: str
    estimator: str  # which estimator produced the prediction, or "none"
    budget_bytes: int | None
    predicted_peak_bytes: int | None  # reserved bytes, worst phase, at this plan (within the limit)
    predicted_phase: str | None
    predicted_phases: dict[str, int] = field(default_factory=dict)  # phase -> predicted reserved bytes
    reductions: int = 0  # OOM reductions applied so far
    note: str = ""
    refusal: str | None = None  # set when nothing fits: the trial must not start
    safety_margin: float | None = None  # the share of the budget the plan was allowed to fill
    #: Data-parallel ranks: each computes ``rank_batch`` samples of every step, ``micro_batch`` at a time.
    ranks: int = 1
    rank_budgets: tuple[int | None, ...] = ()  # each rank's budget, as the group was planned
    exchange_bytes: int = 0  # what each rank holds for the gradient exchange (taken from its budget)
    #: Plan verification (``orchestrator.trial.verify``): each measured phase's (batch size,
    #: measured / predicted peak) points, which the plan's predictions were scaled by; the other
    #: phases' were raised by ``error_bound`` (the estimator's, while they are not measured yet).
    corrections: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    measured_phases: dict[str, int] = field(default_factory=dict)  # phase -> its last peak measured on the device
    error_bound: float = 0.0
    #: The model is ``torch.compile``d and the estimate is its eager modules' (the profile's
    #: ``compiled``): the compiled graph's memory may differ (``contract.COMPILED_MODEL_NOTE``).
    compiled: bool = False

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in known}
        for name in ("predicted_phases", "measured_phases"):
            values[name] = dict(values.get(name) or {})
        values["corrections"] = {k: tuple((int(b), float(f)) for b, f in v) for k, v in (values.get("corrections") or {}).items()}
        values["rank_budgets"] = tuple(values.get("rank_budgets") or ())
        return cls(**values)

    @property
    def rank_batch(self) -> int:
        """Samples of each optimizer step one rank computes."""
        return self.effective_batch // self.ranks

    @property
    def settings(self) -> Settings:
        return Settings(self.precision, self.activation_checkpointing)

    def describe(self) -> str:
        """'16 x 4 (eval 128, bf16, ckpt)', '26 x 5 (last 24, eval 128, fp32)', or the refusal."""
        if self.refusal:
            return f"refused: {self.refusal}"
        last = last_micro_batch(self.micro_batch, self.accum_steps, self.effective_batch, self.ranks)
        extras = ([f"last {last}"] if last else []) + [f"eval {self.eval_batch}", self.precision] + (
            ["ckpt"] if self.activation_checkpointing else [])
        return f"{split_text(self.micro_batch, self.accum_steps, ranks=self.ranks)} ({', '.join(extras)})"


def make_plan(
    workload, policy, effective_batch: int, budget_bytes: int | None, *, target: str, device=None,
    profiles: ProfileCache | None = None, settings: Settings | None = None,
    corrections: dict[str, tuple[tuple[int, float], ...]] | None = None, error_bound: float = 0.0,
    micro_cap: int | None = None,
) -> Plan:
    """The plan for one trial of ``workload`` on a device of kind ``target`` with ``budget_bytes``.

    ``budget_bytes`` is what the trial may use on the device in total: for a CUDA target the
    profile counts the CUDA context itself, so this is the free memory *before* the trial's
    process initialises CUDA (or the card's size). None means unbounded (the CPU): the whole
    effective batch at once. ``policy`` is the sweep's ``MemoryPolicy``; ``device`` the worker's
    ``Device``, which the ``measured`` estimator probes on; ``profiles`` the estimates made so
    far (the driver's, handed to a trial), which the plan adds to where it needs more.
    ``settings``: only these (precision, activation checkpointing), not the policy's candidates;
    ``corrections`` and ``error_bound``: what a verifying trial scales each phase's predictions
    by (:func:`correction_at`); ``micro_cap``: the largest micro-batch it may pick.
    """
    return plan_with_profile(workload, policy, effective_batch, budget_bytes, target=target, device=device,
                             profiles=profiles, settings=settings, corrections=corrections,
                             error_bound=error_bound, micro_cap=micro_cap)[0]


def plan_with_profile(
    workload, policy, effective_batch: int, budget_bytes: int | None, *, target: str, device=None,
    profiles: ProfileCache | None = None, settings: Settings | None = None,
    corrections: dict[str, tuple[tuple[int, float], ...]] | None = None, error_bound: float = 0.0,
    micro_cap: int | None = None,
) -> tuple[Plan, MemoryProfile | None]:
    """:func:`make_plan`, and the profile of the settings it planned with (to show its breakdown)."""
    if effective_batch < 1:
        raise ValueError(f"effective batch must be at least 1, got {effective_batch}")
    start = Settings(policy.precision, False)
    if policy.estimator == "none":  # no estimate: the whole batch at once, OOM retries do the rest
        plan = Plan(effective_batch, 1, effective_batch, effective_batch, False, policy.precision,
                    "none", budget_bytes, None, None)
        return plan, None
    profiles = profiles if profiles is not None else ProfileCache(workload, policy, target, device)
    eval_cap = min(EVAL_BATCH_CAP * effective_batch, _eval_samples(workload))
    if budget_bytes is None:
        start = settings or start
        profile = profiles.get(start)
        if profile is None:
            raise EstimationError(profiles.errors[start])
        eval_batch = min(effective_batch, eval_cap)
        return _plan(profile, effective_batch, effective_batch, eval_batch, None), profile

    limit = int(budget_bytes * policy.safety_margin)
    trust = _Trust(dict(corrections or {}), error_bound)
    candidates = [settings] if settings is not None else _candidates(start, policy, workload.supports_activation_checkpointing)
    for candidate in candidates:
        profile = profiles.get(candidate)
        if profile is None:
            continue
        micro = _largest(lambda m: _train_fits(profile, m, limit, trust), min(effective_batch, micro_cap or effective_batch))
        if not micro:
            continue
        micro = even_split(micro, effective_batch)
        eval_batch = _largest(lambda b: _eval_fits(profile, b, micro, limit, trust), eval_cap)
        if eval_batch:
            plan = _plan(profile, micro, effective_batch, eval_batch, budget_bytes, limit, trust)
            return replace(plan, safety_margin=policy.safety_margin, corrections=trust.corrections,
                           error_bound=error_bound), profile
    return _refuse(workload, policy, effective_batch, budget_bytes, limit, profiles, start), profiles.get(start)


def next_reduction(
    plan: Plan, policy, phase_kind: str = "train", *, workload_supports_checkpointing: bool = False
) -> Plan | None:
    """The plan to resume with after an out-of-memory error in ``phase_kind``, or None to give up.

    Pure: nothing is re-estimated, so the returned plan's predictions are cleared (None/empty)
    rather than carried stale (:func:`predicted` puts them back from the trial's profile); the
    note says what was reduced.
    """
    def reduced(note: str, **changes) -> Plan:
        return replace(plan, **changes, reductions=plan.reductions + 1, note=note,
                       predicted_peak_bytes=None, predicted_phase=None, predicted_phases={})

    if phase_kind == "eval":
        if plan.eval_batch <= 1:
            return None
        half = plan.eval_batch // 2
        return reduced(f"out of memory in eval: eval batch {plan.eval_batch} -> {half}", eval_batch=half)
    if plan.micro_batch > 1:
        half = even_split(plan.micro_batch // 2, plan.rank_batch)
        accum = math.ceil(plan.rank_batch / half)
        return reduced(f"out of memory in train: micro-batch {plan.micro_batch} -> {half} (x {accum})",
                       micro_batch=half, accum_steps=accum)
    if not plan.activation_checkpointing and workload_supports_checkpointing and policy.allow_activation_checkpointing:
        return reduced("out of memory in train at micro-batch 1: activation checkpointing on",
                       activation_checkpointing=True)
    if policy.lower_precision and plan.precision != policy.lower_precision:
        return reduced(f"out of memory in train at micro-batch 1: precision {plan.precision} -> {policy.lower_precision}",
                       precision=policy.lower_precision)
    return None


def predicted(plan: Plan, profile: MemoryProfile) -> Plan:
    """``plan`` with its predictions at its own batch sizes, from ``profile`` (of ``plan.settings``).

    What an OOM's reduction resumes with: the estimate, corrections and error bound the trial
    planned with, at the smaller batches (a rank's with the exchange's bucket), so the trial's
    reports, its live line and MLflow still compare a prediction with what the device measures.
    """
    limit = None
    if plan.budget_bytes is not None and plan.safety_margin:
        limit = int(_usable(plan.budget_bytes, plan.exchange_bytes, plan.safety_margin) * plan.safety_margin)
    trust = _Trust(dict(plan.corrections), plan.error_bound)
    fresh = _plan(profile, plan.micro_batch, plan.rank_batch, plan.eval_batch, plan.budget_bytes, limit, trust)
    return replace(plan, predicted_peak_bytes=fresh.predicted_peak_bytes + plan.exchange_bytes,
                   predicted_phase=fresh.predicted_phase,
                   predicted_phases={name: peak + plan.exchange_bytes for name, peak in fresh.predicted_phases.items()})


def plan_for_ranks(
    workload, policy, effective_batch: int, rank_budgets: list[int | None], *, target: str, device=None,
    profiles: ProfileCache | None = None,
) -> Plan:
    """The plan of a data-parallel group whose rank ``r`` may fill ``rank_budgets[r]``.

    Each distinct budget is planned once, less the exchange's bucket (made at the first step and
    kept, as DDP keeps its buckets, so it sits beside every phase's peak). The group takes the smallest
    micro-batch and eval batch of its ranks, so the slowest-to-fit rank decides and every rank
    cuts its share of a step the same way. A refusal names the rank that cannot fit.
    """
    strategy = DataParallel(len(rank_budgets))
    rank_batch = strategy.rank_batch(effective_batch)
    profiles = profiles if profiles is not None else ProfileCache(workload, policy, target, device)
    exchange = 0
    if policy.estimator != "none":
        exchange = strategy.extra_bytes(profiles.get(Settings(policy.precision, False)))
    by_budget: dict[int | None, Plan] = {}
    for budget in dict.fromkeys(rank_budgets):
        usable = None if budget is None else _usable(budget, exchange, policy.safety_margin)
        plan = make_plan(workload, policy, rank_batch, usable, target=target, device=device, profiles=profiles)
        by_budget[budget] = replace(plan, budget_bytes=budget)
    plans = [by_budget[b] for b in rank_budgets]
    refused = next((r for r, p in enumerate(plans) if p.refusal), None)
    # Where ranks tie on batches, the smallest budget is the group's: what its report and MLflow show.
    worst = min(range(len(plans)), key=lambda r: (plans[r].refusal is None, plans[r].micro_batch, plans[r].eval_batch,
                                                  math.inf if rank_budgets[r] is None else rank_budgets[r]))
    plan = plans[worst]
    group = dict(effective_batch=effective_batch, ranks=strategy.ranks, rank_budgets=tuple(rank_budgets),
                 exchange_bytes=exchange)
    if refused is not None:
        return replace(plan, **group, refusal=f"rank {refused}: {plans[refused].refusal}")
    eval_batch = min(p.eval_batch for p in plans)
    # A rank's predicted peak holds the exchange's bucket too: that is what its device will see.
    if plan.predicted_peak_bytes is not None:
        group.update(predicted_peak_bytes=plan.predicted_peak_bytes + exchange,
                     predicted_phases={name: peak + exchange for name, peak in plan.predicted_phases.items()})
    return replace(plan, **group, eval_batch=eval_batch)


# -- helpers -------------------------------------------------------------------------------


def format_bytes(n: int) -> str:
    """GiB as every table shows them from 1 GiB up; below, the unit the size reaches (``64.0MiB``,
    not ``0.06G``), as the sizes beside it in the same line are."""
    return gib(n) if abs(n) >= GiB else human(n).replace(" ", "")


def _usable(budget: int, exchange: int, margin: float) -> int:
    """What a rank's plan may fill, x ``margin``: the gradient exchange's bucket comes on top,
    so the plan and the bucket together fill ``budget`` x ``margin``."""
    return max(budget - math.ceil(exchange / margin), 0)


def _candidates(start: Settings, policy, supports_checkpointing: bool) -> list[Settings]:
    """Settings to try in order: as configured, + checkpointing, + lower precision, + both."""
    checkpointing = supports_checkpointing and policy.allow_activation_checkpointing
    lower = policy.lower_precision if policy.lower_precision and policy.lower_precision != start.precision else None
    out = [start]
    if checkpointing:
        out.append(Settings(start.precision, True))
    if lower:
        out.append(Settings(lower, False))
        if checkpointing:
            out.append(Settings(lower, True))
    return out


def _eval_samples(workload) -> int:
    try:
        return max(len(workload.eval_data()), 1)
    except (TypeError, NotImplementedError):  # an iterable dataset has no length
        return 2**31


@dataclass(frozen=True)
class _Trust:
    """How far a plan trusts each phase's prediction: a phase whose peak is ``factor`` x its
    prediction fits ``limit`` when its prediction fits ``limit / factor``."""

    corrections: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    error_bound: float = 0.0

    def limit(self, phase: str, limit: int, batch: int) -> int:
        return int(limit / correction_at(self.corrections.get(phase, ()), batch, 1.0 + self.error_bound))


def correction_at(points: tuple[tuple[int, float], ...], batch: int, default: float) -> float:
    """measured / predicted at ``batch``: linear between the batch sizes it was measured at, the
    nearest one's beyond them, ``default`` where it was never measured."""
    if not points:
        return default
    points = tuple(sorted(points))
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, f0), (b1, f1) in zip(points, points[1:]):
        if batch <= b1:
            return f0 + (f1 - f0) * (batch - b0) / (b1 - b0)
    return points[-1][1]


TRUSTED = _Trust()


def _train_fits(profile: MemoryProfile, micro: int, limit: int, trust: _Trust = TRUSTED) -> bool:
    return all(p.fits(micro, trust.limit(p.name, limit, micro)) for p in profile.phases_of("train"))


def _eval_fits(profile: MemoryProfile, batch: int, micro: int, limit: int, trust: _Trust = TRUSTED) -> bool:
    return all(p.fits(batch, trust.limit(p.name, limit, batch), micro_batch=micro) for p in profile.phases_of("eval"))


def _largest(fits: Callable[[int], bool], cap: int) -> int:
    """The largest ``b`` in [1, cap] that fits (memory grows with ``b``), or 0."""
    if cap < 1 or not fits(1):
        return 0
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def even_split(micro: int, effective: int) -> int:
    """The smallest micro-batch that takes ``effective`` samples in as few passes as ``micro`` does.

    A pass's memory grows with its micro-batch, and a step's passes are what it costs in time,
    so for the passes the largest fitting micro-batch needs the lowest peak is the effective
    batch spread evenly over them: 128 as 64 + 64 rather than 100 + 28, 256 as 86 + 86 + 84
    rather than 90 + 90 + 76. Whether the micro-batch divides the effective batch does not
    matter: each micro-batch's loss is weighted by its share of the step (`trainables.step`).
    """
    return math.ceil(effective / math.ceil(effective / micro))


def _plan(profile: MemoryProfile, micro: int, effective: int, eval_batch: int, budget: int | None,
          limit: int | None = None, trust: _Trust = TRUSTED) -> Plan:
    if limit is None or trust == TRUSTED:
        phases = profile.phase_peaks(micro, eval_batch, limit)
    else:  # each phase's replay within the limit its trust leaves it
        phases = {p.name: p.reserved_at(profile.batch_for(p, micro, eval_batch), micro_batch=micro,
                                        limit=trust.limit(p.name, limit, profile.batch_for(p, micro, eval_batch)))
                  for p in profile.phases}
    worst = profile.worst(phases, micro, eval_batch)
    fallback = profile.fallback
    flat = profile.allocator_model_gap()  # a flat factor where the allocator model is not used: say so
    return Plan(
        micro_batch=micro,
        accum_steps=math.ceil(effective / micro),
        effective_batch=effective,
        eval_batch=eval_batch,
        activation_checkpointing=profile.settings.activation_checkpointing,
        precision=profile.settings.precision,
        estimator=profile.estimator,
        budget_bytes=budget,
        predicted_peak_bytes=phases[worst],
        predicted_phase=worst,
        predicted_phases=phases,
        note="; ".join(n for n in (fallback, flat) if n),
        compiled=profile.compiled,
    )


def _refuse(workload, policy, effective: int, budget: int, limit: int, profiles: ProfileCache, start: Settings) -> Plan:
    """Nothing allowed fits: what the trial needs at micro-batch 1, and what (if anything) would fit."""
    profile = profiles.get(start)
    if profile is None:
        needs = f"could not be estimated ({profiles.errors.get(start, 'no profile')})"
        phases: dict[str, int] = {}
        limit_text = format_bytes(limit)
    else:
        phases = profile.phase_peaks(1, 1)
        peak, name = profile.peak(1, 1)
        needs_text, limit_text = apart(peak, limit, format_bytes)
        needs = f"needs {needs_text} at micro-batch 1 in {name} ({_breakdown_at_one(profile, name, peak)})"
    margin = f" (x safety margin {policy.safety_margin:g} = {limit_text})" if policy.safety_margin != 1 else ""
    message = f"{needs}, budget {format_bytes(budget)}{margin}; {_what_would_fit(workload, policy, limit, profiles, start)}"
    worst = profile.worst(phases, 1, 1) if phases else None
    return Plan(
        1, effective, effective, 1, False, policy.precision, profile.estimator if profile else policy.estimator,
        budget, phases.get(worst), worst, phases, refusal=message, safety_margin=policy.safety_margin,
        compiled=profile.compiled if profile else False,
    )


def _breakdown_at_one(profile: MemoryProfile, name: str, peak: int) -> str:
    """What phase ``name`` holds at micro-batch 1, part by part, adding up to its ``peak``. At small
    batches a train step peaks where the batch does not count (the optimizer step's temporaries,
    a copy or two of the largest parameter: the curve is flat there), above the line the
    activations make; that and the allocator's cache above the tensors are parts of their own."""
    p = next(ph for ph in profile.phases if ph.name == name)
    line = p.fixed + p.activations_per_sample
    allocated = p.allocated_at(1)
    parts = [("params", p.params), ("grads", p.grads), ("optim", p.optimizer), ("buffers", p.buffers),
             ("activations/sample", p.activations_per_sample), ("other", p.fixed_other),
             ("step temporaries" if p.kind == "train" else "temporaries", allocated - max(line, 0)),
             ("allocator cache", peak - allocated - p.overhead - p.fragmentation_bytes(allocated)), ("ctx", p.overhead)]
    shown = ", ".join(f"{label} {format_bytes(v)}" for label, v in parts if v > 0)
    frag = f", frag {p.fragmentation:.0%}" if p.fragmentation else ""
    return f"{shown}{frag}"


def _what_would_fit(workload, policy, limit: int, profiles: ProfileCache, start: Settings) -> str:
    """Try what the policy does not allow too, to say what would make the trial fit."""
    lower = policy.lower_precision or "bf16"
    options = []
    if workload.supports_activation_checkpointing:
        options.append((Settings(start.precision, True), "activation checkpointing"))
    if lower != start.precision:
        options.append((Settings(lower, False), lower))
        if workload.supports_activation_checkpointing:
            options.append((Settings(lower, True), f"activation checkpointing and {lower}"))
    if not options:
        return "no smaller settings to try"
    allowed = _candidates(start, policy, workload.supports_activation_checkpointing)
    for settings, label in options:
        profile = profiles.get(settings)
        if profile is not None and _train_fits(profile, 1, limit) and _eval_fits(profile, 1, 1, limit):
            hint = "" if settings in allowed else " (which the memory policy does not allow)"
            return f"would fit with {label}{hint}"
    return f"would not fit even with {options[-1][1]}"
