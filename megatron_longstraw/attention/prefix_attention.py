"""Attention of new tokens over a prefix (the prompt state) plus themselves, causally.

``prefix_causal_attention`` is what capture (a prompt chunk over the pages so far) and replay (a
response over the whole prompt) compute. The math path (CPU, and the reference) runs one softmax
over ``[prefix keys; new keys]``. The GPU path splits it into two kernel calls that return the
log-sum-exp, merges them exactly, and in backward hands each part the merged output and LSE, so
gradients equal one global softmax (``prefix_attention_cuda.py``).
"""

from typing import Optional

import torch

from megatron_longstraw.attention.partials import default_scale, expand_groups
from megatron_longstraw.attention.prefix_attention_cuda import prefix_causal_attention_cuda
from megatron_longstraw.config.kernels import KernelOptions


def prefix_causal_attention_math(q_SBHD, k_SBGD, v_SBGD, prefix_k_SBGD=None, prefix_v_SBGD=None,
                                 scale: Optional[float] = None) -> torch.Tensor:
    """Reference: explicit fp32 (fp64 for fp64 inputs) softmax over ``[prefix; new]`` keys; returns ``[s, b, h, d_v]``.

    A prefix with batch 1 is shared by every query sample (G responses of one prompt).
    """
    seq, batch, heads, dim = q_SBHD.shape
    scale = default_scale(scale, dim)
    compute = torch.promote_types(q_SBHD.dtype, torch.float32)
    q = q_SBHD.permute(1, 2, 0, 3).to(compute)
    k = expand_groups(k_SBGD.permute(1, 2, 0, 3).to(compute), heads)
    v = expand_groups(v_SBGD.permute(1, 2, 0, 3).to(compute), heads)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    if prefix_k_SBGD is not None and prefix_k_SBGD.shape[0] > 0:
        pk = expand_groups(prefix_k_SBGD.permute(1, 2, 0, 3).to(compute), heads).expand(batch, -1, -1, -1)
        pv = expand_groups(prefix_v_SBGD.permute(1, 2, 0, 3).to(compute), heads).expand(batch, -1, -1, -1)
        k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
        prefix_mask = torch.ones(seq, pk.shape[2], dtype=torch.bool, device=q.device)
        mask = torch.cat([prefix_mask, mask], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    out_BHSD = probs @ v
    return out_BHSD.permute(2, 0, 1, 3).to(q_SBHD.dtype)


def prefix_causal_attention(q_SBHD, k_SBGD, v_SBGD, prefix_k_SBGD=None, prefix_v_SBGD=None,
                            scale: Optional[float] = None,
                            options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """New-token queries ``[s, b, h, d]`` over prefix keys (all visible) and new keys (causal).

    ``prefix_k/v`` are ``[p, b or 1, groups, d]``; gradients flow to the new queries, keys and
    values, and to the prefix where it requires grad (a detached prefix gets none, at no extra
    cost on the fused path). Returns ``[s, b, h, d_v]``. On a GPU, or anywhere with
    ``options.attention_backend == "emulated"`` (tests), the fused path runs.
    """
    if q_SBHD.is_cuda or options.attention_backend == "emulated":
        return prefix_causal_attention_cuda(q_SBHD, k_SBGD, v_SBGD, prefix_k_SBGD, prefix_v_SBGD, scale, options)
    return prefix_causal_attention_math(q_SBHD, k_SBGD, v_SBGD, prefix_k_SBGD, prefix_v_SBGD, scale)
