"""The project's RMSNorm: its no-grad path (torch's fused ``rms_norm``) against its autograd path."""

import types

import pytest
import torch

from megatron_longstraw.models.norms import RMSNorm, fused_without_autograd


def _config(dtype):
    return types.SimpleNamespace(layernorm_zero_centered_gamma=True, use_cpu_initialization=True,
                                 params_dtype=dtype, sequence_parallel=False)


# relative to the largest output: rounding of the computing dtype; for bf16 one bf16 rounding of
# nearly the same fp32 value (at most one unit in the last place apart)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 1e-6), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_fused_path_equals_the_autograd_path(dtype, tol, zero_centered):
    """Capture and decoding (no autograd, the fused kernel) normalize as replay does, and both as
    the fp64 formula ``x / rms(x) * (1 + w)`` (or ``* w``), within the rounding of the computing
    dtype; without autograd outside that block (scoring) the result is replay's bit for bit."""
    norm = RMSNorm(_config(dtype), 48, eps=1e-6, zero_centered_gamma=zero_centered)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=torch.Generator().manual_seed(0)).to(dtype))
    x = (3 * torch.randn(5, 2, 48, generator=torch.Generator().manual_seed(1))).to(dtype).requires_grad_()
    with_grad = norm(x)
    assert with_grad.requires_grad and with_grad.dtype == dtype
    with torch.no_grad():
        assert torch.equal(norm(x), with_grad.detach())  # scoring: the old log-probs are replay's
        with fused_without_autograd():
            without = norm(x)
    diff = (without.double() - with_grad.detach().double()).abs().max().item()
    scale = with_grad.detach().double().abs().max().item()
    assert diff <= tol * scale, diff
    gamma = norm.weight.double() + (1.0 if zero_centered else 0.0)
    x64 = x.detach().double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
    assert (without.double() - want).abs().max().item() <= tol * scale
