"""A capture chunk's attention computed exactly enough to judge FP8 kernels by, at any prompt
length: fp32 (fp64 for fp64 inputs) with TF32 off, by blocks of keys with an online softmax, for
any subset of the chunk's query rows (a million keys times a 32K-query chunk is too much to
recompute whole; the rows that are checked are enough).

Its own loop on purpose: the code under test merges its partials with
``attention/partials.merge_partials``, and ``prefix_causal_attention_math`` materializes every
score, which does not fit at a million keys.
"""

from typing import Optional, Sequence

import torch


def exact_chunk_attention(q_SBHD: torch.Tensor, k_SBGD: torch.Tensor, v_SBGD: torch.Tensor,
                          prefix_k_SBGD: Optional[torch.Tensor] = None, prefix_v_SBGD: Optional[torch.Tensor] = None,
                          rows: Optional[Sequence[int]] = None, scale: Optional[float] = None,
                          key_block: int = 131072) -> torch.Tensor:
    """The chunk's queries ``[s, 1, h, d]`` (those at ``rows``, default all) over every page
    ``[p, 1, groups, d]`` and causally over the chunk's keys ``[s, 1, groups, d]`` (row ``r`` sees
    the pages and the chunk's keys ``0..r``; GQA: query head ``i`` reads group ``i // (h / groups)``).
    Returns ``[len(rows), 1, h, d_v]`` in fp32 (fp64 for fp64 inputs)."""
    seq, batch, heads, dim = q_SBHD.shape
    assert batch == 1, "one prompt"
    compute = torch.float64 if q_SBHD.dtype == torch.float64 else torch.float32
    scale = dim ** -0.5 if scale is None else scale
    device = q_SBHD.device
    rows_R = torch.arange(seq, device=device) if rows is None else torch.as_tensor(rows, device=device)
    pages = 0 if prefix_k_SBGD is None else prefix_k_SBGD.shape[0]
    keys_TGD = k_SBGD[:, 0] if not pages else torch.cat([prefix_k_SBGD[:, 0], k_SBGD[:, 0]])
    values_TGD = v_SBGD[:, 0] if not pages else torch.cat([prefix_v_SBGD[:, 0], v_SBGD[:, 0]])
    rep = heads // keys_TGD.shape[1]
    q_HRD = q_SBHD[rows_R, 0].to(compute).transpose(0, 1)
    visible_to_R = pages + rows_R + 1  # keys before this position are visible
    top_HR = torch.full(q_HRD.shape[:2], float("-inf"), dtype=compute, device=device)
    total_HR = torch.zeros(q_HRD.shape[:2], dtype=compute, device=device)
    acc_HRD = torch.zeros(*q_HRD.shape[:2], v_SBGD.shape[-1], dtype=compute, device=device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            for k0 in range(0, int(visible_to_R.max()), key_block):
                k_HTD = keys_TGD[k0:k0 + key_block].to(compute).repeat_interleave(rep, 1).transpose(0, 1)
                v_HTD = values_TGD[k0:k0 + key_block].to(compute).repeat_interleave(rep, 1).transpose(0, 1)
                scores_HRT = (q_HRD @ k_HTD.transpose(1, 2)) * scale
                position_T = k0 + torch.arange(k_HTD.shape[1], device=device)
                scores_HRT = scores_HRT.masked_fill(position_T[None, None, :] >= visible_to_R[None, :, None],
                                                    float("-inf"))
                new_top_HR = torch.maximum(top_HR, scores_HRT.amax(-1))
                probs_HRT = (scores_HRT - new_top_HR[..., None]).exp()
                keep_HR = (top_HR - new_top_HR).exp()
                acc_HRD = acc_HRD * keep_HR[..., None] + probs_HRT @ v_HTD
                total_HR = total_HR * keep_HR + probs_HRT.sum(-1)
                top_HR = new_top_HR
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return (acc_HRD / total_HR[..., None]).transpose(0, 1)[:, None]
