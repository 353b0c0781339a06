"""The planner's rules on hand-made profiles, and one plan checked against a real emulated run."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from orchestrator.allocator_conf import parse_alloc_conf
from orchestrator.config import MemoryPolicy, Stop
from orchestrator.device import EmulatedDevice
from orchestrator.memory import MemoryProfile, PhaseProfile, Settings
from orchestrator.memory.cache import ProfileCache
from orchestrator.memory.sequence import TrialSequence, fit_log
from orchestrator.planner import Plan, correction_at, even_split, make_plan, next_reduction, plan_for_ranks, predicted
from trainables.cnn import CNNWorkload
from trainables.loop import LoopPlan, LoopSettings, Trainer
from trainables.mlp import MLPWorkload


def phase(name, kind, fixed, per_sample):
    return PhaseProfile(name, kind, params=fixed, grads=0, optimizer=0, buffers=0,
                        activations_per_sample=per_sample, fixed_other=0)


def profile(settings, *phases):
    return MemoryProfile("trace", settings, "emulated", tuple(phases))


class HandMadeProfiles(ProfileCache):
    """Profiles written by the test, handed to the planner as the driver hands its estimates to a
    trial; records the settings the planner asked for, in order."""

    def __init__(self):
        super().__init__(workload=None, policy=None, target="emulated")
        self.asked: list[Settings] = []

    def get(self, settings: Settings) -> MemoryProfile | None:
        self.asked.append(settings)
        return self.cache[settings]

    def __setitem__(self, settings: Settings, profile: MemoryProfile) -> None:
        self.cache[settings] = profile

    def __getitem__(self, settings: Settings) -> MemoryProfile:
        return self.cache[settings]


@pytest.fixture
def profiles():
    return HandMadeProfiles()


def policy(**kwargs):
    return MemoryPolicy(**{"safety_margin": 1.0, **kwargs})


FP32 = Settings("fp32")
CKPT = Settings("fp32", True)
BF16 = Settings("bf16")
BF16_CKPT = Settings("bf16", True)


def test_largest_micro_batch_that_fits_and_divides(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(), 180, 1000, target="emulated", profiles=profiles)  # 100 + 10m <= 1000: m <= 90
    assert (plan.micro_batch, plan.accum_steps, plan.effective_batch) == (90, 2, 180)
    assert plan.note == ""
    assert plan.predicted_peak_bytes == 1000 and plan.predicted_phase in ("train", "eval")


def test_the_effective_batch_is_spread_evenly_over_the_fewest_passes(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    # 90 fits (100 + 10m <= 1000): 256 samples take three passes, and 86 + 86 + 84 peaks lower than 90 + 90 + 76.
    plan = make_plan(MLPWorkload(), policy(), 256, 1000, target="emulated", profiles=profiles)
    assert (plan.micro_batch, plan.accum_steps, plan.note) == (86, 3, "")
    assert plan.describe().startswith("86 x 3 (last 84, eval")
    assert plan.predicted_peak_bytes == 100 + 10 * 86
    plan = make_plan(MLPWorkload(), policy(), 170, 1000, target="emulated", profiles=profiles)
    assert (plan.micro_batch, plan.accum_steps) == (85, 2)


def test_an_even_split_keeps_the_passes_at_the_smallest_micro_batch():
    assert [even_split(m, 128) for m in (128, 100, 64, 31, 1)] == [128, 64, 64, 26, 1]
    assert even_split(90, 1000) == 84  # 12 passes: 11 x 84 + 76
    for effective in range(1, 200):
        for micro in range(1, effective + 1):
            split = even_split(micro, effective)
            assert split <= micro and math.ceil(effective / split) == math.ceil(effective / micro)


def test_safety_margin_shrinks_the_budget(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(safety_margin=0.5), 40, 1000, target="emulated", profiles=profiles)  # m <= 40
    assert plan.micro_batch == 40 and plan.predicted_peak_bytes <= 500


def test_a_verifying_trial_starts_within_the_error_bound_and_plans_with_what_it_measured(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    profiles[CKPT] = profile(CKPT, phase("train", "train", 100, 1), phase("eval", "eval", 100, 1))
    workload = MLPWorkload(eval_samples=40)
    trusted = make_plan(workload, policy(), 1000, 1000, target="emulated", profiles=profiles)
    assert trusted.micro_batch == even_split(90, 1000) and trusted.corrections == {} and trusted.error_bound == 0
    # Every prediction raised by 25 %: 1.25 x (100 + 10m) <= 1000, m <= 70; the settings stay.
    start = make_plan(workload, policy(), 1000, 1000, target="emulated", profiles=profiles, settings=FP32, error_bound=0.25)
    assert (start.micro_batch, start.error_bound, start.settings) == (even_split(70, 1000), 0.25, FP32)
    assert start.predicted_phases["train"] == 100 + 10 * start.micro_batch  # the estimate's own, as measured against
    # Train measured at 0.5 x its prediction; eval still within the bound (its 1.25 x 140 fits).
    corrected = make_plan(workload, policy(), 1000, 1000, target="emulated", profiles=profiles, settings=FP32,
                          corrections={"train": ((70, 0.5),)}, error_bound=0.25)
    assert corrected.micro_batch == even_split(190, 1000) and corrected.corrections == {"train": ((70, 0.5),)}
    # Never above a micro-batch that measured too much.
    assert make_plan(workload, policy(), 1000, 1000, target="emulated", profiles=profiles, settings=FP32,
                     corrections={"train": ((70, 0.5),)}, micro_cap=150).micro_batch == even_split(150, 1000)
    assert Plan.from_dict(json.loads(json.dumps(corrected.to_dict()))) == corrected


def test_a_correction_is_interpolated_between_the_batch_sizes_it_was_measured_at():
    points = ((10, 1.2), (30, 1.0))
    assert [correction_at(points, b, 1.1) for b in (1, 10, 20, 30, 99)] == pytest.approx([1.2, 1.2, 1.1, 1.0, 1.0])
    assert correction_at((), 5, 1.1) == 1.1  # not measured: the error bound


def test_eval_batch_from_the_eval_phase_capped(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 3))
    plan = make_plan(MLPWorkload(eval_samples=10_000), policy(), 32, 1000, target="emulated", profiles=profiles)
    assert plan.eval_batch == 128  # 4 x effective batch, though 300 would fit
    plan = make_plan(MLPWorkload(eval_samples=50), policy(), 32, 1000, target="emulated", profiles=profiles)
    assert plan.eval_batch == 50  # the eval set
    plan = make_plan(MLPWorkload(eval_samples=10_000), policy(), 256, 1000, target="emulated", profiles=profiles)
    assert plan.eval_batch == 300  # its own profile, not the micro-batch


def test_worst_phase_decides(profiles):
    profiles[FP32] = profile(
        FP32, phase("train", "train", 100, 5), phase("eval", "eval", 100, 1),
        phase("train@epoch2", "train", 300, 10), phase("eval@epoch2", "eval", 100, 1),
    )
    plan = make_plan(MLPWorkload(), policy(), 100, 1000, target="emulated", profiles=profiles)
    assert plan.micro_batch == 50 and plan.predicted_phase == "train@epoch2"  # 70 fits: two passes of 50
    assert set(plan.predicted_phases) == {"train", "eval", "train@epoch2", "eval@epoch2"}


def test_checkpointing_then_lower_precision_when_nothing_fits(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 2000, 10), phase("eval", "eval", 100, 1))
    profiles[CKPT] = profile(CKPT, phase("train", "train", 990, 1), phase("eval", "eval", 100, 1))
    plan = make_plan(CNNWorkload(), policy(), 64, 1000, target="emulated", profiles=profiles)
    assert plan.activation_checkpointing and plan.precision == "fp32" and plan.micro_batch == 10
    assert profiles.asked == [FP32, CKPT]  # the lower precision was never estimated

    profiles[CKPT] = profile(CKPT, phase("train", "train", 2000, 1), phase("eval", "eval", 100, 1))
    profiles[BF16] = profile(BF16, phase("train", "train", 900, 1), phase("eval", "eval", 100, 1))
    plan = make_plan(CNNWorkload(), policy(), 64, 1000, target="emulated", profiles=profiles)
    assert (plan.precision, plan.activation_checkpointing, plan.micro_batch) == ("bf16", False, 64)


def test_refusal_says_what_it_needs_and_what_would_fit(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 2 * 2**30, 2**20), phase("eval", "eval", 100, 1))
    profiles[BF16] = profile(BF16, phase("train", "train", 2 * 2**30, 2**20), phase("eval", "eval", 100, 1))
    profiles[CKPT] = profile(CKPT, phase("train", "train", 2**29, 1), phase("eval", "eval", 100, 1))
    plan = make_plan(CNNWorkload(), policy(allow_activation_checkpointing=False), 64, 2**30, target="emulated",
                     profiles=profiles)
    assert plan.refusal.startswith("needs 2.00G at micro-batch 1 in train (params 2.00G, activations/sample 1.0MiB")
    assert "budget 1.00G" in plan.refusal
    assert "would fit with activation checkpointing (which the memory policy does not allow)" in plan.refusal
    assert plan.describe().startswith("refused")

    profiles[CKPT] = profiles[BF16_CKPT] = profiles[FP32]
    plan = make_plan(CNNWorkload(), policy(), 64, 2**30, target="emulated", profiles=profiles)
    assert plan.refusal.endswith("would not fit even with activation checkpointing and bf16")


def test_a_refusals_parts_add_up_to_what_it_needs_and_close_sizes_are_told_apart(profiles):
    """The trace's curve is flat at small batches, where the optimizer step peaks: that part is
    named, and the sizes the line compares get the digits that tell them apart (``units.apart``)."""
    MiB = 2**20
    states = PhaseProfile("train", "train", params=325 * 1024, grads=325 * 1024, optimizer=650 * 1024, buffers=0,
                          activations_per_sample=7440, fixed_other=1040,
                          points=((1, 1_856_596), (60, 1_856_596), (1110, 9_590_720)))
    profiles[FP32] = profiles[BF16] = profile(FP32, states, phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(safety_margin=0.98), 64, int(1.8 * MiB), target="emulated", profiles=profiles)
    assert plan.refusal.startswith(
        "needs 1.77MiB at micro-batch 1 in train (params 325.0KiB, grads 325.0KiB, optim 650.0KiB, "
        "activations/sample 7.3KiB, other 1.0KiB, step temporaries 504.8KiB), budget 1.8MiB (x safety margin 0.98 = 1.76MiB)")


# -- phases whose reserved memory comes from the caching-allocator model ---------------------------

MiB = 2**20


def log(*events):
    """An allocation log at every batch size: ``(bytes at b=0, bytes per sample)`` allocations, ``~k`` frees."""
    at = lambda b: [e if isinstance(e, int) else e[0] + e[1] * b for e in events]  # noqa: E731
    return fit_log(at(1), at(2), 1, 2)


def modelled(train_log, eval_log, conf=""):
    """A train and an eval phase of a CUDA profile (no context or workspace, to keep the sums short)."""
    allocator = parse_alloc_conf(conf)
    return (
        PhaseProfile("train", "train", 0, 0, 0, 0, 0, 0, sequence=TrialSequence(train_log), allocator=allocator),
        PhaseProfile("eval", "eval", 0, 0, 0, 0, 0, 0, sequence=TrialSequence(train_log, eval_log), allocator=allocator),
    )


def test_the_plan_counts_on_the_allocator_freeing_its_cache_under_pressure(profiles):
    # Parameters (20 MiB), activations (20 MiB per sample) freed, then a temporary 2 MiB larger
    # than them: it cannot reuse their cached segment, so without pressure the default allocator
    # holds both: 20 + 20b + (20b + 2) MiB. Within a capacity it frees the cached activations'
    # segment and retries: it fits while 20 + 20b + 2 <= capacity.
    train = log((20 * MiB, 0), (0, 20 * MiB), ~1, (2 * MiB, 20 * MiB), ~2)
    evaluate = log((0, 1024), ~3)
    profiles[FP32] = MemoryProfile("trace", FP32, "cuda", modelled(train, evaluate))
    plan = make_plan(MLPWorkload(), policy(), 8, 102 * MiB, target="cuda", profiles=profiles)
    assert plan.micro_batch == 4  # 20 + 80 + 2 = 102; a flat budget of unpressured reserved memory: 2
    train_phase = profiles[FP32].phases[0]
    assert train_phase.reserved_at(4) == (20 + 80 + 82) * MiB  # unpressured
    # within the limit: 100 MiB before the temporary; the flush leaves 20, plus its 82
    assert plan.predicted_peak_bytes == 102 * MiB and plan.predicted_phases["train"] == 102 * MiB
    assert not train_phase.fits(5, 102 * MiB) and train_phase.fits(4, 102 * MiB)


def test_the_allocator_configuration_changes_the_plan(profiles):
    # Activations (20 MiB per sample) freed, 30 MiB of optimizer state carved out of their cache,
    # activations again. Default allocator: the first segment keeps the state, the second
    # activations need a new one, and nothing can be freed: fits while 40b <= capacity.
    # Expandable segments: the free pages after the state are unmapped under pressure and the
    # segment grows at its end from the state's last page: fits while 20b + 40 <= capacity.
    train = log((0, 20 * MiB), ~0, (30 * MiB, 0), (0, 20 * MiB), ~2)
    evaluate = log((0, 1024), ~3)
    default = MemoryProfile("trace", FP32, "cuda", modelled(train, evaluate))
    expandable = MemoryProfile("trace", FP32, "cuda", modelled(train, evaluate, "expandable_segments:True"))
    profiles[FP32] = default
    assert make_plan(MLPWorkload(), policy(), 40, 200 * MiB, target="cuda", profiles=profiles).micro_batch == 5
    profiles[FP32] = expandable
    assert make_plan(MLPWorkload(), policy(), 40, 200 * MiB, target="cuda", profiles=profiles).micro_batch == 8
    assert expandable.phases[0].reserved_at(8) == (160 + 40) * MiB  # 8 pages of activations, 2 more for the state


def test_the_eval_batch_is_planned_in_the_cache_training_leaves(profiles):
    # Training at micro-batch 4 leaves its 80 MiB activation segment cached; eval's 30 MiB per
    # sample fits beside it until the allocator must free it, and after that up to the capacity.
    train = log((20 * MiB, 0), (0, 20 * MiB), ~1)
    evaluate = log((0, 30 * MiB), ~2)
    profiles[FP32] = MemoryProfile("trace", FP32, "cuda", modelled(train, evaluate))
    plan = make_plan(MLPWorkload(eval_samples=100), policy(), 4, 200 * MiB, target="cuda", profiles=profiles)
    assert (plan.micro_batch, plan.eval_batch) == (4, 6)  # 20 + 30e <= 200 once the 80 MiB are freed
    assert plan.predicted_phases["eval"] == (20 + 180) * MiB


def test_the_note_says_where_a_cuda_plan_does_not_use_the_allocator_model(profiles):
    train, evaluate = modelled(log((0, 20 * MiB), ~0), log((0, 1024), ~1))
    flat_eval = PhaseProfile("eval", "eval", 0, 0, 0, 0, 1024, 0, fragmentation=0.1)
    cases = {  # estimator, notes, phases -> what the note says
        "did not line up": ("trace", (), (train, flat_eval)),
        "PYTORCH_CUDA_ALLOC_CONF backend:cudaMallocAsync is not modelled": (
            "trace", ("backend:cudaMallocAsync is not modelled: reserved = allocated x (1 + 0.1)",),
            (PhaseProfile("train", "train", 0, 0, 0, 0, 20 * MiB, 0, fragmentation=0.1), flat_eval)),
        "the static estimator logs no allocations": (
            "static", (), (PhaseProfile("train", "train", 0, 0, 0, 0, 20 * MiB, 0, fragmentation=0.1), flat_eval)),
    }
    for why, (estimator, notes, phases) in cases.items():
        profiles[FP32] = MemoryProfile(estimator, FP32, "cuda", phases, notes)
        plan = make_plan(MLPWorkload(eval_samples=100), policy(), 4, 200 * MiB, target="cuda", profiles=profiles)
        assert why in plan.note and "not the allocator model" in plan.note, plan.note
        flat = ", ".join(p.name for p in phases if p.sequence is None)
        assert f"{flat}: reserved = allocated x 1.1, not the allocator model" in plan.note, plan.note
    profiles[FP32] = MemoryProfile("trace", FP32, "cuda", (train, evaluate))
    assert make_plan(MLPWorkload(eval_samples=100), policy(), 4, 200 * MiB, target="cuda", profiles=profiles).note == ""
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    assert make_plan(MLPWorkload(), policy(), 4, 1000, target="emulated", profiles=profiles).note == ""  # no allocator


def test_no_estimator_and_unbounded_budget(profiles):
    plan = make_plan(MLPWorkload(), policy(estimator="none"), 64, 1000, target="emulated", profiles=profiles)
    assert (plan.micro_batch, plan.eval_batch, plan.estimator, plan.predicted_peak_bytes) == (64, 64, "none", None)
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(), 64, None, target="cpu", profiles=profiles)
    assert (plan.micro_batch, plan.accum_steps, plan.budget_bytes) == (64, 1, None)
    assert plan.predicted_peak_bytes == 100 + 10 * 64


def test_plan_round_trips_through_json(profiles):
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(), policy(), 256, 1000, target="emulated", profiles=profiles)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_plan_from_a_compiled_models_eager_profile_says_so_through_its_reductions(profiles):
    profiles[FP32] = replace(profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1)),
                             compiled=True)
    plan = make_plan(MLPWorkload(), policy(), 64, 1000, target="emulated", profiles=profiles)
    assert plan.compiled and Plan.from_dict(plan.to_dict()).compiled
    assert next_reduction(plan, policy(), "train").compiled  # an OOM's smaller plan is still the eager one's


def ranked_phase(name, kind, fixed, grads, per_sample):
    return PhaseProfile(name, kind, params=fixed, grads=grads, optimizer=0, buffers=0,
                        activations_per_sample=per_sample, fixed_other=0)


def test_a_group_is_planned_per_rank_and_runs_the_smallest_ranks_plan(profiles):
    # 100 B of weights, 40 B of gradients (the exchange's bucket), 10 B per training sample.
    profiles[FP32] = profile(FP32, ranked_phase("train", "train", 100, 40, 10), ranked_phase("eval", "eval", 100, 0, 1))
    plan = plan_for_ranks(MLPWorkload(), policy(), 64, [2000, 400], target="emulated", profiles=profiles)
    # Rank 1: 400 - 40 (the exchange's bucket) - 140 (states) = 220 B -> micro-batch 22 fits, so
    # a rank's 32 samples take two passes of 16.
    assert (plan.ranks, plan.rank_batch, plan.effective_batch, plan.exchange_bytes) == (2, 32, 64, 40)
    assert plan.rank_budgets == (2000, 400) and plan.budget_bytes == 400
    assert (plan.micro_batch, plan.accum_steps) == (16, 2)
    alone = make_plan(MLPWorkload(), policy(), 32, 400 - 40, target="emulated", profiles=profiles)
    assert (plan.micro_batch, plan.accum_steps) == (alone.micro_batch, alone.accum_steps)
    assert plan.predicted_peak_bytes == alone.predicted_peak_bytes + 40  # what rank 1's device holds
    roomy = make_plan(MLPWorkload(), policy(), 32, 2000 - 40, target="emulated", profiles=profiles)
    assert roomy.micro_batch == 32 > plan.micro_batch  # rank 0 alone would take its whole share at once
    assert plan.describe().startswith("16 x 2 x 2 ranks (eval")
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_a_group_whose_ranks_all_take_their_whole_share_records_its_smallest_budget(profiles):
    """Ranks that tie on batches: the group's budget is still the smallest rank's, whatever its place."""
    profiles[FP32] = profile(FP32, ranked_phase("train", "train", 100, 40, 10), ranked_phase("eval", "eval", 100, 0, 1))
    for budgets in ([64_000, 3_000], [3_000, 64_000]):
        plan = plan_for_ranks(MLPWorkload(), policy(), 64, budgets, target="emulated", profiles=profiles)
        assert (plan.micro_batch, plan.accum_steps, plan.budget_bytes) == (32, 1, 3_000), budgets


def test_a_group_that_one_rank_cannot_hold_is_refused_naming_the_rank(profiles):
    profiles[FP32] = profile(FP32, ranked_phase("train", "train", 100, 40, 10), ranked_phase("eval", "eval", 100, 0, 1))
    profiles[BF16] = profile(BF16, ranked_phase("train", "train", 100, 40, 10), ranked_phase("eval", "eval", 100, 0, 1))
    plan = plan_for_ranks(MLPWorkload(), policy(), 60, [2000, 2000, 150], target="emulated", profiles=profiles)
    assert plan.refusal.startswith("rank 2: needs ")
    # Micro-batch 1 alone would fit 175 B (140 + 10), not beside the exchange's bucket (40 B).
    assert plan_for_ranks(MLPWorkload(), policy(), 60, [2000, 175], target="emulated", profiles=profiles).refusal.startswith("rank 1: ")


def test_a_groups_reductions_keep_micro_batch_x_accumulation_x_ranks_exact():
    plan = Plan(16, 2, 128, 64, False, "fp32", "trace", 1000, None, None, ranks=4)
    while plan is not None and plan.micro_batch > 1:
        plan = next_reduction(plan, policy(), "train")
        assert plan.micro_batch * plan.accum_steps * plan.ranks == plan.effective_batch == 128


def test_reductions_keep_the_effective_batch():
    p = policy(lower_precision="bf16")
    plan = Plan(8, 4, 32, 64, False, "fp32", "trace", 1000, 900, "train", {"train": 900})
    steps = []
    while plan is not None:
        steps.append((plan.micro_batch, plan.accum_steps, plan.activation_checkpointing, plan.precision, plan.reductions))
        assert plan.effective_batch == 32
        plan = next_reduction(plan, p, "train", workload_supports_checkpointing=True)
    assert steps == [
        (8, 4, False, "fp32", 0), (4, 8, False, "fp32", 1), (2, 16, False, "fp32", 2), (1, 32, False, "fp32", 3),
        (1, 32, True, "fp32", 4), (1, 32, True, "bf16", 5),
    ]


def test_a_reduction_halves_the_micro_batch_and_spreads_the_step_evenly_over_its_passes():
    plan = Plan(100, 2, 128, 64, False, "fp32", "trace", 1000, None, None)
    reduced = next_reduction(plan, policy(), "train")
    assert (reduced.micro_batch, reduced.accum_steps) == (43, 3)  # 50 + 50 + 28 as 43 + 43 + 42
    assert "micro-batch 100 -> 43 (x 3)" in reduced.note


def test_reductions_are_pure_and_clear_stale_predictions():
    plan = Plan(8, 4, 32, 64, False, "fp32", "trace", 1000, 900, "train", {"train": 900})
    reduced = next_reduction(plan, policy(), "train")
    assert plan.micro_batch == 8  # unchanged
    assert reduced.predicted_peak_bytes is None and reduced.predicted_phases == {}
    assert "micro-batch 8 -> 4" in reduced.note
    one = Plan(1, 32, 32, 64, False, "bf16", "trace", 1000, None, None)
    assert next_reduction(one, policy(lower_precision="bf16"), "train", workload_supports_checkpointing=False) is None


def test_a_reduction_is_predicted_again_at_its_smaller_batches_from_the_same_profile(profiles):
    """After an OOM the trial still compares a prediction with what its device measures."""
    profiles[FP32] = profile(FP32, phase("train", "train", 100, 10), phase("eval", "eval", 100, 1))
    plan = make_plan(MLPWorkload(eval_samples=40), policy(), 80, 1000, target="emulated", profiles=profiles)
    assert (plan.micro_batch, plan.predicted_phases) == (80, {"train": 900, "eval": 140})
    reduced = predicted(next_reduction(plan, policy(), "train"), profiles[FP32])
    assert (reduced.micro_batch, reduced.accum_steps, reduced.reductions) == (40, 2, 1)
    assert reduced.predicted_phases == {"train": 500, "eval": 140}
    assert (reduced.predicted_peak_bytes, reduced.predicted_phase) == (500, "train")


def test_a_groups_reduction_is_predicted_with_the_exchange_s_bucket(profiles):
    profiles[FP32] = profile(FP32, ranked_phase("train", "train", 100, 40, 10), ranked_phase("eval", "eval", 100, 0, 1))
    plan = plan_for_ranks(MLPWorkload(), policy(), 64, [2000, 400], target="emulated", profiles=profiles)
    reduced = predicted(next_reduction(plan, policy(), "train"), profiles[FP32])
    alone = make_plan(MLPWorkload(), policy(), 32, 400 - 40, target="emulated", profiles=profiles)
    at_half = predicted(replace(alone, micro_batch=reduced.micro_batch), profiles[FP32])
    assert reduced.micro_batch == plan.micro_batch // 2
    assert reduced.predicted_phases == {name: peak + 40 for name, peak in at_half.predicted_phases.items()}


def test_eval_reductions_touch_only_the_eval_batch():
    plan = Plan(8, 4, 32, 3, False, "fp32", "trace", 1000, None, None)
    first = next_reduction(plan, policy(), "eval")
    assert (first.eval_batch, first.micro_batch, first.reductions) == (1, 8, 1)
    assert next_reduction(first, policy(), "eval") is None


def test_a_traced_plan_runs_on_the_emulated_device_without_oom():
    """The trace is exact on the CPU tracker, so its plan fits the emulated device it was made for."""
    workload = CNNWorkload(train_samples=128, eval_samples=64)
    capacity = 3 * 2**20
    plan = make_plan(workload, policy(safety_margin=0.95), 64, capacity, target="emulated")
    assert plan.refusal is None and plan.accum_steps > 1
    device = EmulatedDevice(capacity)
    with device.measuring():  # counted from the model's construction on, as in a trial
        trainer = Trainer(workload, device, LoopPlan(plan.micro_batch, 64, plan.eval_batch), LoopSettings(Stop(epochs=1)))
        (milestone,) = trainer.run()  # no OutOfMemoryError
    # the loop's own bookkeeping (its running loss) is the only difference
    assert milestone.memory.peak_allocated == pytest.approx(plan.predicted_peak_bytes, rel=1e-3)
