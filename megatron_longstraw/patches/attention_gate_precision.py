"""Fix: the attention output gate of an fp64 model stays fp64.

Megatron's ``Attention._apply_output_gate`` (Qwen3.5's gated attention) computes
``x * sigmoid(gate.float())``: "at least fp32" for bf16/fp32, a downcast for fp64. An fp64 model
then rounds the gate's gradient to fp32, differently for a sum over several responses than for
each response alone, so the fp64 tests of exact prompt gradients could not resolve their bound.
The replacement computes in ``promote_types(dtype, float32)`` for fp64 inputs and calls
Megatron's own (fused) function otherwise: identical below fp64.
"""

import torch
from megatron.core.transformer.attention import Attention

_ORIGINAL = Attention._apply_output_gate


def apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` in fp64 for fp64 inputs; Megatron's function below fp64."""
    if x.dtype != torch.float64:
        return _ORIGINAL(self, x, gate)
    return x * torch.sigmoid(gate.contiguous().view(*x.shape).to(x.dtype))


def needed() -> bool:
    """Always (a no-op below fp64)."""
    return True


def apply() -> None:
    """Install the fp64-keeping gate."""
    Attention._apply_output_gate = apply_output_gate


def revert() -> None:
    """Restore Megatron's gate."""
    Attention._apply_output_gate = _ORIGINAL
