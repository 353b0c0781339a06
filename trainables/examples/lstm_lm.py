"""An LSTM language model trained by truncated back-propagation through time (a stateful workload).

The usual word-level RNN language-model loop (PyTorch's ``word_language_model`` example)
"batchifies" one long token stream into ``batch_size`` parallel streams, walks them ``bptt``
tokens at a time, and carries the LSTM's hidden state from each window to the next, detached,
so gradients flow back ``bptt`` tokens while the state remembers the whole stream. Here the
same thing is a :class:`Workload` with ``stateful = True``:

* the dataset is the stream cut into windows of ``bptt`` tokens (each with its next-token
  targets); the loop's ordered sampler cuts the windows into ``effective_batch`` contiguous
  streams, and row ``j`` of step ``s`` is window ``s`` of stream ``j``: the batchify layout;
* ``initial_state(rows)`` is the LSTM's zero ``(h, c)``, ``(layers, rows, hidden)`` each, whose
  rows lie along dimension 1 (``state_dim = 1``);
* ``loss(model, batch, state)`` returns the loss and the new state; the loop detaches it
  between optimizer steps, gives each micro-batch its own streams' rows, and checkpoints it.

The tokens come from a fixed random Markov chain (``causal_lm.markov_chain``), so the loss falls
from log(vocab) towards the chain's entropy within a minute on a CPU. Eval windows each start
from the zero state (the loop's eval is stateless), so eval perplexity is a little above what
a carried state reaches.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainables.examples.causal_lm import markov_sequences
from trainables.workload import Workload

#: Tokens per chain drawn at once: the stream is chains of this length, end to end.
CHAIN_LENGTH = 256


class TokenWindows(Dataset):
    """A token stream as windows of ``bptt`` tokens: window ``i`` is ``(inputs, targets)``, the
    stream's tokens ``[i*bptt, (i+1)*bptt)`` and the ones after each."""

    def __init__(self, tokens: torch.Tensor, bptt: int):
        self.tokens, self.bptt = tokens, bptt

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.bptt

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.bptt
        return self.tokens[start : start + self.bptt], self.tokens[start + 1 : start + self.bptt + 1]


@functools.lru_cache(maxsize=4)
def token_stream(tokens: int, vocab: int, branching: int, split: str) -> torch.Tensor:
    """``tokens`` tokens of the Markov chain (chains of ``CHAIN_LENGTH``, end to end); made once per process."""
    chains = markov_sequences(math.ceil(tokens / CHAIN_LENGTH), vocab, branching, CHAIN_LENGTH, CHAIN_LENGTH, split)
    return torch.cat(chains.sequences)[:tokens]


class LSTMLanguageModel(nn.Module):
    """Embedding, a stacked LSTM (batch first) and a linear head; ``forward`` takes and returns the state."""

    def __init__(self, vocab: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        out, state = self.lstm(self.embed(tokens), state)
        return self.head(out), state


@dataclasses.dataclass
class LSTMLanguageModelWorkload(Workload):
    vocab: int = 64
    hidden: int = 64
    layers: int = 2
    bptt: int = 16
    branching: int = 4
    train_tokens: int = 32768
    eval_tokens: int = 4096

    stateful = True
    state_dim = 1  # nn.LSTM's (h, c) are (layers, rows, hidden)
    metrics = ("loss", "perplexity")

    def build_model(self) -> nn.Module:
        return LSTMLanguageModel(self.vocab, self.hidden, self.layers)

    def train_data(self) -> Dataset:
        return TokenWindows(self.tokens(self.train_tokens, "train"), self.bptt)

    def eval_data(self) -> Dataset:
        return TokenWindows(self.tokens(self.eval_tokens, "eval"), self.bptt)

    def tokens(self, count: int, split: str) -> torch.Tensor:
        return token_stream(count, self.vocab, self.branching, split)

    def initial_state(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(self.layers, rows, self.hidden), torch.zeros(self.layers, rows, self.hidden)

    def loss(self, model: nn.Module, batch, state):
        """Mean next-token loss over the batch's windows (all ``bptt`` long), and the new state."""
        inputs, targets = batch
        logits, state = model(inputs, state)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()), state

    def summarize_metrics(self, totals: dict[str, float], samples: int) -> dict[str, float]:
        loss = totals["loss"] / samples
        return {"loss": loss, "perplexity": math.exp(loss)}
