"""Values a trace can know, so that a model's data-dependent Python checks get the real answer.

Fake tensors have no values, and stock modules read some before they compute:
``nn.TransformerEncoder`` asks whether its mask is causal (``_detect_is_causal_mask``:
``bool((mask == causal).all())``), other models check their masks, lengths or padding with
``.item()`` or ``if tensor``. On a fake tensor that read raises, and the trace fell back to
``static``. Yet the values those checks read are usually knowable: a causal mask is made from
sizes alone (``torch.full`` then ``triu``), a padding mask comes from the workload's sample
(real, on the host), a small buffer was real when the model was built.

:class:`KnownValues` keeps, next to each fake tensor whose value is knowable, a real CPU copy
(its *value*) and runs every op on those values too, when all its tensor inputs have one and
every tensor involved is small (``VALUE_NUMEL_LIMIT``): factory ops (no tensor inputs), real
host tensors, and what is computed from them. Random ops have no known value. An op that writes
to a tensor without known inputs forgets the value of every tensor sharing its storage. Where the
fake op cannot give its result (a value read on the host, an output whose shape depends on
values, e.g. ``nonzero`` of a known mask), the real op on the values gives it: what the real
input would give. Where a value is not known, the fake op fails as before, and the trace's
fallback names the op and the line.

The mode sits between the fake mode and the tracker: it sees the ops the tracker sees, and the
real ops on values run with every mode off, so nothing counts them.
"""

from __future__ import annotations

import weakref

import torch

from orchestrator.device.torch_internals import (
    DataDependentOutputException,
    DispatchMode,
    DynamicOutputShapeException,
    FakeTensor,
    OpOverload,
    disable_current_modes,
    op_schema,
)

#: Tensors with more elements than this get no known value: masks and index tables are small
#: next to activations, and values are computed for real on the CPU.
VALUE_NUMEL_LIMIT = 2**22

_CPU = torch.device("cpu")


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors ``func`` writes to (an in-place op's self, an ``out=``)."""
    written = []
    for i, name in _written_arguments(func):
        t = args[i] if i < len(args) else kwargs.get(name)
        written.extend(t if isinstance(t, (list, tuple)) else [t])
    return [t for t in written if isinstance(t, torch.Tensor)]


_WRITTEN_ARGUMENTS: dict[OpOverload, tuple[tuple[int, str], ...]] = {}


def _written_arguments(func) -> tuple[tuple[int, str], ...]:
    """The positions and names of the arguments ``func`` writes to, read from its schema once
    per op (reading them at every op was 2 % of a trace)."""
    if not isinstance(func, OpOverload):
        return ()
    if func not in _WRITTEN_ARGUMENTS:
        _WRITTEN_ARGUMENTS[func] = tuple((i, a.name) for i, a in enumerate(op_schema(func).arguments)
                                         if a.alias_info is not None and a.alias_info.is_write)
    return _WRITTEN_ARGUMENTS[func]


class KnownValues(DispatchMode):
    """While active, fake tensors computed from knowable inputs carry their real values."""

    def __init__(self, limit: int = VALUE_NUMEL_LIMIT):
        super().__init__()
        self.limit = limit
        self._values: dict[int, tuple[torch.Tensor, int]] = {}  # id(fake) -> (value, id of its storage)
        #: id of a storage -> the fakes with a known value on it: a write forgets them without a
        #: walk over every known value (which was 1.5 % of a trace of a 48-layer transformer).
        self._on_storage: dict[int, set[int]] = {}

    def know(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        """``fake``'s value is ``value`` (a real tensor of its shape and dtype), if it is small enough."""
        if value.numel() > self.limit or value.is_meta or isinstance(value, FakeTensor):
            return
        key = id(fake)
        if key in self._values:
            self._forget(key)
        else:
            weakref.finalize(fake, self._forget, key)
        storage = id(fake.untyped_storage())
        with disable_current_modes():
            self._values[key] = (value.detach().to(_CPU), storage)
        self._on_storage.setdefault(storage, set()).add(key)

    def _forget(self, key: int) -> None:
        """The fake ``key`` (its ``id``) has no known value from now on."""
        entry = self._values.pop(key, None)
        if entry is None:
            return
        on_storage = self._on_storage[entry[1]]
        on_storage.discard(key)
        if not on_storage:
            del self._on_storage[entry[1]]

    def __len__(self) -> int:
        """How many fake tensors alive have a known value."""
        return len(self._values)

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s real value: its known value if it is fake, ``t`` itself if it is a real tensor."""
        if not isinstance(t, FakeTensor):
            return None if t.is_meta or t.numel() > self.limit else t
        entry = self._values.get(id(t))
        return entry[0] if entry is not None else None

    def _forget_storage_of(self, t: torch.Tensor) -> None:
        for key in list(self._on_storage.get(id(t.untyped_storage()), ())):
            self._forget(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in _leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        values = [self.value(t) for t in tensors]
        knowable = all(v is not None for v in values) and torch.Tag.nondeterministic_seeded not in func.tags
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            if not knowable:
                raise
            return self._from_values(func, args, kwargs, tensors, values)
        out_leaves = _leaves(out)
        out_tensors = [t for t in out_leaves if isinstance(t, FakeTensor)]
        if knowable and all(t.numel() <= self.limit and t.layout == torch.strided for t in out_tensors):
            for fake, real in zip(out_leaves, _leaves(self._real(func, args, kwargs, tensors, values))):
                if isinstance(fake, FakeTensor) and isinstance(real, torch.Tensor):
                    if real.shape == fake.shape and real.dtype == fake.dtype:
                        self.know(fake, real)
                    else:
                        self._forget(id(fake))
            return out
        for t in _written(func, args, kwargs):
            self._forget_storage_of(t)
        for t in out_tensors:
            self._forget(id(t))
        return out

    def _real(self, func, args, kwargs, tensors, values):
        """``func`` on the real values, on the CPU, outside every mode (nothing counts it)."""
        by_id = {id(t): v for t, v in zip(tensors, values)}

        def real(a):
            if isinstance(a, torch.Tensor):
                return by_id[id(a)]
            if isinstance(a, torch.device):
                return _CPU
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            return a

        real_args, real_kwargs = real(args), {k: real(v) for k, v in kwargs.items()}
        if real_kwargs.get("pin_memory"):
            real_kwargs["pin_memory"] = False
        with disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
            return func(*real_args, **real_kwargs)

    def _from_values(self, func, args, kwargs, tensors, values):
        """The result of an op the fake mode cannot give: from the real op, its tensors made fake
        (on the device of the op's fake inputs) with their values known."""
        device = next((t.device for t in tensors if isinstance(t, FakeTensor)), _CPU)

        def fake(r):
            if isinstance(r, (list, tuple)):
                return type(r)(fake(x) for x in r)
            if not isinstance(r, torch.Tensor):
                return r
            made = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device)  # the fake mode below us
            self.know(made, r)
            return made

        return fake(self._real(func, args, kwargs, tensors, values))


def _leaves(tree) -> list:
    """The leaves of an aten op's arguments or results: values, or tuples, lists and dicts of them
    (an op's schema nests no deeper than a list of tensors inside its arguments or results)."""
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in _leaves(item)]
    return [tree]
