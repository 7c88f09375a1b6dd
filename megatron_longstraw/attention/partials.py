"""Attention partials: the attention of queries over one set of keys, and their exact merges.

A partial ``(out, lse)`` is the attention of some queries over a subset of the keys: ``out``
normalized over that subset (fp32, fp64 for fp64 inputs) and ``lse`` the log of its softmax
denominator. Partials over disjoint key sets merge exactly: ``lse = log(e^lse_a + e^lse_b)``,
``out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse)``; that is how the prompt's key blocks,
the prompt and a response's own keys, and the context-parallel (CP) ranks' pages combine.

The empty partial (a row with no key in a block, on a CP rank, in a page set) is ``out = 0``,
``lse = -inf``. Every function here keeps that convention and stays finite, in values and in
gradients, when one side of a merge is empty for a row and when every side is (the merged row is
then empty too: ``0`` and ``-inf``); a row's empty side gets a zero gradient.

Also here: what every attention core shares (the default softmax scale, GQA expansion, and the
kernel choice for the fused prefix parts).
"""

from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

from megatron_longstraw.config.kernels import KernelOptions

_EMPTY = float("-inf")  # the log-sum-exp of a partial over no key


def default_scale(scale: Optional[float], head_dim: int) -> float:
    """The softmax scale: ``scale``, or ``head_dim ** -0.5`` when it is None."""
    return head_dim ** -0.5 if scale is None else scale


def expand_groups(x_BGSD: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: each of the ``groups`` key/value heads (dim 1) repeated for its ``heads / groups``
    query heads, ``[b, heads, s, d]``; ``x`` itself when there is one query head per group."""
    groups = x_BGSD.shape[1]
    return x_BGSD if groups == heads else x_BGSD.repeat_interleave(heads // groups, dim=1)


def kernel_settings(q: torch.Tensor, options: KernelOptions) -> tuple[str, int]:
    """``(backend, prefix block)`` of a partial computed with the fused kernels: the options'
    backend for 16-bit queries on a GPU (the fused kernels' inputs), ``emulated`` otherwise."""
    backend = options.attention_backend
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        backend = "emulated"
    return backend, options.prefix_block


def empty_partial(out_shape, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial over no key: ``out`` zeros of ``out_shape`` and ``lse = -inf`` (``out_shape[:-1]``)."""
    return (torch.zeros(out_shape, dtype=dtype, device=device),
            torch.full(tuple(out_shape[:-1]), _EMPTY, dtype=dtype, device=device))


def softmax_partial(scores_XK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [..., k], lse [...])`` of scores masked with ``-inf`` where a key is not visible:
    the softmax over the visible keys and its log-sum-exp; a row with no visible key gets
    probabilities 0 and ``lse = -inf`` (the empty partial), with zero gradients."""
    seen_X1 = scores_XK.amax(-1, keepdim=True) > _EMPTY
    lse_X1 = scores_XK.masked_fill(~seen_X1, 0.0).logsumexp(-1, keepdim=True)
    return (scores_XK - lse_X1).exp(), lse_X1.squeeze(-1).masked_fill(~seen_X1.squeeze(-1), _EMPTY)


def merge_partials(out_a_XD: torch.Tensor, lse_a_X: torch.Tensor, out_b_XD: torch.Tensor,
                   lse_b_X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge ``(out [..., d], lse [...])`` of two partials over disjoint keys (with
    autograd), in the wider dtype of the two; empty on a row where both are empty."""
    high_X, low_X = torch.maximum(lse_a_X, lse_b_X), torch.minimum(lse_a_X, lse_b_X)
    seen_X = high_X > _EMPTY
    high_X = torch.where(seen_X, high_X, 0.0)
    lse_X = torch.where(seen_X, high_X + torch.log1p((low_X - high_X).exp()), _EMPTY)
    shift_X = torch.where(seen_X, lse_X, 0.0)
    out_XD = out_a_XD * (lse_a_X - shift_X).exp()[..., None] + out_b_XD * (lse_b_X - shift_X).exp()[..., None]
    return out_XD, lse_X


def merge_stacked_partials(out_NXD: torch.Tensor, lse_NX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge ``(out [..., d], lse [...])`` of ``n`` partials over disjoint keys stacked on
    the first dimension (``[n, ..., d]``, ``[n, ...]``), in fp32 at least; empty where all are."""
    compute = torch.promote_types(out_NXD.dtype, torch.float32)
    lse_NX = lse_NX.to(compute)
    top_X = lse_NX.amax(0)
    top_X = torch.where(top_X > _EMPTY, top_X, 0.0)  # all empty: weights 0, not NaN
    weight_NX = (lse_NX - top_X).exp()
    total_X = weight_NX.sum(0)
    seen_X = total_X > 0
    total_X = torch.where(seen_X, total_X, 1.0)
    out_XD = (out_NXD.to(compute) * weight_NX[..., None]).sum(0) / total_X[..., None]
    return out_XD, torch.where(seen_X, top_X + total_X.log(), _EMPTY)


def _sum_over_group(group):
    def all_reduce(packed: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(packed, group=group)
        return packed
    return all_reduce


def _merge_over_group(out_XD, lse_X, group, sum_over_group):
    """One max all-reduce of the log-sum-exps, one ``sum_over_group`` of ``[out e^(lse - max),
    e^(lse - max)]``: the merged partial, the same on every rank."""
    top_X = lse_X.detach().clone()
    dist.all_reduce(top_X, op=dist.ReduceOp.MAX, group=group)
    top_X = torch.where(top_X > _EMPTY, top_X, 0.0)  # every rank empty: weights 0, not NaN
    weight_X = (lse_X - top_X).exp()
    packed = sum_over_group(torch.cat([out_XD * weight_X[..., None], weight_X[..., None]], dim=-1))
    total_X = packed[..., -1]
    seen_X = total_X > 0
    total_X = torch.where(seen_X, total_X, 1.0)
    return packed[..., :-1] / total_X[..., None], torch.where(seen_X, top_X + total_X.log(), _EMPTY)


def merge_partials_over_group(out_XD: torch.Tensor, lse_X: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact merge of every rank's partial over its own keys (no autograd): ``(out, lse)``
    over the keys of the whole ``group``, the same on every rank."""
    with torch.no_grad():
        return _merge_over_group(out_XD, lse_X, group, _sum_over_group(group))


def merge_partials_over_group_with_grad(out_XD: torch.Tensor, lse_X: torch.Tensor,
                                        group) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_partials_over_group`` with autograd: the sum is Megatron's
    ``reduce_from_tensor_model_parallel_region`` over ``group``, whose backward is the identity
    (what follows the merge is replicated over the group), so each rank's partial gets the
    gradient of its own share."""
    return _merge_over_group(out_XD, lse_X, group,
                             lambda packed: reduce_from_tensor_model_parallel_region(packed, group=group))


def merge_partials_over_group_own_rows(out_XD: torch.Tensor, lse_X: torch.Tensor,
                                       group) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_partials_over_group`` with autograd when what follows the merge differs by rank
    (the reverse sweep: each rank keeps the rows of its own queries): the sum's backward is an
    all-reduce, so each rank's partial gets the gradient of every rank's rows."""
    return _merge_over_group(out_XD, lse_X, group, lambda packed: dist_nn.all_reduce(packed, group=group))
