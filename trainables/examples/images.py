"""A ``timm`` image classifier on JPEG images decoded and augmented per sample.

The dataset holds encoded JPEG bytes, as an image folder or a WebDataset shard does; every
``__getitem__`` decodes one (``torchvision.io.decode_jpeg``) and augments it with torchvision's
transforms (random resized crop, flip, colour jitter), which is the per-sample CPU work that
``data.num_workers`` exists for. The images are synthetic (a smooth per-class pattern plus
noise, encoded once when the dataset is made), so nothing is downloaded; the model is any of a
few small timm architectures, built without pretrained weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainables.synthetic import DATA_SEED
from trainables.workload import Workload

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


class EncodedImages(Dataset):
    """JPEG-encoded images and their labels; every ``__getitem__`` decodes one and transforms it."""

    def __init__(self, encoded: tuple[list[torch.Tensor], list[int]], transform):
        self.encoded, self.labels = encoded
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.io import decode_jpeg

        return self.transform(decode_jpeg(self.encoded[index])), self.labels[index]


@functools.lru_cache(maxsize=4)
def encoded_images(count: int, classes: int, image_size: int, split: str) -> tuple[list[torch.Tensor], list[int]]:
    """``count`` JPEGs of ``image_size`` pixels: a smooth per-class pattern under strong noise.
    Encoded once per process (a trial asks for its data more than once)."""
    from torchvision.io import encode_jpeg

    patterns = F.interpolate(
        torch.randn(classes, 3, 4, 4, generator=torch.Generator().manual_seed(DATA_SEED)),
        size=(image_size, image_size), mode="bicubic", align_corners=False,
    )
    generator = torch.Generator().manual_seed(DATA_SEED + (1 if split == "train" else 2))
    labels = torch.randint(0, classes, (count,), generator=generator).tolist()
    encoded = []
    for label in labels:
        pixels = 128 + 12 * patterns[label] + 64 * torch.randn(3, image_size, image_size, generator=generator)
        encoded.append(encode_jpeg(pixels.clamp(0, 255).to(torch.uint8), quality=90))
    return encoded, labels


def train_transform(crop: int):
    from torchvision.transforms import v2

    return v2.Compose([
        v2.RandomResizedCrop(crop, scale=(0.35, 1.0), antialias=True),
        v2.RandomHorizontalFlip(),
        v2.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])


def eval_transform(crop: int):
    from torchvision.transforms import v2

    return v2.Compose([
        v2.Resize(crop, antialias=True),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(MEAN, STD),
    ])


@dataclasses.dataclass
class ImageClassifierWorkload(Workload):
    model: Literal["resnet10t", "resnet18", "mobilenetv3_small_050", "efficientnet_b0"] = "resnet10t"
    drop_rate: float = 0.0
    classes: int = 10
    image_size: int = 64  # stored (encoded) size
    crop: int = 48  # what the model sees
    train_images: int = 2048
    eval_images: int = 512

    metrics = ("loss", "accuracy")

    def build_model(self) -> nn.Module:
        import timm

        return timm.create_model(self.model, pretrained=False, num_classes=self.classes, drop_rate=self.drop_rate)

    def train_data(self) -> Dataset:
        encoded = encoded_images(self.train_images, self.classes, self.image_size, "train")
        return EncodedImages(encoded, train_transform(self.crop))

    def eval_data(self) -> Dataset:
        encoded = encoded_images(self.eval_images, self.classes, self.image_size, "eval")
        return EncodedImages(encoded, eval_transform(self.crop))

    def largest_sample(self) -> tuple[torch.Tensor, int]:
        """Every image is ``crop`` pixels after augmentation, so any sample is the largest."""
        return self.eval_data()[0]

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels)

    def eval_metrics(self, model: nn.Module, batch, samples: int) -> dict[str, torch.Tensor]:
        images, labels = batch
        logits = model(images)
        return {
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
            "accuracy": (logits.argmax(dim=1) == labels).sum(),
        }
