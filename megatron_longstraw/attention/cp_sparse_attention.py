"""GLM-5's DSA top-k and absorbed-MLA sparse attention over pages sharded over the CP group.

Same layout as ``cp_attention`` ("pages stay, queries travel", ``longstraw/context_parallel.py``):
a CP rank holds the MLA latents and DSA indexer keys of its own shards, and the global
positions of those rows (``positions_P`` of the GLM-5 states).

- ``cp_index_topk`` (no autograd): every rank scores the queries against its own keys, keeps its
  local top-k candidates (score, global position), all-gathers them, and all ranks select the
  same global top-k. Candidates are ranked by (score descending, position ascending), exactly the
  order of the single-rank selection (``patches/dsa_causal_topk``), so CP=1 and CP=2 select the
  same positions; ``-1`` marks an empty slot. Replicated keys (the response's own, in replay)
  are scored on every rank and merged in once, after the gather.
- ``cp_sparse_latent_attention`` (autograd): each rank attends the queries over its own selected
  keys (the latent ``[c_kv; k_rope]`` is the key, its first ``v_channels`` the value), and the
  partial outputs merge exactly through their log-sum-exps: a max all-reduce and one sum
  all-reduce (Megatron's ``reduce_from_tensor_model_parallel_region`` with the CP group:
  identity backward, because what follows is replicated). The queries enter the page part
  through ``copy_to_tensor_model_parallel_region`` (all-reduce backward), so every rank ends
  with the CP=1 gradient of the queries. Replicated own keys (replay) are merged in locally.

Both are the dense-masked CPU/reference formulation (like Megatron's unfused absorbed DSA path):
the scores of a query block against a rank's keys are materialized, so memory is queries x keys
per rank; the blockwise GPU path is the long-context issue's work.
"""

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.experimental_attention_variant.dsa import _compute_index_scores

from megatron_longstraw.patches.dsa_causal_topk import causal_topk

_MASKED = -1e30  # finite, so rows without a visible key on this rank keep finite gradients


def _candidates(q_SBHD, weights_SBH, keys_TBD, key_pos_T, query_pos_S, k, use_relu):
    """Top ``k`` (scores, positions) ``[b, s, k]`` of the queries over ``keys`` (causal by
    position), padded with ``-inf``; ``keys`` are in ascending position order."""
    batch, seq = q_SBHD.shape[1], q_SBHD.shape[0]
    scores_BST = torch.full((batch, seq, 0), float("-inf"), device=q_SBHD.device)
    if keys_TBD.shape[0]:
        keys_TBD = keys_TBD.expand(keys_TBD.shape[0], batch, keys_TBD.shape[2])
        scores_BST = _compute_index_scores(q_SBHD, weights_SBH, keys_TBD, use_relu=use_relu)
        scores_BST = scores_BST.masked_fill(key_pos_T[None, None, :] > query_pos_S[None, :, None],
                                            float("-inf"))
    values, order = causal_topk(scores_BST, min(k, scores_BST.shape[-1]))
    positions = key_pos_T[order] if order.numel() else order
    pad = k - values.shape[-1]
    if pad:
        values = torch.cat([values, values.new_full((batch, seq, pad), float("-inf"))], -1)
        positions = torch.cat([positions, positions.new_full((batch, seq, pad), -1)], -1)
    return values, positions


def _rank_candidates(values_BSN, positions_BSN, k):
    """Top ``k`` by (value descending, position ascending)."""
    order = positions_BSN.argsort(dim=-1, stable=True)
    values, positions = values_BSN.gather(-1, order), positions_BSN.gather(-1, order)
    values, best = causal_topk(values, k)
    return values, positions.gather(-1, best)


@torch.no_grad()
def cp_index_topk(q_SBHD, weights_SBH, keys_TBD, key_pos_T, query_pos_S, index_topk: int,
                  total_keys: int, use_relu: bool, group, own_keys_TBD=None, own_pos_T=None):
    """Global top-k positions ``[b, s, min(index_topk, total_keys)]`` (``-1``: none) of the
    queries over every CP rank's ``keys`` (``[t_r, 1 or b, d]`` at global positions ``key_pos_T``)
    plus the replicated ``own_keys``; identical on every rank."""
    k = min(index_topk, total_keys)
    values, positions = _candidates(q_SBHD, weights_SBH, keys_TBD, key_pos_T, query_pos_S, k, use_relu)
    gathered_v = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    gathered_p = [torch.empty_like(positions) for _ in gathered_v]
    dist.all_gather(gathered_v, values.contiguous(), group=group)
    dist.all_gather(gathered_p, positions.contiguous(), group=group)
    if own_keys_TBD is not None:
        own_v, own_p = _candidates(q_SBHD, weights_SBH, own_keys_TBD, own_pos_T, query_pos_S, k, use_relu)
        gathered_v.append(own_v)
        gathered_p.append(own_p)
    values, positions = _rank_candidates(torch.cat(gathered_v, -1), torch.cat(gathered_p, -1), k)
    return positions.masked_fill(values == float("-inf"), -1)


