"""Pure-torch versions of the fla kernels that Gated DeltaNet calls, with fla's signatures.

They serve the CPU path (fla's Triton kernels need a GPU) and act as the slow references that
the GPU kernels are checked against. Megatron ships the chunked delta rule itself
(``torch_chunk_gated_delta_rule``); this module adds ``l2norm`` and ``causal_conv1d`` with
fla's conventions (conv state ``[N, D, W]`` holding the last ``W`` inputs).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

__all__ = ["l2norm", "causal_conv1d", "chunk_gated_delta_rule"]


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype=None) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over ``dim``, computed in fp32 (fla's definition; fp64 for
    fp64 inputs, the exactness tests)."""
    x_compute = x.to(torch.promote_types(x.dtype, torch.float32))
    y = x_compute * torch.rsqrt(x_compute.pow(2).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def causal_conv1d(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    activation: Optional[str] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    **kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Depthwise causal conv over ``x_BTD`` with weight ``[D, W]``; returns ``(y_BTD, state)``.

    ``initial_state`` / the returned state are ``[B, D, W]``: the ``W`` inputs before the first
    / after the last token (zeros where the sequence is shorter), as in fla.
    """
    if cu_seqlens is not None:
        raise ValueError("causal_conv1d (torch): packed sequences (cu_seqlens) are not supported")
    batch, seq_len, dim = x.shape
    width = weight.shape[-1]
    x_BDT = x.transpose(1, 2)
    if initial_state is None:
        history_BDW = x_BDT.new_zeros(batch, dim, width)
    else:
        history_BDW = initial_state.to(x_BDT.dtype)
    padded_BDT = torch.cat([history_BDW[:, :, 1:], x_BDT], dim=-1)
    y_BDT = F.conv1d(padded_BDT.to(weight.dtype), weight.unsqueeze(1), bias, groups=dim)
    if activation in ("silu", "swish"):
        y_BDT = F.silu(y_BDT)
    elif activation is not None:
        raise ValueError(f"causal_conv1d (torch): unsupported activation {activation!r}")
    y = y_BDT.transpose(1, 2).to(x.dtype)
    if residual is not None:
        y = y + residual
    final_state = None
    if output_final_state:
        final_state = torch.cat([history_BDW, x_BDT], dim=-1)[:, :, -width:].contiguous()
    return y, final_state


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False):
    """Token-by-token ``S_t = e^{g_t} S_{t-1} + beta_t k_t (v_t - e^{g_t} S_{t-1}^T k_t)^T``,
    ``o_t = S_t^T q_t / sqrt(K)``, in the inputs' precision (fp64 stays fp64)."""
    batch, seq, heads, dim_k = q.shape
    compute = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (t.to(compute) for t in (q, k, v, g, beta))
    q = q * dim_k ** -0.5
    state = (torch.zeros(batch, heads, dim_k, v.shape[-1], dtype=compute, device=q.device)
             if initial_state is None else initial_state.to(compute))
    outs = []
    for t in range(seq):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)) * beta[:, t, :, None]
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, dim=1), (state if output_final_state else None)


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
):
    """fla's ``chunk_gated_delta_rule`` signature over Megatron's torch implementation.

    Inputs are ``[B, T, H, K]`` / ``[B, T, H, V]``, ``g`` and ``beta`` ``[B, T, H]``; the
    state is ``[B, H, K, V]`` in fp32. Megatron's chunked code computes in fp32 whatever the
    input; fp64 inputs (precision tests) take the exact token recurrence instead.
    """
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError("chunk_gated_delta_rule (torch): only the default scale is supported")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if q.dtype == torch.float64:
        if cu_seqlens is not None:
            raise ValueError("chunk_gated_delta_rule (torch): packed sequences are not supported")
        out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state)
        return out, state
    out, state = torch_chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )
    return out, state
