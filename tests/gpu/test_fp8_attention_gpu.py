"""GPU tier, FP8 attention in the capture (``--fp8-attention capture``; the cuDNN frontend from
``.whl-c``, ``scripts/gpu_host.sh install-c``): cuDNN's ``sdpa_fp8`` against its torch emulation on
the same E4M3 inputs, the capture of ``qwen3.5-0.8b`` against its bf16 capture, and a head dim
it cannot take."""

import importlib

import pytest
import torch

from megatron_longstraw.attention import fp8_capture_attention as fp8
from megatron_longstraw.attention.kernel_options import KernelOptions
from megatron_longstraw.testing.fp8_attention_emulation import emulated_sdpa_fp8


def _hopper_with_cudnn_frontend() -> bool:
    try:
        importlib.import_module("cudnn")
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper_with_cudnn_frontend(),
                                                  reason="needs Hopper and nvidia-cudnn-frontend (install-c)")]


@pytest.mark.parametrize("causal,queries,keys", [(False, 512, 2048), (True, 512, 512), (False, 500, 1000),
                                                 (True, 404, 404)])
def test_cudnn_kernel_matches_its_emulation(causal, queries, keys, record_property):
    """One call (lengths on the 128-grid and off it), 8 query / 2 KV heads of 256: cuDNN's output
    (dequantized) and log-sum-exp against the emulation's on the same E4M3 inputs and scales. The
    emulation casts P against the row's maximum, a fused kernel against running block maxima
    (and may scale the normalized P): both on E4M3's grid, so they differ by
    a few E4M3 roundings, well under the 6% FP8 itself moves the output."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, queries, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, keys, 256, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    q8, dq = fp8.cast_fp8(q)
    k8, dk = fp8.cast_fp8(k)
    v8, dv = fp8.cast_fp8(v)
    scale_s = torch.full((1, 1, 1, 1), fp8.P_SCALE, device="cuda")
    scale_o = 0.5 / dv
    got, got_lse = fp8.cudnn_sdpa_fp8(q8, k8, v8, dq, dk, dv, scale_s, scale_o, 256 ** -0.5, causal)
    want, want_lse = emulated_sdpa_fp8(q8, k8, v8, dq, dk, dv, scale_s, scale_o, 256 ** -0.5, causal)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    lse = (got_lse - want_lse).abs().max().item()
    record_property("out_rel_err", f"{rel:.2e}")
    record_property("lse_max_abs", f"{lse:.2e}")
    assert rel < 2e-2 and lse < 1e-3, (rel, lse)


def test_capture_in_fp8_against_bf16(single_process, record_property):
    """qwen3.5-0.8b (random weights, head dim 256), a 4,500-token prompt in 1,000-token chunks
    (a last chunk of 500, page counts off the 128-grid): the last position's log-probs of the
    FP8-attention capture within 2e-2 mean absolute of the bf16 capture's."""
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.models.presets import resolve_hf_config

    hf = resolve_hf_config("qwen3.5-0.8b")
    plain = build_model(hf, ModelOptions(params_dtype=torch.bfloat16)).eval()
    fp8_model = build_model(hf, ModelOptions(params_dtype=torch.bfloat16,
                                             kernel_options=KernelOptions(fp8_attention="capture"))).eval()
    fp8_model.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, hf["vocab_size"], (1, 4500), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.no_grad():
        want = capture_prompt(plain, tokens, 1000).last_logits_BV.float().log_softmax(-1)
        got = capture_prompt(fp8_model, tokens, 1000).last_logits_BV.float().log_softmax(-1)
    error = (got - want).abs().mean().item()
    record_property("logprob_mean_abs", f"{error:.2e}")
    assert torch.isfinite(got).all() and error < 2e-2, error


def test_a_head_dim_it_cannot_take_names_the_flag():
    with pytest.raises(ValueError, match=r"^--fp8-attention capture: cuDNN's FP8 attention takes head dims"):
        fp8.check_supported([24], torch.device("cuda"))
