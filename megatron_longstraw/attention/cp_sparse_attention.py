"""GLM-5's DSA top-k and absorbed-MLA sparse attention over pages sharded over the CP group.

Same layout as ``cp_attention`` ("pages stay, queries travel", ``core/collectives.py``):
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
  all-reduce (``partials.merge_partials_over_group_with_grad``: Megatron's
  ``reduce_from_tensor_model_parallel_region`` with the CP group, identity backward, because
  what follows is replicated). The queries enter the page part
  through ``copy_to_tensor_model_parallel_region`` (all-reduce backward), so every rank ends
  with the CP=1 gradient of the queries. Replicated own keys (replay) are merged in locally.
- ``cp_sweep_sparse_latent_attention`` (autograd): the reverse sweep's recompute of a prompt
  chunk (``--prompt-gradient exact``), the capture's attention with gradients: the chunk's
  queries all-gathered with autograd, this rank's part over its latents before the chunk and its
  shard's own, merged so that each rank's part backpropagates every row of the chunk
  (``partials.merge_partials_over_group_own_rows``); this rank's rows returned.

Both run in blocks (``attention/dsa_blockwise.py``): a rank's candidates come from the blockwise
running top-k over the runs of consecutive positions of its pages, and its attention part
gathers only the selected keys that live on it (found by position with ``searchsorted``), so no
rank materializes queries x keys.
"""

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from megatron_longstraw.attention.dsa_blockwise import (
    candidate_positions, merge_candidates, sparse_latent_partial, topk_candidates)
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.attention.partials import (
    merge_partials, merge_partials_over_group_own_rows, merge_partials_over_group_with_grad)
from megatron_longstraw.core.binding import CaptureBinding, SweepBinding
from megatron_longstraw.core.collectives import all_gather_rows_with_grad


def _runs(keys_TBD: torch.Tensor, positions_T: torch.Tensor) -> list:
    """``[(keys, first position), ...]`` of the rows' runs of consecutive positions (ascending)."""
    if positions_T.numel() == 0:
        return []
    cuts = (torch.nonzero(positions_T[1:] - positions_T[:-1] != 1).flatten() + 1).tolist()
    bounds = [0, *cuts, positions_T.numel()]
    firsts = positions_T[bounds[:-1]].tolist()
    return [(keys_TBD[lo:hi], first) for lo, hi, first in zip(bounds[:-1], bounds[1:], firsts)]


@torch.no_grad()
def cp_index_topk(q_SBHD, weights_SBH, local_parts, query_pos_S, index_topk: int, total_keys: int, use_relu: bool,
                  group, own_keys_TBD=None, own_pos_T=None, options: KernelOptions = KernelOptions()):
    """Global top-k positions ``[b, s, min(index_topk, total_keys)]`` (``-1``: none) of the
    queries (consecutive positions ``query_pos_S``) over every CP rank's keys (this rank's
    ``local_parts``: ``[(keys [t, 1 or b, d], ascending global positions [t]), ...]`` in
    ascending order, e.g. the pages and the chunk's own shard) plus the replicated ``own_keys``;
    identical on every rank. Each rank's candidates come from ``dsa_blockwise.topk_candidates``
    (blocks set by ``options``, fused scores on CUDA), then all ranks' are gathered and merged."""
    width = min(index_topk, total_keys)
    start = int(query_pos_S[0])
    dtype = torch.promote_types(q_SBHD.dtype, torch.float32)
    runs = [run for keys, positions in local_parts for run in _runs(keys, positions)]
    mine = topk_candidates(q_SBHD, weights_SBH, runs, start, width, use_relu, dtype, options)
    pieces = mine if isinstance(mine, tuple) else (mine,)
    gathered = []
    for piece in pieces:
        parts = [torch.empty_like(piece) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, piece.contiguous(), group=group)
        gathered.append(parts)
    sets = list(zip(*gathered)) if isinstance(mine, tuple) else gathered[0]
    if own_keys_TBD is not None:
        sets.append(topk_candidates(q_SBHD, weights_SBH, _runs(own_keys_TBD, own_pos_T), start, width, use_relu,
                                    dtype, options))
    return candidate_positions(merge_candidates(sets, width))


