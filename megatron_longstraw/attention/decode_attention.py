"""Decode-time attention: the newest token(s) of G samples over one shared prompt plus their own keys.

The keys a decoded token sees are, in order: the prompt's K/V pages (``[p, 1, groups, d]``,
captured once and shared by every sample), then the sample's own keys ``[t, b, groups, d]``
(its earlier generated tokens and, last, the new ones; causal with bottom-right alignment:
the ``i``-th of ``s`` new queries sees own keys ``0 .. t - s + i``). The two parts are computed
separately and merged exactly by log-sum-exp. The prompt part folds every sample's queries that
share a KV group into one query sequence over the batch-1 pages (the fused kernels of replay's
GPU path; plain torch on the CPU), so the pages are never expanded or copied per sample. A
step's queries are few (G x heads per group), and a fused kernel spreads its work over query
blocks and heads, so one call over the pages would keep only a few multiprocessors reading
them; the pages are instead viewed as splits of at least ``decode_split_keys`` keys, one per
batch entry of a single call, and the splits' partials merged by log-sum-exp (as
flash-decoding does). The own-key part is small (``t`` is at most the response length)
and runs in plain fp32 torch; on a GPU, for one query per sample without CP, it runs with the
merge of the splits' partials and the cast in one Triton kernel (``decode_merge_triton``), where
torch takes about forty small kernels a layer.

Context parallelism (``core/collectives.py``): every CP rank decodes the same samples
(replicated tokens and own keys) and holds its shard of the prompt pages. With ``cp_group`` the
prompt part is computed over this rank's pages only and merged over the CP group with
``partials.merge_partials_over_group`` (every rank then has the attention over the whole
prompt); the own-key part, which every rank computes identically, is merged in locally *after*
the global merge, so it is counted exactly once.
"""

from typing import Optional

import torch

from megatron_longstraw.attention.decode_merge_triton import decode_merge
from megatron_longstraw.attention.kernel_options import MAX_DECODE_SPLITS
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.attention.partials import (
    default_scale, empty_partial, expand_groups, kernel_settings, merge_partials, merge_partials_over_group,
    merge_stacked_partials, softmax_partial)
from megatron_longstraw.attention.prefix_attention_cuda import fold_groups, kernel_forward, unfold_groups


def _own_keys_part(q_BHSD, k_BGTD, v_BGTD, scale, own_valid=None):
    """fp32 output and log-sum-exp of the queries over the sample's own keys, bottom-right causal
    (with ``own_valid``, a device count, over the first ``own_valid`` of the ``t`` keys only)."""
    heads = q_BHSD.shape[1]
    seq, keys = q_BHSD.shape[2], k_BGTD.shape[2]
    compute = torch.promote_types(q_BHSD.dtype, torch.float32)
    k_BHTD = expand_groups(k_BGTD.to(compute), heads)
    v_BHTD = expand_groups(v_BGTD.to(compute), heads)
    scores_BHST = (q_BHSD.to(compute) @ k_BHTD.transpose(-1, -2)) * scale
    if own_valid is None:
        visible_ST = torch.ones(seq, keys, dtype=torch.bool, device=q_BHSD.device).tril(keys - seq)
    else:  # query i sees the keys before own_valid - seq + i + 1
        last_S = own_valid.reshape(()) - seq + torch.arange(seq, device=q_BHSD.device)
        visible_ST = torch.arange(keys, device=q_BHSD.device)[None, :] <= last_S[:, None]
    probs_BHST, lse_BHS = softmax_partial(scores_BHST.masked_fill(~visible_ST, float("-inf")))
    return probs_BHST @ v_BHTD, lse_BHS


