"""GLM-5's DSA at long context: the indexer top-k and absorbed-MLA sparse attention in blocks.

Megatron's DSA reference (``fused_qk_topk_naive``, ``_unfused_absorbed_dsa_fn``) materializes the
``[queries, keys]`` index scores (times the indexer heads) and the dense ``[heads, queries, keys]``
attention scores: at 128K tokens that is tens of GB per layer. Here the same math runs in blocks:

- ``index_topk_blockwise`` (no autograd): index scores of a block of queries against a block of
  keys (Megatron's ``_compute_index_scores``: fp32 ``q . k``, ReLU if asked, head-weighted sum),
  causally masked, reduced to the block's top-k and merged into a running top-k per query. Key
  blocks come in ascending position order and every ranking is a stable sort by score, so the
  order is (score descending, position ascending), the selection of
  ``patches/dsa_causal_topk``, whatever the block sizes; blocks wholly after a query block are
  skipped. Transient memory is one block's ``[query block, heads, key block]`` scores.
- ``sparse_latent_attention`` (autograd): each query attends to its selected keys only, gathered
  from the latent pages ``[c_kv; k_rope]`` (the key; its first ``v_channels`` are the value), in
  blocks of queries. With autograd each block is recomputed in backward
  (``torch.utils.checkpoint``), so what stays for backward is the queries and the pages, not the
  gathered ``[queries, top-k, latent]`` tensor. Gradients reach the queries and the pages that
  carry them (a response's own latents); detached prompt pages get none.

Keys live in segments ``(pages [t, 1 or b, d], first position)``, each covering consecutive
positions (the prompt's pages from 0, then the new tokens' own); a query block is consecutive
positions starting at ``query_start``. A query sees every key at or before its position.
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from megatron_longstraw.patches.dsa_causal_topk import causal_topk, dsa

KEY_BLOCK = 4096            # keys scored at a time
SCORE_ELEMENTS = 1 << 27    # fp32 elements of one block's [query block, heads, key block] scores
GATHER_ELEMENTS = 1 << 27   # elements of one query block's gathered keys plus attention scores


def _block_scores(q_QBHD, weights_QBH, keys_TBD, use_relu):
    """Megatron's index scores ``[b, q, t]`` (looked up at call time: ``patches`` may promote
    them to fp64); batch-1 keys are expanded (a view) to the queries' batch."""
    keys_TBD = keys_TBD.expand(keys_TBD.shape[0], q_QBHD.shape[1], keys_TBD.shape[2])
    return dsa._compute_index_scores(q_QBHD, weights_QBH, keys_TBD, use_relu=use_relu)


def _merge(best, block, width: int):
    """Top ``width`` of two ``(values, positions)`` candidate lists, each sorted by (value
    descending, position ascending), ``best``'s positions all below ``block``'s: the stable sort
    keeps equal values in position order."""
    values = torch.cat([best[0], block[0]], dim=-1)
    values, order = causal_topk(values, min(width, values.shape[-1]))
    return values, torch.cat([best[1], block[1]], dim=-1).gather(-1, order)


