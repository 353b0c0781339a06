"""A multi-layer perceptron on synthetic vectors: the smallest workload, seconds on a CPU."""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from torch import nn

from trainables.synthetic import teacher_classification
from trainables.workload import Workload


@dataclasses.dataclass
class MLPWorkload(Workload):
    width: int = 64
    depth: int = 2
    in_features: int = 32
    classes: int = 8
    train_samples: int = 2048
    eval_samples: int = 512

    #: A step's memory depends on the batch, not on how many samples the datasets hold.
    memory_neutral = Workload.memory_neutral + ("train_samples", "eval_samples")

    def build_model(self) -> nn.Module:
        layers: list[nn.Module] = []
        features = self.in_features
        for _ in range(self.depth):
            layers += [nn.Linear(features, self.width), nn.ReLU()]
            features = self.width
        layers.append(nn.Linear(features, self.classes))
        return nn.Sequential(*layers)

    def train_data(self):
        return teacher_classification(self.train_samples, (self.in_features,), self.classes, "train")

    def eval_data(self):
        return teacher_classification(self.eval_samples, (self.in_features,), self.classes, "eval")

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)
