"""Full attention over prompt K/V pages sharded over the context-parallel (CP) group.

Each CP rank holds its own pages (``core/collectives.py`` describes the layout). A
rank computes the partial output (normalized over its keys, fp32) and log-sum-exp of the
queries over its own keys; ``partials.merge_partials_over_group`` combines the partials of all
ranks exactly with one all-reduce of the max and one of ``[out * e^(lse - max), e^(lse - max)]``.

- ``cp_capture_attention`` (no autograd): a prompt chunk's queries, all-gathered, over every
  rank's pages plus the chunk's keys causally; returns this rank's rows.
- ``cp_prefix_causal_attention`` (autograd): replicated response queries over every rank's
  pages (no mask) and the response's own keys (causal, computed on every rank), through
  ``prefix_attention_cuda.prefix_attention_parts`` with the CP group. Backward hands each part
  the merged output and log-sum-exp, which gives
  the exact gradient of one softmax; the queries' gradient from the page parts is all-reduced
  over CP, so every rank holds the full CP=1 gradient of the queries, keys and values.

- ``cp_sweep_attention`` (autograd): the reverse sweep's recompute of a prompt chunk
  (``--prompt-gradient exact``), ``cp_capture_attention`` with gradients. Backward all-gathers
  the output gradient of the chunk's rows, so each rank backpropagates every query of the chunk
  through its own part: its pages and its shard's keys and values get their complete gradient
  there, and the chunk queries' gradient, all-reduced over CP, gives each rank its own rows'.

The page parts use the same kernels, folding and autograd as the single-rank GPU path
(``prefix_attention_cuda``: cuDNN / flash on a GPU in 16-bit, ``emulated`` plain torch otherwise,
``partials.kernel_settings``).
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.attention.partials import (
    default_scale, empty_partial, expand_groups, kernel_settings, merge_partials_over_group)
from megatron_longstraw.attention.prefix_attention_cuda import (
    kernel_backward, kernel_forward, merge_prefix_blocks, prefix_attention_parts, prefix_blocks_grads)
from megatron_longstraw.core.collectives import all_gather_rows


@torch.no_grad()
def cp_capture_attention(q_SBHD, k_SBGD, v_SBGD, pages_k_SBGD, pages_v_SBGD,
                         shard_sizes: tuple[int, ...], scale: Optional[float], group,
                         options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """This rank's shard of a prompt chunk: queries ``[s_r, 1, heads, d]``, keys/values
    ``[s_r, 1, groups, d]`` (tokens ``sum(shard_sizes[:r]) ...`` of the chunk) over every rank's
    pages (all visible) and the chunk's keys (causal). Returns ``[s_r, 1, heads, d_v]``."""
    rank = dist.get_rank(group)
    seq, batch, heads, dim = q_SBHD.shape
    if batch != 1:
        raise ValueError(f"context-parallel capture needs a prompt batch of 1, got {batch}")
    scale = default_scale(scale, dim)
    start = sum(shard_sizes[:rank])
    end = start + seq
    q_all_SBHD = torch.cat(all_gather_rows(q_SBHD, shard_sizes, group))
    q_BHSD = q_all_SBHD.permute(1, 2, 0, 3).contiguous()
    backend, block = kernel_settings(q_SBHD, options)
    compute = torch.promote_types(q_SBHD.dtype, torch.float32)
    acc_BHSD, lse_BHS = empty_partial(q_BHSD.shape, compute, q_SBHD.device)
    # own shard of the chunk's keys: the chunk's queries before it see none of them, its own
    # queries see them causally, the later ones see all of them
    if seq > 0:
        k_1GTD, v_1GTD = k_SBGD.permute(1, 2, 0, 3), v_SBGD.permute(1, 2, 0, 3)
        out, lse, _ = kernel_forward(backend, q_BHSD[:, :, start:end].contiguous(),
                                     expand_groups(k_1GTD, heads).contiguous(),
                                     expand_groups(v_1GTD, heads).contiguous(), True, scale)
        acc_BHSD[:, :, start:end], lse_BHS[:, :, start:end] = out, lse
        if end < q_BHSD.shape[2]:
            acc_BHSD[:, :, end:], lse_BHS[:, :, end:], _, _ = merge_prefix_blocks(
                backend, block, q_BHSD[:, :, end:].contiguous(), k_1GTD, v_1GTD, scale,
                acc_BHSD[:, :, end:].contiguous(), lse_BHS[:, :, end:].contiguous())
    if pages_k_SBGD.shape[0] > 0:
        acc_BHSD, lse_BHS, _, _ = merge_prefix_blocks(
            backend, block, q_BHSD, pages_k_SBGD.permute(1, 2, 0, 3), pages_v_SBGD.permute(1, 2, 0, 3),
            scale, acc_BHSD, lse_BHS)
    out_BHSD, _ = merge_partials_over_group(acc_BHSD, lse_BHS, group)
    return out_BHSD[:, :, start:start + seq].to(q_SBHD.dtype).permute(2, 0, 1, 3)


