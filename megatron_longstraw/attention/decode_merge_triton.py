"""One decode query per sample over its own keys, merged with the prompt pages' partials: one
Triton kernel (CUDA).

A decode step's attention over the shared pages runs on the fused kernels as partials, one per
split of the pages (``attention/decode_attention.py``). What is left is small and was about forty
kernels a layer in plain torch: the query over the sample's own keys (a few to a few thousand
rows, with a device count of the valid ones in a fixed-shape step), the log-sum-exp merge of the
splits' partials and of that part, the cast. Here it is one kernel: a program per (sample,
head) runs an online softmax over the valid own rows, then folds in each split's ``(out, lse)``
(the same exact merge as ``partials.merge_partials``), and writes the output in the query's
dtype. Scores and sums are fp32. The torch path of ``decode_attention`` is the reference
(``tests/test_decode_merge_triton.py`` runs this kernel in Triton's CPU interpreter; ``tests/gpu``
on the GPU).
"""

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

BLOCK_T = 32
"""Own-key rows per iteration of a program."""


@triton.jit
def _merge_split_partials(acc, total, top, out_ptr, lse_ptr, splits, stride_on, stride_ln, dims_v, dim_ok):
    """Fold ``splits`` partials ``(out [dim_v], lse)`` into the running ``(acc, total, top)``."""
    for n in range(splits):
        lse = tl.load(lse_ptr + n * stride_ln).to(tl.float32)
        out = tl.load(out_ptr + n * stride_on + dims_v, mask=dim_ok, other=0.0).to(tl.float32)
        new_top = tl.maximum(top, lse)
        shift = tl.where(new_top > float("-inf"), new_top, 0.0)  # all empty so far: weights 0, not NaN
        keep, weight = tl.exp(top - shift), tl.exp(lse - shift)
        acc = acc * keep + out * weight
        total = total * keep + weight
        top = new_top
    return acc, total, top


@triton.jit
def _decode_merge_kernel(q_ptr, k_ptr, v_ptr, valid_ptr, out1_ptr, lse1_ptr, out2_ptr, lse2_ptr, o_ptr,
                         rows, splits1, splits2, scale,
                         stride_qb, stride_qh, stride_kt, stride_kb, stride_kg, stride_vt, stride_vb, stride_vg,
                         stride_o1n, stride_o1g, stride_o1q, stride_l1n, stride_l1g, stride_l1q,
                         stride_o2n, stride_o2g, stride_o2q, stride_l2n, stride_l2g, stride_l2q,
                         stride_ob, stride_oh, dim, dim_v,
                         HEADS_PER_GROUP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         BLOCK_T: tl.constexpr, HAS_VALID: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    g = h // HEADS_PER_GROUP
    folded = b * HEADS_PER_GROUP + h % HEADS_PER_GROUP  # the query's row in the pages' folded call
    dims, dims_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    dim_ok, dim_v_ok = dims < dim, dims_v < dim_v
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + dims, mask=dim_ok, other=0.0).to(tl.float32)
    valid = rows
    if HAS_VALID:
        valid = tl.minimum(tl.load(valid_ptr).to(tl.int32), rows)
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for start in range(0, rows, BLOCK_T):  # own keys: online softmax over the valid rows
        t = (start + tl.arange(0, BLOCK_T)).to(tl.int64)  # row offsets can pass 2^31 elements
        ok = t < valid
        k = tl.load(k_ptr + t[:, None] * stride_kt + b * stride_kb + g * stride_kg + dims[None, :],
                    mask=ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.where(ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=0))
        shift = tl.where(new_top > float("-inf"), new_top, 0.0)
        probs = tl.exp(scores - shift)
        keep = tl.exp(top - shift)
        v = tl.load(v_ptr + t[:, None] * stride_vt + b * stride_vb + g * stride_vg + dims_v[None, :],
                    mask=ok[:, None] & dim_v_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * keep + tl.sum(probs[:, None] * v, axis=0)
        total = total * keep + tl.sum(probs, axis=0)
        top = new_top
    acc, total, top = _merge_split_partials(acc, total, top, out1_ptr + g * stride_o1g + folded * stride_o1q,
                                            lse1_ptr + g * stride_l1g + folded * stride_l1q, splits1,
                                            stride_o1n, stride_l1n, dims_v, dim_v_ok)
    acc, total, top = _merge_split_partials(acc, total, top, out2_ptr + g * stride_o2g + folded * stride_o2q,
                                            lse2_ptr + g * stride_l2g + folded * stride_l2q, splits2,
                                            stride_o2n, stride_l2n, dims_v, dim_v_ok)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + dims_v, out.to(o_ptr.dtype.element_ty), mask=dim_v_ok)


