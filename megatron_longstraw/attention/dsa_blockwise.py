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

The block sizes and the top-k's key form are ``KernelOptions`` (``dsa_key_block``,
``dsa_score_elements``, ``dsa_gather_elements``, ``dsa_topk``), passed as ``options``.
"""

import functools

import torch
from torch.utils.checkpoint import checkpoint

from megatron_longstraw.attention.partials import empty_partial, softmax_partial
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.patches.dsa_causal_topk import causal_topk, dsa


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


def _block_best_packed(scores_BQT: torch.Tensor, positions_T: torch.Tensor, width: int) -> torch.Tensor:
    """The best ``width`` of one key block as packed candidates (any order): ``torch.topk`` on
    the fp32 scores, exact unless some row's k-th score is tied with a score left out (then the
    whole block is ranked packed). Ties at ``-inf`` do not matter (invisible keys)."""
    scores_BQT = scores_BQT + 0.0  # -0.0 as +0.0, as the packed order counts them
    values, index = scores_BQT.topk(width, dim=-1, sorted=False)
    kth = values.amin(dim=-1, keepdim=True)
    cut = ((scores_BQT == kth).sum(-1) != (values == kth).sum(-1)) & (kth[..., 0] > float("-inf"))
    if bool(cut.any()):
        return _pack(scores_BQT, positions_T).topk(width, dim=-1, sorted=False).values
    return _pack(values, positions_T[index])


class _RunningTopk:
    """Top ``width`` candidates of a query block over the key blocks seen so far (in ascending
    position order). fp32 scores travel packed (``_pack``: exact ``torch.topk``, kept unsorted
    until ``result``); wider scores (fp64 tests) as (values, positions) ranked by a stable sort.
    ``keys``: ``KernelOptions.dsa_topk``, how an fp32 block enters (``packed`` or ``float``)."""

    def __init__(self, width: int, keys: str = "packed"):
        self.width, self.keys, self.best = width, keys, None

    def add(self, scores_BQT: torch.Tensor, positions_T: torch.Tensor) -> None:
        """Merge one key block's masked scores ``[b, q, t]`` at ``positions_T``."""
        keep = min(self.width, scores_BQT.shape[-1])
        if scores_BQT.dtype == torch.float32:
            if self.keys == "float" and scores_BQT.shape[-1] > self.width:
                packed = _block_best_packed(scores_BQT, positions_T, self.width)
            else:
                packed = _pack(scores_BQT, positions_T)
            if self.best is not None:
                packed = torch.cat([self.best, packed], dim=-1)
            self.best = packed if packed.shape[-1] <= self.width else \
                packed.topk(self.width, dim=-1, sorted=False).values
            return
        values, order = causal_topk(scores_BQT, keep)
        block = (values, positions_T[order])
        self.best = block if self.best is None else _merge(self.best, block, self.width)

    def result(self):
        """The candidates ordered (score descending, position ascending)."""
        if isinstance(self.best, tuple):
            return self.best
        return self.best.sort(dim=-1, descending=True).values


def _fused_scorer(q_SBHD, keys):
    """The Triton index-score kernel when it takes these inputs (CUDA, bf16/fp16), else None."""
    if not q_SBHD.is_cuda:
        return None
    from megatron_longstraw.attention import index_scores_triton

    return index_scores_triton if index_scores_triton.supported(q_SBHD, keys) else None


def _pad_candidates(candidates, width: int):
    """Pad ``[b, s, n]`` candidates to ``width`` with invisible (``-inf``) entries."""
    if isinstance(candidates, tuple):
        values, positions = candidates
        pad = width - values.shape[-1]
        if pad <= 0:
            return candidates
        return (torch.cat([values, values.new_full((*values.shape[:-1], pad), float("-inf"))], -1),
                torch.cat([positions, positions.new_full((*positions.shape[:-1], pad), -1)], -1))
    pad = width - candidates.shape[-1]
    if pad <= 0:
        return candidates
    device = candidates.device
    filler = _pack(torch.full((1,), float("-inf"), device=device), torch.full((1,), _LOW, device=device))
    return torch.cat([candidates, filler.expand(*candidates.shape[:-1], pad)], -1)


