"""The model zoo of the memory benchmarks and the zoo test, as workloads (``trainables.workload.Workload``).

Three families:

* the library zoo (``LIBRARY_ZOO``): models people train, from timm (ConvNeXt, Swin,
  EfficientNet, ViT), torchvision (ResNet, DeepLabV3, Faster R-CNN), transformers (BERT, GPT-2,
  Llama) and torch.nn (Transformer, TransformerEncoder with and without masks, LSTM, GRU, a
  UNet), at small sizes that trace in seconds. ``tests/test_zoo.py`` plans them all on fake tensors (``bash
  scripts/setup.sh --zoo`` installs the libraries); the accuracy benchmark compares them with a
  GPU's truth.
* GPU models (``GPU_ZOO``), at their published sizes: ResNet-50 (torchvision), ViT-B/16 in bf16
  (torchvision), GPT-2 124M in bf16 at sequence 1024 (transformers), a temporal conv net on
  (b, 19, 15360) EEG-like input, a GAT (torch_geometric) on batches of small graphs, and GPT-2
  written with plain PyTorch in transformers' ops (a model whose every op we can see, to tell
  the CUDA emulation's error from transformers' specifics), torch.nn's encoder at the original
  Transformer's base size with a causal and a padding mask, and the stateful LSTM language
  model at Zaremba et al.'s medium size (truncated BPTT). The first four are the models of
  the H100 ground truth (the JSON given to ``estimator_accuracy.py --truth``, ``Entry.truth``),
  built the same way.
* CPU stand-ins (``CPU_ZOO``), hand-written with plain PyTorch so they run where those
  libraries are not installed: a bottleneck ResNet on small images, the same 1-d conv net on
  a shorter signal, a GPT-style causal transformer (``scaled_dot_product_attention`` with
  dropout, tied embeddings, bf16) and a ViT-style encoder, plus the project's own workloads:
  torch.nn's encoder with a causal and a padding mask (both layouts) and the stateful LSTM
  language model (``trainables/examples/lstm_lm.py``, truncated BPTT).

Data are synthetic and small (the benchmarks index them modulo their length): memory depends
on shapes, not values. A sweep names a zoo model as ``bench.zoo:Swin`` (run from the project
root); its fields are the sweep's hyper-parameters.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from trainables.cnn import CNNWorkload
from trainables.examples.lstm_lm import LSTMLanguageModelWorkload
from trainables.mlp import MLPWorkload
from trainables.staged import StagedMLPWorkload
from trainables.workload import Workload

SAMPLES = 16  # distinct synthetic samples per dataset
LENGTH = 4096  # samples per epoch: the stored ones repeated, so a sweep has whole optimizer steps


class Repeated(Dataset):
    """``base`` cycled to ``length`` samples: memory is what matters here, not what is learnt,
    and a few samples of a (19, 15360) signal or a 224 px image are enough."""

    def __init__(self, base: Dataset, length: int = LENGTH):
        self.base, self.length = base, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.base[index % len(self.base)]


def _repeated(*tensors: torch.Tensor) -> Repeated:
    return Repeated(TensorDataset(*tensors))


def _images(shape: tuple[int, ...], classes: int) -> Repeated:
    g = torch.Generator().manual_seed(0)
    return _repeated(torch.randn(SAMPLES, *shape, generator=g), torch.randint(0, classes, (SAMPLES,), generator=g))


def _tokens(vocab: int, seq: int) -> Repeated:
    g = torch.Generator().manual_seed(0)
    return _repeated(torch.randint(0, vocab, (SAMPLES, seq), generator=g))


@dataclasses.dataclass
class _Classifier(Workload):
    """Cross-entropy classification of synthetic inputs: the shape every vision zoo model shares."""

    classes: int = 1000

    input_shape = (3, 224, 224)

    def train_data(self):
        return _images(self.input_shape, self.classes)

    def eval_data(self):
        return _images(self.input_shape, self.classes)

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)


# -- models from the libraries people train with ----------------------------------------------
#
# Each class's defaults are a small configuration of the model (the same kinds of layers, fewer
# of them), which traces in seconds: the zoo test plans them all on a CPU. The published sizes
# are presets (``ResNet50``, ``ViTB16``, ``GPT2``) or parameters of the zoo's entries.


@dataclasses.dataclass
class _Timm(_Classifier):
    """A timm classifier: ``arch`` as published, or cut down by ``SMALL`` (the default), which
    keeps its kinds of blocks. Stochastic depth on, as timm's recipes train them."""

    arch: str = ""
    published: bool = False
    classes: int = 1000

    SMALL: ClassVar[dict] = {}

    def build_model(self):
        import timm

        small = {} if self.published else dict(self.SMALL)
        arch = small.pop("arch", self.arch)
        return timm.create_model(arch, num_classes=self.classes, drop_path_rate=0.1, **small)


