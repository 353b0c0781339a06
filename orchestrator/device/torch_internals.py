"""Every private PyTorch API this project uses, and nothing else: the one place to look when torch
is upgraded.

The estimators trace a training step on fake tensors and count what it allocates, the CPU device
counts live tensors with a dispatch mode, and the CUDA emulation swaps CPU's autocast policy and
attention/dropout kernels for CUDA's. None of that has a public API in torch, so it uses these
names, which torch may change in any release. Every other module imports them from here (never
from ``torch._*``, ``torch.utils._*`` or an underscored attribute), and
``tests/test_torch_internals.py`` checks each of them against the installed torch, naming what
changed; ``pyproject.toml`` bounds ``torch`` to the versions that test passed on.

What each is for:

* ``FakeTensorMode`` and its exceptions, ``unset_fake_temporarily``: tensors with shapes and no
  data, the trace itself (``orchestrator.memory.fake``, ``construction``, ``workspaces``).
* ``TorchDispatchMode``, :func:`disable_current_modes`: seeing every op a step runs (the CPU tensor
  tracker, the trace's helpers) and running host work unseen by them; :class:`DispatchMode`, the
  base of ours, which opts out of torch's own Dynamo guard (``_should_skip_dynamo``) for one that
  does not import Dynamo.
* ``tree_leaves``, ``tree_map``: the tensors in an op's nested arguments and results.
* ``OpOverload``, :func:`op_schema`: which op is running, and its arguments' names and types.
* :func:`parameter_slots`, :func:`buffer_slots`: an ``nn.Module``'s own parameter and buffer
  dictionaries, replaced in place so that tied parameters stay tied.
* :func:`excluding_dispatch_key`, :func:`ops_with_kernel`, :func:`remove_library`: kernels
  registered at the ``AutocastCPU`` key while a trace emulates CUDA's autocast policy.
* :func:`cpu_flash_attention`, :func:`math_attention`: the private aten attention kernels CPU
  dispatches to, called directly to allocate what CUDA's fused kernels allocate.
* :func:`eager_module`: a ``torch.compile``d model's eager modules (``OptimizedModule._orig_mod``,
  ``Module._compiled_call_impl``), which a trace runs instead of compiling on fake tensors.
* :func:`loader_worker_deaths_found_at_fetch`: no DataLoader SIGCHLD handler in this process
  (``torch.utils.data._utils.signal_handling._SIGCHLD_handler_set``), for a data-parallel rank.
* :func:`loader_keeps_workers`, :func:`loader_worker_processes`, :func:`unwatch_loader_workers`,
  :func:`shut_down_loader_workers`: a DataLoader's iterator and its worker processes
  (``DataLoader._iterator``, ``_workers``, ``_worker_pids_set``, ``_shutdown_workers``, the SIGCHLD
  watch's ``_remove_worker_pids``), for workers forked from a trial that never ran Python
  (``trainables.worker_start``).
* :func:`clear_cublas_workspaces`: the cuBLAS/cuBLASLt workspaces PyTorch keeps for the process's
  life (``torch._C._cuda_clearCublasWorkspaces``, which PyTorch's own leak check calls), given back.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator

import torch
from torch import nn
from torch._ops import OpOverload, _len_torch_dispatch_stack_pre_dispatch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _len_torch_dispatch_stack,
    _pop_torch_dispatch_stack,
    _push_on_torch_dispatch_stack,
)
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "FAKE_TENSOR_LOGGER",
    "DataDependentOutputException",
    "DispatchMode",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorMode",
    "OpOverload",
    "TorchDispatchMode",
    "UnsupportedFakeTensorException",
    "buffer_slots",
    "clear_cublas_workspaces",
    "cpu_flash_attention",
    "disable_current_modes",
    "eager_module",
    "excluding_dispatch_key",
    "loader_keeps_workers",
    "loader_worker_deaths_found_at_fetch",
    "loader_worker_processes",
    "math_attention",
    "op_schema",
    "ops_with_kernel",
    "parameter_slots",
    "remove_library",
    "shut_down_loader_workers",
    "tree_leaves",
    "tree_map",
    "unset_fake_temporarily",
    "unwatch_loader_workers",
]

#: The logger fake tensors report failing meta kernels on (with a whole traceback each).
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"


class DispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` Dynamo skips once Dynamo is loaded.

    torch wraps every mode's ``__torch_dispatch__`` so that Dynamo, compiling a model, does not
    trace into it (``_should_skip_dynamo``, ``torch._disable_dynamo``), and that wrapper imports
    ``torch._dynamo`` at its first call: 0.9 s here (sympy, inductor), at the first op a mode
    sees, in a process that compiles nothing. That was every ``orchestrator run``'s pre-flight
    (``HostOrMeta``), before Ray started, and every CPU trial worker's first step (the tracker).
    Nothing can be compiling while ``torch._dynamo`` has not been imported (``torch.compile``
    imports it), so this wrapper calls the mode's own method until then, and Dynamo's ``disable``
    of it from then on, as torch's does.

    The wrapper also answers a fake tensor's device query (``prim.device``) itself, with what the
    fake mode at the bottom of the stack answers (``FakeTensor.device``), instead of passing it
    through every mode to it. Autograd's engine, ``nn.Linear`` and the optimizers ask a tensor's
    device from C++, which for a fake tensor is a dispatched op: in a trace of a 48-layer
    transformer those were 213,000 of 309,000 ops, about 30 % of the trace's time, each going
    through the trace's three modes and Dynamo's wrapper of each."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's guard off: __init_subclass__ puts this one on instead

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        method = cls.__dict__.get("__torch_dispatch__")
        if method is not None and not isinstance(method, classmethod):
            cls.__torch_dispatch__ = _dispatched(method)


_DEVICE_QUERY = torch.ops.prim.device.default


def _dispatched(method):
    """``method`` behind the two short-cuts of :class:`DispatchMode`."""
    disabled = None

    @functools.wraps(method)
    def dispatch(mode, func, types, args=(), kwargs=None):
        nonlocal disabled
        if func is _DEVICE_QUERY and isinstance(args[0], FakeTensor):
            return args[0].device  # the fake mode's answer (meta inside its kernels), asked of no mode
        if disabled is None:
            dynamo = sys.modules.get("torch._dynamo")
            if getattr(dynamo, "disable", None) is None:  # not imported (or still importing): nothing compiles
                return method(mode, func, types, args, kwargs)
            disabled = dynamo.disable(method, recursive=True, wrapping=False)
        return disabled(mode, func, types, args, kwargs)

    return dispatch


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """An aten op's schema: ``.name``, ``.arguments`` and ``.returns`` with names and types."""
    return op._schema


