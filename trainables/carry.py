"""The state a stateful workload carries from one optimizer step to the next (truncated BPTT).

A stateful workload (``Workload.stateful``) trains on parallel streams: the rows of a step's
batch are ``effective_batch`` streams, each continuing where its row of the previous step
stopped (``trainables.data``'s ordered sampler), as the batchify layout of the usual RNN
language-model loop does. Its state (an RNN's hidden state, say: a tensor or a tuple, list or
dict of them) holds one row per stream, along ``Workload.state_dim`` of every tensor.

A :class:`Carry` holds the state of all the streams of a step (of this rank). A step cut into
micro-batches gives each micro-batch the rows of the streams it computes (:func:`split_rows`),
and puts their new states back together (:func:`merge_rows`), detached: gradients stop at the
optimizer step, as truncated BPTT's ``repackage_hidden`` does. A smaller micro-batch after an
OOM cuts the same rows differently; the streams and their states do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainables.workload import Batch, LossTypeError, Workload, map_tensors, one_number, to_device

#: What ``Workload.initial_state`` returns and ``loss`` receives and returns for a stateful workload.
State = Any


class StateShapeError(ValueError):
    """A state does not have the rows it should (one per stream, along ``state_dim``)."""


@dataclass
class Carry:
    """The state of ``rows`` streams, rows along ``dim`` of each tensor; replaced after every step."""

    state: State
    dim: int

    @classmethod
    def initial(cls, workload: Workload, rows: int, device: torch.device) -> Carry:
        """The workload's initial state for ``rows`` streams, on ``device``, its rows checked."""
        carry = cls(to_device(workload.initial_state(rows), device), workload.state_dim)
        carry.check(rows, f"{type(workload).__name__}.initial_state({rows})")
        return carry

    def check(self, rows: int, what: str) -> None:
        for tensor in leaves(self.state):
            if tensor.dim() <= self.dim or tensor.shape[self.dim] != rows:
                raise StateShapeError(
                    f"{what}: a state tensor of shape {tuple(tensor.shape)} does not have {rows} rows "
                    f"(one per stream) along state_dim {self.dim}"
                )

    def split(self, sizes: Sequence[int]) -> list[State]:
        return split_rows(self.state, sizes, self.dim)


def split_rows(state: State, sizes: Sequence[int], dim: int) -> list[State]:
    """``state`` cut along ``dim`` into consecutive parts of ``sizes`` rows, each contiguous (a
    slice along a later dimension is strided, and kernels such as the LSTM's copy it anyway)."""
    parts, start = [], 0
    for size in sizes:
        parts.append(map_tensors(lambda t, start=start, size=size: t.narrow(dim, start, size).contiguous(), state))
        start += size
    return parts


def merge_rows(parts: Sequence[State], dim: int) -> State:
    """The parts of :func:`split_rows` back into one state, detached from their graphs."""
    return _zip_map(lambda tensors: torch.cat([t.detach() for t in tensors], dim), parts)


def leaves(state: State) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, state)
    return found


def _zip_map(fn: Callable[[list[torch.Tensor]], torch.Tensor], trees: Sequence[State]) -> State:
    first = trees[0]
    if isinstance(first, torch.Tensor):
        return fn(list(trees))
    if isinstance(first, dict):
        return {k: _zip_map(fn, [t[k] for t in trees]) for k in first}
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_zip_map(fn, list(col)) for col in zip(*trees)))
    if isinstance(first, (list, tuple)):
        return type(first)(_zip_map(fn, list(col)) for col in zip(*trees))
    return first


def stateful_loss(workload: Workload, model: nn.Module, batch: Batch, state: State) -> tuple[torch.Tensor, State]:
    """The workload's ``loss(model, batch, state) -> (loss, state)``, its answer's shape checked."""
    out = workload.loss(model, batch, state)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise LossTypeError(
            f"{type(workload).__name__}.loss: a stateful workload's loss returns (loss, state), got {type(out).__name__}"
        )
    loss, state = out
    return one_number(workload, loss), state