@dataclasses.dataclass
class ConvNeXt(_Timm):
    arch: str = "convnext_atto"
    SMALL: ClassVar[dict] = {"depths": (1, 1, 1, 1)}


@dataclasses.dataclass
class Swin(_Timm):
    """Shifted windows: the constructor builds index tables and attention masks on the host."""

    arch: str = "swin_tiny_patch4_window7_224"
    SMALL: ClassVar[dict] = {"depths": (2, 2), "num_heads": (3, 6)}


@dataclasses.dataclass
class EfficientNet(_Timm):
    arch: str = "efficientnet_b0"
    SMALL: ClassVar[dict] = {"arch": "test_efficientnet"}  # timm's own EfficientNet of a few blocks
    input_shape = (3, 160, 160)


@dataclasses.dataclass
class ViT(_Timm):
    arch: str = "vit_tiny_patch16_224"
    SMALL: ClassVar[dict] = {"depth": 2}


@dataclasses.dataclass
class ViTB16(_Classifier):
    """ViT-B/16 as torchvision builds it: the ground truth's model."""

    def build_model(self):
        import torchvision

        return torchvision.models.vit_b_16(num_classes=self.classes)


@dataclasses.dataclass
class ResNet(_Classifier):
    """A torchvision ResNet by name."""

    arch: str = "resnet18"

    def build_model(self):
        import torchvision

        return getattr(torchvision.models, self.arch)(num_classes=self.classes)


@dataclasses.dataclass
class ResNet50(ResNet):
    arch: str = "resnet50"


def _segmentation(image: int, classes: int) -> Repeated:
    g = torch.Generator().manual_seed(0)
    return _repeated(
        torch.randn(SAMPLES, 3, image, image, generator=g), torch.randint(0, classes, (SAMPLES, image, image), generator=g)
    )


@dataclasses.dataclass
class DeepLabV3(Workload):
    """torchvision's DeepLabV3 with its auxiliary head: per-pixel cross-entropy. The published
    backbones (``resnet50``, ``mobilenet_v3_large``) through torchvision's builders; the default
    puts torchvision's DeepLabV3 head on a ResNet-18, which traces in a few seconds."""

    backbone: Literal["resnet18", "resnet50", "mobilenet_v3_large"] = "resnet18"
    classes: int = 21
    image: int = 224

    def build_model(self):
        from torchvision.models import resnet18, segmentation
        from torchvision.models._utils import IntermediateLayerGetter

        if self.backbone != "resnet18":
            build = getattr(segmentation, f"deeplabv3_{self.backbone}")
            return build(weights=None, weights_backbone=None, num_classes=self.classes, aux_loss=True)
        layers = IntermediateLayerGetter(resnet18(), {"layer4": "out", "layer3": "aux"})
        return segmentation.DeepLabV3(
            layers, segmentation.deeplabv3.DeepLabHead(512, self.classes), segmentation.fcn.FCNHead(256, self.classes)
        )

    def train_data(self):
        return _segmentation(self.image, self.classes)

    def eval_data(self):
        return _segmentation(self.image, self.classes)

    def loss(self, model, batch):
        x, y = batch
        out = model(x)
        return F.cross_entropy(out["out"], y) + 0.5 * F.cross_entropy(out["aux"], y)


@dataclasses.dataclass
class FasterRCNN(Workload):
    """torchvision's Faster R-CNN (MobileNetV3-Large FPN, 320 px): its training losses; in eval,
    the detections' scores. Fake tensors cannot trace it: in training its transform picks a
    resize at random and reads the choice on the host (``.item()``), and its region proposals
    keep the boxes that survive non-maximum suppression, a number that depends on the values."""

    classes: int = 91
    image: int = 64  # the published model resizes to 320
    boxes: int = 4
    proposals: int = 64  # region proposals per image (published: 150 of 2000 at test, 512 sampled in training)

    def build_model(self):
        from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

        return fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None, num_classes=self.classes, min_size=self.image, max_size=self.image,
            rpn_pre_nms_top_n_train=self.proposals, rpn_post_nms_top_n_train=self.proposals,
            rpn_pre_nms_top_n_test=self.proposals, rpn_post_nms_top_n_test=self.proposals,
            box_batch_size_per_image=self.proposals,
        )

    def _data(self):
        g = torch.Generator().manual_seed(0)
        corner = torch.rand(SAMPLES, self.boxes, 2, generator=g) * self.image / 2
        size = 8 + torch.rand(SAMPLES, self.boxes, 2, generator=g) * self.image / 2
        return _repeated(
            torch.rand(SAMPLES, 3, self.image, self.image, generator=g),
            torch.cat([corner, corner + size], dim=-1),
            torch.randint(1, self.classes, (SAMPLES, self.boxes), generator=g),
        )

    def train_data(self):
        return self._data()

    def eval_data(self):
        return self._data()

    def loss(self, model, batch):
        images, boxes, labels = batch
        if not model.training:
            return sum(d["scores"].sum() for d in model(list(images)))
        targets = [{"boxes": b, "labels": c} for b, c in zip(boxes, labels)]
        return sum(model(list(images), targets).values())