def cp_sparse_latent_attention(query_SBNK, local_parts, topk_BSK, scale: float, v_channels: int, group,
                               own_keys_TBK=None, own_pos_T=None,
                               options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """Absorbed sparse attention ``[s, b, heads, v_channels]`` (before the V up projection) of
    the queries over their selected keys: this rank's ``local_parts`` (``[(latents [t, 1 or b,
    kv_lora + rope], ascending global positions [t]), ...]``, a gradient of this rank's
    latents where they require one: exact replay) merged over the CP
    group, plus the replicated ``own_keys`` (with gradient). Each part gathers only its selected
    keys (``dsa_blockwise.sparse_latent_partial``, in blocks set by ``options``)."""
    q_pages = copy_to_tensor_model_parallel_region(query_SBNK, group=group) if query_SBNK.requires_grad \
        else query_SBNK
    partial = None
    for keys_TBK, positions_T in local_parts:
        part = sparse_latent_partial(q_pages, keys_TBK, positions_T, topk_BSK, scale, v_channels, options)
        partial = part if partial is None else merge_partials(*partial, *part)
    out, lse = merge_partials_over_group_with_grad(*partial, group)
    if own_keys_TBK is not None:
        own = sparse_latent_partial(query_SBNK, own_keys_TBK, own_pos_T, topk_BSK, scale, v_channels, options)
        out, lse = merge_partials(out, lse, *own)
    return out.to(query_SBNK.dtype)


def cp_sweep_sparse_latent_attention(query_SBNK, local_parts, topk_BSK, scale: float, v_channels: int,
                                     shard_sizes: tuple[int, ...], group,
                                     options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """This rank's rows ``[s_r, 1, heads, v_channels]`` of a prompt chunk's absorbed sparse
    attention, recomputed with autograd for the reverse sweep: its queries ``[s_r, 1, heads,
    kv_lora + rope]`` travel (all-gathered, the chunk's ``topk_BSK`` covers them all), attend
    over their selected keys in this rank's ``local_parts`` (``[(latents, ascending global
    positions), ...]``, with gradient where they require it), and the parts merge over the
    group. The gradients of this rank's queries and latents are complete once every rank has
    backpropagated its rows (every rank must)."""
    mine = sum(shard_sizes[:dist.get_rank(group)])
    q_all = torch.cat(all_gather_rows_with_grad(query_SBNK, shard_sizes, group))
    partial = None
    for keys_TBK, positions_T in local_parts:
        part = sparse_latent_partial(q_all, keys_TBK, positions_T, topk_BSK, scale, v_channels, options)
        partial = part if partial is None else merge_partials(*partial, *part)
    out, _ = merge_partials_over_group_own_rows(*partial, group)
    return out[mine:mine + query_SBNK.shape[0]].to(query_SBNK.dtype)


def up_project(out_SBNC: torch.Tensor, up_v_weight: torch.Tensor) -> torch.Tensor:
    """The V up projection of absorbed attention, ``[s, b, heads * v_head_dim]`` (as Megatron's
    ``_run_sparse_attention`` applies it)."""
    out = torch.einsum("sbhc,hdc->sbhd", out_SBNC, up_v_weight).contiguous()
    return out.view(out.size(0), out.size(1), -1)


def chunk_query_positions(binding: CaptureBinding | SweepBinding, group, device) -> tuple[int, torch.Tensor]:
    """A chunk's shard under CP (capture, the reverse sweep): ``(this rank's first row in the
    chunk, the global positions of all the chunk's queries)``, from the binding's shard sizes and
    this rank's position offset."""
    sizes = binding.shard_sizes
    mine = sum(sizes[:dist.get_rank(group)])
    chunk_start = binding.position_offset - mine
    return mine, torch.arange(chunk_start, chunk_start + sum(sizes), device=device)
