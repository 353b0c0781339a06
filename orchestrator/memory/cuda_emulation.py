"""Make a fake-CPU trace allocate what the same step would allocate on CUDA.

Without a GPU, fake *cuda* tensors cannot run backward (pytorch #92627, #157869, #148977), so a
head node traces on fake *cpu* tensors. Four CPU code paths then allocate differently from
CUDA, which put transformers 36-95 % over the truth (FACTS.md); during the trace only:

* attention: ``scaled_dot_product_attention`` with dropout takes CPU's math path, which
  materialises the (b, heads, s, s) score matrix; CUDA's flash/efficient kernels keep only the
  output and a logsumexp, dropout included. The call runs dropout-free on CPU's flash kernel,
  which allocates what CUDA's does.
* dropout: CPU multiplies by a noise mask of the input's dtype; CUDA's fused kernel keeps a
  1-byte bool mask. ``dropout`` becomes ``native_dropout``, which has that mask on CPU too.
* autocast: CPU and CUDA cast different ops (CUDA runs softmax, log_softmax, layer_norm, sum,
  exp, ... in fp32 and ``cross_entropy`` only through them; CPU casts ``cross_entropy_loss``
  as a whole and pooling/padding ops to fp32). CUDA's cast policy replaces CPU's for the
  duration, by registering kernels at the ``AutocastCPU`` dispatch key (the level autocast
  itself works at, above autograd, so casts are recorded and saved for backward as on CUDA).
  CPU's own kernels stay for the matmul/conv ops both devices run in lower precision, which
  keeps autocast's weight-cast cache for them.
* fused transformer layers: in eval, ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``
  take a fast path of single ops (``_native_multi_head_attention``,
  ``_transformer_encoder_layer_fwd``) whose intermediates no tracker sees, and CPU's computes the
  score matrix where CUDA's uses fused attention. The fast path is off during the trace: the
  layers' Python path shows every intermediate (at most one extra copy of the packed q/k/v per
  layer over CUDA's fused op).

Attention and dropout are replaced where the ops are defined (their ``CompositeImplicitAutograd``
kernels), not where Python calls them, so calls made inside torch's own Python functions
(``F.multi_head_attention_forward``) and positional arguments are covered alike. The
registrations are process-global while active (another thread running CPU autocast, attention
or dropout at the same time would see CUDA's behaviour) and are removed on exit.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import warnings

import torch

from orchestrator.device.torch_internals import (
    cpu_flash_attention,
    excluding_dispatch_key,
    math_attention,
    op_schema,
    ops_with_kernel,
    remove_library,
    tree_leaves,
    tree_map,
)

LOWER, FP32, FP32_SET_OPT_DTYPE, FP32_APPEND_DTYPE, PROMOTE = "lower", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote"

#: CUDA's autocast policy (aten/src/ATen/autocast_mode.h, AT_FORALL_* lists, torch 2.x).
_CUDA_LOWER = """
_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm
baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention scaled_dot_product_attention
cudnn_convolution cudnn_convolution_transpose
"""
_CUDA_FP32 = """
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm group_norm rms_norm frobenius_norm.dim
nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
_upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa
"""
_CUDA_FP32_SET_OPT_DTYPE = """
prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm
linalg_matrix_norm.str_ord sum sum.dim_IntList
"""
_CUDA_PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
_CUDA_FP32_APPEND_DTYPE = "norm.Scalar norm.ScalarOpt_dim"

CUDA_POLICY: dict[str, str] = {
    name: policy
    for names, policy in (
        (_CUDA_LOWER, LOWER), (_CUDA_FP32, FP32), (_CUDA_FP32_SET_OPT_DTYPE, FP32_SET_OPT_DTYPE),
        (_CUDA_PROMOTE, PROMOTE), (_CUDA_FP32_APPEND_DTYPE, FP32_APPEND_DTYPE),
    )
    for name in names.split()
}


def _qualified(name: str) -> str:
    return name if "." in name else f"{name}.default"


def _op(name: str):
    packet, _, overload = _qualified(name).partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type == "cpu" and t.dtype != torch.float64


def _cast(args, kwargs, dtype):
    def cast(t):
        return t.to(dtype) if _eligible(t) and t.dtype != dtype else t

    return tree_map(cast, args), tree_map(cast, kwargs)


def _first_tensor(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _kernel(name: str, policy: str):
    """A Python kernel for the AutocastCPU key applying CUDA's ``policy`` to ``name``."""
    op = _op(name)
    dtype_index = next((i for i, a in enumerate(op_schema(op).arguments) if a.name == "dtype"), None)

    def kernel(*args, **kwargs):
        with excluding_dispatch_key("AutocastCPU"):
            lower = torch.get_autocast_dtype("cpu")
            if policy == LOWER:
                args, kwargs = _cast(args, kwargs, lower)
            elif policy == FP32:
                args, kwargs = _cast(args, kwargs, torch.float32)
            elif policy == PROMOTE:
                flat = [t for t in tree_leaves((args, kwargs)) if _eligible(t)]
                widest = torch.float32 if any(t.dtype == torch.float32 for t in flat) else lower
                args, kwargs = _cast(args, kwargs, widest)
            elif _eligible(_first_tensor(args)):  # FP32_SET_OPT_DTYPE / FP32_APPEND_DTYPE
                if policy == FP32_APPEND_DTYPE:
                    return _norm_with_dtype(name, args, kwargs)
                if dtype_index is not None and dtype_index < len(args):
                    if args[dtype_index] is None:
                        args = args[:dtype_index] + (torch.float32,) + args[dtype_index + 1 :]
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)

    return kernel


