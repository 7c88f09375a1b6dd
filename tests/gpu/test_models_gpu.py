"""GPU tier: bf16 parity with HF (fla kernels on both sides) and a 32K-token qwen3.5-0.8b step."""

import time

import pytest
import torch

from megatron_longstraw.distributed import device
from megatron_longstraw.models.builder import build_model
from megatron_longstraw.models.options import ModelOptions
from megatron_longstraw.models.presets import resolve_hf_config
from megatron_longstraw.testing.hf_reference import build_hf_model
from megatron_longstraw.testing.parity import forward_logits, megatron_from_hf

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("preset", ["qwen3.5-debug", "glm-5-debug"])
def test_hf_parity_bf16(single_process, preset, record_property):
    """Our bf16 logits are as close to HF's fp32 logits as HF's own bf16 logits are (<= 2x + 0.02)."""
    hf = resolve_hf_config(preset)
    hf_fp32 = build_hf_model(hf, seed=1).to(device())
    hf_bf16 = build_hf_model(hf, seed=1).to(device(), torch.bfloat16)
    ours = megatron_from_hf(hf, hf_bf16, ModelOptions(params_dtype=torch.bfloat16))
    tokens = torch.randint(0, hf["vocab_size"], (2, 256), device=device(),
                           generator=torch.Generator(device=device()).manual_seed(0))
    with torch.no_grad():
        reference = hf_fp32(tokens).logits.float()
        err_hf = (hf_bf16(tokens).logits.float() - reference).abs().max().item()
        err_ours = (forward_logits(ours, tokens).float() - reference).abs().max().item()
    record_property("bf16_err_ours", f"{err_ours:.4f}")
    record_property("bf16_err_hf", f"{err_hf:.4f}")
    assert err_ours <= 2 * err_hf + 0.02, f"ours {err_ours:.4f} vs HF bf16 {err_hf:.4f}"


def test_qwen3_5_0_8b_forward_backward_32k(single_process, record_property):
    """32K tokens with full activation recompute; next-token loss on the last 8K positions
    (a GRPO-shaped step: the full-vocabulary fp32 loss over all 32K positions alone is ~60 GB)."""
    hf = resolve_hf_config("qwen3.5-0.8b")
    model = build_model(hf, ModelOptions(params_dtype=torch.bfloat16, recompute_granularity="full"))
    seq, loss_tokens = 32_768, 8_192
    tokens = torch.randint(0, hf["vocab_size"], (1, seq + 1), device=device())
    position_ids = torch.arange(seq, device=device()).unsqueeze(0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for step in range(2):  # the first step includes kernel compilation
        start = time.perf_counter()
        logits = model(tokens[:, :-1], position_ids, None)[:, -loss_tokens:]
        loss = torch.nn.functional.cross_entropy(logits[0].float(), tokens[0, -loss_tokens:])
        loss.backward()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    record_property("seconds_fwd_bwd", f"{seconds:.3f}")
    record_property("peak_GiB", f"{torch.cuda.max_memory_allocated() / 2**30:.1f}")
    record_property("loss", f"{loss.item():.4f}")
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_random_init_capture_is_finite(single_process, dtype, record_property):
    """The trainer's model (Megatron's random initialization, as without --pretrained-checkpoint)
    captures a 2048-token prompt in 1024-token chunks to finite logits in fp32 (the trainer's
    default without --bf16) and in bf16; where it is not, the first module whose output is not finite is recorded."""
    from megatron_longstraw.longstraw.capture import capture_prompt

    hf = resolve_hf_config("qwen3.5-debug")
    model = build_model(hf, ModelOptions(params_dtype=dtype))
    bad = []

    def check(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(out) and out.is_floating_point() and not bad and not torch.isfinite(out).all():
            bad.append(type(module).__name__ + " " + names[module])
    names = {m: n for n, m in model.named_modules()}
    handles = [m.register_forward_hook(check) for m in model.modules()]
    tokens = torch.randint(0, hf["vocab_size"], (1, 2048), device=device(),
                           generator=torch.Generator(device=device()).manual_seed(0))
    try:
        with torch.no_grad():
            state = capture_prompt(model, tokens, 1024)
    finally:
        for handle in handles:
            handle.remove()
    record_property("first_non_finite", bad[0] if bad else "none")
    assert torch.isfinite(state.last_logits_BV).all() and not bad, bad


def test_rms_norm_kernel_matches_step_by_step(record_property):
    """The Triton RMSNorm of the no-grad paths against ``RMSNorm``'s step-by-step math in bf16
    (decode-sized and capture-sized rows, zero-centred and plain weights): within one bf16
    rounding step of the same fp32 value."""
    from megatron_longstraw.ops.rms_norm_triton import rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for rows, width, plus_one in ((8, 1024, True), (64, 256, True), (32768, 1024, False), (3, 5120, True)):
        x = (torch.randn(rows, width, device="cuda", generator=gen) * 4).bfloat16()
        w = (torch.randn(width, device="cuda", generator=gen) * 0.2).bfloat16()
        x32 = x.float()
        want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)) * (w.float() + 1.0 if plus_one else w.float())
        got = rms_norm(x, w, 1e-6, plus_one)
        steps = (got.float() - want).abs() / (torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-30))
        worst = max(worst, steps.max().item())
    record_property("max_rounding_steps", f"{worst:.2f}")
    assert worst <= 1.0, worst