def disable_current_modes() -> contextlib.AbstractContextManager:
    """Every active dispatch mode set aside for the duration (``_disable_current_modes``): host
    work no tracker or trace should see, and the CPU device's unsampled steps.

    Torch's context costs ~8 us a call with one mode pushed (imports, the pre-dispatch stack's
    bookkeeping, a generator; this one ~2 us), paid at every unsampled step of a CPU trial,
    whose tracker stays pushed for the whole trial. Where no pre-dispatch mode is active (every
    trial) the modes are popped and pushed back as torch's own ``_pop_mode``/``_push_mode`` do
    for them, with nothing else; where none is active at all (the fetches inside an unsampled
    step, a GPU trial), nothing."""
    if _len_torch_dispatch_stack_pre_dispatch():
        return _disable_current_modes()
    if _len_torch_dispatch_stack() == 0:
        return _NO_MODES
    return _ModesSetAside()


_NO_MODES = contextlib.nullcontext()


class _ModesSetAside:
    """The dispatch stack's modes (user modes, then infra modes such as ``FakeTensorMode``)
    popped on entry and pushed back in their order on exit."""

    __slots__ = ("_modes",)

    def __enter__(self) -> list[TorchDispatchMode]:
        self._modes = [_pop_torch_dispatch_stack(None) for _ in range(_len_torch_dispatch_stack())]
        return list(self._modes)

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            _push_on_torch_dispatch_stack(mode)


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The module's own parameters, by name, as the dictionary ``module.parameters()`` reads:
    assigning to it replaces a parameter without the checks ``setattr`` makes."""
    return module._parameters


def buffer_slots(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own buffers, by name, as the dictionary ``module.buffers()`` reads."""
    return module._buffers


