"""GPU path of ``prefix_causal_attention``: fused-attention calls merged by log-sum-exp.

Part 1: every new query over the prefix (the prompt state), no mask, in blocks of at most
``KernelOptions.prefix_block`` keys (``--prefix-block``, default 262,144). All query heads of a
KV group and all samples of the micro-batch share the same prefix keys, so they are folded into
the query length (``[1, groups, samples * heads_per_group * s, d]``): no copy or head expansion
of the prompt pages. Part 2: the new tokens over themselves, causal (small). Outputs merge
exactly with their log-sum-exps (``partials.merge_partials``). Backward runs each part's fused
backward with the *merged* output and log-sum-exp, which yields exactly the gradient of one
softmax over all parts. The prefix keys/values get a gradient only when they require one: a
prefix block's dK/dV of the folded call is then exactly the gradient of that block of the
batch-1 prefix (every folded query shares it) and is written into its slice of one
preallocated gradient; otherwise the parts' dK/dV are discarded (blocking bounds those
transients) and nothing more is kept.

With a process group (context parallelism, ``cp_attention``) the prefix is this rank's pages:
their part is merged over the group before the new tokens' part joins it, and the queries'
gradient from the pages is all-reduced over the group. The pages' own gradient (when they
require one) is that of this rank's pages alone, with no reduction: the queries and the
upstream gradient are the same on every rank.

Kernels: cuDNN SDPA (fastest on Hopper at head dim 128/256) or flash SDPA, both from torch and
both returning the log-sum-exp; ``KernelOptions.attention_backend`` (``--attention-backend
cudnn|flash``) chooses. ``emulated`` runs the same kernel interface in plain torch, so the
folding, blocking and merge logic is tested on a CPU (``tests/test_prefix_attention.py``).
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.attention.partials import (
    default_scale, empty_partial, expand_groups, kernel_settings, merge_partials, merge_partials_over_group,
    softmax_partial)


def _emulated_scores(q, k, causal, scale):
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _kernel(backend, q, k):
    """The kernel for one part: cuDNN's backward rejects ``s_q = s_kv = 1`` (a response of one
    token over itself), so that part runs on flash, forward and backward alike."""
    if backend == "cudnn" and q.shape[-2] == 1 and k.shape[-2] == 1:
        return "flash"
    return backend


def kernel_forward(backend, q, k, v, causal, scale):
    """One part on the ``backend`` kernel: ``(out_BHSD, lse_BHS, aux)`` of the queries
    ``[b, h, s_q, d]`` over the keys/values ``[b, h, s_k, d]`` (causal: top-left aligned), with
    the kernel's bookkeeping ``aux`` for ``kernel_backward``."""
    backend = _kernel(backend, q, k)
    if backend == "emulated":
        scores = _emulated_scores(q, k, causal, scale)
        probs, lse = softmax_partial(scores)
        return (probs @ v.to(scores.dtype)).to(q.dtype), lse, None
    if backend == "cudnn":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale)
    else:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3]), (cum_q, cum_k, max_q, max_k, seed, offset)


