"""RMSNorm for the local spec: fp32 math, optional zero-centred ("1 + w") gamma, SP-aware.

Megatron's local ``WrappedTorchNorm`` refuses ``layernorm_zero_centered_gamma`` and sequence
parallelism, both of which Qwen3.5 needs; Transformer Engine's ``TENorm`` supports them and is
used by the TE spec instead.
"""

import contextlib
import copy

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_longstraw.ops import rms_norm_triton


_FUSED_WITHOUT_AUTOGRAD = False


@contextlib.contextmanager
def fused_without_autograd():
    """Within the block, RMSNorms that run without autograd take one fused kernel (on a GPU
    ``ops/rms_norm_triton.py``, where the step-by-step math is ten; on a CPU, and inside a
    compiled function, torch's ``rms_norm``): the prompt's capture and decoding enter it. Outside
    the block they keep the step-by-step math of the autograd path, so that the old log-probs
    scored without autograd are bit for bit the ones replay computes (the ratio is exactly 1
    before an update); the fused kernel rounds differently."""
    global _FUSED_WITHOUT_AUTOGRAD
    previous, _FUSED_WITHOUT_AUTOGRAD = _FUSED_WITHOUT_AUTOGRAD, True
    try:
        yield
    finally:
        _FUSED_WITHOUT_AUTOGRAD = previous


class RMSNorm(torch.nn.Module):
    """``x / rms(x) * w`` (or ``* (1 + w)`` when zero-centred), computed in fp32.

    ``zero_centered_gamma=None`` follows ``config.layernorm_zero_centered_gamma``; a spec may
    force it off for a norm whose reference weight is plain (Gated DeltaNet's output norm).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6,
                 zero_centered_gamma=None, **kwargs):
        super().__init__()
        if zero_centered_gamma is None:
            zero_centered_gamma = config.layernorm_zero_centered_gamma
        self.zero_centered_gamma = zero_centered_gamma
        self.eps = eps
        init = torch.zeros if zero_centered_gamma else torch.ones
        device = None if config.use_cpu_initialization else torch.cuda.current_device()  # None: default
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype, device=device))
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize over the last dimension."""
        compute = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 tests
        if _FUSED_WITHOUT_AUTOGRAD and not torch.is_grad_enabled():
            return self._forward_fused(x, compute)
        x32 = x.to(compute)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self._gamma(compute)).to(x.dtype)

    def _gamma(self, compute: torch.dtype) -> torch.Tensor:
        """The weight in ``compute``, plus one when zero-centred."""
        gamma = self.weight.to(compute)
        return gamma + 1.0 if self.zero_centered_gamma else gamma

    def _forward_fused(self, x: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
        """The same math in fewer kernels (``fused_without_autograd``): a decode step runs about
        sixty norms of a few rows each. The activations saved for backward, which the memory plan
        counts, are those of the autograd path."""
        if rms_norm_triton.supported(x) and compute == torch.float32 and not torch.compiler.is_compiling():
            return rms_norm_triton.rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)
        return torch.nn.functional.rms_norm(x.to(compute), (x.shape[-1],), self._gamma(compute), self.eps).to(x.dtype)


class PlainTENorm:
    """Transformer Engine RMSNorm with zero-centred gamma forced off, whatever the config says.

    Used under the TE spec for norms whose reference weight is plain ``w`` although the model's
    other norms are ``1 + w`` (Qwen3.5's Gated DeltaNet output norm).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        from megatron.core.extensions.transformer_engine import TENorm

        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        return TENorm(plain, hidden_size, eps)
