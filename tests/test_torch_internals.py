"""What this project takes from PyTorch beyond its public API (``orchestrator/device/torch_internals.py``),
checked against the installed torch: a torch upgrade that changes one of them fails here, naming
what changed, instead of as a wrong estimate. ``pyproject.toml`` bounds ``torch`` to the versions
this file passed on.
"""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch
from torch import nn

from orchestrator.device import torch_internals as ti


def test_an_ops_schema_names_its_arguments_and_types():
    schema = ti.op_schema(torch.ops.aten.zeros.default)
    assert schema.name == "aten::zeros", "torch changed: OpOverload._schema.name"
    assert "device" in [a.name for a in schema.arguments], "torch changed: OpOverload._schema.arguments"
    assert any(isinstance(r.type, torch.TensorType) for r in schema.returns), "torch changed: schema return types"
    assert isinstance(torch.ops.aten.zeros.default, ti.OpOverload), "torch changed: torch._ops.OpOverload"


def test_a_modules_slots_are_what_its_parameters_and_buffers_read():
    module = nn.BatchNorm1d(3)
    parameters, buffers = ti.parameter_slots(module), ti.buffer_slots(module)
    assert set(parameters) == {"weight", "bias"} and "running_mean" in buffers, "torch changed: Module._parameters/_buffers"
    replaced = nn.Parameter(torch.ones(3))
    parameters["weight"] = replaced
    buffers["running_mean"] = torch.full((3,), 7.0)
    assert module.weight is replaced and dict(module.named_parameters())["weight"] is replaced
    assert torch.equal(dict(module.named_buffers())["running_mean"], torch.full((3,), 7.0))


def test_excluding_the_autocast_key_skips_autocast():
    a, b = torch.ones(2, 2), torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, b).dtype == torch.bfloat16
        with ti.excluding_dispatch_key("AutocastCPU"):
            assert torch.mm(a, b).dtype == torch.float32, "torch changed: _ExcludeDispatchKeyGuard / DispatchKey"


def test_the_ops_with_their_own_autocast_kernel_are_listed():
    ops = ti.ops_with_kernel("AutocastCPU")
    assert {"conv2d", "mm", "linear"} <= ops, f"torch changed: _dispatch_has_kernel_for_dispatch_key ({len(ops)} ops)"
    assert not any(name.startswith("aten::") for name in ops)


def test_a_removed_library_takes_its_kernels_with_it():
    def as_zeros(a, b):
        with ti.excluding_dispatch_key("AutocastCPU"):
            return torch.zeros(a.shape[0], b.shape[1])

    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel", as the emulation does
        library.impl("mm", as_zeros, "AutocastCPU")
    a = torch.ones(2, 2)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.mm(a, a).sum() == 0, "torch changed: Library.impl at AutocastCPU is not called"
    finally:
        ti.remove_library(library)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype == torch.bfloat16, "torch changed: Library._destroy leaves its kernels"


