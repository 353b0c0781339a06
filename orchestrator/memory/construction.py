"""Building a workload's model for a trace: never for real, yet with the host arithmetic it needs.

Fake tensors have no values, so a constructor that computes on the host fails under
``FakeTensorMode``: timm turns ``torch.linspace(0, drop_path_rate, depth)`` into a list of
drop-path rates, Swin builds index tables, rotary embeddings their frequencies. Building on
real tensors instead would allocate the whole model (a 7B model does not fit a head node's
RAM). So the model is built with every tensor factory placed by size: small tensors (up to
``HOST_TENSOR_BYTES``: schedules, index tables, norms' weights) are made for real on the CPU,
where ``.tolist()`` and ``.item()`` work; large ones (weight matrices, embeddings) on ``meta``,
which has shapes and no storage. Then every parameter and buffer becomes a fake tensor of the
trace device, one per original, so tied parameters stay tied.

Building is not a step: nothing here is counted, and the model that comes out has exactly the
parameters, buffers, dtypes and strides the real one would have.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from orchestrator.device.torch_internals import (
    DispatchMode,
    FakeTensorMode,
    buffer_slots,
    op_schema,
    parameter_slots,
    tree_leaves,
    tree_map,
)
from orchestrator.memory.known_values import KnownValues

#: Factory tensors up to this size are real during construction (host arithmetic works on
#: them); larger ones go to ``meta``. A model's real part is its small tensors only.
HOST_TENSOR_BYTES = 2**20

_CPU, _META = torch.device("cpu"), torch.device("meta")


def _is_factory(func) -> bool:
    """An op that makes a tensor from sizes alone (``empty``, ``arange``, ``randn``, ...), or from
    sizes and a tensor whose options it takes (``new_empty``, ``new_zeros``, ...)."""
    schema = op_schema(func)
    if not any(a.name == "device" for a in schema.arguments):
        return False
    if schema.name.startswith("aten::new_"):
        return True
    return not any(isinstance(a.type, torch.TensorType) for a in schema.arguments) and any(
        isinstance(r.type, torch.TensorType) for r in schema.returns
    )


class HostOrMeta(DispatchMode):
    """While active, tensor factories make small tensors on the CPU and large ones on ``meta``.

    An op that meets both kinds runs on ``meta`` (the real inputs are small, their copies cheap).
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_factory(func):
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            shape_only = {**kwargs, "device": _META, **({"generator": None} if "generator" in kwargs else {})}
            meta = func(*args, **shape_only)
            if isinstance(meta, torch.Tensor) and meta.numel() * meta.element_size() > HOST_TENSOR_BYTES:
                return meta
            return func(*args, **{**kwargs, "device": _CPU})
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.is_meta for t in tensors) and any(not t.is_meta and t.dim() > 0 for t in tensors):
            args, kwargs = tree_map(lambda t: t.to(_META) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        return func(*args, **kwargs)


def build_fake(build: Callable[[], nn.Module], mode: FakeTensorMode, device: torch.device,
               values: KnownValues | None = None) -> nn.Module:
    """``build()`` under :class:`HostOrMeta`, its parameters and buffers then fake on ``device``
    (``values``: see :func:`to_fake`)."""
    with HostOrMeta():
        model = build()
    return to_fake(model, mode, device, values)


def to_fake(model: nn.Module, mode: FakeTensorMode, device: torch.device, values: KnownValues | None = None) -> nn.Module:
    """Replace every parameter and buffer of ``model`` by a fake tensor on ``device``, in place.

    One fake per original tensor: a parameter shared by two modules (tied embeddings) is one
    fake parameter in both. Plain tensor attributes that are not parameters or buffers stay
    where ``Module.to`` leaves them, on the host; the large ones (on ``meta``) become fake host
    tensors, as the real ones would be real host tensors. ``values`` learns the real values of the
    small buffers (a registered causal mask, say), which a model's checks may read.
    """
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, on: torch.device) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=on)
                if isinstance(t, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=t.requires_grad)
                    new.__dict__.update(t.__dict__)  # attributes such as ``_no_weight_decay``
            fakes[id(t)] = new
        return fakes[id(t)]

    for module in model.modules():
        parameters = parameter_slots(module)
        for slots in (parameters, buffer_slots(module)):
            for name, tensor in slots.items():
                if tensor is not None and not isinstance(tensor, nn.parameter.UninitializedTensorMixin):
                    slots[name] = fake(tensor, device)
                    if values is not None and slots is not parameters:
                        values.know(slots[name], tensor)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and value.is_meta:
                setattr(module, name, fake(value, _CPU))
    return model
