"""FP8 GEMM numerics emulated in torch: the reference that separates what FP8 itself does to a
model from what Transformer Engine's implementation does.

Inside ``emulated_fp8_linears(model, recipe)`` every Megatron ``ColumnParallelLinear`` and
``RowParallelLinear`` of a local-spec model except the output layer (the GEMMs Megatron's TE
spec runs in FP8) computes like an FP8 GEMM of the ``hybrid`` format: the input and the weight
are cast to E4M3, the output gradient to E5M2, each with one scale per tensor, and the products
accumulate exactly (in the model's dtype). ``recipe``:

- ``tensorwise`` (TE's ``Float8CurrentScaling``): the scale comes from the tensor being cast;
- ``delayed`` (TE's ``DelayedScaling`` with Megatron's default history of one): every cast
  records its amax into a running maximum, casts saturate, and the scale moves to that maximum
  (which then starts afresh) only after a call with gradients enabled (TE updates forward scales
  when an autocast exits with gradients on; gradient scales after every backward). So a replay
  forward casts with the scale its previous replay set, and the next one with the largest amax
  of every call since, the no-grad capture chunks between included. A role's first cast uses
  its own amax, as LongStraw's calibrations make TE do (the first capture's dropped chunk and
  the first replay's dropped backward, ``models/fp8.py``).

``passes="forward"`` or ``"backward"`` casts in that pass only (the other computes from the
uncast tensors): which of the two moves a model's gradients. Runs on CPU and GPU, on one
tensor-parallel rank without sequence parallelism (``ValueError`` otherwise).
"""

from contextlib import contextmanager
from typing import Callable, Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import get_pg_size

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "delayed")


def quantize_dequantize(t: torch.Tensor, dtype: torch.dtype, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t`` cast to the FP8 ``dtype`` with the per-tensor scale ``fp8_max / amax`` (``amax`` of
    ``t`` itself unless given), saturating at ``fp8_max``, and back to ``t``'s dtype."""
    fp8_max = torch.finfo(dtype).max
    amax = (t.abs().amax() if amax is None else amax).float().clamp(min=1e-12)
    scale = fp8_max / amax
    return ((t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype).float() / scale).to(t.dtype)


class _Scales:
    """Per-module amax memory: ``amax(role, t)`` is the amax to cast ``t`` with; ``cast`` casts
    ``t`` in the passes it is asked for."""

    def __init__(self, recipe: str, passes: str):
        self.recipe, self.passes = recipe, passes
        self.scale_amax: dict[str, torch.Tensor] = {}  # delayed: what each role casts with now
        self.running_amax: dict[str, torch.Tensor] = {}  # delayed: the max since the last move

    def cast(self, role: str, t: torch.Tensor, dtype: torch.dtype, backward: bool, moves: bool) -> torch.Tensor:
        """``t`` cast for ``role``; under delayed scaling ``moves`` says whether the role's scale
        moves to the largest amax recorded since its last move, this cast's included."""
        if self.passes != "both" and (self.passes == "backward") != backward:
            return t
        return quantize_dequantize(t, dtype, self.amax(role, t, moves))

    def amax(self, role: str, t: torch.Tensor, moves: bool) -> torch.Tensor:
        current = t.detach().abs().amax()
        if self.recipe == "tensorwise":
            return current
        amax = self.scale_amax.setdefault(role, current)
        running = torch.maximum(self.running_amax.pop(role, current), current)
        if moves:
            self.scale_amax[role] = running
        else:
            self.running_amax[role] = running
        return amax


class _Fp8Linear(torch.autograd.Function):
    """``y = x @ w.T`` from E4M3 ``x`` and ``w``; ``dx``, ``dw`` from the E5M2 output gradient
    and the same E4M3 operands (what TE keeps for backward)."""

    @staticmethod
    def forward(ctx, x_SBI, weight_OI, scales: _Scales, grad_enabled: bool):
        x8 = scales.cast("input", x_SBI, E4M3, backward=False, moves=grad_enabled)
        w8 = scales.cast("weight", weight_OI, E4M3, backward=False, moves=grad_enabled)
        ctx.save_for_backward(x8, w8)
        ctx.scales = scales
        return x8 @ w8.t()

    @staticmethod
    def backward(ctx, grad_SBO):
        x8, w8 = ctx.saved_tensors
        g8 = ctx.scales.cast("grad_output", grad_SBO, E5M2, backward=True, moves=True)
        grad_weight_OI = g8.reshape(-1, g8.shape[-1]).t() @ x8.reshape(-1, x8.shape[-1])
        return g8 @ w8, grad_weight_OI, None, None


def _fp8_forward_impl(scales: _Scales):
    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False, **_):
        assert not gradient_accumulation_fusion, "emulated FP8 writes .grad, not main_grad"
        out = _Fp8Linear.apply(input, weight, scales, torch.is_grad_enabled())  # (off inside apply)
        return out if bias is None else out + bias
    return forward_impl


@contextmanager
def switched_linears(model: torch.nn.Module, make_forward_impl: Callable[[], Callable]):
    """Within the block, each of ``model``'s ``ColumnParallelLinear``/``RowParallelLinear``
    layers except the output layer (the GEMMs Megatron's TE spec runs in FP8) computes with its
    own ``make_forward_impl()`` (Megatron's ``_forward_impl`` signature); yields how many layers
    are switched. Restores them after."""
    switched = [(name, module) for name, module in model.named_modules()
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not name.endswith("output_layer")]
    for name, module in switched:  # all checked before any is switched
        if get_pg_size(module.tp_group) > 1 or module.sequence_parallel:
            raise ValueError(f"emulated GEMM numerics run one tensor-parallel rank without sequence parallelism ({name})")
        assert "_forward_impl" not in vars(module), f"{name} is switched already"
    for _, module in switched:
        module._forward_impl = make_forward_impl()
    try:
        yield len(switched)
    finally:
        for _, module in switched:
            del module._forward_impl  # back to the class's implementation


def emulated_fp8_matmul(x_SI: torch.Tensor, weight_OI: torch.Tensor) -> torch.Tensor:
    """``x_SI @ weight_OI.T`` as one ideal FP8 GEMM of the hybrid format with tensorwise scales
    (the casts above, exact accumulation), differentiable in both operands: one layer's
    reference outside a model."""
    return _Fp8Linear.apply(x_SI, weight_OI, _Scales("tensorwise", "both"), torch.is_grad_enabled())


def emulated_fp8_linears(model: torch.nn.Module, recipe: str = "tensorwise", passes: str = "both"):
    """Context manager: within it, ``model``'s linear layers except the output layer compute as
    FP8 GEMMs of ``recipe`` in ``passes`` (module docstring), each layer with its own scales."""
    if recipe not in RECIPES:
        raise ValueError(f"emulated FP8 recipe must be one of {RECIPES}, got {recipe!r}")
    if passes not in ("forward", "backward", "both"):
        raise ValueError(f"emulated FP8 passes must be forward, backward or both, got {passes!r}")
    return switched_linears(model, lambda: _fp8_forward_impl(_Scales(recipe, passes)))