class _Records(torch.utils.data.Dataset):
    """A dataset of dict samples, as tokenizers make them."""

    def __init__(self, records: list[dict]):
        self.records = records

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]


@dataclasses.dataclass
class Bert(Workload):
    """transformers' BERT, masked-LM loss on random tokens, with an attention mask (padded batches)."""

    layers: int = 2
    dim: int = 128
    heads: int = 2
    seq: int = 128
    vocab: int = 30522

    def build_model(self):
        from transformers import BertConfig, BertForMaskedLM

        return BertForMaskedLM(BertConfig(
            vocab_size=self.vocab, hidden_size=self.dim, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            intermediate_size=4 * self.dim, max_position_embeddings=max(512, self.seq),
        ))

    def _data(self):
        (ids,) = _tokens(self.vocab, self.seq).base.tensors
        return Repeated(_Records([{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]))

    def train_data(self):
        return self._data()

    def eval_data(self):
        return self._data()

    def loss(self, model, batch):
        return model(**batch, labels=batch["input_ids"]).loss


@dataclasses.dataclass
class GPT2LM(Workload):
    """transformers' GPT-2, causal LM loss on random tokens, as transformers computes it."""

    layers: int = 2
    dim: int = 128
    heads: int = 2
    seq: int = 128
    vocab: int = 50257

    def build_model(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(  # SDPA attention by default
            vocab_size=self.vocab, n_embd=self.dim, n_layer=self.layers, n_head=self.heads, n_positions=max(self.seq, 1024),
        ))

    def train_data(self):
        return _tokens(self.vocab, self.seq)

    def eval_data(self):
        return _tokens(self.vocab, self.seq)

    def loss(self, model, batch):
        (ids,) = batch
        return model(input_ids=ids, labels=ids).loss


@dataclasses.dataclass
class GPT2(GPT2LM):
    """GPT-2 124M at sequence 1024."""

    layers: int = 12
    dim: int = 768
    heads: int = 12
    seq: int = 1024


@dataclasses.dataclass
class Llama(GPT2LM):
    """transformers' Llama from a small config: RMSNorm, rotary positions, SwiGLU, grouped-query
    attention (fewer key/value heads than query heads)."""

    layers: int = 2
    dim: int = 128
    heads: int = 4
    kv_heads: int = 2
    seq: int = 128
    vocab: int = 32000

    def build_model(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.dim, intermediate_size=int(8 / 3 * self.dim),
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.seq,
        ))


