"""A small convolutional net on synthetic images; supports activation checkpointing."""

from __future__ import annotations

import dataclasses

import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainables.synthetic import template_images
from trainables.workload import Workload


class _ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm = nn.BatchNorm2d(cout)
        self.checkpointed = False

    def _body(self, x):
        return F.relu(self.norm(self.conv(x)))

    def forward(self, x):
        if self.checkpointed and self.training and x.requires_grad:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class SmallCNN(nn.Module):
    def __init__(self, width: int, depth: int, classes: int, channels: int):
        super().__init__()
        blocks, cin = [], channels
        for i in range(depth):
            blocks.append(_ConvBlock(cin, width * 2**i))
            cin = width * 2**i
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        for block in self.blocks:
            x = F.max_pool2d(block(x), 2) if x.shape[-1] > 4 else block(x)
        return self.head(x.mean(dim=(2, 3)))


@dataclasses.dataclass
class CNNWorkload(Workload):
    width: int = 16
    depth: int = 2
    image_size: int = 16
    channels: int = 3
    classes: int = 8
    train_samples: int = 1024
    eval_samples: int = 256

    #: A step's memory depends on the batch, not on how many samples the datasets hold.
    memory_neutral = Workload.memory_neutral + ("train_samples", "eval_samples")

    supports_activation_checkpointing = True

    def build_model(self) -> nn.Module:
        return SmallCNN(self.width, self.depth, self.classes, self.channels)

    def set_activation_checkpointing(self, model, enabled: bool) -> None:
        for block in model.blocks:
            block.checkpointed = enabled

    def _data(self, n: int, split: str):
        return template_images(n, (self.channels, self.image_size, self.image_size), self.classes, split)

    def train_data(self):
        return self._data(self.train_samples, "train")

    def eval_data(self):
        return self._data(self.eval_samples, "eval")

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)
