"""Full attention over prompt K/V pages sharded over the context-parallel (CP) group.

Each CP rank holds its own pages (``longstraw/context_parallel.py`` describes the layout). A
rank computes the partial output (normalized over its keys, fp32) and log-sum-exp of the
queries over its own keys; ``cp_merge`` combines the partials of all ranks exactly with one
all-reduce of the max and one of ``[out * e^(lse - max), e^(lse - max)]``.

- ``cp_capture_attention`` (no autograd): a prompt chunk's queries, all-gathered, over every
  rank's pages plus the chunk's keys causally; returns this rank's rows.
- ``cp_prefix_causal_attention`` (autograd): replicated response queries over every rank's
  pages (no mask) and the response's own keys (causal, computed on every rank). Backward hands
  each part the merged output and log-sum-exp (as ``prefix_attention_cuda`` does), which gives
  the exact gradient of one softmax; the queries' gradient from the page parts is all-reduced
  over CP, so every rank holds the full CP=1 gradient of the queries, keys and values.

The page parts use the same kernels and folding as the single-rank GPU path
(``merge_prefix_blocks``: cuDNN / flash on a GPU in 16-bit, ``emulated`` plain torch otherwise).
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron_longstraw.attention.prefix_attention_cuda import (
    _backward, _forward, merge_prefix_blocks, prefix_blocks_dq, prefix_kernel_settings)
from megatron_longstraw.longstraw.context_parallel import all_gather_rows


def _kernel_settings(q: torch.Tensor) -> tuple[str, int]:
    backend, block = prefix_kernel_settings()
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        backend = "emulated"  # fused kernels: 16-bit on a GPU only
    return backend, block


def cp_merge(out_BHSD: torch.Tensor, lse_BHS: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of every CP rank's partial ``(out, lse)`` (no autograd); rows a rank cannot
    see have ``lse = -inf``. Returns the global ``(out, lse)``, the same on every rank."""
    max_BHS = lse_BHS.clone()
    dist.all_reduce(max_BHS, op=dist.ReduceOp.MAX, group=group)
    max_BHS = torch.where(torch.isfinite(max_BHS), max_BHS, torch.zeros_like(max_BHS))
    weight_BHS = (lse_BHS - max_BHS).exp()  # 0 where this rank sees no key
    packed = torch.cat([out_BHSD * weight_BHS[..., None], weight_BHS[..., None]], dim=-1)
    dist.all_reduce(packed, group=group)
    total_BHS = packed[..., -1]
    return packed[..., :-1] / total_BHS[..., None], max_BHS + total_BHS.log()


@torch.no_grad()
def cp_capture_attention(q_SBHD, k_SBGD, v_SBGD, pages_k_SBGD, pages_v_SBGD,
                         shard_sizes: tuple[int, ...], scale: Optional[float], group) -> torch.Tensor:
    """This rank's shard of a prompt chunk: queries ``[s_r, 1, heads, d]``, keys/values
    ``[s_r, 1, groups, d]`` (tokens ``sum(shard_sizes[:r]) ...`` of the chunk) over every rank's
    pages (all visible) and the chunk's keys (causal). Returns ``[s_r, 1, heads, d_v]``."""
    rank = dist.get_rank(group)
    seq, batch, heads, dim = q_SBHD.shape
    if batch != 1:
        raise ValueError(f"context-parallel capture needs a prompt batch of 1, got {batch}")
    scale = dim ** -0.5 if scale is None else scale
    start = sum(shard_sizes[:rank])
    end = start + seq
    q_all_SBHD = torch.cat(all_gather_rows(q_SBHD, shard_sizes, group))
    q_BHSD = q_all_SBHD.permute(1, 2, 0, 3).contiguous()
    backend, block = _kernel_settings(q_SBHD)
    compute = torch.promote_types(q_SBHD.dtype, torch.float32)
    acc_BHSD = q_BHSD.new_zeros(q_BHSD.shape, dtype=compute)
    lse_BHS = torch.full(q_BHSD.shape[:3], float("-inf"), dtype=compute, device=q_SBHD.device)
    # own shard of the chunk's keys: the chunk's queries before it see none of them, its own
    # queries see them causally, the later ones see all of them
    if seq > 0:
        k_1GTD, v_1GTD = k_SBGD.permute(1, 2, 0, 3), v_SBGD.permute(1, 2, 0, 3)
        per_group = heads // k_1GTD.shape[1]
        out, lse, _ = _forward(backend, q_BHSD[:, :, start:end].contiguous(),
                               k_1GTD.repeat_interleave(per_group, dim=1).contiguous(),
                               v_1GTD.repeat_interleave(per_group, dim=1).contiguous(), True, scale)
        acc_BHSD[:, :, start:end], lse_BHS[:, :, start:end] = out, lse
        if end < q_BHSD.shape[2]:
            acc_BHSD[:, :, end:], lse_BHS[:, :, end:], _, _ = merge_prefix_blocks(
                backend, block, q_BHSD[:, :, end:].contiguous(), k_1GTD, v_1GTD, scale,
                acc_BHSD[:, :, end:].contiguous(), lse_BHS[:, :, end:].contiguous())
    if pages_k_SBGD.shape[0] > 0:
        acc_BHSD, lse_BHS, _, _ = merge_prefix_blocks(
            backend, block, q_BHSD, pages_k_SBGD.permute(1, 2, 0, 3), pages_v_SBGD.permute(1, 2, 0, 3),
            scale, acc_BHSD, lse_BHS)
    out_BHSD, _ = cp_merge(acc_BHSD, lse_BHS, group)
    return out_BHSD[:, :, start:start + seq].to(q_SBHD.dtype).permute(2, 0, 1, 3)