class _Seq2Seq(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(dim, heads, layers, layers, 4 * dim, dropout, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.head(self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask, tgt_is_causal=True))


@dataclasses.dataclass
class NNTransformer(Workload):
    """``torch.nn.Transformer`` (encoder-decoder, causal decoder) translating token sequences."""

    layers: int = 1
    dim: int = 64
    heads: int = 4
    seq: int = 64
    vocab: int = 1000
    dropout: float = 0.1

    def build_model(self):
        return _Seq2Seq(self.vocab, self.dim, self.heads, self.layers, self.dropout)

    def _data(self):
        g = torch.Generator().manual_seed(0)
        return _repeated(*(torch.randint(0, self.vocab, (SAMPLES, self.seq), generator=g) for _ in range(2)))

    def train_data(self):
        return self._data()

    def eval_data(self):
        return self._data()

    def loss(self, model, batch):
        src, tgt = batch
        logits = model(src, tgt[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tgt[:, 1:].flatten())


class _SequenceClassifier(nn.Module):
    def __init__(self, body: nn.Module, dim: int, classes: int, batch_first: bool):
        super().__init__()
        self.body, self.head, self.batch_first = body, nn.Linear(dim, classes), batch_first

    def forward(self, x):  # x: (batch, seq, features)
        h = self.body(x if self.batch_first else x.transpose(0, 1))
        h = h[0] if isinstance(h, tuple) else h  # an RNN's (output, state)
        return self.head(h.mean(dim=1 if self.batch_first else 0))


@dataclasses.dataclass
class _Sequences(Workload):
    layers: int = 2
    dim: int = 64
    seq: int = 64
    classes: int = 10

    def train_data(self):
        return _images((self.seq, self.dim), self.classes)

    def eval_data(self):
        return _images((self.seq, self.dim), self.classes)

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)


@dataclasses.dataclass
class NNEncoder(_Sequences):
    """``torch.nn.TransformerEncoder`` classifying sequences, batch first (its eval fast path)."""

    heads: int = 4
    dropout: float = 0.1
    batch_first: bool = True

    def build_model(self):
        layer = nn.TransformerEncoderLayer(self.dim, self.heads, 4 * self.dim, self.dropout, batch_first=self.batch_first)
        encoder = nn.TransformerEncoder(layer, self.layers, enable_nested_tensor=self.batch_first)
        return _SequenceClassifier(encoder, self.dim, self.classes, self.batch_first)


@dataclasses.dataclass
class NNEncoderSeqFirst(NNEncoder):
    """The same, sequence first (``batch_first=False``, torch's default)."""

    batch_first: bool = False


class _MaskedEncoder(nn.Module):
    def __init__(self, encoder: nn.Module, dim: int, classes: int, batch_first: bool, causal: bool):
        super().__init__()
        self.encoder, self.head = encoder, nn.Linear(dim, classes)
        self.batch_first, self.causal = batch_first, causal

    def forward(self, x, padding):  # x: (batch, seq, features); padding: (batch, seq), True = padded
        seq = x.shape[1]
        # what people write: the mask made from the size, and the encoder left to detect that it is causal
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=x.device) if self.causal else None
        h = self.encoder(x if self.batch_first else x.transpose(0, 1), mask=mask, src_key_padding_mask=padding)
        h = h if self.batch_first else h.transpose(0, 1)
        kept = (~padding).unsqueeze(-1).to(h.dtype)
        return self.head((h * kept).sum(dim=1) / kept.sum(dim=1))


@dataclasses.dataclass
class NNEncoderMasked(NNEncoder):
    """``torch.nn.TransformerEncoder`` given a causal mask (``mask``, which the encoder checks for
    causality by reading its values) and a padding mask from the data (``src_key_padding_mask``,
    the last quarter of every sequence padded; in eval, batch first, the encoder's nested-tensor
    fast path checks it): the data-dependent checks of torch's own layers."""

    causal: bool = True

    def _data(self):
        g = torch.Generator().manual_seed(0)
        padding = torch.zeros(SAMPLES, self.seq, dtype=torch.bool)
        padding[:, self.seq - self.seq // 4:] = True
        x, y = torch.randn(SAMPLES, self.seq, self.dim, generator=g), torch.randint(0, self.classes, (SAMPLES,), generator=g)
        return _repeated(x, padding, y)

    def train_data(self):
        return self._data()

    def eval_data(self):
        return self._data()

    def build_model(self):
        layer = nn.TransformerEncoderLayer(self.dim, self.heads, 4 * self.dim, self.dropout, batch_first=self.batch_first)
        encoder = nn.TransformerEncoder(layer, self.layers, enable_nested_tensor=self.batch_first)
        return _MaskedEncoder(encoder, self.dim, self.classes, self.batch_first, self.causal)

    def loss(self, model, batch):
        x, padding, y = batch
        return F.cross_entropy(model(x, padding), y)


@dataclasses.dataclass
class NNEncoderMaskedSeqFirst(NNEncoderMasked):
    """The same, sequence first (``batch_first=False``)."""

    batch_first: bool = False


@dataclasses.dataclass
class LSTM(_Sequences):
    """``torch.nn.LSTM`` (stacked, dropout between layers) classifying sequences."""

    seq: int = 8  # CPU's GRU runs step by step: the trace's op count grows with the sequence
    dropout: float = 0.1

    RNN: ClassVar[type[nn.Module]] = nn.LSTM

    def build_model(self):
        rnn = self.RNN(self.dim, self.dim, self.layers, batch_first=True, dropout=self.dropout)
        return _SequenceClassifier(rnn, self.dim, self.classes, batch_first=True)


@dataclasses.dataclass
class GRU(LSTM):
    """``torch.nn.GRU``, the same way."""

    RNN: ClassVar[type[nn.Module]] = nn.GRU


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class _UNet(nn.Module):
    def __init__(self, channels: int, classes: int, depth: int, width: int):
        super().__init__()
        widths = [width * 2**i for i in range(depth + 1)]
        self.down = nn.ModuleList([_double_conv(channels, widths[0])] + [_double_conv(a, b) for a, b in zip(widths, widths[1:])])
        self.up = nn.ModuleList(nn.ConvTranspose2d(b, a, 2, stride=2) for a, b in zip(widths, widths[1:]))
        self.merge = nn.ModuleList(_double_conv(2 * a, a) for a in widths[:-1])
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        x = skips.pop()
        for up, merge in zip(reversed(self.up), reversed(self.merge)):
            x = merge(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


@dataclasses.dataclass
class UNet(Workload):
    """A UNet as people write it in torch.nn (convolutions, batch norm, max-pooling, transposed
    convolutions, skip connections by concatenation), per-pixel cross-entropy."""

    depth: int = 3
    width: int = 16
    classes: int = 4
    image: int = 64

    def build_model(self):
        return _UNet(3, self.classes, self.depth, self.width)

    def train_data(self):
        return _segmentation(self.image, self.classes)

    def eval_data(self):
        return _segmentation(self.image, self.classes)

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)


# -- GPU models without a library zoo counterpart --------------------------------------------


class Conv1dNet(nn.Module):
    """Stacked strided 1-d convolutions over a multichannel signal, then a classifier head."""

    def __init__(self, channels: int = 19, width: int = 64, depth: int = 6, classes: int = 2):
        super().__init__()
        layers, cin = [], channels
        for i in range(depth):
            cout = width * 2 ** min(i, 3)
            layers += [nn.Conv1d(cin, cout, 7, padding=3), nn.BatchNorm1d(cout), nn.ReLU(), nn.MaxPool1d(2)]
            cin = cout
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.body(x).mean(dim=-1))


