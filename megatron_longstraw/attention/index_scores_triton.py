"""DSA index scores of one query block against one key block, fused in Triton (CUDA, bf16/fp16).

``scores[q, t] = sum_h w[q, h] * relu(q[q, h, :] . k[t, :])`` (ReLU optional), causally masked
with ``-inf`` where the key's position is after the query's: Megatron's ``_compute_index_scores``
without its ``[queries, heads, keys]`` fp32 intermediate. Products run on the tensor cores
(bf16 x bf16 -> fp32 accumulation, exact products), the head sum in fp32 registers, so one
``[queries, keys]`` fp32 block is all that is written. The torch path of
``attention/dsa_blockwise.py`` is the reference (``tests/test_dsa_blockwise.py`` runs this kernel
in Triton's CPU interpreter; ``tests/gpu`` on the GPU).
"""

import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (the CPU tier) runs one fixed tile; on a GPU the first call per
# (heads, dim, relu) times these tiles and keeps the fastest.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_TILES = [triton.Config({"BLOCK_Q": q, "BLOCK_T": t}, num_warps=w)
          for q, t, w in ((64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8))]


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, k_ptr, out_ptr, n_queries, n_keys, query_start, key_start,
                         stride_qs, stride_qh, stride_ws, stride_kt, stride_os,
                         HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                         BLOCK_T: tl.constexpr, RELU: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    dims = tl.arange(0, DIM)
    row_ok, col_ok = rows < n_queries, cols < n_keys
    keys = tl.load(k_ptr + cols[None, :] * stride_kt + dims[:, None], mask=col_ok[None, :], other=0.0)
    acc = tl.zeros((BLOCK_Q, BLOCK_T), dtype=tl.float32)
    for head in range(HEADS):
        q = tl.load(q_ptr + rows[:, None] * stride_qs + head * stride_qh + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        dots = tl.dot(q, keys)
        if RELU:
            dots = tl.maximum(dots, 0.0)
        weight = tl.load(w_ptr + rows * stride_ws + head, mask=row_ok, other=0.0).to(tl.float32)
        acc += dots * weight[:, None]
    future = (key_start + cols)[None, :] > (query_start + rows)[:, None]
    acc = tl.where(future, float("-inf"), acc)
    tl.store(out_ptr + rows[:, None] * stride_os + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


_kernel = _index_scores_kernel if INTERPRETED else triton.autotune(_TILES, key=["HEADS", "DIM", "RELU"])(
    _index_scores_kernel)


def supported(q_SBHD: torch.Tensor, keys_TBD: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: CUDA, bf16/fp16, head dim a power of two >= 16."""
    dim = q_SBHD.shape[-1]
    return (q_SBHD.is_cuda and q_SBHD.dtype in (torch.bfloat16, torch.float16) and keys_TBD.dtype == q_SBHD.dtype
            and dim >= 16 and dim & (dim - 1) == 0)


def index_scores(q_SBHD: torch.Tensor, weights_SBH: torch.Tensor, keys_TBD: torch.Tensor, query_start: int,
                 key_start: int, use_relu: bool) -> torch.Tensor:
    """Masked index scores ``[b, s, t]`` fp32 of queries at ``query_start + i`` over keys at
    ``key_start + j`` (keys ``[t, 1 or b, d]``, batch 1 shared by every query batch row)."""
    seq, batch, heads, dim = q_SBHD.shape
    keys = keys_TBD.shape[0]
    out = torch.empty(batch, seq, keys, dtype=torch.float32, device=q_SBHD.device)
    tile = dict(BLOCK_Q=64, BLOCK_T=64) if INTERPRETED else {}
    grid = lambda meta: (triton.cdiv(seq, meta["BLOCK_Q"]), triton.cdiv(keys, meta["BLOCK_T"]))  # noqa: E731
    for b in range(batch):
        q = q_SBHD[:, b].contiguous()
        w = weights_SBH[:, b].contiguous()
        k = keys_TBD[:, b if keys_TBD.shape[1] > 1 else 0].contiguous()
        _kernel[grid](q, w, k, out[b], seq, keys, query_start, key_start, q.stride(0), q.stride(1), w.stride(0),
                      k.stride(0), out.stride(1), HEADS=heads, DIM=dim, RELU=use_relu, **tile)
    return out
