"""What a workload's data and state hold on the host (``trainables/footprint.py``), on real datasets."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import Dataset, TensorDataset

from trainables.footprint import data_footprint
from trainables.mlp import MLPWorkload


class Records(Dataset):
    """Samples kept as Python objects: each worker process ends up with its own copy."""

    def __init__(self, n):
        self.rows = [{"x": [float(i)] * 8, "y": i % 2} for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        row = self.rows[i]
        return torch.tensor(row["x"]), row["y"]


class ArrayRecords(Dataset):
    """Samples kept in a NumPy array."""

    def __init__(self, array):
        self.array = array

    def __len__(self):
        return len(self.array)

    def __getitem__(self, i):
        return torch.from_numpy(self.array[i]), 0


def _workload(train, eval_):
    base = MLPWorkload()

    @dataclasses.dataclass
    class Measured(type(base)):
        def train_data(self):
            return train

        def eval_data(self):
            return eval_

    return Measured()


def test_tensors_count_once_by_their_buffers_and_objects_as_copies():
    x = torch.zeros(1000, 8)
    tensors = data_footprint(_workload(TensorDataset(x, x[:, 0]), TensorDataset(x[:10])), micro_batch=4)
    assert tensors.tensor_bytes == 1000 * 8 * 4  # the eval set is a view of the same buffer: counted once
    assert tensors.array_bytes == 0 and tensors.copied_bytes < 1000
    assert tensors.batch_bytes >= 4 * 9 * 4
    objects = data_footprint(_workload(Records(1000), Records(10)), micro_batch=4)
    assert objects.tensor_bytes == objects.array_bytes == 0
    assert objects.copied_bytes > 1000 * 8 * 24  # a float object is 24 bytes


def test_numpy_arrays_count_apart_from_tensors():
    import numpy

    x = numpy.zeros((1000, 8), dtype=numpy.float32)
    arrays = data_footprint(_workload(TensorDataset(torch.zeros(10, 8), torch.zeros(10)), ArrayRecords(x)), micro_batch=4)
    assert arrays.array_bytes == x.nbytes and arrays.tensor_bytes == (10 * 8 + 10) * 4


def test_the_state_is_the_parameters_twice_more_for_the_optimizer_and_the_buffers():
    workload = MLPWorkload()
    model = workload.build_model()
    parameters = sum(p.numel() * 4 for p in model.parameters())
    x = torch.zeros(64, 1)
    assert data_footprint(_workload(TensorDataset(x), TensorDataset(x)), 4).state_bytes >= 3 * parameters
