"""Decode-time attention: the newest token(s) of G samples over one shared prompt plus their own keys.

The keys a decoded token sees are, in order: the prompt's K/V pages (``[p, 1, groups, d]``,
captured once and shared by every sample), then the sample's own keys ``[t, b, groups, d]``
(its earlier generated tokens and, last, the new ones; causal with bottom-right alignment:
the ``i``-th of ``s`` new queries sees own keys ``0 .. t - s + i``). The two parts are computed
separately and merged exactly by log-sum-exp. The prompt part folds every sample's queries that
share a KV group into one query sequence over the batch-1 pages (``merge_prefix_blocks``, the
same kernels and blocking as replay's GPU path; plain torch on the CPU), so the pages are never
expanded or copied per sample. The own-key part is small (``t`` is at most the response length)
and runs in plain fp32 torch.

Context parallelism (``longstraw/context_parallel.py``): every CP rank decodes the same samples
(replicated tokens and own keys) and holds its shard of the prompt pages. With ``cp_group`` the
prompt part is computed over this rank's pages only and merged over the CP group with
``cp_merge`` (every rank then has the attention over the whole prompt); the own-key part, which
every rank computes identically, is merged in locally *after* the global merge, so it is counted
exactly once.
"""

from typing import Optional

import torch

from megatron_longstraw.attention.cp_attention import cp_merge
from megatron_longstraw.attention.prefix_attention_cuda import merge_prefix_blocks, prefix_kernel_settings


def _own_keys_part(q_BHSD, k_BGTD, v_BGTD, scale):
    """fp32 output and log-sum-exp of the queries over the sample's own keys, bottom-right causal."""
    heads, groups = q_BHSD.shape[1], k_BGTD.shape[1]
    seq, keys = q_BHSD.shape[2], k_BGTD.shape[2]
    compute = torch.promote_types(q_BHSD.dtype, torch.float32)
    k_BHTD = k_BGTD.to(compute).repeat_interleave(heads // groups, dim=1)
    v_BHTD = v_BGTD.to(compute).repeat_interleave(heads // groups, dim=1)
    scores_BHST = (q_BHSD.to(compute) @ k_BHTD.transpose(-1, -2)) * scale
    visible_ST = torch.ones(seq, keys, dtype=torch.bool, device=q_BHSD.device).tril(keys - seq)
    scores_BHST = scores_BHST.masked_fill(~visible_ST, float("-inf"))
    lse_BHS = scores_BHST.logsumexp(-1)
    return (scores_BHST - lse_BHS[..., None]).exp() @ v_BHTD, lse_BHS


def _prompt_settings(q_SBHD: torch.Tensor) -> tuple[str, int]:
    backend, block = prefix_kernel_settings()
    if not q_SBHD.is_cuda or q_SBHD.dtype not in (torch.float16, torch.bfloat16):
        backend = "emulated"  # the kernels' interface in plain torch (fused kernels: 16-bit only)
    return backend, block


@torch.no_grad()
def decode_attention(q_SBHD: torch.Tensor, k_SBGD: torch.Tensor, v_SBGD: torch.Tensor,
                     prompt_k_SBGD: Optional[torch.Tensor], prompt_v_SBGD: Optional[torch.Tensor],
                     scale: Optional[float] = None, cp_group=None) -> torch.Tensor:
    """Attention of the newest ``s`` tokens' queries ``[s, b, heads, d]`` over the shared prompt keys
    ``[p, 1, groups, d]`` (all visible) and the samples' own keys ``[t, b, groups, d]`` (``t >= s``,
    the last ``s`` being the queries' own tokens). Returns ``[s, b, heads, d_v]``; no autograd.

    With ``cp_group`` (context parallelism) the prompt keys are this rank's shard of the pages;
    the queries and own keys must be the same on every rank of the group (see the module doc).
    """
    seq, batch, heads, dim = q_SBHD.shape
    assert k_SBGD.shape[0] >= seq and k_SBGD.shape[1] == batch, (k_SBGD.shape, q_SBHD.shape)
    scale = dim ** -0.5 if scale is None else scale
    q_BHSD = q_SBHD.permute(1, 2, 0, 3)
    acc_BHSD, lse_BHS = _own_keys_part(q_BHSD, k_SBGD.permute(1, 2, 0, 3), v_SBGD.permute(1, 2, 0, 3), scale)
    has_pages = prompt_k_SBGD is not None and prompt_k_SBGD.shape[0] > 0
    if has_pages:
        assert prompt_k_SBGD.shape[1] == 1, "the shared prompt state must have batch 1"
    if cp_group is not None:
        # this rank's pages from an empty accumulator, merged over the CP group, then the own keys
        prompt_acc = torch.zeros_like(acc_BHSD)
        prompt_lse = torch.full_like(lse_BHS, float("-inf"))
        if has_pages:
            backend, block = _prompt_settings(q_SBHD)
            prompt_acc, prompt_lse, _, _ = merge_prefix_blocks(
                backend, block, q_BHSD.contiguous(), prompt_k_SBGD.permute(1, 2, 0, 3),
                prompt_v_SBGD.permute(1, 2, 0, 3), scale, prompt_acc, prompt_lse)
        prompt_acc, prompt_lse = cp_merge(prompt_acc, prompt_lse, cp_group)  # every rank's pages
        merged_BHS = torch.logaddexp(lse_BHS, prompt_lse)
        acc_BHSD = (acc_BHSD * (lse_BHS - merged_BHS).exp()[..., None]
                    + prompt_acc * (prompt_lse - merged_BHS).exp()[..., None])
    elif has_pages:
        backend, block = _prompt_settings(q_SBHD)
        acc_BHSD, lse_BHS, _, _ = merge_prefix_blocks(
            backend, block, q_BHSD.contiguous(), prompt_k_SBGD.permute(1, 2, 0, 3),
            prompt_v_SBGD.permute(1, 2, 0, 3), scale, acc_BHSD, lse_BHS)
    return acc_BHSD.to(q_SBHD.dtype).permute(2, 0, 1, 3)
