"""FP8 attention numerics emulated in torch, for the no-grad prompt capture: the reference that
says on any machine what an FP8 attention forward (cuDNN's ``sdpa_fp8`` on Hopper, FlashAttention-3's
FP8 path) does to a model, and what a kernel's own error must be judged against.

One call is one capture chunk's queries over the cached pages and the chunk itself (causal), as
the capture's attention computes it (``attention/prefix_attention.py``); every tensor cast takes
its scale from the call itself (current scaling, so per chunk):

- ``Q``, ``K`` and ``V`` (the pages and the chunk's keys/values together) are cast to E4M3, one
  scale per tensor (``fp8_max / amax``);
- the scores ``Q K^T`` accumulate exactly (fp32, fp64 for fp64 inputs), are scaled and masked;
- the unnormalized probabilities ``P = exp(S - rowmax)``, in ``(0, 1]``, are cast to E4M3 with the
  fixed scale ``fp8_max`` (amax 1: no pass over ``P`` is needed to choose it), while the row sums
  that normalize the output are taken from ``P`` before the cast, in full precision;
- ``O = P V / rowsum`` accumulates exactly and is cast to E4M3 with its own scale (Hopper's
  kernels return FP8; the next GEMM takes it back to the model's dtype).

This is an ideal FP8 kernel: one softmax over every key of the row, where a fused kernel keeps a
running maximum over key blocks and so casts ``P`` against block-local maxima (values at most
1 either way, so the same grid). The K/V pages themselves stay in the model's dtype.

``emulated_fp8_capture_attention(model)`` makes every full-attention core of the model compute
its capture (``forward_capture``, without context parallelism) this way, through the cores'
``capture_attention`` hook; replay, decode and the prompt backward keep their own attention.
"""

from contextlib import contextmanager
from typing import Optional

import torch
from megatron.core import parallel_state

from megatron_longstraw.attention.partials import default_scale, expand_groups
from megatron_longstraw.attention.sdpa_core import SDPACoreAttention, capture_attention_as
from megatron_longstraw.testing.fp8_emulation import E4M3, quantize_dequantize


def fp8_prefix_attention(q_SBHD: torch.Tensor, k_SBGD: torch.Tensor, v_SBGD: torch.Tensor,
                         prefix_k_SBGD: Optional[torch.Tensor] = None, prefix_v_SBGD: Optional[torch.Tensor] = None,
                         scale: Optional[float] = None, **_) -> torch.Tensor:
    """Emulated FP8 forward of the chunk's queries ``[s, b, h, d]`` over the prefix ``[p, b or 1,
    groups, d]`` (all visible) and the chunk's keys ``[s, b, groups, d]`` (causal); no autograd.
    Returns ``[s, b, h, d_v]`` in the queries' dtype (see the module docstring)."""
    seq, batch, heads, dim = q_SBHD.shape
    scale = default_scale(scale, dim)
    compute = torch.promote_types(q_SBHD.dtype, torch.float32)
    keys, values = k_SBGD, v_SBGD
    prefix = 0
    if prefix_k_SBGD is not None and prefix_k_SBGD.shape[0] > 0:
        prefix = prefix_k_SBGD.shape[0]
        keys = torch.cat([prefix_k_SBGD.expand(-1, batch, -1, -1), k_SBGD])
        values = torch.cat([prefix_v_SBGD.expand(-1, batch, -1, -1), v_SBGD])
    with torch.no_grad():
        q8, k8, v8 = (quantize_dequantize(t.to(compute), E4M3) for t in (q_SBHD, keys, values))
        q_BHSD = q8.permute(1, 2, 0, 3)
        k_BHKD = expand_groups(k8.permute(1, 2, 0, 3), heads)
        v_BHKD = expand_groups(v8.permute(1, 2, 0, 3), heads)
        scores_BHSK = (q_BHSD @ k_BHKD.transpose(-1, -2)) * scale
        visible_SK = torch.ones(seq, prefix + seq, dtype=torch.bool, device=q_SBHD.device).tril(prefix)
        scores_BHSK = scores_BHSK.masked_fill(~visible_SK, float("-inf"))
        probs_BHSK = (scores_BHSK - scores_BHSK.amax(-1, keepdim=True)).exp()  # in (0, 1]; 0 where masked
        rowsum_BHS1 = probs_BHSK.sum(-1, keepdim=True)
        probs8_BHSK = quantize_dequantize(probs_BHSK, E4M3, amax=torch.ones((), device=q_SBHD.device))
        out_BHSD = (probs8_BHSK @ v_BHKD) / rowsum_BHS1
        out_BHSD = quantize_dequantize(out_BHSD, E4M3)
    return out_BHSD.permute(2, 0, 1, 3).to(q_SBHD.dtype)


