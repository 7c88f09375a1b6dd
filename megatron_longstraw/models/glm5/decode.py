"""GLM-5 decode math: DSA top-k and absorbed-MLA sparse attention over [shared prompt; own tokens].

A decoded token's keys are the prompt's (batch 1, shared by every sample, never expanded or
copied per sample) followed by its sample's own generated tokens (``[t, b, d]``, the last ``s``
being the tokens decoded in this step, causal with bottom-right alignment). Key index ``j`` means
prompt token ``j`` for ``j < p`` and own token ``j - p`` otherwise, exactly the positions a full
forward of ``prompt + generated`` uses, so its top-k (ties broken by position, as
``patches.dsa_causal_topk``) is the full forward's. The sparse attention gathers just the
selected ``index_topk`` latents per query instead of scoring every key. Both run in blocks
(``attention/dsa_blockwise.py``), so the prompt's scores are never materialized at once.

Context parallelism (``cp_group``, ``core/collectives.py``): the prompt keys and latents are
this rank's shard of the prompt, at the global positions ``prompt_pos_P``, and every CP rank
decodes the same samples, so the queries and the samples' own keys and latents are replicated.
The top-k is then chosen over every rank's shard plus the own keys
(``cp_sparse_attention.cp_index_topk``: local candidates all-gathered, ranked by score then
position, CP=1's selection), and the attention's per-rank partials over the shards merge by
log-sum-exp before the own latents' part is merged in once
(``cp_sparse_attention.cp_sparse_latent_attention``): the same shape of decode as full
attention's (``attention/decode_attention.py``).
"""

from typing import Optional

import torch

from megatron_longstraw.attention.cp_sparse_attention import cp_index_topk, cp_sparse_latent_attention, up_project
from megatron_longstraw.attention.dsa_blockwise import index_topk_blockwise, sparse_latent_attention
from megatron_longstraw.config.kernels import KernelOptions


def _own_start(prompt_P1D, prompt_length: Optional[int], prompt_pos_P, cp_group) -> int:
    """The global position of the samples' first own token: the prompt's length (without CP the
    prompt rows given; under CP ``prompt_length``, with this rank's shard at ``prompt_pos_P``)."""
    if cp_group is None:
        assert prompt_pos_P is None and prompt_length in (None, prompt_P1D.shape[0]), (prompt_length, prompt_P1D.shape)
        return prompt_P1D.shape[0]
    assert prompt_pos_P is not None and prompt_length is not None, "CP decode needs the shard's positions"
    assert prompt_pos_P.shape[0] == prompt_P1D.shape[0] <= prompt_length, (prompt_pos_P.shape, prompt_P1D.shape)
    return prompt_length


def decode_index_topk(q_SBHD, weights_SBH, prompt_k_P1D, own_k_TBD, index_topk: int, use_relu: bool,
                      options: KernelOptions = KernelOptions(), *, cp_group=None, prompt_pos_P=None,
                      prompt_length: Optional[int] = None):
    """DSA top-k ``[b, s, min(index_topk, p + t)]`` of the newest ``s`` tokens' indexer queries
    ``[s, b, heads, d]`` (weights ``[s, b, heads]``) over ``[prompt keys [p, 1, d]; own keys [t, b, d]]``:
    a query sees every prompt key and its own keys up to itself; -1 marks slots with no visible key.
    Blocks as ``options`` set them.

    With ``cp_group`` the prompt keys are this rank's shard (global positions ``prompt_pos_P``)
    of a ``prompt_length``-token prompt, and the selection, made over every rank's shard, is
    the same on every rank and equal to CP=1's (module doc); the entries are global positions
    (own token ``i`` at ``prompt_length + i``), as without CP."""
    seq, own = q_SBHD.shape[0], own_k_TBD.shape[0]
    assert own >= seq and own_k_TBD.shape[1] == q_SBHD.shape[1] and prompt_k_P1D.shape[1] == 1
    start = _own_start(prompt_k_P1D, prompt_length, prompt_pos_P, cp_group)
    if cp_group is None:
        return index_topk_blockwise(q_SBHD, weights_SBH, [(prompt_k_P1D, 0), (own_k_TBD, start)],
                                    start + own - seq, index_topk, use_relu, options)
    own_pos_T = torch.arange(start, start + own, device=own_k_TBD.device)
    return cp_index_topk(q_SBHD, weights_SBH, [(prompt_k_P1D, prompt_pos_P)], own_pos_T[own - seq:], index_topk,
                         start + own, use_relu, cp_group, own_keys_TBD=own_k_TBD, own_pos_T=own_pos_T,
                         options=options)


def decode_sparse_attention(query_SBNK, prompt_latent_P1K, own_latent_TBK, topk_BSK, up_v_weight,
                            softmax_scale: float, kv_lora_rank: int, options: KernelOptions = KernelOptions(), *,
                            cp_group=None, prompt_pos_P=None, prompt_length: Optional[int] = None):
    """Absorbed-MLA attention ``[s, b, heads * v_head_dim]`` (after the V up projection
    ``up_v_weight`` ``[heads, v_head_dim, kv_lora_rank]``) of the newest ``s`` tokens over their
    selected keys among the latents ``[c_kv ; k_rope]`` of the shared prompt ``[p, 1, .]`` and of
    the sample's own tokens ``[t, b, .]``; ``topk_BSK`` indexes ``[prompt; own]`` (-1: none).
    Blocks as ``options`` set them.

    With ``cp_group`` the prompt latents are this rank's shard (global positions
    ``prompt_pos_P``) of a ``prompt_length``-token prompt and ``topk_BSK`` holds global
    positions (``decode_index_topk``'s CP selection): this rank's partial over its shard, merged
    over the group by log-sum-exp, then the own latents' part (module doc); the same on every rank."""
    start = _own_start(prompt_latent_P1K, prompt_length, prompt_pos_P, cp_group)
    if cp_group is None:
        segments = [(prompt_latent_P1K, 0), (own_latent_TBK, start)]
        out = sparse_latent_attention(query_SBNK, segments, topk_BSK, softmax_scale, kv_lora_rank, options)
    else:
        own_pos_T = torch.arange(start, start + own_latent_TBK.shape[0], device=own_latent_TBK.device)
        out = cp_sparse_latent_attention(query_SBNK, [(prompt_latent_P1K, prompt_pos_P)], topk_BSK, softmax_scale,
                                         kv_lora_rank, cp_group, own_keys_TBK=own_latent_TBK, own_pos_T=own_pos_T,
                                         options=options)
    return up_project(out, up_v_weight)