@torch.no_grad()
def index_topk_blockwise(q_SBHD: torch.Tensor, weights_SBH: torch.Tensor, segments, query_start: int,
                         index_topk: int, use_relu: bool) -> torch.Tensor:
    """DSA top-k positions ``[b, s, min(index_topk, keys)]`` (``-1``: no visible key) of the
    indexer queries ``[s, b, heads, d]`` at positions ``query_start + i`` over the key
    ``segments`` ``[(keys [t, 1 or b, d], first position), ...]``; sorted by score descending,
    ties by position ascending, exactly like ``fused_qk_topk_causal`` on the concatenated keys."""
    seq, batch, heads = q_SBHD.shape[:3]
    total = sum(keys.shape[0] for keys, _ in segments)
    width = min(index_topk, total)
    device = q_SBHD.device
    key_block = max(1, KEY_BLOCK)
    query_block = max(1, SCORE_ELEMENTS // (batch * heads * key_block))
    out = torch.full((batch, seq, width), -1, dtype=torch.int64, device=device)
    if width == 0:
        return out
    for q0 in range(0, seq, query_block):
        q1 = min(seq, q0 + query_block)
        query_pos = torch.arange(query_start + q0, query_start + q1, device=device)
        best = None
        for keys_TBD, first in segments:
            for k0 in range(0, keys_TBD.shape[0], key_block):
                if first + k0 > query_start + q1 - 1:  # every key of the block is in the future
                    break
                k1 = min(keys_TBD.shape[0], k0 + key_block)
                key_pos = torch.arange(first + k0, first + k1, device=device)
                scores = _block_scores(q_SBHD[q0:q1], weights_SBH[q0:q1], keys_TBD[k0:k1], use_relu)
                scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
                values, order = causal_topk(scores, min(width, k1 - k0))
                block = (values, key_pos[order])
                best = block if best is None else _merge(best, block, width)
        if best is None:
            continue
        out[:, q0:q1, :best[1].shape[-1]] = best[1].masked_fill(best[0] == float("-inf"), -1)
    return out


def _gather_keys(segments, index_BQK: torch.Tensor) -> torch.Tensor:
    """Rows ``[b, q, k, w]`` of the segments at the positions ``index_BQK`` (>= 0)."""
    batch, rows, picks = index_BQK.shape
    keys = None
    for pages_TBW, first in segments:
        length, width = pages_TBW.shape[0], pages_TBW.shape[-1]
        if length == 0:
            continue
        local = (index_BQK - first).clamp(0, length - 1)
        if pages_TBW.shape[1] == 1:
            part = pages_TBW[:, 0].index_select(0, local.flatten()).view(batch, rows, picks, width)
        else:
            part = torch.gather(pages_TBW.transpose(0, 1), 1,
                                local.reshape(batch, rows * picks, 1).expand(-1, -1, width))
            part = part.view(batch, rows, picks, width)
        inside = ((index_BQK >= first) & (index_BQK < first + length))[..., None]
        keys = part if keys is None else torch.where(inside, part, keys)
    return keys


def _attend_block(firsts, scale, v_channels, query_QBNW, topk_BQK, *pages):
    """Absorbed sparse attention ``[q, b, heads, v]`` of a query block over its selected keys in
    the pages starting at positions ``firsts`` (Megatron's unfused math: fp32 scores and softmax,
    probabilities cast to the key dtype)."""
    segments = list(zip(pages, firsts))
    keys_BQKW = _gather_keys(segments, topk_BQK.clamp_min(0))
    compute = torch.promote_types(query_QBNW.dtype, torch.float32)  # as patches.dsa_promote_precision
    scores_BQNK = torch.einsum("qbnw,bqkw->bqnk", query_QBNW.to(compute), keys_BQKW.to(compute)) * scale
    scores_BQNK = scores_BQNK.masked_fill((topk_BQK < 0)[:, :, None, :], float("-inf"))
    probs_BQNK = scores_BQNK.softmax(dim=-1).to(keys_BQKW.dtype)
    return torch.einsum("bqnk,bqkc->qbnc", probs_BQNK, keys_BQKW[..., :v_channels])


def sparse_latent_attention(query_SBNW: torch.Tensor, segments, topk_BSK: torch.Tensor, scale: float,
                            v_channels: int) -> torch.Tensor:
    """Absorbed-MLA sparse attention ``[s, b, heads, v_channels]`` (before the V up projection)
    of the queries ``[s, b, heads, kv_lora_rank + rope]`` over their selected keys.

    ``segments``: ``[(latent pages [t, 1 or b, w], first position), ...]``; ``topk_BSK`` holds
    positions (``-1``: none). Every query must have at least one selected key (it sees itself).
    """
    seq, batch, heads, width = query_SBNW.shape
    picks = topk_BSK.shape[-1]
    rows = max(1, GATHER_ELEMENTS // max(1, batch * picks * (width + heads)))
    pages = [p for p, _ in segments]
    block = functools.partial(_attend_block, tuple(first for _, first in segments), scale, v_channels)
    grad = torch.is_grad_enabled() and (query_SBNW.requires_grad or any(p.requires_grad for p in pages))
    outs = []
    for q0 in range(0, seq, rows):
        args = (query_SBNW[q0:q0 + rows], topk_BSK[:, q0:q0 + rows], *pages)
        outs.append(checkpoint(block, *args, use_reentrant=False) if grad else block(*args))
    return torch.cat(outs) if len(outs) > 1 else outs[0]