def _truncate(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` with its mantissa truncated to ``bits`` bits (toward zero)."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.trunc(mantissa * 2 ** bits) / 2 ** bits, exponent)


def emulated_sdpa_fp8(q8, k8, v8, descale_q, descale_k, descale_v, scale_s, scale_o, attn_scale: float,
                      causal: bool, accumulator_bits: Optional[int] = None,
                      accumulator_tile: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's ``sdpa_fp8`` forward emulated in torch, with the interface of
    ``attention/fp8_capture_attention.py``'s ``cudnn_sdpa_fp8`` (the orchestration's kernel on a
    CPU): the inputs dequantized by their descales, exact fp32 (fp64) products, the unnormalized
    probabilities cast at ``scale_s`` into the inputs' dtype and the row sums taken before the
    cast, the output cast at ``scale_o``; returns ``(O [b, h, s, d_v] in the inputs' dtype,
    lse [b, h, s])``. With an fp64 "FP8 dtype" every cast is exact: plain attention.

    ``accumulator_bits``, when given, models a coarse ``P V`` accumulator instead of an exact one:
    the sum runs over tiles of ``accumulator_tile`` keys and is truncated to that many mantissa
    bits after every tile, so its precision is relative to the accumulated output (as Hopper's
    FP8 kernel behaves; see ``fp8_capture_attention``'s centring)."""
    compute = torch.float64 if q8.dtype == torch.float64 else torch.float32
    heads = q8.shape[1]
    q = q8.to(compute) * descale_q.to(compute)
    k = expand_groups(k8.to(compute) * descale_k.to(compute), heads)
    v = expand_groups(v8.to(compute) * descale_v.to(compute), heads)
    scores = (q @ k.transpose(-1, -2)) * attn_scale
    if causal:
        visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    probs = (scores - top).exp()
    rowsum = probs.sum(-1, keepdim=True)
    probs8 = (probs * scale_s.to(compute)).to(q8.dtype).to(compute) / scale_s.to(compute)
    if accumulator_bits is None:
        acc = probs8 @ v
    else:
        acc = torch.zeros(*q.shape[:3], v.shape[-1], dtype=compute, device=q.device)
        for start in range(0, k.shape[2], accumulator_tile):
            end = start + accumulator_tile
            acc = _truncate(acc + probs8[..., start:end] @ v[:, :, start:end], accumulator_bits)
    out = acc / rowsum
    return (out * scale_o.to(compute)).to(q8.dtype), (top + rowsum.log())[..., 0]


@contextmanager
def emulated_fp8_capture_attention(model: torch.nn.Module):
    """Inside, every ``SDPACoreAttention`` of ``model`` computes its capture with
    ``fp8_prefix_attention``; the hooks are restored on exit."""
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_context_parallel_world_size() > 1:
        raise ValueError("emulated FP8 attention: the capture under context parallelism does not take the hook")
    if not any(isinstance(m, SDPACoreAttention) for m in model.modules()):
        raise ValueError("emulated FP8 attention: the model has no full-attention core (SDPACoreAttention)")
    with capture_attention_as(model, fp8_prefix_attention):
        yield
