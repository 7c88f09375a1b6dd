"""GPU tier, FP8 attention in the capture (``--fp8-attention capture``; the cuDNN frontend from
``.whl-c``, ``scripts/gpu_host.sh install-c``): cuDNN's ``sdpa_fp8`` against exact attention on the
same E4M3 inputs, beside its torch emulation; the capture of ``qwen3.5-0.8b`` against its bf16
capture; and a head dim it cannot take."""

import importlib

import pytest
import torch

from megatron_longstraw.attention import fp8_capture_attention as fp8
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.testing.exact_attention import exact_chunk_attention
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
                                                 (True, 404, 404), (False, 512, 8192)])
def test_cudnn_kernel_is_as_accurate_as_its_emulation(causal, queries, keys, record_property):
    """One call (lengths on the 128-grid and off it), 8 query / 2 KV heads of 256, on E4M3 inputs
    and their scales: cuDNN's output (dequantized) and log-sum-exp against exact attention of the
    same dequantized inputs (every cast exact), beside the emulation's error against the same.

    The kernel is not compared with the emulation directly: the emulation rounds P against the
    row's maximum and a fused kernel against running block maxima, two roundings of P on the same
    grid that differ by about sqrt(2) times the error of either (3.8% where each is 3.6%). Against
    exact attention the kernel's error must be FP8's own: at most 1.1x the emulation's (an error of
    the kernel's own, independent of FP8's, would add in quadrature: 1.1x allows one under half of
    FP8's). The stats come from the same scores in both, so they agree to the kernel's fp32 softmax."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, queries, 256, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, keys, 256, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
    q8, dq = fp8.cast_fp8(q)
    k8, dk = fp8.cast_fp8(k)
    v8, dv = fp8.cast_fp8(v)
    scale_s = torch.full((1, 1, 1, 1), fp8.P_SCALE, device="cuda")
    scale_o = 0.5 / dv
    args = (dq, dk, dv, scale_s, scale_o, 256 ** -0.5, causal)
    got, got_lse = fp8.cudnn_sdpa_fp8(q8, k8, v8, *args)
    emulated, _ = emulated_sdpa_fp8(q8, k8, v8, *args)
    exact, exact_lse = emulated_sdpa_fp8(q8.double(), k8.double(), v8.double(), *args)  # fp64 "FP8": exact casts
    exact = exact / scale_o.double()

    def rel(out):
        return ((out.double() / scale_o.double() - exact).norm() / exact.norm()).item()

    kernel_err, emulation_err = rel(got), rel(emulated)
    lse = (got_lse.double() - exact_lse).abs().max().item()
    record_property("kernel_rel_err", f"{kernel_err:.3e}")
    record_property("emulation_rel_err", f"{emulation_err:.3e}")
    record_property("lse_max_abs", f"{lse:.2e}")
    assert 0 < emulation_err < 0.1, emulation_err  # FP8 moves the output a few percent
    assert kernel_err <= 1.1 * emulation_err and lse < 1e-3, (kernel_err, emulation_err, lse)


@pytest.mark.parametrize("queries,pages", [(1024, 262144), (1024, 1048576), (32768, 1048576)])
def test_capture_attention_over_long_prompts_is_as_accurate_as_its_emulation(queries, pages, record_property):
    """The whole FP8 capture attention of one chunk (the pages in blocks of 262,144 keys, the
    chunk causal, merged) over up to a million pages, 8 query / 2 KV heads of 256, against exact
    fp32 attention of the same bf16 inputs on 128 query rows spread over the chunk (the kernel
    runs the whole chunk: cuDNN picks its kernel by the call's shape), beside the same
    orchestration on the emulated kernel (a chunk of the first 128 queries, against their exact
    attention). The values share a common direction, as a model's do, so the output sits near
    their mean: an error that rescales, mixes heads or mixes the blocks' partials shows at once.
    The kernel's error must be FP8's own: at most 1.1x the emulation's (the bf16 capture
    attention's error is recorded beside them)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    common = torch.randn(1, 1, 2, 256, device="cuda", generator=gen)
    q = torch.randn(queries, 1, 8, 256, device="cuda", generator=gen).bfloat16()
    k_all = torch.randn(pages + queries, 1, 2, 256, device="cuda", generator=gen).bfloat16()
    v_all = (0.5 * torch.randn(pages + queries, 1, 2, 256, device="cuda", generator=gen) + common).bfloat16()
    pk, pv, k, v = k_all[:pages], v_all[:pages], k_all[pages:], v_all[pages:]
    options = KernelOptions(prefix_block=262144)
    rows = torch.linspace(0, queries - 1, 128).round().long().unique().tolist()

    def rel(got, want):
        return ((got.float() - want).norm() / want.norm()).item()

    exact = exact_chunk_attention(q, k, v, pk, pv, rows=rows)
    kernel_err = rel(fp8.fp8_capture_attention(q, k, v, pk, pv, options=options)[rows], exact)
    with torch.no_grad():  # the bf16 capture attention beside it, for the record
        bf16_err = rel(prefix_causal_attention(q, k, v, pk, pv, options=options)[rows], exact)
    few = 128
    emulated = fp8.fp8_capture_attention(q[:few], k[:few], v[:few], pk, pv, options=options, kernel=emulated_sdpa_fp8)
    emulation_err = rel(emulated, exact_chunk_attention(q[:few], k[:few], v[:few], pk, pv))
    record_property("kernel_emulation_bf16_rel_err", f"{kernel_err:.3e},{emulation_err:.3e},{bf16_err:.3e}")
    assert 0 < emulation_err < 0.1, emulation_err
    assert kernel_err <= 1.1 * emulation_err, (kernel_err, emulation_err)


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
    fp8_model = build_model(hf, ModelOptions(params_dtype=torch.bfloat16, fp8_attention="capture")).eval()
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