class TCN(nn.Module):
    """An EEG-style temporal conv net (19 channels, 60 s at 256 Hz): strided then dilated 1-d
    convolutions to a per-step output; the ground truth's 1-d conv net."""

    def __init__(self):
        super().__init__()
        ch = [19, 64, 128, 256, 512]
        layers: list[nn.Module] = []
        for a, b in zip(ch, ch[1:]):
            layers += [nn.Conv1d(a, b, 7, stride=2, padding=3), nn.BatchNorm1d(b), nn.GELU()]
        for d in (1, 2, 4, 8):
            layers += [nn.Conv1d(512, 512, 3, padding=d, dilation=d), nn.BatchNorm1d(512), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Conv1d(512, 1, 1)

    def forward(self, x):
        return self.head(self.body(x))


@dataclasses.dataclass
class TCNWorkload(Workload):
    """Regression of a 960-step output from a (19, 15360) signal, mean squared error."""

    def build_model(self):
        return TCN()

    def _data(self):
        g = torch.Generator().manual_seed(0)
        return _repeated(torch.randn(SAMPLES, 19, 15360, generator=g), torch.randn(SAMPLES, 1, 960, generator=g))

    def train_data(self):
        return self._data()

    def eval_data(self):
        return self._data()

    def loss(self, model, batch):
        x, y = batch
        return F.mse_loss(model(x), y)


@dataclasses.dataclass
class Conv1d(_Classifier):
    length: int = 15360
    classes: int = 2

    @property
    def input_shape(self):
        return (19, self.length)

    def build_model(self):
        return Conv1dNet(classes=self.classes)


@dataclasses.dataclass
class GAT(Workload):
    """Node classification with a 3-layer GAT (torch_geometric) on batches of random graphs.

    A sample is one graph (``nodes`` nodes, ``edges`` edges); a batch is their disjoint union.
    """

    nodes: int = 256
    edges: int = 2048
    features: int = 128
    hidden: int = 64
    heads: int = 8
    classes: int = 16

    def build_model(self):
        from torch_geometric.nn import GATConv

        class Net(nn.Module):
            def __init__(self, w: GAT):
                super().__init__()
                self.convs = nn.ModuleList([
                    GATConv(w.features, w.hidden, heads=w.heads),
                    GATConv(w.hidden * w.heads, w.hidden, heads=w.heads),
                    GATConv(w.hidden * w.heads, w.classes, heads=1),
                ])

            def forward(self, x, edge_index):
                for i, conv in enumerate(self.convs):
                    x = conv(x, edge_index)
                    if i < len(self.convs) - 1:
                        x = F.elu(x)
                return x

        return Net(self)

    def _graphs(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, self.nodes, self.features, generator=g)
        edge_index = torch.randint(0, self.nodes, (SAMPLES, 2, self.edges), generator=g)
        y = torch.randint(0, self.classes, (SAMPLES, self.nodes), generator=g)
        return _repeated(x, edge_index, y)

    def train_data(self):
        return self._graphs()

    def eval_data(self):
        return self._graphs()

    def loss(self, model, batch):
        x, edge_index, y = batch
        b = x.shape[0]
        offsets = (torch.arange(b, device=x.device) * self.nodes).view(b, 1, 1)
        edges = (edge_index + offsets).transpose(0, 1).reshape(2, -1)
        out = model(x.reshape(b * self.nodes, -1), edges)
        return F.cross_entropy(out, y.reshape(-1))


# -- CPU stand-ins (plain PyTorch) ------------------------------------------------------------


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int):
        super().__init__()
        cout = mid * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else nn.Identity()
        )

    def forward(self, x):
        return F.relu(self.body(x) + self.skip(x))