def _selected(topk_BSK, key_pos_T, total_positions: int):
    """``[b, s, t]``: key ``t`` is among the query's selected positions."""
    batch, seq = topk_BSK.shape[:2]
    chosen = torch.zeros(batch, seq, total_positions + 1, dtype=torch.bool, device=topk_BSK.device)
    chosen.scatter_(-1, topk_BSK + 1, True)  # slot 0 collects the -1 fillers
    return chosen[..., key_pos_T + 1]


def _latent_part(q_BNSK, keys_BTK, visible_BST, scale, v_channels):
    """Output ``[b, heads, s, v]`` (fp32 or fp64) and log-sum-exp over the visible keys; a row with
    no visible key gets a log-sum-exp near ``-1e30`` (weight 0 in any merge) and finite gradients."""
    compute = torch.promote_types(q_BNSK.dtype, torch.float32)
    keys = keys_BTK.to(compute)[:, None]  # one key head (MQA)
    scores = (q_BNSK.to(compute) @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible_BST[:, None], _MASKED)
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp() @ keys[..., :v_channels], lse


def cp_sparse_latent_attention(query_SBNK, keys_TBK, key_pos_T, topk_BSK, total_positions: int,
                               scale: float, v_channels: int, group, own_keys_TBK=None,
                               own_pos_T=None) -> torch.Tensor:
    """Absorbed sparse attention ``[s, b, heads, v_channels]`` (before the V up projection) of
    the queries over their selected keys: this rank's ``keys`` (``[t_r, 1 or b, kv_lora + rope]``,
    no gradient) merged over the CP group, plus the replicated ``own_keys`` (with gradient)."""
    batch = query_SBNK.shape[1]
    q_BNSK = query_SBNK.permute(1, 2, 0, 3)
    chosen = lambda pos: _selected(topk_BSK, pos, total_positions)  # noqa: E731
    keys_BTK = keys_TBK.expand(keys_TBK.shape[0], batch, keys_TBK.shape[2]).transpose(0, 1)
    q_pages = copy_to_tensor_model_parallel_region(q_BNSK, group=group) if q_BNSK.requires_grad else q_BNSK
    out, lse = _latent_part(q_pages, keys_BTK, chosen(key_pos_T), scale, v_channels)
    top = lse.detach().clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    weight = (lse - top).exp()
    packed = reduce_from_tensor_model_parallel_region(torch.cat([out * weight[..., None], weight[..., None]], -1),
                                                      group=group)
    out, lse = packed[..., :-1] / packed[..., -1:], top + packed[..., -1].log()
    if own_keys_TBK is not None:
        own_out, own_lse = _latent_part(q_BNSK, own_keys_TBK.transpose(0, 1), chosen(own_pos_T), scale,
                                        v_channels)
        merged = torch.logaddexp(lse, own_lse)
        out = out * (lse - merged).exp()[..., None] + own_out * (own_lse - merged).exp()[..., None]
    return out.to(query_SBNK.dtype).permute(2, 0, 1, 3)


def up_project(out_SBNC: torch.Tensor, up_v_weight: torch.Tensor) -> torch.Tensor:
    """The V up projection of absorbed attention, ``[s, b, heads * v_head_dim]`` (as Megatron's
    ``_run_sparse_attention`` applies it)."""
    out = torch.einsum("sbhc,hdc->sbhd", out_SBNC, up_v_weight).contiguous()
    return out.view(out.size(0), out.size(1), -1)


def chunk_query_positions(binding, group, device) -> tuple[int, torch.Tensor]:
    """CAPTURE under CP: ``(this rank's first row in the chunk, the global positions of all the
    chunk's queries)``, from the binding's shard sizes and this rank's position offset."""
    sizes = binding.shard_sizes
    mine = sum(sizes[:dist.get_rank(group)])
    chunk_start = binding.position_offset - mine
    return mine, torch.arange(chunk_start, chunk_start + sum(sizes), device=device)
