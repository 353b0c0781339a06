"""What a parallel strategy adds to, or takes from, each rank's memory.

A data-parallel rank holds the whole model, its gradients and its optimizer state, as a single
process does, plus what its gradient exchange needs. Ours (``trainables.distributed``) reduces
the gradients bucket by bucket through one flat buffer, as DDP does with
``gradient_as_bucket_view=False`` and a bucket cap: the buffer is at most one bucket, or the
gradients themselves when they are smaller. With ``gradient_as_bucket_view=True`` DDP would hold
the gradients *in* its buckets and add nothing; with the view off it holds a second copy of all
of them. Our bucket is made at the first step and kept for the trial's life (a buffer made and
dropped every step would be freed whenever the backend's last work object lets go of it, which
makes a rank's peak depend on a race), so the planner takes it from each rank's budget.

A sharded strategy (FSDP2's ``fully_shard``) is another class with the same two answers: its
rank holds params/grads/optimizer state divided by the ranks, plus the all-gather buffers of the
largest unit it unshards at once; the planner asks the strategy and needs no other change.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.memory.profile import MemoryProfile
from trainables.distributed import BUCKET_CAP_BYTES


@dataclass(frozen=True)
class DataParallel:
    """Every rank a full replica; gradients summed over ``ranks`` through one bucket buffer."""

    ranks: int
    bucket_cap_bytes: int = BUCKET_CAP_BYTES

    name = "data_parallel"

    def rank_batch(self, effective_batch: int) -> int:
        """Samples of each optimizer step a rank computes (the sweep checks they divide evenly)."""
        if effective_batch % self.ranks:
            raise ValueError(f"effective batch {effective_batch} does not split evenly over {self.ranks} ranks")
        return effective_batch // self.ranks

    def extra_bytes(self, profile: MemoryProfile | None) -> int:
        """Bytes a rank holds for the exchange on top of what one process would: one bucket."""
        if profile is None or self.ranks == 1:
            return 0
        grads = max((p.grads for p in profile.phases_of("train")), default=0)
        return min(grads, self.bucket_cap_bytes)
