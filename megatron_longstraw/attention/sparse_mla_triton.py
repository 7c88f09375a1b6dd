"""Absorbed-MLA sparse attention over gathered latents, forward only, fused in Triton (CUDA).

The prompt capture runs without autograd, and there ``dsa_blockwise.sparse_latent_attention``'s
torch path (gather ``[queries, top-k, latent]``, fp32 batched matmuls, softmax) is the largest
cost of a GLM-5 capture: it writes and re-reads the gathered keys in fp32. This kernel reads each
selected latent row ``[c_kv; k_rope]`` once per query straight from the pages, scores all heads
of that query against it on the tensor cores (``q_c . c_kv + q_r . k_rope``, fp32 accumulation),
and keeps an online softmax and the ``[heads, kv_lora_rank]`` output in registers: nothing per
pick is written. One program is one query (all heads share its selection, as DSA selects per
query); picks are processed ``BLOCK_K`` at a time.

Output ``out [s, b, heads, v]`` (fp32) and ``lse [s, b, heads]``, where a query with no pick in
these pages gets the empty partial ``out = 0``, ``lse = -inf`` (``partials``; as
``dsa_blockwise.sparse_latent_partial`` returns it). The pages are one or two tensors indexed
as their concatenation (the prompt's latents, then the chunk's own), so nothing is copied.

Numerics differ from Megatron's unfused math only in rounding: the unnormalized probabilities
(each <= 1) are cast to the key dtype for the value product and divided by their fp32 sum at the
end, where the reference casts the normalized ones. The torch path stays the reference and the
only path with autograd (``tests/test_sparse_mla_triton.py`` runs this kernel in Triton's CPU
interpreter in fp32 and fp16; ``tests/gpu/test_dsa_gpu.py`` in bf16 at GLM-5's shape).
"""

import torch
import triton
import triton.language as tl

from megatron_longstraw.attention.index_scores_triton import INTERPRETED

# picks per step and warps: on a GPU the first call per latent shape times these and keeps the
# fastest; Triton's CPU interpreter (the CPU tier) runs 32 picks
_STEPS = [triton.Config({"BLOCK_K": k}, num_warps=w) for k in (16, 32, 64) for w in (4, 8)]

@triton.jit
def _sparse_latent_kernel(q_ptr, a_ptr, b_ptr, rows_ptr, out_ptr, lse_ptr, n_heads, n_picks, a_rows, scale,
                          stride_qs, stride_qh, stride_a, stride_b, stride_rs, stride_os, stride_oh, stride_ls,
                          V: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                          IEEE: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    cv, cr = tl.arange(0, V), tl.arange(0, R)
    q_row = q_ptr + s * stride_qs + heads[:, None] * stride_qh
    q_c = tl.load(q_row + cv[None, :], mask=head_ok[:, None], other=0.0)
    q_r = tl.load(q_row + V + cr[None, :], mask=head_ok[:, None], other=0.0)
    m = tl.full((BLOCK_H,), -1e30, dtype=tl.float32)  # running max: finite, so exp(m - m_new) is never NaN
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, V), dtype=tl.float32)
    for k0 in range(0, n_picks, BLOCK_K):
        picks = k0 + tl.arange(0, BLOCK_K)
        rows = tl.load(rows_ptr + s * stride_rs + picks, mask=picks < n_picks, other=-1).to(tl.int64)
        ok = rows >= 0
        in_a, in_b = ok & (rows < a_rows), ok & (rows >= a_rows)
        a_row = a_ptr + rows * stride_a
        b_row = b_ptr + (rows - a_rows) * stride_b
        k_c = (tl.load(a_row[:, None] + cv[None, :], mask=in_a[:, None], other=0.0)
               + tl.load(b_row[:, None] + cv[None, :], mask=in_b[:, None], other=0.0))
        k_r = (tl.load(a_row[:, None] + V + cr[None, :], mask=in_a[:, None], other=0.0)
               + tl.load(b_row[:, None] + V + cr[None, :], mask=in_b[:, None], other=0.0))
        if IEEE:
            scores = tl.dot(q_c, tl.trans(k_c), input_precision="ieee") + \
                tl.dot(q_r, tl.trans(k_r), input_precision="ieee")
        else:
            scores = tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_r, tl.trans(k_r))
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)
        m = m_new
    seen = total > 0
    out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(out_ptr + s * stride_os + heads[:, None] * stride_oh + cv[None, :], out, mask=head_ok[:, None])
    tl.store(lse_ptr + s * stride_ls + heads, lse, mask=head_ok)


_kernel = _sparse_latent_kernel if INTERPRETED else triton.autotune(_STEPS, key=["V", "R", "BLOCK_H", "IEEE"])(
    _sparse_latent_kernel)


def _power_of_two(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def supported(query_SBNW: torch.Tensor, pages, v_channels: int) -> bool:
    """Whether the kernel takes these inputs: CUDA, no autograd wanted, bf16/fp16 queries and
    pages of one dtype, ``kv_lora_rank`` and the RoPE width powers of two >= 16, <= 128 heads."""
    width, heads = query_SBNW.shape[-1], query_SBNW.shape[-2]
    return (query_SBNW.is_cuda and query_SBNW.dtype in (torch.bfloat16, torch.float16)
            and not (torch.is_grad_enabled() and (query_SBNW.requires_grad or any(p.requires_grad for p in pages)))
            and all(p.dtype == query_SBNW.dtype and p.shape[-1] == width for p in pages)
            and _power_of_two(v_channels) and _power_of_two(width - v_channels) and heads <= 128)


@torch.no_grad()
def sparse_latent_forward(query_SBNW: torch.Tensor, pages, rows_BSK: torch.Tensor, scale: float,
                          v_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [s, b, heads, v_channels] fp32, lse [s, b, heads] fp32)`` of the queries
    ``[s, b, heads, v_channels + rope]`` over their picks: ``rows_BSK`` index the concatenation of
    ``pages`` (one or two ``[t, 1 or b, w]`` tensors), ``-1`` for none."""
    assert 1 <= len(pages) <= 2, "one or two page tensors"
    seq, batch, heads, width = query_SBNW.shape
    first, second = pages[0], pages[-1]
    a_rows = first.shape[0] if len(pages) == 2 else torch.iinfo(torch.int64).max
    out = torch.empty(seq, batch, heads, v_channels, dtype=torch.float32, device=query_SBNW.device)
    lse = torch.empty(seq, batch, heads, dtype=torch.float32, device=query_SBNW.device)
    ieee = query_SBNW.dtype == torch.float32  # the interpreter tests: exact fp32 products
    step = dict(BLOCK_K=32, num_warps=4) if INTERPRETED else {}
    for b in range(batch):
        q = query_SBNW[:, b]
        if q.stride(-1) != 1:
            q = q.contiguous()
        a, c = (p[:, b if p.shape[1] > 1 else 0].contiguous() for p in (first, second))
        rows = rows_BSK[b].contiguous()
        out_b, lse_b = out[:, b], lse[:, b]
        _kernel[(seq,)](q, a, c, rows, out_b, lse_b, heads, rows.shape[-1], a_rows, scale, q.stride(0), q.stride(1),
                        a.stride(0), c.stride(0), rows.stride(0), out_b.stride(0), out_b.stride(1), lse_b.stride(0),
                        V=v_channels, R=width - v_channels, BLOCK_H=max(16, triton.next_power_of_2(heads)), IEEE=ieee,
                        **step)
    return out, lse