class SmallResNet(nn.Module):
    """ResNet-50's shape (stem, bottleneck stages, in-place ReLUs, BatchNorm), scaled down."""

    def __init__(self, classes: int, width: int = 16, blocks: tuple[int, ...] = (2, 2, 2)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        layers, cin = [], width
        for i, n in enumerate(blocks):
            mid = width * 2**i
            for j in range(n):
                layers.append(Bottleneck(cin, mid, 2 if j == 0 and i > 0 else 1))
                cin = mid * 4
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(self.layers(self.stem(x)).mean(dim=(2, 3)))


@dataclasses.dataclass
class ResNetIsh(_Classifier):
    classes: int = 100
    input_shape = (3, 32, 32)

    def build_model(self):
        return SmallResNet(self.classes)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float, causal: bool):
        super().__init__()
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float, causal: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout, causal)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """GPT-2's structure (learned positions, pre-LN blocks, tied embedding/head) at a small size."""

    def __init__(self, vocab: int, seq: int, dim: int, heads: int, layers: int, dropout: float):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout, causal=True) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids):
        x = self.drop(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


@dataclasses.dataclass
class TinyGPTWorkload(Workload):
    """Causal LM loss the way transformers computes it: logits upcast to fp32, labels shifted."""

    vocab: int = 4096
    seq: int = 256
    dim: int = 128
    heads: int = 4
    layers: int = 2
    dropout: float = 0.1

    def build_model(self):
        return TinyGPT(self.vocab, self.seq, self.dim, self.heads, self.layers, self.dropout)

    def train_data(self):
        return _tokens(self.vocab, self.seq)

    def eval_data(self):
        return _tokens(self.vocab, self.seq)

    def loss(self, model, batch):
        (ids,) = batch
        logits = model(ids).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), ids[:, 1:].reshape(-1))


class _HFConv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D``: a linear layer as ``addmm`` with an (in, out) weight."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.02)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], self.weight.size(-1))


class _GPT2Block(nn.Module):
    """One GPT-2 block with transformers' ops: tanh GELU written out, SDPA with dropout."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn, self.attn_proj = _HFConv1D(3 * dim, dim), _HFConv1D(dim, dim)
        self.c_fc, self.mlp_proj = _HFConv1D(4 * dim, dim), _HFConv1D(dim, 4 * dim)
        self.resid_drop, self.mlp_drop = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.resid_drop(self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, d)))
        h = self.c_fc(self.ln_2(x))
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.mlp_drop(self.mlp_proj(h))


class GPT2StandIn(nn.Module):
    """GPT-2 124M written with the ops transformers' GPT2LMHeadModel runs, loss included."""

    def __init__(self, vocab: int = 50257, positions: int = 1024, dim: int = 768, heads: int = 12, layers: int = 12,
                 dropout: float = 0.1):
        super().__init__()
        self.wte, self.wpe, self.drop = nn.Embedding(vocab, dim), nn.Embedding(positions, dim), nn.Dropout(dropout)
        self.h = nn.ModuleList(_GPT2Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x)).float()  # transformers' loss upcasts the logits
        labels = F.pad(ids, (0, 1), value=-100)[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


@dataclasses.dataclass
class GPT2StandInWorkload(GPT2):
    """GPT-2 124M without transformers: same shapes and ops, for machines without the library."""

    def build_model(self):
        return GPT2StandIn(positions=max(self.seq, 1024))

    def loss(self, model, batch):
        (ids,) = batch
        return model(ids)


class TinyViT(nn.Module):
    def __init__(self, image: int, patch: int, dim: int, heads: int, layers: int, classes: int, dropout: float):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout, causal=False) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x[:, 0]))