@contextlib.contextmanager
def excluding_dispatch_key(key: str) -> Iterator[None]:
    """Dispatch skips ``key`` (e.g. ``"AutocastCPU"``) on this thread for the duration: a kernel
    registered at that key calls the op again without re-entering itself."""
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    with torch._C._ExcludeDispatchKeyGuard(keys):
        yield


def ops_with_kernel(key: str) -> frozenset[str]:
    """The aten ops (``conv2d``, ``pow.Scalar``, ...) with a kernel of their own at ``key`` in
    this build of torch."""
    return frozenset(
        qualified[len("aten::"):]
        for qualified in torch._C._dispatch_get_all_op_names()
        if qualified.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key)
    )


def remove_library(library: torch.library.Library) -> None:
    """Unregisters every kernel ``library`` registered (a ``Library`` has no public way to)."""
    library._destroy()


def cpu_flash_attention(query, key, value, dropout_p: float, is_causal: bool, *, attn_mask=None, scale=None):
    """CPU's flash attention kernel: ``(output, logsumexp)`` for 4-d inputs."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )


def math_attention(query, key, value, attn_mask, dropout_p: float, is_causal: bool, *, scale=None, enable_gqa=False):
    """The reference attention (materialises the score matrix): ``(output, attention weights)``."""
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
    )


def eager_module(model: nn.Module) -> tuple[nn.Module, bool]:
    """``model`` with ``torch.compile`` taken off, and whether it had been compiled: a model
    returned by ``torch.compile`` becomes the module it wraps (``OptimizedModule._orig_mod``), a
    compiled submodule is replaced by its own in its parent, and a module compiled in place
    (``Module.compile()``) calls its eager ``forward`` again. Changes ``model``'s modules in place.

    Dynamo is imported by ``torch.compile``: where it is not loaded nothing was compiled, and
    it is not loaded here (its import takes a second).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    compiled = False
    while wrapper is not None and isinstance(model, wrapper):
        model, compiled = model._orig_mod, True
    for module in list(model.modules()):
        for name, child in list(module._modules.items()):
            while wrapper is not None and isinstance(child, wrapper):
                child, compiled = child._orig_mod, True
                module._modules[name] = child
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl, compiled = None, True
    return model, compiled


def loader_worker_deaths_found_at_fetch() -> None:
    """DataLoaders made from now on in this process's main thread install no SIGCHLD handler.

    Torch's handler raises a loader worker's death in the main thread wherever it then is; in a
    data-parallel rank that may be between two collectives, outside the agreement that makes one
    rank's lost worker the group's (``trainables.distributed``), so that rank alone would recover.
    Without it the loader finds the dead worker when the rank next fetches a batch (its liveness
    check, every few seconds while it waits), inside the agreement: as in rank 0, whose Tune
    trainable runs off the main thread, where torch installs no handler anyway.
    """
    from torch.utils.data._utils import signal_handling

    signal_handling._SIGCHLD_handler_set = True


def loader_keeps_workers(loader) -> bool:
    """Whether ``iter(loader)`` goes on with the workers an earlier iterator started (persistent
    workers) rather than starting new ones."""
    return bool(loader.persistent_workers) and loader._iterator is not None


def loader_worker_processes(iterator) -> list:
    """The worker processes of a multi-process DataLoader iterator, by worker id."""
    return iterator._workers


def unwatch_loader_workers(iterator) -> None:
    """Take the iterator's workers out of torch's SIGCHLD watch, which raises a worker's death in
    the main thread wherever it then is: for workers about to be killed on purpose."""
    from torch.utils.data._utils import signal_handling

    if iterator._worker_pids_set:
        signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False


def shut_down_loader_workers(loader, iterator) -> None:
    """Shut the iterator's workers down as the DataLoader does, and forget the iterator, so that
    the next ``iter(loader)`` starts new workers (persistent ones too)."""
    iterator._shutdown_workers()
    loader._iterator = None


def clear_cublas_workspaces() -> None:
    """Drop the workspaces cuBLAS and cuBLASLt keep per handle and stream. They are allocated
    through the caching allocator, so ``memory_allocated()`` counts them (32 MiB and more on an
    H100) though no trial's tensor holds them, and ``empty_cache`` cannot free them. cuBLAS makes
    them again at its next call. Nothing to do where CUDA was never initialised (a CPU build has
    no such function)."""
    if torch.cuda.is_initialized():
        torch._C._cuda_clearCublasWorkspaces()
