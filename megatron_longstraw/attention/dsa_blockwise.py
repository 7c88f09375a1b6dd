"""GLM-5's DSA at long context: the indexer top-k and absorbed-MLA sparse attention in blocks.

Megatron's DSA reference (``fused_qk_topk_naive``, ``_unfused_absorbed_dsa_fn``) materializes the
``[queries, keys]`` index scores (times the indexer heads) and the dense ``[heads, queries, keys]``
attention scores: at 128K tokens that is tens of GB per layer. Here the same math runs in blocks:

- ``index_topk_blockwise`` (no autograd): index scores of a block of queries against a block of
  keys (Megatron's ``_compute_index_scores``: fp32 ``q . k``, ReLU if asked, head-weighted sum;
  on CUDA in bf16 the fused Triton kernel of ``index_scores_triton``), causally masked, merged
  into a running top-k per query. The order is (score descending, position ascending), the
  selection of ``patches/dsa_causal_topk``, whatever the block sizes: fp32 scores travel packed
  with their positions in one int64 whose ``torch.topk`` is exact and tie-free; fp64 scores (the
  fp64 tests) are ranked by stable sorts over key blocks taken in ascending position order.
  Blocks wholly after a query block are skipped. Transient memory is one block's scores.
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

KEY_BLOCK = 16384           # keys scored at a time
SCORE_ELEMENTS = 1 << 27    # fp32 elements of one block's scores ([query block, heads, key block]
                            # in torch, [query block, key block] in the fused kernel)
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


_LOW = (1 << 32) - 1  # a packed candidate's low 32 bits hold _LOW - position


def _pack(scores_BQT: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
    """fp32 score and position in one int64 that orders like (score descending, position
    ascending): the score's bits in an order-preserving integer form (``-0.0`` as ``+0.0``, as
    ``torch.topk`` counts them) above the reversed position. ``topk`` on it has no ties."""
    bits = (scores_BQT + 0.0).view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)
    return (ordered << 32) | (_LOW - positions_T)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """Positions of packed candidates, ``-1`` where the score is ``-inf`` (not visible)."""
    bits = (packed >> 32).to(torch.int32)
    scores = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).view(torch.float32)
    return (_LOW - (packed & _LOW)).masked_fill(scores == float("-inf"), -1)


class _RunningTopk:
    """Top ``width`` candidates of a query block over the key blocks seen so far (in ascending
    position order). fp32 scores travel packed (``_pack``: one exact ``torch.topk``); wider
    scores (fp64 tests) as (values, positions) ranked by a stable sort."""

    def __init__(self, width: int):
        self.width, self.best = width, None

    def add(self, scores_BQT: torch.Tensor, positions_T: torch.Tensor) -> None:
        """Merge one key block's masked scores ``[b, q, t]`` at ``positions_T``."""
        keep = min(self.width, scores_BQT.shape[-1])
        if scores_BQT.dtype == torch.float32:
            packed = _pack(scores_BQT, positions_T)
            if self.best is not None:
                packed = torch.cat([self.best, packed], dim=-1)
            self.best = packed.topk(min(self.width, packed.shape[-1]), dim=-1).values
            return
        values, order = causal_topk(scores_BQT, keep)
        block = (values, positions_T[order])
        self.best = block if self.best is None else _merge(self.best, block, self.width)

    def positions(self) -> torch.Tensor | None:
        """``[b, q, n <= width]`` positions, best first, ``-1`` where nothing was visible."""
        if self.best is None:
            return None
        if isinstance(self.best, tuple):
            values, positions = self.best
            return positions.masked_fill(values == float("-inf"), -1)
        return _unpack(self.best)


def _fused_scorer(q_SBHD, keys):
    """The Triton index-score kernel when it takes these inputs (CUDA, bf16/fp16), else None."""
    if not q_SBHD.is_cuda:
        return None
    from megatron_longstraw.attention import index_scores_triton

    return index_scores_triton if index_scores_triton.supported(q_SBHD, keys) else None


@torch.no_grad()
def index_topk_blockwise(q_SBHD: torch.Tensor, weights_SBH: torch.Tensor, segments, query_start: int,
                         index_topk: int, use_relu: bool) -> torch.Tensor:
    """DSA top-k positions ``[b, s, min(index_topk, keys)]`` (``-1``: no visible key) of the
    indexer queries ``[s, b, heads, d]`` at positions ``query_start + i`` over the key
    ``segments`` ``[(keys [t, 1 or b, d], first position), ...]`` (ascending positions); sorted
    by score descending, ties by position ascending, exactly like ``fused_qk_topk_causal`` on the
    concatenated keys. On CUDA with bf16/fp16 inputs the scores come from the fused Triton
    kernel (``index_scores_triton``), elsewhere from Megatron's ``_compute_index_scores``."""
    seq, batch, heads = q_SBHD.shape[:3]
    total = sum(keys.shape[0] for keys, _ in segments)
    width = min(index_topk, total)
    device = q_SBHD.device
    assert all(a[1] + a[0].shape[0] <= b[1] for a, b in zip(segments, segments[1:])), "segments out of order"
    fused = _fused_scorer(q_SBHD, segments[0][0])
    key_block = max(1, KEY_BLOCK)
    query_block = max(1, SCORE_ELEMENTS // (batch * (1 if fused else heads) * key_block))
    out = torch.full((batch, seq, width), -1, dtype=torch.int64, device=device)
    if width == 0:
        return out
    for q0 in range(0, seq, query_block):
        q1 = min(seq, q0 + query_block)
        query_pos = torch.arange(query_start + q0, query_start + q1, device=device)
        running = _RunningTopk(width)
        for keys_TBD, first in segments:
            for k0 in range(0, keys_TBD.shape[0], key_block):
                if first + k0 > query_start + q1 - 1:  # every key of the block is in the future
                    break
                k1 = min(keys_TBD.shape[0], k0 + key_block)
                key_pos = torch.arange(first + k0, first + k1, device=device)
                if fused:
                    scores = fused.index_scores(q_SBHD[q0:q1], weights_SBH[q0:q1], keys_TBD[k0:k1],
                                                query_start + q0, first + k0, use_relu)
                else:
                    scores = _block_scores(q_SBHD[q0:q1], weights_SBH[q0:q1], keys_TBD[k0:k1], use_relu)
                    scores = scores.masked_fill(key_pos[None, None, :] > query_pos[None, :, None], float("-inf"))
                running.add(scores, key_pos)
        positions = running.positions()
        if positions is not None:
            out[:, q0:q1, :positions.shape[-1]] = positions
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
