"""Graph classification with message passing in plain PyTorch, on graphs of different sizes.

Each sample is one graph (its own node and edge counts); a batch is the graphs side by side:
nodes concatenated, every graph's edge indices offset by the nodes before it, and a graph
index per node for the read-out. That is how graph libraries batch (torch_geometric's
``Batch``), written out here so the example needs nothing beyond PyTorch. The model is a GIN
(sum of neighbours' features, an MLP, a residual), mean-pooled per graph.

The task: tell four families of random graphs apart (rings, trees, ladders, dense random
graphs, each with a few random extra edges) from their structure; node features are a
constant channel plus noise, so only message passing can find the signal.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainables.synthetic import DATA_SEED
from trainables.workload import Workload

FAMILIES = ("ring", "tree", "ladder", "dense")


class Graph(NamedTuple):
    """One sample: node features ``(nodes, features)``, edges ``(2, edges)`` (source, target), label."""

    x: torch.Tensor
    edge_index: torch.Tensor
    y: int


class GraphBatch(NamedTuple):
    """Graphs side by side. A NamedTuple, so the loop moves it to the device and the memory
    tracker sees its tensors (``to_device`` and PyTorch's pytree know NamedTuples)."""

    x: torch.Tensor  # (all nodes, features)
    edge_index: torch.Tensor  # (2, all edges), indices into x
    graph: torch.Tensor  # (all nodes,): which graph each node belongs to
    y: torch.Tensor  # (graphs,)


def collate_graphs(samples: list[Graph]) -> GraphBatch:
    """Concatenate nodes and edges; offset each graph's edge indices by the nodes before it.

    Reads only shapes, never values, so it runs on fake tensors too (the estimators collate
    copies of the largest graph this way).
    """
    offsets, total = [], 0
    for sample in samples:
        offsets.append(total)
        total += sample.x.shape[0]
    return GraphBatch(
        x=torch.cat([s.x for s in samples]),
        edge_index=torch.cat([s.edge_index + offset for s, offset in zip(samples, offsets)], dim=1),
        graph=torch.cat([torch.full((s.x.shape[0],), i, dtype=torch.long) for i, s in enumerate(samples)]),
        y=torch.tensor([int(s.y) for s in samples], dtype=torch.long),
    )


def _family_edges(family: str, nodes: int, rng: np.random.Generator) -> np.ndarray:
    """Undirected edges ``(2, m)`` of one graph of ``family`` on ``nodes`` nodes."""
    i = np.arange(nodes)
    if family == "ring":
        pairs = np.stack([i, (i + 1) % nodes])
    elif family == "tree":  # node k > 0 hangs off a random earlier node
        pairs = np.stack([(rng.random(nodes - 1) * i[1:]).astype(np.int64), i[1:]])
    elif family == "ladder":  # two rails (k, k+2) and rungs (2j, 2j+1)
        pairs = np.concatenate([np.stack([i[:-2], i[2:]]), np.stack([i[0:-1:2], i[1::2]])], axis=1)
    else:  # dense: each pair with probability 0.3
        pairs = np.stack(np.nonzero(np.triu(rng.random((nodes, nodes)) < 0.3, k=1)))
    chords = rng.integers(0, nodes, (2, max(1, nodes // 10)))  # a few random extra edges, so no
    return np.concatenate([pairs, chords[:, chords[0] != chords[1]]], axis=1)  # family is one count


class RandomGraphs(Dataset):
    """``count`` graphs of ``min_nodes`` to ``max_nodes`` nodes, the same for every trial.

    Made with NumPy: a few thousand small graphs cost tens of milliseconds, not the seconds
    as many tiny torch ops take.
    """

    def __init__(self, count: int, min_nodes: int, max_nodes: int, features: int, split: str):
        rng = np.random.default_rng(DATA_SEED + (1 if split == "train" else 2))
        self.graphs = []
        for _ in range(count):
            label = int(rng.integers(len(FAMILIES)))
            nodes = int(rng.integers(min_nodes, max_nodes + 1))
            pairs = _family_edges(FAMILIES[label], nodes, rng)
            x = np.concatenate([np.ones((nodes, 1)), rng.standard_normal((nodes, features - 1))], axis=1)
            edges = np.concatenate([pairs, pairs[::-1]], axis=1)
            self.graphs.append(Graph(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(edges.astype(np.int64)), label))

    def __len__(self) -> int:
        return len(self.graphs)

    def __getitem__(self, index: int) -> Graph:
        return self.graphs[index]


@functools.lru_cache(maxsize=4)
def random_graphs(count: int, min_nodes: int, max_nodes: int, features: int, split: str) -> RandomGraphs:
    """Made once per process: a trial asks for its data to train, to evaluate, to plan and to
    find its largest sample, and the graphs never change."""
    return RandomGraphs(count, min_nodes, max_nodes, features, split)


class GINLayer(nn.Module):
    """h' = h + MLP((1 + eps) h + sum of neighbours' h), normalised (Xu et al., "How Powerful are GNNs?")."""

    def __init__(self, width: int):
        super().__init__()
        self.eps = nn.Parameter(torch.zeros(()))
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.norm = nn.LayerNorm(width)

    def forward(self, h: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        source, target = edge_index[0], edge_index[1]
        messages = torch.zeros_like(h).index_add_(0, target, h[source])
        return h + F.relu(self.norm(self.mlp((1 + self.eps) * h + messages)))


class GIN(nn.Module):
    def __init__(self, features: int, width: int, layers: int, classes: int):
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.layers = nn.ModuleList(GINLayer(width) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes))

    def forward(self, batch: GraphBatch) -> torch.Tensor:
        h = self.embed(batch.x)
        for layer in self.layers:
            h = layer(h, batch.edge_index)
        graphs = batch.y.shape[0]  # a shape, not a value: no host sync, and traceable
        sums = h.new_zeros(graphs, h.shape[1]).index_add_(0, batch.graph, h)
        counts = h.new_zeros(graphs).index_add_(0, batch.graph, h.new_ones(h.shape[0]))
        return self.head(sums / counts.clamp(min=1).unsqueeze(1))


@dataclasses.dataclass
class GraphWorkload(Workload):
    width: int = 64
    layers: int = 3
    features: int = 8
    min_nodes: int = 8
    max_nodes: int = 48
    train_graphs: int = 2048
    eval_graphs: int = 512

    metrics = ("loss", "accuracy")

    def build_model(self) -> nn.Module:
        return GIN(self.features, self.width, self.layers, len(FAMILIES))

    def train_data(self) -> Dataset:
        return random_graphs(self.train_graphs, self.min_nodes, self.max_nodes, self.features, "train")

    def eval_data(self) -> Dataset:
        return random_graphs(self.eval_graphs, self.min_nodes, self.max_nodes, self.features, "eval")

    def collate(self, samples: list[Graph]) -> GraphBatch:
        return collate_graphs(samples)

    def largest_sample(self) -> Graph:
        """As many nodes as the largest graph and as many edges as the densest (of both splits):
        memory grows with both, and they need not come from the same graph."""
        graphs = self.train_data().graphs + self.eval_data().graphs
        nodes = max(g.x.shape[0] for g in graphs)
        densest = max(graphs, key=lambda g: g.edge_index.shape[1])
        return Graph(torch.ones(nodes, self.features), densest.edge_index, 0)

    def loss(self, model: nn.Module, batch: GraphBatch) -> torch.Tensor:
        return F.cross_entropy(model(batch), batch.y)

    def eval_metrics(self, model: nn.Module, batch: GraphBatch, samples: int) -> dict[str, torch.Tensor]:
        logits = model(batch)
        return {
            "loss": F.cross_entropy(logits, batch.y, reduction="sum"),
            "accuracy": (logits.argmax(dim=1) == batch.y).sum(),
        }