@dataclasses.dataclass
class ViTIsh(_Classifier):
    classes: int = 100
    input_shape = (3, 64, 64)

    def build_model(self):
        return TinyViT(64, 8, 128, 4, 2, self.classes, dropout=0.0)


# -- the zoo -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    name: str
    workload: type[Workload]
    precision: str
    batches: tuple[int, ...]  # where the accuracy benchmark compares predicted and true peaks
    needs: tuple[str, ...] = ()  # modules that must be importable
    params: dict = field(default_factory=dict)  # hyper-parameters beyond the workload's defaults
    #: For a model fake tensors cannot trace: the library folder of the code the trace stops in.
    untraceable: str | None = None
    truth: str | None = None  # its name in the H100 ground truth, where it is one of those models

    def make(self) -> Workload:
        return self.workload(**self.params)

    @property
    def import_path(self) -> str:
        """What a sweep's YAML names it by (``workload: {name: ...}``)."""
        return f"{self.workload.__module__}:{self.workload.__qualname__}"

    def available(self) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in self.needs)


_VISION = ("timm", "torchvision")

GPU_ZOO = (
    # SGD with momentum, as the ground truth trains it (the others use AdamW, as there)
    Entry("resnet50", ResNet50, "fp32", (32, 64, 128, 256), ("torchvision",), params={"optimizer": "sgd"},
          truth="resnet50"),
    Entry("vit_b16_bf16", ViTB16, "bf16", (32, 64, 128, 256), ("torchvision",), truth="vit_b16_bf16"),
    Entry("gpt2_bf16_seq1024", GPT2, "bf16", (2, 4, 8, 12), ("transformers",), truth="gpt2_bf16"),
    Entry("tcn_eeg", TCNWorkload, "fp32", (32, 64, 128, 256), truth="tcn_eeg"),
    Entry("gat", GAT, "fp32", (8, 32, 128), ("torch_geometric",)),
    Entry("gpt2_standin_bf16_seq1024", GPT2StandInWorkload, "bf16", (2, 4, 8, 12)),
    # torch.nn's encoder at the original Transformer's base size, given a causal mask it checks by
    # its values and a padding mask; an LSTM language model at Zaremba et al.'s medium size on a
    # WikiText-2-sized vocabulary, trained by truncated BPTT (a stateful workload)
    Entry("nn_encoder_masked_base", NNEncoderMasked, "bf16", (16, 32, 64, 128),
          params={"layers": 6, "dim": 512, "heads": 8, "seq": 512}),
    Entry("lstm_lm_tbptt_medium", LSTMLanguageModelWorkload, "fp32", (20, 80, 320, 1280),
          params={"vocab": 33278, "hidden": 650, "layers": 2, "bptt": 35}),
)

CPU_ZOO = (
    Entry("mlp", MLPWorkload, "fp32", (8, 64, 256)),
    Entry("cnn", CNNWorkload, "fp32", (8, 32, 64)),
    Entry("staged_mlp", StagedMLPWorkload, "fp32", (8, 64, 256)),
    Entry("resnet_ish", ResNetIsh, "fp32", (4, 16, 32)),
    Entry("conv1d_19x1536", Conv1d, "fp32", (4, 16, 32), params={"length": 1536}),
    Entry("tiny_gpt_bf16", TinyGPTWorkload, "bf16", (2, 4, 8)),
    Entry("vit_ish_bf16", ViTIsh, "bf16", (4, 16, 32)),
    Entry("nn_encoder_masked", NNEncoderMasked, "bf16", (8, 32, 64)),
    Entry("nn_encoder_masked_seq_first", NNEncoderMaskedSeqFirst, "bf16", (8, 32, 64)),
    Entry("lstm_lm_tbptt", LSTMLanguageModelWorkload, "fp32", (8, 32, 64)),
)

