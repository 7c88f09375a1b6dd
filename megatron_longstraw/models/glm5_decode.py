"""GLM-5 decode math: DSA top-k and absorbed-MLA sparse attention over [shared prompt; own tokens].

A decoded token's keys are the prompt's (batch 1, shared by every sample, never expanded or
copied per sample) followed by its sample's own generated tokens (``[t, b, d]``, the last ``s``
being the tokens decoded in this step, causal with bottom-right alignment). Key index ``j`` means
prompt token ``j`` for ``j < p`` and own token ``j - p`` otherwise, exactly the positions a full
forward of ``prompt + generated`` uses, so its top-k (ties broken by position, as
``patches.dsa_causal_topk``) is the full forward's. The sparse attention gathers just the
selected ``index_topk`` latents per query instead of scoring every key.
"""

import torch
from megatron.core.transformer.experimental_attention_variant.dsa import _compute_index_scores

from megatron_longstraw.patches.dsa_causal_topk import causal_topk

PROMPT_SCORE_BLOCK = 65_536  # prompt keys scored at a time (bounds the per-head transient)


def _shared_key_index_scores(q_SBHD, weights_SBH, k_TD, use_relu: bool) -> torch.Tensor:
    """Megatron's ``_compute_index_scores`` for keys ``[t, d]`` shared by every sample: ``[b, s, t]``."""
    scores_SBHT = torch.einsum("sbhd,td->sbht", q_SBHD.float(), k_TD.float())
    if use_relu:
        scores_SBHT = torch.relu(scores_SBHT)
    return (scores_SBHT * weights_SBH.unsqueeze(-1)).sum(dim=2).transpose(0, 1)


@torch.no_grad()
def decode_index_topk(q_SBHD: torch.Tensor, weights_SBH: torch.Tensor, prompt_k_P1D: torch.Tensor,
                      own_k_TBD: torch.Tensor, index_topk: int, use_relu: bool) -> torch.Tensor:
    """DSA top-k ``[b, s, min(index_topk, p + t)]`` of the newest ``s`` tokens' indexer queries
    ``[s, b, heads, d]`` (weights ``[s, b, heads]``) over ``[prompt keys [p, 1, d]; own keys [t, b, d]]``.

    Scores are Megatron's (fp32 ``q . k``, ReLU if ``use_relu``, head-weighted sum); a query sees
    every prompt key and its own keys up to itself; -1 marks slots with no visible key.
    """
    seq, batch = q_SBHD.shape[:2]
    own = own_k_TBD.shape[0]
    assert own >= seq and own_k_TBD.shape[1] == batch and prompt_k_P1D.shape[1] == 1
    pieces = [_shared_key_index_scores(q_SBHD, weights_SBH, prompt_k_P1D[start:start + PROMPT_SCORE_BLOCK, 0],
                                       use_relu)
              for start in range(0, prompt_k_P1D.shape[0], PROMPT_SCORE_BLOCK)]
    own_scores_BST = _compute_index_scores(q_SBHD, weights_SBH, own_k_TBD, use_relu=use_relu)
    visible_ST = torch.ones(seq, own, dtype=torch.bool, device=q_SBHD.device).tril(own - seq)
    pieces.append(own_scores_BST.masked_fill(~visible_ST, float("-inf")))
    scores_BSK = torch.cat(pieces, dim=-1)
    values, indices = causal_topk(scores_BSK, min(index_topk, scores_BSK.shape[-1]))
    return indices.masked_fill(values == float("-inf"), -1)


@torch.no_grad()
def decode_sparse_attention(query_SBNK: torch.Tensor, prompt_latent_P1K: torch.Tensor,
                            own_latent_TBK: torch.Tensor, topk_BSK: torch.Tensor,
                            up_v_weight: torch.Tensor, softmax_scale: float,
                            kv_lora_rank: int) -> torch.Tensor:
    """Absorbed-MLA attention of the newest ``s`` tokens over their selected keys.

    ``query_SBNK`` ``[s, b, heads, kv_lora_rank + rope]`` (absorbed, post-RoPE); keys are the
    latents ``[c_kv ; k_rope]`` of the shared prompt ``[p, 1, .]`` and of the sample's own tokens
    ``[t, b, .]``; ``topk_BSK`` indexes ``[prompt; own]`` (-1: none). The value is ``c_kv``.
    Same math as Megatron's unfused absorbed DSA (fp32 scores and softmax, probabilities cast to
    the latent dtype) restricted to the selected keys. Returns ``[s, b, heads * v_head_dim]``
    after the V up projection ``up_v_weight`` ``[heads, v_head_dim, kv_lora_rank]``.
    """
    seq, batch, heads, width = query_SBNK.shape
    prompt_length, own = prompt_latent_P1K.shape[0], own_latent_TBK.shape[0]
    picks = topk_BSK.shape[-1]
    index_BSK = topk_BSK.clamp_min(0)
    in_prompt_BSK = index_BSK < prompt_length
    own_index = (index_BSK - prompt_length).clamp(0, own - 1).reshape(batch, seq * picks, 1)
    keys_BSKW = torch.gather(own_latent_TBK.transpose(0, 1), 1, own_index.expand(-1, -1, width))
    keys_BSKW = keys_BSKW.reshape(batch, seq, picks, width)
    if prompt_length:
        prompt_rows = prompt_latent_P1K[:, 0].index_select(0, index_BSK.clamp_max(prompt_length - 1).flatten())
        keys_BSKW = torch.where(in_prompt_BSK[..., None], prompt_rows.view(batch, seq, picks, width), keys_BSKW)
    scores_BSNK = torch.einsum("sbnw,bskw->bsnk", query_SBNK.float(), keys_BSKW.float()) * softmax_scale
    scores_BSNK = scores_BSNK.masked_fill((topk_BSK < 0)[:, :, None, :], float("-inf"))
    probs_BSNK = scores_BSNK.softmax(dim=-1).to(keys_BSKW.dtype)
    out_SBNC = torch.einsum("bsnk,bskc->sbnc", probs_BSNK, keys_BSKW[..., :kv_lora_rank])
    out_SBND = torch.einsum("sbhc,hdc->sbhd", out_SBNC, up_v_weight)
    return out_SBND.reshape(seq, batch, -1)
