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

The page parts use the same kernels, folding and autograd as the single-rank GPU path
(``prefix_attention_cuda``: cuDNN / flash on a GPU in 16-bit, ``emulated`` plain torch otherwise,
``partials.kernel_settings``).
"""

from typing import Optional

import torch
import torch.distributed as dist

from megatron_longstraw.attention.kernel_options import KernelOptions
from megatron_longstraw.attention.partials import (
    default_scale, empty_partial, expand_groups, kernel_settings, merge_partials_over_group)
from megatron_longstraw.attention.prefix_attention_cuda import (
    kernel_forward, merge_prefix_blocks, prefix_attention_parts)
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
