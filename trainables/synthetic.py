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
    y = (x.reshape(n, features) @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


def template_images(n: int, shape: tuple[int, int, int], classes: int, split: str, noise: float = 1.0) -> TensorDataset:
    """Images of a per-class random template plus noise: a signal a small conv net can find."""
    templates = torch.randn(classes, *shape, generator=torch.Generator().manual_seed(DATA_SEED))
    data_gen = torch.Generator().manual_seed(DATA_SEED + (1 if split == "train" else 2))
    y = torch.randint(0, classes, (n,), generator=data_gen)
    x = templates[y] + noise * torch.randn(n, *shape, generator=data_gen)
    return TensorDataset(x, y)