def _norm_with_dtype(name: str, args, kwargs):
    """CUDA's ``norm`` wrappers redispatch to the overload that takes an output dtype."""
    if name == "norm.Scalar":
        return torch.ops.aten.norm.ScalarOpt_dtype(*args, dtype=torch.float32, **kwargs)
    return torch.ops.aten.norm.ScalarOpt_dim_dtype(*args, dtype=torch.float32, **kwargs)


@functools.lru_cache(maxsize=1)
def _cpu_autocast_ops() -> frozenset[str]:
    """Ops with an explicit AutocastCPU kernel in this build (``conv2d``, ``pow.Scalar``, ...)."""
    return ops_with_kernel("AutocastCPU")


class _Registrations:
    """Kernels registered on ``aten`` while at least one trace uses them (process-global)."""

    def __init__(self, register):
        self._register = register
        self._lock = threading.Lock()
        self._active = 0
        self._library: torch.library.Library | None = None

    @contextlib.contextmanager
    def __call__(self):
        with self._lock:
            if self._active == 0:
                library = torch.library.Library("aten", "IMPL")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
                    self._register(library)
                self._library = library
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0 and self._library is not None:
                    remove_library(self._library)
                    self._library = None


def _register_autocast_policy(library: torch.library.Library) -> None:
    cpu_ops = _cpu_autocast_ops()
    for name in cpu_ops - CUDA_POLICY.keys():
        library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    for name, policy in CUDA_POLICY.items():
        if not _exists(name) or (policy == LOWER and name in cpu_ops):
            continue  # both devices cast it down: keep CPU's kernel and its weight cache
        library.impl(name, _kernel(name, policy), "AutocastCPU")


#: While active, CPU autocast casts exactly what CUDA autocast would.
cuda_autocast_policy = _Registrations(_register_autocast_policy)


def _exists(name: str) -> bool:
    try:
        _op(name)
        return True
    except (AttributeError, RuntimeError):
        return False


#: Notes of the traces running now (a kernel adds to every one): what could not be emulated.
_collectors: list[set[str]] = []


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as CUDA's fused kernels allocate it: CPU's flash kernel,
    without dropout (CUDA's keep the output and logsumexp whatever the dropout), which also
    takes grouped-query attention as CUDA's flash kernel does, without repeating k and v."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # what sdpa makes of a boolean mask before any fused kernel, on CUDA as well
        zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device)
        masked = torch.scalar_tensor(-math.inf, dtype=query.dtype, device=attn_mask.device)
        attn_mask = torch.where(attn_mask, zero, masked)
    unbatched = query.dim() == 3
    if unbatched:  # (heads, L, E): the flash kernel wants a batch dimension
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    try:
        if query.dim() != 4:
            raise RuntimeError(f"{query.dim()}-d inputs")
        out = cpu_flash_attention(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]
    except RuntimeError as exc:
        for notes in _collectors:
            notes.add(
                "attention traced on CPU's math kernel, which materialises the score matrix CUDA's "
                f"flash/efficient kernels do not: over-estimates ({str(exc).splitlines()[0][:120]})"
            )
        out = math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
    return out.squeeze(0) if unbatched else out


def _dropout(input, p, train):
    """``dropout`` as CUDA runs it: the fused kernel with a 1-byte mask (``native_dropout``)."""
    if not train or p == 0 or input.numel() == 0:
        return input
    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    return torch.ops.aten.native_dropout(input, p, True)[0]


def _register_kernels(library: torch.library.Library) -> None:
    library.impl("scaled_dot_product_attention", _attention, "CompositeImplicitAutograd")
    library.impl("dropout", _dropout, "CompositeImplicitAutograd")


#: While active, attention and dropout allocate what CUDA's kernels allocate.
cuda_kernels = _Registrations(_register_kernels)


@contextlib.contextmanager
def mha_fast_path(enabled: bool):
    """``nn.MultiheadAttention``'s and ``nn.TransformerEncoderLayer``'s fused eval path on or off."""
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


@contextlib.contextmanager
def cuda_semantics():
    """Everything above, for the duration of a trace; yields the notes it gathers."""
    notes: list[str] = []
    seen: set[str] = set()
    _collectors.append(seen)
    try:
        with cuda_autocast_policy(), cuda_kernels(), mha_fast_path(False):
            yield notes
    finally:
        _collectors.remove(seen)
    notes.extend(sorted(seen))
