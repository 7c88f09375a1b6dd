"""The Triton RMSNorm of the no-grad paths (``ops/rms_norm_triton.py``), run by Triton's CPU
interpreter, against ``models/norms.py``'s step-by-step math."""

from megatron_longstraw.testing.triton_interpreter import run_interpreted

_INTERPRETED_KERNEL = """
from megatron_longstraw.testing.triton_interpreter import patch_loop_bounds
patch_loop_bounds()
import torch
from megatron_longstraw.ops.rms_norm_triton import rms_norm

gen = torch.Generator().manual_seed(0)


def step_by_step(x, w, eps, plus_one):  # models/norms.py RMSNorm.forward (autograd path)
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (w.float() + 1.0 if plus_one else w.float())).to(x.dtype)


checked = 0
for dtype in (torch.float32, torch.float16):
    for shape, plus_one in (((5, 3, 64), True), ((7, 100), False), ((1, 1, 2, 48), True)):
        x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
        w = (torch.randn(shape[-1], generator=gen) * 0.1).to(dtype)
        got = rms_norm(x, w, 1e-6, plus_one)
        want = step_by_step(x, w, 1e-6, plus_one)
        assert got.dtype == dtype and got.shape == x.shape
        if dtype == torch.float32:
            error = ((got - want).abs().max() / want.abs().max()).item()
            assert error <= 1e-6, (shape, error)
        else:  # the same fp32 value up to its last bits, rounded once: at most one fp16 step apart
            step = torch.finfo(dtype).eps * want.float().abs().clamp_min(2.0 ** -14)
            assert bool(((got.float() - want.float()).abs() <= step).all()), shape
        checked += 1
    # a non-contiguous input (a column slice) and no rows
    x = torch.randn(6, 80, generator=gen).to(dtype)[:, 8:72]
    w = torch.randn(64, generator=gen).to(dtype)
    assert torch.allclose(rms_norm(x, w, 1e-5, False).float(), step_by_step(x, w, 1e-5, False).float(),
                          rtol=2e-3, atol=1e-5)
    assert rms_norm(x[:0], w, 1e-5, False).shape == (0, 64)
assert checked == 6
print("ok")
"""


def test_rms_norm_kernel_in_triton_interpreter():
    """fp32 within 1e-6 of the step-by-step math, fp16 within one rounding step, zero-centred
    and plain weights, widths not a power of two, a non-contiguous input, an empty one."""
    result = run_interpreted(_INTERPRETED_KERNEL)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
