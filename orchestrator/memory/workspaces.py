"""Workspaces that CPU kernels keep and their fake versions do not report.

oneDNN's LSTM layer (``aten.mkldnn_rnn_layer``, what ``nn.LSTM`` runs on the CPU in fp32)
returns a workspace that its backward reads, several times the size of its output (61 KiB
per sample at 16 steps of 64 units); its fake kernel returns an empty one, so a fake trace
under-counted a real CPU LSTM by 20-40 %. The size is oneDNN's internal business (padded,
not affine in the batch size), so it is asked of the real kernel: once per shape, on real
zeros of the call's shapes, when they are small enough to make here; otherwise the fake
workspace stays empty and the trace says so.
"""

from __future__ import annotations

import torch

from orchestrator.device.torch_internals import DispatchMode, disable_current_modes, unset_fake_temporarily

#: Real inputs larger than this are not made to ask a kernel its workspace size.
PROBE_LIMIT_BYTES = 256 * 2**20


class KernelWorkspaces(DispatchMode):
    """Between the fake mode and the tracker: gives ``mkldnn_rnn_layer`` its real workspace."""

    WORKSPACE = 3  # mkldnn_rnn_layer returns (output, hy, cy, workspace)

    def __init__(self):
        super().__init__()
        self.notes: set[str] = set()
        self._sizes: dict[tuple, int | None] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not torch.ops.aten.mkldnn_rnn_layer.default:
            return out
        workspace = out[self.WORKSPACE]
        if workspace is None:  # inference: there is none to size
            return out
        size = self._real_size(func, args, kwargs)
        if size is None:
            self.notes.add("oneDNN's LSTM workspace not counted (its inputs are too large to ask the real kernel)")
            return out
        real = torch.empty(size, dtype=workspace.dtype, device=workspace.device)
        return (*out[: self.WORKSPACE], real, *out[self.WORKSPACE + 1 :])

    def _real_size(self, func, args, kwargs) -> int | None:
        key = tuple(
            (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (tuple(a) if isinstance(a, list) else a)
            for a in (*args, *kwargs.values())
        )
        if key not in self._sizes:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            if sum(t.numel() * t.element_size() for t in tensors) > PROBE_LIMIT_BYTES:
                self._sizes[key] = None
            else:
                with disable_current_modes(), unset_fake_temporarily():  # zeros need no gradients
                    real = [torch.zeros(a.shape, dtype=a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
                    real_kwargs = {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else v
                                   for k, v in kwargs.items()}
                    workspace = func(*real, **real_kwargs)[self.WORKSPACE]
                self._sizes[key] = 0 if workspace is None else workspace.untyped_storage().nbytes()
        return self._sizes[key]