def test_the_private_attention_kernels_agree_with_the_public_one():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    flash = ti.cpu_flash_attention(q, k, v, 0.0, True)
    assert flash[0].shape == expected.shape and flash[1].shape == (2, 3, 5), "torch changed: CPU flash attention's outputs"
    math_out = ti.math_attention(q, k, v, None, 0.0, True)
    torch.testing.assert_close(flash[0], expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(math_out[0], expected, atol=1e-5, rtol=1e-4)


class Seen(ti.DispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_ops_except_where_modes_are_disabled():
    with Seen() as seen:
        torch.ones(2) + 1
        with ti.disable_current_modes():
            torch.ones(3) * 2
    assert "aten.add.Tensor" in seen.ops and "aten.mul.Tensor" not in seen.ops, "torch changed: _disable_current_modes"
    with Seen() as later:  # set aside while nothing else was active, then active again
        with ti.disable_current_modes(), ti.disable_current_modes():
            torch.ones(3) * 2
        torch.ones(2) - 1
    assert later.ops == ["aten.ones.default", "aten.sub.Tensor"], "torch changed: _len_torch_dispatch_stack"


def test_a_fake_tensors_device_is_asked_of_no_mode_of_ours_and_answered_as_the_fake_mode_answers():
    """Autograd's engine and modules ask a tensor's device from C++, which for a fake tensor is an
    op (``prim.device``) through every mode; ours answer it as the fake mode at the bottom does."""
    with ti.FakeTensorMode():
        weight = torch.ones(3, 2, requires_grad=True)
    host = torch.ones(2)  # real: made outside the modes
    with ti.FakeTensorMode(allow_non_fake_inputs=True), Seen() as below, Seen() as above:
        (weight.t() @ torch.ones(3, 4)).sum().backward()  # the engine asks each gradient's device
        asked = torch.ops.prim.device.default(weight)
        real = torch.ops.prim.device.default(host)
    assert isinstance(weight.grad, ti.FakeTensor) and asked == weight.device == torch.device("cpu")
    assert real == torch.device("cpu")
    assert "aten.mm.default" in above.ops and "aten.mm.default" in below.ops
    assert "prim.device.default" not in above.ops + below.ops, \
        "a mode of ours passed a fake tensor's device query down (or torch changed prim.device)"


DYNAMO = """
import sys
import torch
from orchestrator.device.torch_internals import DispatchMode

class Counted(DispatchMode):
    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        type(self).ops += 1
        return func(*args, **(kwargs or {}))

with Counted():
    torch.ones(2) + 1
assert Counted.ops == 2, Counted.ops
assert "torch._dynamo" not in sys.modules, "torch changed: TorchDispatchMode._should_skip_dynamo"
compiled = torch.compile(lambda x: (x * 2).sum(), backend="eager")
with Counted():
    assert compiled(torch.ones(3)).item() == 6
assert Counted.ops > 2
print("ok")
"""


def test_a_mode_of_ours_sees_ops_without_loading_dynamo_and_under_a_compiled_function_once_loaded():
    """Torch's guard imports Dynamo (0.9 s) at a mode's first op; ours does not, and a function
    compiled afterwards runs under a mode of ours. In a fresh interpreter: this one may have Dynamo."""
    import subprocess

    run = subprocess.run([sys.executable, "-c", DYNAMO], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_setting_modes_aside_keeps_a_fake_mode_and_a_user_mode_on_top_of_it_in_their_order():
    with ti.FakeTensorMode(), Seen() as seen:
        with ti.disable_current_modes() as modes:
            real = torch.ones(2) * 2  # neither sees it: a real tensor
        after = torch.ones(2) - 1
    assert [type(m) for m in modes] == [Seen, ti.FakeTensorMode], "torch changed: _pop_torch_dispatch_stack's order"
    assert not isinstance(real, ti.FakeTensor) and real.tolist() == [2.0, 2.0]
    assert isinstance(after, ti.FakeTensor), "torch changed: _push_on_torch_dispatch_stack of an infra mode"
    assert "aten.mul.Tensor" not in seen.ops and "aten.sub.Tensor" in seen.ops


def test_fake_tensors_have_shapes_and_no_data():
    with ti.FakeTensorMode() as mode:
        fake = torch.empty(4, 1024, 1024)
        assert isinstance(fake, ti.FakeTensor) and fake.shape == (4, 1024, 1024)
        with ti.unset_fake_temporarily():
            assert not isinstance(torch.zeros(1), ti.FakeTensor), "torch changed: unset_fake_temporarily"
        with pytest.raises(ti.DynamicOutputShapeException):
            torch.nonzero(fake)
        with pytest.raises(ti.DataDependentOutputException):
            fake.sum().item()
    assert issubclass(ti.UnsupportedFakeTensorException, Exception)
    assert isinstance(mode.from_tensor(torch.ones(2)), ti.FakeTensor)
    assert sys.modules[ti.FakeTensorMode.__module__].log is logging.getLogger(ti.FAKE_TENSOR_LOGGER), (
        "torch changed: fake tensors log under another name; the trace's quiet filter would miss it"
    )


def test_nested_arguments_are_walked():
    tree = ({"a": torch.ones(1)}, [torch.zeros(2), 3])
    assert len([t for t in ti.tree_leaves(tree) if isinstance(t, torch.Tensor)]) == 2
    doubled = ti.tree_map(lambda t: t * 2 if isinstance(t, torch.Tensor) else t, tree)
    assert doubled[0]["a"].item() == 2 and doubled[1][1] == 3


def test_a_compiled_models_eager_modules_are_found_without_compiling():
    """``torch.compile``'s wrapper (``OptimizedModule._orig_mod``), a compiled submodule and a
    module compiled in place (``Module._compiled_call_impl``) all give back their eager modules."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    inner = nn.Linear(4, 4)
    wrapped = torch.compile(nn.Sequential(torch.compile(inner, backend=backend), nn.ReLU()), backend=backend)
    eager, compiled = ti.eager_module(wrapped)
    assert compiled and isinstance(eager, nn.Sequential), "torch changed: OptimizedModule._orig_mod"
    assert eager[0] is inner, "torch changed: a compiled submodule's _orig_mod"
    in_place = nn.Linear(4, 4)
    in_place.compile(backend=backend)
    assert ti.eager_module(in_place) == (in_place, True), "torch changed: Module._compiled_call_impl"
    eager(torch.ones(2, 4))
    in_place(torch.ones(2, 4))
    assert graphs == [], "the eager modules ran through dynamo"
    plain = nn.Linear(2, 2)
    assert ti.eager_module(plain) == (plain, False)


def test_a_process_can_make_data_loaders_without_torch_s_sigchld_handler(monkeypatch):
    import signal

    from torch.utils.data._utils import signal_handling

    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)  # restored after the test
    before = signal.getsignal(signal.SIGCHLD)
    ti.loader_worker_deaths_found_at_fetch()
    signal_handling._set_SIGCHLD_handler()  # what a DataLoader with workers calls in the main thread
    assert signal.getsignal(signal.SIGCHLD) is before


def test_a_loaders_workers_are_found_unwatched_and_shut_down():
    """What ``trainables.worker_start`` reads and stops of a DataLoader's forked workers."""
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data._utils import signal_handling

    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2, persistent_workers=True,
                        multiprocessing_context=multiprocessing.get_context("fork"))
    assert not ti.loader_keeps_workers(loader)
    iterator = iter(loader)
    workers = ti.loader_worker_processes(iterator)
    assert len(workers) == 2 and all(w.is_alive() for w in workers), "torch changed: the iterator's _workers"
    assert next(iterator)[0].tolist() == [0.0, 1.0]
    assert ti.loader_keeps_workers(loader), "torch changed: DataLoader._iterator of persistent workers"
    ti.unwatch_loader_workers(iterator)
    assert not iterator._worker_pids_set, "torch changed: the iterator's _worker_pids_set"
    if signal_handling._SIGCHLD_handler_set:  # the main thread's loaders: watched until unwatched
        with pytest.raises(ValueError):  # already removed
            signal_handling._remove_worker_pids(id(iterator))
    ti.shut_down_loader_workers(loader, iterator)
    assert not any(w.is_alive() for w in workers), "torch changed: the iterator's _shutdown_workers"
    assert not ti.loader_keeps_workers(loader)
    assert [b[0].tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]  # new workers


def test_the_cublas_workspaces_can_be_given_back():
    """Nothing to give back where CUDA never started; a CUDA build has the function it calls."""
    ti.clear_cublas_workspaces()
    if torch.backends.cuda.is_built():
        assert hasattr(torch._C, "_cuda_clearCublasWorkspaces"), "torch changed: torch._C._cuda_clearCublasWorkspaces"
