"""Workloads shaped like real work, each runnable at CPU-demo scale with a sweep in ``configs/``.

* :mod:`trainables.examples.causal_lm`: a ``transformers`` causal LM (GPT-2 or Llama config, no
  download) on token sequences of varying length, padded per batch (needs ``transformers``);
* :mod:`trainables.examples.images`: a ``timm`` classifier on JPEG-encoded images decoded and
  augmented per sample with torchvision's transforms (needs ``timm`` and ``torchvision``);
* :mod:`trainables.examples.graphs`: a graph network in plain PyTorch on batches of graphs of
  different sizes (needs nothing beyond PyTorch).

They are named in sweeps by import path (``trainables.examples.graphs:GraphWorkload``), as a
user's own workload is. ``pip install -e '.[zoo]'`` installs the optional libraries.
"""