@torch.no_grad()
def topk_candidates(q_SBHD: torch.Tensor, weights_SBH: torch.Tensor, segments, query_start: int, width: int,
                    use_relu: bool, score_dtype=torch.float32, options: KernelOptions = KernelOptions()):
    """The best ``width`` keys of every query over the ``segments``, as candidates ``[b, s, width]``
    that ``merge_candidates`` can combine with other candidate sets (other CP ranks' keys):
    packed int64 for fp32 scores, ``(values, positions)`` for fp64; see ``index_topk_blockwise``.
    Keys are scored ``options.dsa_key_block`` at a time, queries as many as
    ``options.dsa_score_elements`` allow."""
    seq, batch, heads = q_SBHD.shape[:3]
    device = q_SBHD.device
    assert all(a[1] + a[0].shape[0] <= b[1] for a, b in zip(segments, segments[1:])), "segments out of order"
    fused = _fused_scorer(q_SBHD, segments[0][0]) if segments else None
    key_block = options.dsa_key_block
    query_block = max(1, options.dsa_score_elements // (batch * (1 if fused else heads) * key_block))
    parts = []
    for q0 in range(0, seq, query_block):
        q1 = min(seq, q0 + query_block)
        query_pos = torch.arange(query_start + q0, query_start + q1, device=device)
        running = _RunningTopk(width, options.dsa_topk)
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
        if running.best is None:  # nothing visible yet: an empty candidate list of the right kind
            empty = torch.full((batch, q1 - q0, 1), float("-inf"), dtype=score_dtype, device=device)
            running.add(empty, torch.full((1,), _LOW, dtype=torch.int64, device=device))
        parts.append(_pad_candidates(running.result(), width))
    if isinstance(parts[0], tuple):
        return tuple(torch.cat([p[i] for p in parts], dim=1) for i in range(2))
    return torch.cat(parts, dim=1)


def merge_candidates(candidate_sets, width: int):
    """The best ``width`` of several candidate sets of the same queries (any positions), ordered
    (score descending, position ascending)."""
    if not isinstance(candidate_sets[0], tuple):
        packed = torch.cat(candidate_sets, dim=-1)
        return packed.topk(min(width, packed.shape[-1]), dim=-1).values
    values = torch.cat([c[0] for c in candidate_sets], dim=-1)
    positions = torch.cat([c[1] for c in candidate_sets], dim=-1)
    order = positions.masked_fill(positions < 0, torch.iinfo(torch.int64).max).argsort(dim=-1, stable=True)
    values, positions = values.gather(-1, order), positions.gather(-1, order)
    values, best = causal_topk(values, min(width, values.shape[-1]))
    return values, positions.gather(-1, best)


def candidate_positions(candidates) -> torch.Tensor:
    """Positions ``[b, s, n]`` of candidates, ``-1`` where nothing was visible."""
    if isinstance(candidates, tuple):
        values, positions = candidates
        return positions.masked_fill(values == float("-inf"), -1)
    return _unpack(candidates)


@torch.no_grad()
def index_topk_blockwise(q_SBHD: torch.Tensor, weights_SBH: torch.Tensor, segments, query_start: int,
                         index_topk: int, use_relu: bool, options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """DSA top-k positions ``[b, s, min(index_topk, keys)]`` (``-1``: no visible key) of the
    indexer queries ``[s, b, heads, d]`` at positions ``query_start + i`` over the key
    ``segments`` ``[(keys [t, 1 or b, d], first position), ...]`` (ascending positions); sorted
    by score descending, ties by position ascending, exactly like ``fused_qk_topk_causal`` on the
    concatenated keys. On CUDA with bf16/fp16 inputs the scores come from the fused Triton
    kernel (``index_scores_triton``), elsewhere from Megatron's ``_compute_index_scores``; in
    blocks set by ``options`` (``topk_candidates``)."""
    seq, batch = q_SBHD.shape[:2]
    width = min(index_topk, sum(keys.shape[0] for keys, _ in segments))
    if width == 0:
        return torch.full((batch, seq, 0), -1, dtype=torch.int64, device=q_SBHD.device)
    dtype = torch.promote_types(torch.promote_types(q_SBHD.dtype, segments[0][0].dtype), torch.float32)
    return candidate_positions(topk_candidates(q_SBHD, weights_SBH, segments, query_start, width, use_relu, dtype,
                                               options))


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


def _locate(topk_BQK: torch.Tensor, positions_T):
    """``(index, here)`` of the picks ``[b, q, k]``: with ``positions_T`` (the ascending global
    positions of one page tensor) the page row of each pick, found with ``searchsorted``
    (clamped where absent), and whether the pick lives in these pages; without, the picks are
    positions in the segments themselves (``-1``: none)."""
    if positions_T is None:
        return topk_BQK.clamp_min(0), topk_BQK >= 0
    rows = torch.searchsorted(positions_T, topk_BQK.clamp_min(0)).clamp_max(positions_T.numel() - 1)
    return rows, (positions_T[rows] == topk_BQK) & (topk_BQK >= 0)


def _attend_block(firsts, scale, v_channels, partial, query_QBNW, topk_BQK, positions_T, *pages):
    """Absorbed sparse attention of a query block over its selected keys in the ``pages``
    starting at positions ``firsts`` (picks located by ``_locate``). Normalized, Megatron's
    unfused math: fp32 scores and softmax, probabilities cast to the key dtype, ``[q, b, heads,
    v]``. ``partial``: fp32 throughout, ``(out [q, b, n, v], lse [q, b, n])``, the empty
    partial for a query with no pick in these pages."""
    index, here = _locate(topk_BQK, positions_T)
    keys_BQKW = _gather_keys(list(zip(pages, firsts)), index)
    compute = torch.promote_types(query_QBNW.dtype, torch.float32)  # as patches.dsa_promote_precision
    if partial:
        keys_BQKW = keys_BQKW.to(compute)
    scores_BQNK = torch.einsum("qbnw,bqkw->bqnk", query_QBNW.to(compute), keys_BQKW.to(compute)) * scale
    scores_BQNK = scores_BQNK.masked_fill(~here[:, :, None, :], float("-inf"))
    if not partial:
        probs_BQNK = scores_BQNK.softmax(dim=-1).to(keys_BQKW.dtype)
        return torch.einsum("bqnk,bqkc->qbnc", probs_BQNK, keys_BQKW[..., :v_channels])
    probs_BQNK, lse_BQN = softmax_partial(scores_BQNK)
    return torch.einsum("bqnk,bqkc->qbnc", probs_BQNK, keys_BQKW[..., :v_channels]), lse_BQN.permute(1, 0, 2)


def _fused_attention(query_SBNW: torch.Tensor, pages, v_channels: int):
    """The forward-only Triton kernel (``sparse_mla_triton``) when it takes these inputs (CUDA,
    bf16/fp16, no autograd wanted: the capture), else None."""
    if not query_SBNW.is_cuda or len(pages) > 2:
        return None
    from megatron_longstraw.attention import sparse_mla_triton

    return sparse_mla_triton if sparse_mla_triton.supported(query_SBNW, pages, v_channels) else None


def _sparse_blockwise(query_SBNW, pages, firsts, positions_T, topk_BSK, scale: float, v_channels: int,
                      partial: bool, options: KernelOptions, fused_ok: bool = True):
    """The one driver of the gathered sparse attention: the fused forward kernel when it takes
    the inputs (and ``fused_ok``), else ``_attend_block`` in blocks of queries within the
    gather budget (``options.dsa_gather_elements``), each recomputed in backward
    (``torch.utils.checkpoint``) when gradients are wanted. ``partial`` selects the output:
    ``(out, lse)`` in fp32 or the normalized output."""
    fused = _fused_attention(query_SBNW, pages, v_channels) if fused_ok else None
    if fused:
        index, here = _locate(topk_BSK, positions_T)
        out, lse = fused.sparse_latent_forward(query_SBNW, pages, torch.where(here, index - firsts[0], -1), scale,
                                               v_channels)
        return (out, lse) if partial else out.to(pages[0].dtype)
    seq, batch, heads, width = query_SBNW.shape
    picks = topk_BSK.shape[-1]
    rows = max(1, options.dsa_gather_elements // max(1, batch * picks * (width + heads)))
    block = functools.partial(_attend_block, tuple(firsts), scale, v_channels, partial)
    grad = torch.is_grad_enabled() and (query_SBNW.requires_grad or any(p.requires_grad for p in pages))
    outs = []
    for q0 in range(0, seq, rows):
        args = (query_SBNW[q0:q0 + rows], topk_BSK[:, q0:q0 + rows], positions_T, *pages)
        outs.append(checkpoint(block, *args, use_reentrant=False) if grad else block(*args))
    if partial:
        return torch.cat([out for out, _ in outs]), torch.cat([lse for _, lse in outs])
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def sparse_latent_attention(query_SBNW: torch.Tensor, segments, topk_BSK: torch.Tensor, scale: float,
                            v_channels: int, options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """Absorbed-MLA sparse attention ``[s, b, heads, v_channels]`` (before the V up projection)
    of the queries ``[s, b, heads, kv_lora_rank + rope]`` over their selected keys.

    ``segments``: ``[(latent pages [t, 1 or b, w], first position), ...]``; ``topk_BSK`` holds
    positions (``-1``: none). Every query must have at least one selected key (it sees itself).
    Without autograd on CUDA, one or two adjacent segments run in the fused Triton kernel.
    """
    adjacent = all(a[1] + a[0].shape[0] == b[1] for a, b in zip(segments, segments[1:]))
    return _sparse_blockwise(query_SBNW, [p for p, _ in segments], [first for _, first in segments], None,
                             topk_BSK, scale, v_channels, partial=False, options=options, fused_ok=adjacent)


def sparse_latent_partial(query_SBNW: torch.Tensor, pages_TBW: torch.Tensor, positions_T: torch.Tensor,
                          topk_BSK: torch.Tensor, scale: float, v_channels: int,
                          options: KernelOptions = KernelOptions()):
    """One part of a sparse attention split over key sets (CP ranks; a replicated response):
    ``(out [s, b, n, v], lse [s, b, n])`` in fp32 (fp64 for fp64) over the selected keys found in
    ``pages`` ``[t, 1 or b, w]`` at ascending global ``positions_T``; a row with none of its picks
    here gets the empty partial (``out = 0``, ``lse = -inf``, see ``partials``). In query blocks,
    recomputed in backward like ``sparse_latent_attention``."""
    if pages_TBW.shape[0] == 0:
        # still a function of the queries: every CP rank must take part in the backward all-reduce
        seq, batch, heads, _ = query_SBNW.shape
        compute = torch.promote_types(query_SBNW.dtype, torch.float32)
        out, lse = empty_partial((seq, batch, heads, v_channels), compute, query_SBNW.device)
        return out + 0 * query_SBNW[..., :1], lse
    return _sparse_blockwise(query_SBNW, [pages_TBW], [0], positions_T, topk_BSK, scale, v_channels, partial=True,
                             options=options)
