"""A ``transformers`` causal language model on token sequences of varying length.

The model is GPT-2 or Llama built from a small config (no download: nothing is fetched from
the Hugging Face hub). The data are sequences from a fixed random Markov chain, each of its own
length between ``min_length`` and ``max_length``; a batch pads them to its longest with an
attention mask, and padding is ignored by the loss (label -100, as transformers expects).

Two things real LM work needs from the orchestrator show here: ``collate`` pads (the default
stacking cannot), and ``largest_sample`` is a ``max_length`` sequence, so the estimators plan
every batch as if all its sequences were as long as any can be; a plan from the first sample
would be too small for the batch that happens to hold the longest ones. Evaluation reports the
per-token loss and its perplexity (``summarize_metrics``: a perplexity is not a mean of
per-sample values); training minimises each sequence's mean next-token loss, averaged over
sequences (see ``loss``).

The chain's transitions are peaked (each token has ``branching`` likely successors), so the
loss falls from log(vocab) towards the chain's entropy within a minute on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

from trainables.synthetic import DATA_SEED
from trainables.workload import Workload

PAD = 0  # token id of padding; the chain emits ids 1..vocab-1
IGNORE = -100  # label transformers' loss (and F.cross_entropy's ignore_index) skips


class MarkovSequences(Dataset):
    """``count`` token sequences of a fixed random Markov chain, lengths in [min_length, max_length]."""

    def __init__(self, count: int, vocab: int, branching: int, min_length: int, max_length: int, split: str):
        cumulative = markov_chain(vocab, branching).cumsum(dim=1)
        cumulative[:, -1] = 1.0  # no draw falls past the last token by rounding
        generator = torch.Generator().manual_seed(DATA_SEED + (1 if split == "train" else 2))
        lengths = torch.randint(min_length, max_length + 1, (count,), generator=generator)
        tokens = torch.empty(count, max_length, dtype=torch.long)
        tokens[:, 0] = torch.randint(1, vocab, (count,), generator=generator)
        for t in range(1, max_length):  # inverse-CDF sampling: torch.multinomial is ~100x slower here
            draws = torch.rand(count, 1, generator=generator)
            tokens[:, t] = torch.searchsorted(cumulative[tokens[:, t - 1]], draws).squeeze(1).clamp(max=vocab - 1)
        self.sequences = [row[:n].clone() for row, n in zip(tokens, lengths.tolist())]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sequences[index]


@functools.lru_cache(maxsize=4)
def markov_sequences(count: int, vocab: int, branching: int, min_length: int, max_length: int, split: str):
    """Made once per process (the sequences never change; a trial asks for them more than once)."""
    return MarkovSequences(count, vocab, branching, min_length, max_length, split)


def markov_chain(vocab: int, branching: int) -> torch.Tensor:
    """Transition probabilities ``(vocab, vocab)``: from each token, ``branching`` successors
    (never the padding id) carry most of the mass. The same chain for every trial and split."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    logits = torch.full((vocab, vocab), -4.0)
    successors = torch.randint(1, vocab, (vocab, branching), generator=generator)
    logits.scatter_(1, successors, 3.0 * torch.rand(vocab, branching, generator=generator) + 1.0)
    logits[:, PAD] = -math.inf
    return logits.softmax(dim=1)


def pad_batch(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence: ``input_ids``, ``attention_mask`` and ``labels``
    (the inputs, -100 at padding). Reads only lengths, so it runs on fake tensors too."""
    lengths = torch.tensor([s.shape[0] for s in sequences])
    input_ids = pad_sequence(sequences, batch_first=True, padding_value=PAD)
    attention_mask = (torch.arange(input_ids.shape[1]) < lengths.unsqueeze(1)).long()
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


@dataclasses.dataclass
class CausalLMWorkload(Workload):
    architecture: Literal["gpt2", "llama"] = "llama"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 256
    branching: int = 4
    min_length: int = 16
    max_length: int = 64
    train_sequences: int = 2048
    eval_sequences: int = 256

    metrics = ("loss", "perplexity")

    def build_model(self) -> nn.Module:
        import transformers

        if self.architecture == "gpt2":
            config = transformers.GPT2Config(
                vocab_size=self.vocab, n_positions=self.max_length, n_embd=self.hidden, n_layer=self.layers,
                n_head=self.heads, pad_token_id=PAD, bos_token_id=None, eos_token_id=None, use_cache=False,
            )
            return transformers.GPT2LMHeadModel(config)
        config = transformers.LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=4 * self.hidden,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=max(1, self.heads // 2),
            max_position_embeddings=self.max_length, pad_token_id=PAD, use_cache=False,
        )
        return transformers.LlamaForCausalLM(config)

    def train_data(self) -> Dataset:
        return self._sequences(self.train_sequences, "train")

    def eval_data(self) -> Dataset:
        return self._sequences(self.eval_sequences, "eval")

    def _sequences(self, count: int, split: str) -> MarkovSequences:
        return markov_sequences(count, self.vocab, self.branching, self.min_length, self.max_length, split)

    def collate(self, samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return pad_batch(samples)

    def largest_sample(self) -> torch.Tensor:
        """A sequence of ``max_length`` tokens: no batch can be wider than copies of it."""
        return torch.full((self.max_length,), 1, dtype=torch.long)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each sequence's mean next-token loss, averaged over the sequences.

        A mean over samples, as the loop's accumulation assumes (it weights each micro-batch by
        its share of the step's samples), so a step cut into micro-batches makes the same update
        as the whole batch. transformers' own ``.loss`` is a mean over the micro-batch's tokens,
        whose weight would change with the cut when lengths vary.
        """
        nll, tokens = _token_nll(model, batch)
        return (nll.sum(dim=1) / tokens.clamp(min=1)).mean()

    def eval_metrics(self, model: nn.Module, batch: dict[str, torch.Tensor], samples: int) -> dict[str, torch.Tensor]:
        nll, tokens = _token_nll(model, batch)
        return {"nll": nll.sum(), "tokens": tokens.sum()}

    def summarize_metrics(self, totals: dict[str, float], samples: int) -> dict[str, float]:
        """Per-token loss over the whole eval set, and its perplexity (not a mean of per-batch ones)."""
        loss = totals["nll"] / totals["tokens"]
        return {"loss": loss, "perplexity": math.exp(loss)}


def _token_nll(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token losses ``(sequences, positions)`` (0 where the target is padding), and each
    sequence's count of real targets."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), targets, ignore_index=IGNORE, reduction="none")
    return nll, (targets != IGNORE).sum(dim=1)