def cp_prefix_causal_attention(q_SBHD, k_SBGD, v_SBGD, pages_k_SBGD, pages_v_SBGD,
                               scale: Optional[float], group,
                               options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """Replicated response queries ``[s, b, heads, d]`` over every CP rank's batch-1 pages
    ``[p_r, 1, groups, d]`` (all visible; a gradient, of this rank's pages, only where they
    require one) and the response keys (causal), with autograd; returns ``[s, b, heads, d_v]``,
    the same on every rank."""
    seq, batch, heads, dim = q_SBHD.shape
    scale = default_scale(scale, dim)
    if pages_k_SBGD.shape[1] != 1:
        raise ValueError("context-parallel replay: the prompt state must have batch 1")
    q_BHSD = q_SBHD.permute(1, 2, 0, 3).contiguous()
    k_BHSD = expand_groups(k_SBGD.permute(1, 2, 0, 3), heads).contiguous()
    v_BHSD = expand_groups(v_SBGD.permute(1, 2, 0, 3), heads).contiguous()
    backend, block = kernel_settings(q_SBHD, options)
    out_BHSD = prefix_attention_parts(q_BHSD, k_BHSD, v_BHSD, pages_k_SBGD.permute(1, 2, 0, 3),
                                      pages_v_SBGD.permute(1, 2, 0, 3), scale, backend, block, group)
    return out_BHSD.permute(2, 0, 1, 3)


class _ShardAttention(torch.autograd.Function):
    """``cp_sweep_attention`` on ``[1, heads or groups, s, d]`` tensors (its docstring)."""

    @staticmethod
    def forward(ctx, q_1HSD, k_1GSD, v_1GSD, pk_1GPD, pv_1GPD, shard_sizes, scale, backend, block, group):
        rank, heads = dist.get_rank(group), q_1HSD.shape[1]
        start = sum(shard_sizes[:rank])
        end = start + q_1HSD.shape[2]
        q_all = torch.cat(all_gather_rows(q_1HSD, shard_sizes, group, dim=2), dim=2).contiguous()
        total = q_all.shape[2]
        compute = torch.promote_types(q_1HSD.dtype, torch.float32)
        acc, lse = empty_partial(q_all.shape[:3] + v_1GSD.shape[3:], compute, q_1HSD.device)
        k_exp, v_exp = (expand_groups(t, heads).contiguous() for t in (k_1GSD, v_1GSD))
        # own shard's keys: none for the chunk's earlier queries, causal for its own, all for the later
        out, own_lse, aux_own = kernel_forward(backend, q_all[:, :, start:end].contiguous(), k_exp, v_exp, True, scale)
        acc[:, :, start:end], lse[:, :, start:end] = out.to(compute), own_lse
        q1_later = q1_pages = None
        aux_later = aux_pages = []
        if end < total:
            acc[:, :, end:], lse[:, :, end:], q1_later, aux_later = merge_prefix_blocks(
                backend, block, q_all[:, :, end:].contiguous(), k_1GSD, v_1GSD, scale,
                acc[:, :, end:].contiguous(), lse[:, :, end:].contiguous())
        if pk_1GPD is not None:
            acc, lse, q1_pages, aux_pages = merge_prefix_blocks(backend, block, q_all, pk_1GPD, pv_1GPD, scale,
                                                                acc, lse)
        out_all, lse_all = merge_partials_over_group(acc, lse, group)
        out_all = out_all.to(q_1HSD.dtype)
        ctx.save_for_backward(q_all, k_1GSD, v_1GSD, k_exp, v_exp, pk_1GPD, pv_1GPD, out_all, lse_all,
                              q1_later, q1_pages)
        ctx.aux = (aux_own, aux_later, aux_pages)
        ctx.rows, ctx.sizes, ctx.scale, ctx.backend, ctx.block, ctx.group = (start, end), shard_sizes, scale, \
            backend, block, group
        return out_all[:, :, start:end].contiguous()

    @staticmethod
    def backward(ctx, grad_1HSD):
        q_all, k, v, k_exp, v_exp, pk, pv, out_all, lse_all, q1_later, q1_pages = ctx.saved_tensors
        aux_own, aux_later, aux_pages = ctx.aux
        (start, end), backend, block, scale = ctx.rows, ctx.backend, ctx.block, ctx.scale
        grad_all = torch.cat(all_gather_rows(grad_1HSD.contiguous(), ctx.sizes, ctx.group, dim=2), dim=2).contiguous()
        rows = slice(start, end)
        dq_all = torch.zeros_like(q_all)
        dq_all[:, :, rows], dk_exp, dv_exp = kernel_backward(
            backend, grad_all[:, :, rows].contiguous(), q_all[:, :, rows].contiguous(), k_exp, v_exp,
            out_all[:, :, rows].contiguous(), lse_all[:, :, rows].contiguous(), aux_own, True, scale)[:3]
        groups = k.shape[1]
        dk = dk_exp.reshape(1, groups, -1, *dk_exp.shape[2:]).sum(2).to(k.dtype)
        dv = dv_exp.reshape(1, groups, -1, *dv_exp.shape[2:]).sum(2).to(v.dtype)
        if q1_later is not None:
            later = slice(end, q_all.shape[2])
            dq_later, dk_later, dv_later = prefix_blocks_grads(
                backend, block, grad_all[:, :, later].contiguous(), q_all[:, :, later].contiguous(), q1_later, k, v,
                out_all[:, :, later].contiguous(), lse_all[:, :, later].contiguous(), aux_later, scale, True, True)
            dq_all[:, :, later] += dq_later
            dk, dv = dk + dk_later, dv + dv_later
        dpk = dpv = None
        if pk is not None:
            dq_pages, dpk, dpv = prefix_blocks_grads(backend, block, grad_all, q_all, q1_pages, pk, pv, out_all,
                                                     lse_all, aux_pages, scale, *ctx.needs_input_grad[3:5])
            dq_all += dq_pages
        dist.all_reduce(dq_all, group=ctx.group)  # every rank's part for every query of the chunk
        return dq_all[:, :, rows], dk, dv, dpk, dpv, None, None, None, None, None


def cp_sweep_attention(q_SBHD, k_SBGD, v_SBGD, pages_k_SBGD, pages_v_SBGD, shard_sizes: tuple[int, ...],
                       scale: Optional[float], group, options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """This rank's shard of a prompt chunk, recomputed with autograd for the reverse sweep: what
    ``cp_capture_attention`` computes (the arguments are the same; ``pages`` are this rank's pages
    before the chunk, a gradient of them where they require one), ``[s_r, 1, heads, d_v]``. The
    gradients of this rank's queries, keys and values, and of its pages, are complete once every
    rank has backpropagated its shard (every rank must)."""
    seq, batch, heads, dim = q_SBHD.shape
    if batch != 1:
        raise ValueError(f"context-parallel prompt sweep needs a prompt batch of 1, got {batch}")
    backend, block = kernel_settings(q_SBHD, options)
    pk = pv = None
    if pages_k_SBGD.shape[0] > 0:
        pk, pv = pages_k_SBGD.permute(1, 2, 0, 3), pages_v_SBGD.permute(1, 2, 0, 3)
    out_1HSD = _ShardAttention.apply(q_SBHD.permute(1, 2, 0, 3).contiguous(), k_SBGD.permute(1, 2, 0, 3),
                                     v_SBGD.permute(1, 2, 0, 3), pk, pv, tuple(shard_sizes),
                                     default_scale(scale, dim), backend, block, group)
    return out_1HSD.permute(2, 0, 1, 3)
