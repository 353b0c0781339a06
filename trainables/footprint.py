"""What a workload's data and state hold on the host, measured for the host-memory plan
(``orchestrator.host_memory``).

The datasets are walked as their objects hold them, in three parts, since the DataLoader's workers
hold them differently (``orchestrator.host_memory`` counts each): tensors by their buffers (a
worker shares them, through shared memory when it gets the dataset pickled), NumPy arrays by
theirs (shared with a forked worker, copied into any other), every other Python object by its
size (each worker ends up with its own copy). One training
micro-batch is collated for the batches loaded ahead. The model is built on ``meta`` (no memory)
for its parameters and buffers; the optimizer's state is counted as Adam's, two moments per
parameter, since it does not exist before the first step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from trainables.workload import Workload

#: The optimizer's state per parameter byte, as Adam keeps it (two moments).
OPTIMIZER_STATE_PER_PARAMETER = 2
#: Objects walked in a dataset at most: a dataset of millions of Python objects is counted from a
#: sample of them, scaled by the count of the container that holds them.
MAX_WALKED = 200_000


@dataclass(frozen=True)
class DataFootprint:
    """What one trial's data and state hold on the host."""

    tensor_bytes: int  # tensors in the datasets: once per trial, whatever its workers
    array_bytes: int  # NumPy arrays in the datasets: once with forked workers, else once per process
    copied_bytes: int  # the datasets' other Python objects: once per process that loads from them
    batch_bytes: int  # one collated training micro-batch
    state_bytes: int  # the model's parameters and buffers with the optimizer's state


def data_footprint(workload: Workload, micro_batch: int) -> DataFootprint:
    train = workload.train_data()
    held = _Held()
    held.walk(train)
    held.walk(workload.eval_data())
    samples = [train[i] for i in range(min(micro_batch, len(train)))]
    batch = _Held()
    batch.walk(workload.collate(samples))
    with torch.device("meta"):
        model = workload.build_model()
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return DataFootprint(held.tensors, held.arrays, held.copied, batch.tensors + batch.arrays + batch.copied,
                         parameters * (1 + OPTIMIZER_STATE_PER_PARAMETER) + buffers)


class _Held:
    """Bytes reachable from objects: buffers of tensors, buffers of arrays, and the rest."""

    def __init__(self) -> None:
        self.tensors = self.arrays = self.copied = 0
        self._seen: set[int] = set()
        self._walked = 0

    def walk(self, root: Any) -> None:
        stack = [root]
        while stack:
            obj = stack.pop()
            if id(obj) in self._seen:
                continue
            self._seen.add(id(obj))
            self._walked += 1
            if isinstance(obj, torch.Tensor):
                storage = obj.untyped_storage()
                if id(storage) not in self._seen:
                    self._seen.add(id(storage))
                    self.tensors += storage.nbytes() if obj.device.type != "meta" else 0
                continue
            if type(obj).__module__ == "numpy" and hasattr(obj, "nbytes"):
                self.arrays += int(obj.nbytes)
                continue
            self.copied += sys.getsizeof(obj)
            if isinstance(obj, (str, bytes, bytearray, int, float, bool, type(None))):
                continue
            children = _children(obj)
            if self._walked + len(children) > MAX_WALKED and len(children) > 16:
                self._sample(children)
                continue
            stack.extend(children)

    def _sample(self, children: list) -> None:
        """A large container: its first 16 items walked, the rest counted as their average."""
        before = (self.tensors, self.arrays, self.copied)
        for child in children[:16]:
            self.walk(child)
        scale = (len(children) - 16) / 16
        self.tensors += int((self.tensors - before[0]) * scale)
        self.arrays += int((self.arrays - before[1]) * scale)
        self.copied += int((self.copied - before[2]) * scale)


def _children(obj: Any) -> list:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, torch.nn.Module):
        return []  # a model inside a dataset is counted with the state, not as data
    state = getattr(obj, "__dict__", None)
    return list(state.values()) if isinstance(state, dict) else []