#: Models people train, from timm, torchvision, transformers and torch.nn, at the small sizes
#: of their classes' defaults (bf16: mixed precision, as they are usually trained). The zoo
#: test plans every one with ``orchestrator plan`` on fake tensors; the accuracy benchmark
#: compares them with the truth on a GPU.
LIBRARY_ZOO = (
    Entry("convnext", ConvNeXt, "bf16", (16, 64, 128), _VISION),
    Entry("swin", Swin, "bf16", (16, 64, 128), _VISION),
    Entry("efficientnet", EfficientNet, "bf16", (16, 64, 128), _VISION),
    Entry("vit", ViT, "bf16", (16, 64, 128), _VISION),
    Entry("resnet18", ResNet, "bf16", (16, 64, 128), ("torchvision",)),
    Entry("deeplabv3", DeepLabV3, "bf16", (4, 16, 32), ("torchvision",)),
    Entry("fasterrcnn", FasterRCNN, "fp32", (2, 4, 8), ("torchvision",), untraceable="torchvision/models/detection"),
    Entry("bert", Bert, "bf16", (8, 32, 64), ("transformers",)),
    Entry("gpt2", GPT2LM, "bf16", (8, 32, 64), ("transformers",)),
    Entry("llama", Llama, "bf16", (8, 32, 64), ("transformers",)),
    Entry("nn_transformer", NNTransformer, "bf16", (8, 32, 64)),
    Entry("nn_encoder", NNEncoder, "bf16", (8, 32, 64)),
    Entry("nn_encoder_seq_first", NNEncoderSeqFirst, "bf16", (8, 32, 64)),
    Entry("nn_encoder_masked", NNEncoderMasked, "bf16", (8, 32, 64)),
    Entry("nn_encoder_masked_seq_first", NNEncoderMaskedSeqFirst, "bf16", (8, 32, 64)),
    Entry("lstm", LSTM, "bf16", (8, 32, 64)),
    Entry("gru", GRU, "bf16", (8, 32, 64)),
    Entry("unet", UNet, "bf16", (8, 32, 64)),
)

ZOOS = {"gpu": GPU_ZOO, "cpu": CPU_ZOO, "library": LIBRARY_ZOO}


class StepRunner:
    """The loop's steps on a real device, for measuring truths and for the other tools' searches.

    A train step is what the loop runs: two micro-batches of ``b`` (gradient accumulation),
    each collated on the host and taken by the step when it needs it, then the optimizer step;
    the peak is read from the device (``orchestrator.device``: CUDA's allocator, or the
    CPU/emulated tracker).
    """

    def __init__(self, workload: Workload, precision: str, device):
        from trainables.step import make_grad_scaler
        from trainables.workload import optimizer_for

        self.workload, self.precision, self.device = workload, precision, device
        torch.manual_seed(0)
        self.model = workload.build_model().to(device.torch_device)
        self.optimizer = optimizer_for(workload, self.model, device.torch_device.type)
        self.scaler = make_grad_scaler(precision, device)
        self.train_data, self.eval_data = workload.train_data(), workload.eval_data()

    def _state(self):
        from orchestrator.device import state_tensors

        return state_tensors(self.model, self.optimizer)

    def batch(self, data, b: int):
        """``b`` samples collated on the host, then admitted to the device (the loop's way)."""
        from trainables.workload import sample_batch

        with self.device.host():
            batch = sample_batch(self.workload, data, b)
        return self.device.admit(batch)

    def _window(self):
        self.device.track(self._state())
        if self.device.torch_device.type == "cuda":
            torch.cuda.empty_cache()  # this window's reserved memory, not an earlier one's
        self.device.reset_peak()
        return self.device.measuring()

    def train(self, b: int, micro_batches: int = 2):
        """One train step; the device's reading (peak allocated, peak reserved) for it. A stateful
        workload's step starts from its initial state, as the trace's does."""
        from trainables.step import train_step

        self.model.train()
        with self._window():
            batches = (self.batch(self.train_data, b) for _ in range(micro_batches))
            train_step(self.workload, self.model, self.optimizer, batches, [b] * micro_batches,
                       self.device.torch_device, self.precision, self.scaler,
                       carry=initial_carry(self.workload, b * micro_batches, self.device.torch_device))
        return self.device.reading()

    def eval(self, b: int):
        from trainables.step import eval_step

        self.model.eval()
        with self._window():
            eval_step(self.workload, self.model, self.batch(self.eval_data, b), b, self.device.torch_device, self.precision)
        return self.device.reading()

    def recover(self) -> None:
        """After an out-of-memory error: drop the failed step's gradients and cached blocks."""
        from orchestrator.device import release

        self.optimizer.zero_grad(set_to_none=True)
        release()

    def fits(self, b: int) -> bool:
        """Whether a train step at micro-batch ``b`` runs without running out of memory."""
        try:
            self.train(b)
            return True
        except torch.OutOfMemoryError as exc:
            exc.__traceback__ = None
            self.recover()
            return False


def initial_carry(workload: Workload, rows: int, device: torch.device):
    """A stateful workload's initial state for a step of ``rows`` streams (None for the others)."""
    from trainables.carry import Carry

    return Carry.initial(workload, rows, device) if workload.stateful else None


def describe_bytes(n: float) -> str:
    return f"{n / 2**30:.2f}G" if abs(n) >= 2**30 / 100 else f"{n / 2**20:.1f}M"


def relative(predicted: float, true: float) -> float:
    return predicted / true - 1 if true else math.nan