def decode_merge(q_BHD: torch.Tensor, k_TBGD: torch.Tensor, v_TBGD: torch.Tensor, scale: float,
                 own_valid: Optional[torch.Tensor] = None,
                 pages: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """Attention ``[b, heads, d_v]`` (``q_BHD``'s dtype) of one query per sample and head over the
    sample's own keys ``[t, b, groups, d]`` (the first ``own_valid`` rows, a one-element device
    count, or all ``t``) and the pages' partials: up to two ``(out [n, groups, q, d_v],
    lse [n, groups, q])`` stacks of ``n`` splits each, over the queries folded per KV group
    (``prefix_attention_cuda.fold_groups``: row ``sample * heads_per_group + head``)."""
    batch, heads, dim = q_BHD.shape
    rows, _, groups, dim_v = v_TBGD.shape
    assert k_TBGD.shape[:3] == (rows, batch, groups) and heads % groups == 0, (k_TBGD.shape, q_BHD.shape)
    assert len(pages) <= 2, len(pages)
    assert all(t.stride(-1) == 1 for t in (q_BHD, k_TBGD, v_TBGD)), "the head dimension must be contiguous"
    out_BHD = torch.empty(batch, heads, dim_v, dtype=q_BHD.dtype, device=q_BHD.device)
    parts = list(pages)
    for out_NGQD, lse_NGQ in parts:
        assert out_NGQD.shape[1:] == (groups, batch * heads // groups, dim_v) and out_NGQD.stride(-1) == 1, \
            out_NGQD.shape
        assert lse_NGQ.shape == out_NGQD.shape[:3], (lse_NGQ.shape, out_NGQD.shape)
    while len(parts) < 2:  # an absent stack: no split (its pointers unused)
        parts.append((out_BHD.new_empty(0, groups, batch * heads // groups, dim_v),
                      out_BHD.new_empty(0, groups, batch * heads // groups, dtype=torch.float32)))
    (out1, lse1), (out2, lse2) = parts
    valid = own_valid if own_valid is not None else out_BHD
    _decode_merge_kernel[(batch, heads)](
        q_BHD, k_TBGD, v_TBGD, valid, out1, lse1, out2, lse2, out_BHD,
        rows, out1.shape[0], out2.shape[0], float(scale),
        q_BHD.stride(0), q_BHD.stride(1), k_TBGD.stride(0), k_TBGD.stride(1), k_TBGD.stride(2),
        v_TBGD.stride(0), v_TBGD.stride(1), v_TBGD.stride(2),
        out1.stride(0), out1.stride(1), out1.stride(2), lse1.stride(0), lse1.stride(1), lse1.stride(2),
        out2.stride(0), out2.stride(1), out2.stride(2), lse2.stride(0), lse2.stride(1), lse2.stride(2),
        out_BHD.stride(0), out_BHD.stride(1), dim, dim_v,
        HEADS_PER_GROUP=heads // groups, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_DV=triton.next_power_of_2(dim_v), BLOCK_T=BLOCK_T, HAS_VALID=own_valid is not None,
    )
    return out_BHD
