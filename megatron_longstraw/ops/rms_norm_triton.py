"""RMSNorm without autograd in one Triton kernel (CUDA): ``x / rms(x) * w`` (``* (1 + w)``
zero-centred) in fp32, written in the input's dtype.

The no-grad norms of the capture and of decoding (``models/norms.py``'s ``fused_without_autograd``)
take it: torch's fused ``rms_norm`` wants the input and weight in fp32, so with the casts around
it a norm is five kernels, and a decode step runs about sixty norms of a few rows each. A program
normalizes one row in fp32 registers: the cast of the input, the weight (plus one), the mean of
squares, the product in the same order as the step-by-step math (``(x * rsqrt(ms + eps)) * w``)
and the cast back. ``tests/test_rms_norm_triton.py`` runs it in Triton's CPU interpreter against
the module's step-by-step math; ``tests/gpu`` on the GPU.
"""

import torch
import triton
import triton.language as tl

MAX_WIDTH = 16384
"""Widest row one program normalizes (the norms of the supported models are at most 8,192)."""


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, width, stride_x, stride_out, eps,
                     PLUS_ONE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / width
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if PLUS_ONE:
        w = w + 1.0
    y = (x * (1.0 / tl.sqrt(mean_square + eps))) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def supported(x: torch.Tensor) -> bool:
    """Whether the kernel takes ``x``: CUDA, at most fp32, a row of at most ``MAX_WIDTH``."""
    return x.is_cuda and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < x.shape[-1] <= MAX_WIDTH


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, plus_one: bool) -> torch.Tensor:
    """``x`` normalized over its last dimension, scaled by ``weight`` (``1 + weight`` with
    ``plus_one``), in ``x``'s dtype and shape; no autograd."""
    width = x.shape[-1]
    assert weight.shape == (width,), (weight.shape, x.shape)
    x_RW = x.reshape(-1, width)
    if x_RW.numel() and x_RW.stride(-1) != 1:
        x_RW = x_RW.contiguous()
    out_RW = torch.empty(x_RW.shape, dtype=x.dtype, device=x.device)
    if x_RW.shape[0]:
        _rms_norm_kernel[(x_RW.shape[0],)](x_RW, weight, out_RW, width, x_RW.stride(0), out_RW.stride(0),
                                           float(eps), PLUS_ONE=plus_one, BLOCK=triton.next_power_of_2(width))
    return out_RW.reshape(x.shape)
