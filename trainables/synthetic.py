"""Synthetic data with a learnable signal, so the demo workloads' loss really goes down.

Labels come from a fixed random "teacher" (a linear map of the inputs), the same for every trial
of a sweep: trials differ in their model and hyper-parameters, not in their data.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

DATA_SEED = 1234


def teacher_classification(n: int, input_shape: tuple[int, ...], classes: int, split: str) -> TensorDataset:
    """``n`` samples of shape ``input_shape`` labelled by a fixed linear teacher."""
    features = 1
    for d in input_shape:
        features *= d
    teacher_gen = torch.Generator().manual_seed(DATA_SEED)
    teacher = torch.randn(features, classes, generator=teacher_gen)
    data_gen = torch.Generator().manual_seed(DATA_SEED + (1 if split == "train" else 2))
    x = torch.randn(n, *input_shape, generator=data_gen)
    y = (x.reshape(n, -1) @ teacher).argmax(dim=1)
    return TensorDataset(x, y)
