"""An MLP whose wide auxiliary block switches on at a given epoch.

This is the shape of the first user story (modules that activate at epoch 3 and push a 24 GB
card to 32.7 GB): a trial that fits at epoch 0 and would run out of memory later unless the
plan accounts for every stage from the start.
"""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from torch import nn

from trainables.mlp import MLPWorkload


class StagedMLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, classes: int, aux_width: int):
        super().__init__()
        layers: list[nn.Module] = []
        features = in_features
        for _ in range(depth):
            layers += [nn.Linear(features, width), nn.ReLU()]
            features = width
        self.trunk = nn.Sequential(*layers)
        self.aux = nn.Sequential(nn.Linear(width, aux_width), nn.ReLU(), nn.Linear(aux_width, width))
        self.head = nn.Linear(width, classes)
        self.active = {"aux": False}

    def set_active(self, name: str, on: bool) -> None:
        self.active[name] = on

    def forward(self, x):
        h = self.trunk(x)
        if self.active["aux"]:
            h = h + self.aux(h)
        return self.head(h)


@dataclasses.dataclass
class StagedMLPWorkload(MLPWorkload):
    aux_width: int = 1024
    aux_start_epoch: int = 2  # counted from 0, as set_epoch counts: 2 is the third epoch

    def activation_schedule(self) -> dict[str, int]:
        return {"aux": self.aux_start_epoch}

    def build_model(self) -> nn.Module:
        return StagedMLP(self.in_features, self.width, self.depth, self.classes, self.aux_width)

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)