class _CPPrefixCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSD, k_BHSD, v_BHSD, pk_1GPD, pv_1GPD, scale, group):
        backend, block = _kernel_settings(q_BHSD)
        out_own, lse_own, aux_own = _forward(backend, q_BHSD, k_BHSD, v_BHSD, True, scale)
        compute = torch.promote_types(q_BHSD.dtype, torch.float32)
        acc = torch.zeros(q_BHSD.shape, dtype=compute, device=q_BHSD.device)
        lse = torch.full(q_BHSD.shape[:3], float("-inf"), dtype=compute, device=q_BHSD.device)
        acc, lse, q1, aux_pages = merge_prefix_blocks(backend, block, q_BHSD, pk_1GPD, pv_1GPD, scale,
                                                      acc, lse)
        acc, lse = cp_merge(acc, lse, group)  # every rank's pages
        merged = torch.logaddexp(lse_own.to(compute), lse)
        out = (out_own.to(compute) * (lse_own - merged).exp()[..., None]
               + acc * (lse - merged).exp()[..., None]).to(q_BHSD.dtype)
        ctx.save_for_backward(q_BHSD, k_BHSD, v_BHSD, pk_1GPD, pv_1GPD, out, merged, q1)
        ctx.aux = (aux_own, aux_pages)
        ctx.scale, ctx.backend, ctx.block, ctx.group = scale, backend, block, group
        return out

    @staticmethod
    def backward(ctx, grad_BHSD):
        q, k, v, pk, pv, out, lse, q1 = ctx.saved_tensors
        aux_own, aux_pages = ctx.aux
        grad_BHSD = grad_BHSD.contiguous()
        dq, dk, dv = _backward(ctx.backend, grad_BHSD, q, k, v, out, lse, aux_own, True, ctx.scale)[:3]
        dq_pages = prefix_blocks_dq(ctx.backend, ctx.block, grad_BHSD, q, q1, pk, pv, out, lse, aux_pages,
                                    ctx.scale)
        dist.all_reduce(dq_pages, group=ctx.group)  # the pages of every CP rank
        return dq + dq_pages, dk, dv, None, None, None, None


def cp_prefix_causal_attention(q_SBHD, k_SBGD, v_SBGD, pages_k_SBGD, pages_v_SBGD,
                               scale: Optional[float], group) -> torch.Tensor:
    """Replicated response queries ``[s, b, heads, d]`` over every CP rank's batch-1 pages
    ``[p_r, 1, groups, d]`` (all visible, no gradient) and the response keys (causal), with
    autograd; returns ``[s, b, heads, d_v]``, the same on every rank."""
    seq, batch, heads, dim = q_SBHD.shape
    scale = dim ** -0.5 if scale is None else scale
    if pages_k_SBGD.shape[1] != 1:
        raise ValueError("context-parallel replay: the prompt state must have batch 1")
    groups = k_SBGD.shape[2]
    q_BHSD = q_SBHD.permute(1, 2, 0, 3).contiguous()
    k_BHSD = k_SBGD.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1).contiguous()
    v_BHSD = v_SBGD.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1).contiguous()
    out_BHSD = _CPPrefixCausalAttention.apply(q_BHSD, k_BHSD, v_BHSD, pages_k_SBGD.permute(1, 2, 0, 3),
                                              pages_v_SBGD.permute(1, 2, 0, 3), scale, group)
    return out_BHSD.permute(2, 0, 1, 3)