def kernel_backward(backend, grad, q, k, v, out, lse, aux, causal, scale):
    """(dq, dk, dv) of one ``kernel_forward`` part, given the merged output and log-sum-exp
    (which makes them the gradients of one softmax over every part)."""
    backend = _kernel(backend, q, k)
    if backend == "emulated":
        scores = _emulated_scores(q, k, causal, scale)
        probs = (scores - lse[..., None]).exp()
        grad, v_, q_, k_ = (t.to(scores.dtype) for t in (grad, v, q, k))
        dprobs = grad @ v_.transpose(-1, -2)
        delta = (grad * out.to(scores.dtype)).sum(-1, keepdim=True)
        dscores = probs * (dprobs - delta)
        return ((dscores @ k_) * scale).to(q.dtype), ((dscores.transpose(-1, -2) @ q_) * scale).to(k.dtype), \
            (probs.transpose(-1, -2) @ grad).to(v.dtype)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    if backend == "cudnn":
        lse = lse.reshape(*lse.shape, 1) if lse.dim() == 3 else lse
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def fold_groups(x_BHSD, groups):
    """[b, h, s, d] -> [1, groups, b * (h / groups) * s, d] (queries sharing one KV group)."""
    b, h, s, d = x_BHSD.shape
    return x_BHSD.reshape(b, groups, h // groups, s, d).transpose(0, 1).reshape(1, groups, -1, d)


def unfold_groups(x_1GND, shape_BHSD):
    b, h, s, d = shape_BHSD
    groups = x_1GND.shape[1]
    return x_1GND.reshape(groups, b, h // groups, s, -1).transpose(0, 1).reshape(b, h, s, -1)


def _blocks(pk_1GPD, block):
    return [(start, min(start + block, pk_1GPD.shape[2])) for start in range(0, pk_1GPD.shape[2], block)]


def merge_prefix_blocks(backend, block, q_BHSD, pk_1GPD, pv_1GPD, scale, acc_BHSD, lse_BHS):
    """Fold ``q_BHSD`` over the batch-1 prefix ``pk/pv_1GPD`` (no mask) ``block`` keys at a time and
    merge each block into the running output ``acc_BHSD`` (fp32) and log-sum-exp ``lse_BHS``.

    Returns ``(acc, lse, q1, aux_per_block)``: ``q1`` is the folded query and ``aux_per_block``
    the kernels' bookkeeping, both for the backward. The prefix is never expanded or copied per
    sample or head: the queries that share a KV group are folded into one query sequence.
    """
    groups = pk_1GPD.shape[1]
    q1 = fold_groups(q_BHSD, groups)
    aux_prefix = []
    for start, end in _blocks(pk_1GPD, block):
        out_b, lse_b, aux = kernel_forward(backend, q1, pk_1GPD[:, :, start:end], pv_1GPD[:, :, start:end],
                                           False, scale)
        aux_prefix.append(aux)
        out_b = unfold_groups(out_b, q_BHSD.shape)
        lse_b = unfold_groups(lse_b.unsqueeze(-1), q_BHSD.shape).squeeze(-1)
        acc_BHSD, lse_BHS = merge_partials(acc_BHSD, lse_BHS, out_b, lse_b)
    return acc_BHSD, lse_BHS, q1, aux_prefix


class _PrefixCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSD, k_BHSD, v_BHSD, pk_1GPD, pv_1GPD, scale, backend, block, group):
        out, lse, aux_new = kernel_forward(backend, q_BHSD, k_BHSD, v_BHSD, True, scale)
        q1, aux_prefix = None, []
        compute = torch.promote_types(out.dtype, torch.float32)
        if group is not None:  # this rank's pages from empty, merged over the group, then the new keys
            pages = empty_partial(q_BHSD.shape[:3] + v_BHSD.shape[3:], compute, q_BHSD.device)
            acc, pages_lse, q1, aux_prefix = merge_prefix_blocks(backend, block, q_BHSD, pk_1GPD, pv_1GPD, scale,
                                                                 *pages)
            acc, lse = merge_partials(out, lse, *merge_partials_over_group(acc, pages_lse, group))
            out = acc.to(q_BHSD.dtype)
        elif pk_1GPD is not None:
            acc, lse, q1, aux_prefix = merge_prefix_blocks(backend, block, q_BHSD, pk_1GPD, pv_1GPD, scale,
                                                           out.to(compute), lse)
            out = acc.to(q_BHSD.dtype)
        ctx.save_for_backward(q_BHSD, k_BHSD, v_BHSD, pk_1GPD, pv_1GPD, out, lse, q1)
        ctx.aux = (aux_new, aux_prefix)
        ctx.scale, ctx.backend, ctx.block, ctx.group = scale, backend, block, group
        return out

    @staticmethod
    def backward(ctx, grad_BHSD):
        q, k, v, pk, pv, out, lse, q1 = ctx.saved_tensors
        aux_new, aux_prefix = ctx.aux
        grad_BHSD = grad_BHSD.contiguous()
        dq, dk, dv = kernel_backward(ctx.backend, grad_BHSD, q, k, v, out, lse, aux_new, True, ctx.scale)[:3]
        dpk = dpv = None
        if pk is not None:
            dq_prefix, dpk, dpv = prefix_blocks_grads(ctx.backend, ctx.block, grad_BHSD, q, q1, pk, pv, out, lse,
                                                      aux_prefix, ctx.scale, *ctx.needs_input_grad[3:5])
            if ctx.group is not None:
                dist.all_reduce(dq_prefix, group=ctx.group)  # the pages of every rank (dpk/dpv: this rank's own)
            dq = dq + dq_prefix
        return dq, dk, dv, dpk, dpv, None, None, None, None


def prefix_attention_parts(q_BHSD, k_BHSD, v_BHSD, pk_1GPD, pv_1GPD, scale: float, backend: str, block: int,
                           group=None) -> torch.Tensor:
    """The fused path with autograd on ``[b, h, s, d]`` tensors: the queries over the batch-1
    prefix ``pk/pv_1GPD`` (``[1, groups, p, d]`` or None; no mask; a gradient only where they
    require one) and over the new keys/values ``[b, h, s, d]`` (causal), merged exactly. With
    ``group`` the prefix is this rank's share of the prefix keys, merged over the group; the
    result and the gradients of the queries, keys and values are then the same on every rank,
    and the prefix's gradient is that of this rank's share. Returns ``[b, h, s, d_v]``."""
    assert group is None or pk_1GPD is not None, "a group merge needs this rank's pages"
    return _PrefixCausalAttention.apply(q_BHSD, k_BHSD, v_BHSD, pk_1GPD, pv_1GPD, scale, backend, block, group)


def prefix_blocks_grads(backend, block, grad_BHSD, q_BHSD, q1, pk_1GPD, pv_1GPD, out_BHSD, lse_BHS, aux_blocks,
                        scale, want_dpk: bool = False, want_dpv: bool = False):
    """The gradients ``(dq [b, h, s, d], dpk, dpv)`` of the prefix part, block by block, given the
    merged output and log-sum-exp (the forward's ``merge_prefix_blocks`` folded queries and saved
    ``aux``). ``dpk``/``dpv`` (``[1, groups, p, d]``, the prefix's dtype and layout) are None unless
    wanted; each block's dK/dV of the folded call is written into its slice (the blocks are
    disjoint, so each entry is written once, as the kernel rounded it)."""
    groups = pk_1GPD.shape[1]
    grad1, out1 = fold_groups(grad_BHSD, groups), fold_groups(out_BHSD, groups)
    lse1 = fold_groups(lse_BHS.unsqueeze(-1), groups).squeeze(-1).contiguous()
    dq = torch.zeros_like(q_BHSD)
    dpk_1GPD = torch.zeros_like(pk_1GPD) if want_dpk else None
    dpv_1GPD = torch.zeros_like(pv_1GPD) if want_dpv else None
    for (start, end), aux in zip(_blocks(pk_1GPD, block), aux_blocks):
        dq1, dk1, dv1 = kernel_backward(backend, grad1, q1, pk_1GPD[:, :, start:end], pv_1GPD[:, :, start:end],
                                        out1, lse1, aux, False, scale)[:3]
        dq = dq + unfold_groups(dq1, q_BHSD.shape)
        if dpk_1GPD is not None:
            dpk_1GPD[:, :, start:end] = dk1
        if dpv_1GPD is not None:
            dpv_1GPD[:, :, start:end] = dv1
    return dq, dpk_1GPD, dpv_1GPD


def prefix_blocks_dq(backend, block, grad_BHSD, q_BHSD, q1, pk_1GPD, pv_1GPD, out_BHSD, lse_BHS, aux_blocks,
                     scale) -> torch.Tensor:
    """The query gradient ``[b, h, s, d]`` of the prefix part, block by block, given the merged
    output and log-sum-exp (the forward's ``merge_prefix_blocks`` folded queries and saved ``aux``)."""
    return prefix_blocks_grads(backend, block, grad_BHSD, q_BHSD, q1, pk_1GPD, pv_1GPD, out_BHSD, lse_BHS,
                               aux_blocks, scale)[0]


def prefix_causal_attention_cuda(q_SBHD, k_SBGD, v_SBGD, prefix_k_SBGD=None, prefix_v_SBGD=None,
                                 scale: Optional[float] = None,
                                 options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """See ``prefix_attention.prefix_causal_attention``; returns ``[s, b, h, d_v]``. The kernels
    are ``options.attention_backend``'s for 16-bit queries on a GPU, else the emulated ones
    (``partials.kernel_settings``), the prefix runs in blocks of ``options.prefix_block``; a
    prefix that requires grad gets its gradient through the ``[1, groups, p, d]`` views."""
    seq, batch, heads, dim = q_SBHD.shape
    scale = default_scale(scale, dim)
    q_BHSD = q_SBHD.permute(1, 2, 0, 3)
    k_BHSD = expand_groups(k_SBGD.permute(1, 2, 0, 3), heads)
    v_BHSD = expand_groups(v_SBGD.permute(1, 2, 0, 3), heads)
    pk = pv = None
    if prefix_k_SBGD is not None and prefix_k_SBGD.shape[0] > 0:
        if prefix_k_SBGD.shape[1] != 1:
            raise ValueError("prefix attention (GPU): the prompt state must have batch 1")
        pk = prefix_k_SBGD.permute(1, 2, 0, 3)
        pv = prefix_v_SBGD.permute(1, 2, 0, 3)
    backend, block = kernel_settings(q_SBHD, options)  # fp32 queries: the emulated kernel (no fused fp32)
    out_BHSD = prefix_attention_parts(q_BHSD.contiguous(), k_BHSD.contiguous(), v_BHSD.contiguous(), pk, pv, scale,
                                      backend, block)
    return out_BHSD.permute(2, 0, 1, 3)