def split_length(pages: int, options: KernelOptions) -> int:
    """Keys per split of ``pages`` prompt keys: at least ``decode_split_keys``, and few enough splits
    (at most ``MAX_DECODE_SPLITS``) that their batched call and merge stay small."""
    return max(options.decode_split_keys, -(-pages // MAX_DECODE_SPLITS))


def _pages_stacks(backend, q_1GND, pk_1GPD, pv_1GPD, scale, length):
    """The folded queries' partials over the pages split into pieces of ``length`` keys, unmerged:
    ``[(out [n, groups, q, d_v], lse [n, groups, q])]``, the whole pieces as the batch of one
    kernel call (the pages viewed, not copied; the queries repeated per piece), then the rest,
    if any, in one more call (``n = 1``)."""
    pages = pk_1GPD.shape[2]
    whole = pages // length * length
    stacks = []
    if whole:
        pieces = whole // length
        k_NGLD = pk_1GPD[0, :, :whole].unflatten(1, (pieces, length)).transpose(0, 1)
        v_NGLD = pv_1GPD[0, :, :whole].unflatten(1, (pieces, length)).transpose(0, 1)
        q_NGQD = q_1GND.expand(pieces, -1, -1, -1).contiguous()
        out_NGQD, lse_NGQ, _ = kernel_forward(backend, q_NGQD, k_NGLD, v_NGLD, False, scale)
        stacks.append((out_NGQD, lse_NGQ))
    if whole < pages:
        out_1GQD, lse_1GQ, _ = kernel_forward(backend, q_1GND, pk_1GPD[:, :, whole:], pv_1GPD[:, :, whole:],
                                              False, scale)
        stacks.append((out_1GQD, lse_1GQ))
    return stacks


def _pages_partial(stacks):
    """``(out [1, groups, q, d_v], lse [1, groups, q])``, fp32 at least: ``_pages_stacks`` merged."""
    parts = [merge_stacked_partials(out_NGQD, lse_NGQ) for out_NGQD, lse_NGQ in stacks]
    out_GQD, lse_GQ = parts[0] if len(parts) == 1 else merge_partials(*parts[0], *parts[1])
    return out_GQD[None], lse_GQ[None]


def _prompt_part(q_SBHD, prompt_k_SBGD, prompt_v_SBGD, scale, options, acc_BHSD, lse_BHS):
    """The partial ``(acc, lse)`` merged with the queries' attention over the prompt pages: the
    queries that share a KV group folded over the samples and heads (``fold_groups``), the pages
    split (``split_length``, ``_pages_stacks``) so that the call keeps the GPU busy."""
    q_BHSD = q_SBHD.permute(1, 2, 0, 3)
    pages_1GND, pages_lse_1GN = _pages_partial(_prompt_stacks(q_SBHD, prompt_k_SBGD, prompt_v_SBGD, scale, options))
    pages_BHSD = unfold_groups(pages_1GND, q_BHSD.shape[:3] + (prompt_v_SBGD.shape[-1],))
    pages_lse_BHS = unfold_groups(pages_lse_1GN.unsqueeze(-1), q_BHSD.shape[:3] + (1,)).squeeze(-1)
    return merge_partials(acc_BHSD, lse_BHS, pages_BHSD, pages_lse_BHS)


def _prompt_stacks(q_SBHD, prompt_k_SBGD, prompt_v_SBGD, scale, options):
    """``_pages_stacks`` of the queries folded per KV group over the prompt pages."""
    backend, _ = kernel_settings(q_SBHD, options)
    pk_1GPD, pv_1GPD = prompt_k_SBGD.permute(1, 2, 0, 3), prompt_v_SBGD.permute(1, 2, 0, 3)
    q_1GND = fold_groups(q_SBHD.permute(1, 2, 0, 3).contiguous(), pk_1GPD.shape[1])
    return _pages_stacks(backend, q_1GND, pk_1GPD, pv_1GPD, scale, split_length(pk_1GPD.shape[2], options))


def _fused_merge(q_SBHD, k_SBGD, v_SBGD, cp_group) -> bool:
    """Whether the step takes ``decode_merge_triton``: one query per sample on a GPU, no CP."""
    return (q_SBHD.is_cuda and q_SBHD.shape[0] == 1 and cp_group is None
            and q_SBHD.dtype in (torch.bfloat16, torch.float16, torch.float32)  # fp64: the torch path
            and all(t.stride(-1) == 1 for t in (q_SBHD, k_SBGD, v_SBGD)))


@torch.no_grad()
def decode_attention(q_SBHD: torch.Tensor, k_SBGD: torch.Tensor, v_SBGD: torch.Tensor,
                     prompt_k_SBGD: Optional[torch.Tensor], prompt_v_SBGD: Optional[torch.Tensor],
                     scale: Optional[float] = None, cp_group=None,
                     options: KernelOptions = KernelOptions(),
                     own_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of the newest ``s`` tokens' queries ``[s, b, heads, d]`` over the shared prompt keys
    ``[p, 1, groups, d]`` (all visible) and the samples' own keys ``[t, b, groups, d]`` (``t >= s``,
    the last ``s`` being the queries' own tokens). Returns ``[s, b, heads, d_v]``; no autograd.

    ``own_valid`` (a one-element device tensor, for a step in fixed shapes): only the first
    ``own_valid`` own keys are real, the queries' own tokens being the last ``s`` of them; the
    rows after them are masked out (their content does not matter).

    With ``cp_group`` (context parallelism) the prompt keys are this rank's shard of the pages;
    the queries and own keys must be the same on every rank of the group (see the module doc).
    """
    seq, batch, heads, dim = q_SBHD.shape
    assert k_SBGD.shape[0] >= seq and k_SBGD.shape[1] == batch, (k_SBGD.shape, q_SBHD.shape)
    scale = default_scale(scale, dim)
    has_pages = prompt_k_SBGD is not None and prompt_k_SBGD.shape[0] > 0
    if has_pages:
        assert prompt_k_SBGD.shape[1] == 1, "the shared prompt state must have batch 1"
    if _fused_merge(q_SBHD, k_SBGD, v_SBGD, cp_group):
        stacks = _prompt_stacks(q_SBHD, prompt_k_SBGD, prompt_v_SBGD, scale, options) if has_pages else []
        return decode_merge(q_SBHD[0], k_SBGD, v_SBGD, scale, own_valid, stacks)[None]
    acc_BHSD, lse_BHS = _own_keys_part(q_SBHD.permute(1, 2, 0, 3), k_SBGD.permute(1, 2, 0, 3),
                                       v_SBGD.permute(1, 2, 0, 3), scale, own_valid)
    if cp_group is not None:
        # this rank's pages from the empty partial, merged over the CP group, then the own keys
        prompt = empty_partial(acc_BHSD.shape, acc_BHSD.dtype, acc_BHSD.device)
        if has_pages:
            prompt = _prompt_part(q_SBHD, prompt_k_SBGD, prompt_v_SBGD, scale, options, *prompt)
        acc_BHSD, lse_BHS = merge_partials(acc_BHSD, lse_BHS, *merge_partials_over_group(*prompt, cp_group))
    elif has_pages:
        acc_BHSD, lse_BHS = _prompt_part(q_SBHD, prompt_k_SBGD, prompt_v_SBGD, scale, options, acc_BHSD, lse_BHS)
    return acc_BHSD.to(q_SBHD.dtype).permute(2, 0, 1, 3)
