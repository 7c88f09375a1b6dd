"""GLM-5 decode math: DSA top-k and absorbed-MLA sparse attention over [shared prompt; own tokens].

A decoded token's keys are the prompt's (batch 1, shared by every sample, never expanded or
copied per sample) followed by its sample's own generated tokens (``[t, b, d]``, the last ``s``
being the tokens decoded in this step, causal with bottom-right alignment). Key index ``j`` means
prompt token ``j`` for ``j < p`` and own token ``j - p`` otherwise, exactly the positions a full
forward of ``prompt + generated`` uses, so its top-k (ties broken by position, as
``patches.dsa_causal_topk``) is the full forward's. The sparse attention gathers just the
selected ``index_topk`` latents per query instead of scoring every key. Both run in blocks
(``attention/dsa_blockwise.py``), so the prompt's scores are never materialized at once.
"""

from megatron_longstraw.attention.cp_sparse_attention import up_project
from megatron_longstraw.attention.dsa_blockwise import index_topk_blockwise, sparse_latent_attention
from megatron_longstraw.attention.kernel_options import KernelOptions


def decode_index_topk(q_SBHD, weights_SBH, prompt_k_P1D, own_k_TBD, index_topk: int, use_relu: bool,
                      options: KernelOptions = KernelOptions()):
    """DSA top-k ``[b, s, min(index_topk, p + t)]`` of the newest ``s`` tokens' indexer queries
    ``[s, b, heads, d]`` (weights ``[s, b, heads]``) over ``[prompt keys [p, 1, d]; own keys [t, b, d]]``:
    a query sees every prompt key and its own keys up to itself; -1 marks slots with no visible key.
    Blocks as ``options`` set them."""
    prompt_length, own = prompt_k_P1D.shape[0], own_k_TBD.shape[0]
    assert own >= q_SBHD.shape[0] and own_k_TBD.shape[1] == q_SBHD.shape[1] and prompt_k_P1D.shape[1] == 1
    return index_topk_blockwise(q_SBHD, weights_SBH, [(prompt_k_P1D, 0), (own_k_TBD, prompt_length)],
                                prompt_length + own - q_SBHD.shape[0], index_topk, use_relu, options)


def decode_sparse_attention(query_SBNK, prompt_latent_P1K, own_latent_TBK, topk_BSK, up_v_weight,
                            softmax_scale: float, kv_lora_rank: int, options: KernelOptions = KernelOptions()):
    """Absorbed-MLA attention ``[s, b, heads * v_head_dim]`` (after the V up projection
    ``up_v_weight`` ``[heads, v_head_dim, kv_lora_rank]``) of the newest ``s`` tokens over their
    selected keys among the latents ``[c_kv ; k_rope]`` of the shared prompt ``[p, 1, .]`` and of
    the sample's own tokens ``[t, b, .]``; ``topk_BSK`` indexes ``[prompt; own]`` (-1: none).
    Blocks as ``options`` set them."""
    segments = [(prompt_latent_P1K, 0), (own_latent_TBK, prompt_latent_P1K.shape[0])]
    return up_project(sparse_latent_attention(query_SBNK, segments, topk_BSK, softmax_scale, kv_lora_rank, options),
                      up_v_weight)
