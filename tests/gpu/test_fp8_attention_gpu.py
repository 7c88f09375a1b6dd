"""GPU tier, FP8 attention in the capture (``--fp8-attention capture``; the cuDNN frontend from
``.whl-c``, ``scripts/gpu_host.sh install-c``): cuDNN's ``sdpa_fp8`` against exact attention on the
same E4M3 inputs, beside its torch emulation; the capture of ``qwen3.5-0.8b`` against its bf16
capture; and a head dim it cannot take."""

import importlib

import pytest
import torch

from megatron_longstraw.attention import fp8_capture_attention as fp8
from megatron_longstraw.attention.kernel_options import KernelOptions
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention
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


def _exact_capture_attention(q_SBHD, k_SBGD, v_SBGD, prefix_k_SBGD, prefix_v_SBGD, key_block=131072,
                             query_block=4096):
    """The capture chunk's attention (queries over every page and causally over the chunk) in
    fp32 without TF32, by blocks of queries and keys with an online softmax: the reference. Its
    own loop, not ``partials.merge_partials``, which the code under test merges with; and not
    ``prefix_causal_attention_math``, whose scores of 32K queries over 1M keys do not fit."""
    seq, _, heads, dim = q_SBHD.shape
    keys_TGD = torch.cat([prefix_k_SBGD, k_SBGD])[:, 0]
    values_TGD = torch.cat([prefix_v_SBGD, v_SBGD])[:, 0]
    pages, total = prefix_k_SBGD.shape[0], keys_TGD.shape[0]
    rep = heads // keys_TGD.shape[1]
    out_SHD = torch.empty(seq, heads, v_SBGD.shape[-1], device=q_SBHD.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for q0 in range(0, seq, query_block):
            q_HSD = q_SBHD[q0:q0 + query_block, 0].float().transpose(0, 1)
            rows = q_HSD.shape[1]
            top_HS = torch.full((heads, rows), float("-inf"), device=q_SBHD.device)
            total_HS = torch.zeros(heads, rows, device=q_SBHD.device)
            acc_HSD = torch.zeros(heads, rows, v_SBGD.shape[-1], device=q_SBHD.device)
            visible_to = pages + q0 + 1 + torch.arange(rows, device=q_SBHD.device)  # keys before these
            for k0 in range(0, min(total, pages + q0 + rows), key_block):
                k_HTD = keys_TGD[k0:k0 + key_block].float().repeat_interleave(rep, 1).transpose(0, 1)
                v_HTD = values_TGD[k0:k0 + key_block].float().repeat_interleave(rep, 1).transpose(0, 1)
                scores_HST = (q_HSD @ k_HTD.transpose(1, 2)) * dim ** -0.5
                position_T = k0 + torch.arange(k_HTD.shape[1], device=q_SBHD.device)
                scores_HST = scores_HST.masked_fill(position_T[None, None, :] >= visible_to[None, :, None],
                                                    float("-inf"))
                new_top_HS = torch.maximum(top_HS, scores_HST.amax(-1))
                probs_HST = (scores_HST - new_top_HS[..., None]).exp()
                keep_HS = (top_HS - new_top_HS).exp()
                acc_HSD = acc_HSD * keep_HS[..., None] + probs_HST @ v_HTD
                total_HS = total_HS * keep_HS + probs_HST.sum(-1)
                top_HS = new_top_HS
            out_SHD[q0:q0 + rows] = (acc_HSD / total_HS[..., None]).transpose(0, 1)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out_SHD[:, None]


@pytest.mark.parametrize("queries,pages", [(1024, 262144), (1024, 1048576), (32768, 1048576)])
def test_capture_attention_over_long_prompts_is_as_accurate_as_its_emulation(queries, pages, record_property):
    """The whole FP8 capture attention of one chunk (the pages in blocks of 262,144 keys, the
    chunk causal, merged) over up to a million pages, 8 query / 2 KV heads of 256, against exact
    fp32 attention of the same bf16 inputs, beside the same orchestration on the emulated
    kernel (its first 1,024 queries, against their exact attention). The values share a common
    direction, as a model's do, so the output sits near their mean: an error that rescales or
    mixes the blocks' partials shows at once. The kernel's error must be FP8's own: at most 1.1x
    the emulation's (the bf16 capture attention's error is recorded beside them)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    common = torch.randn(1, 1, 2, 256, device="cuda", generator=gen)
    q = torch.randn(queries, 1, 8, 256, device="cuda", generator=gen).bfloat16()
    k_all = torch.randn(pages + queries, 1, 2, 256, device="cuda", generator=gen).bfloat16()
    v_all = (0.5 * torch.randn(pages + queries, 1, 2, 256, device="cuda", generator=gen) + common).bfloat16()
    pk, pv, k, v = k_all[:pages], v_all[:pages], k_all[pages:], v_all[pages:]
    options = KernelOptions(prefix_block=262144)

    def rel(got, want):
        return ((got.float() - want).norm() / want.norm()).item()

    exact = _exact_capture_attention(q, k, v, pk, pv)
    kernel_err = rel(fp8.fp8_capture_attention(q, k, v, pk, pv, options=options), exact)
    with torch.no_grad():  # the bf16 capture attention beside it, for the record
        bf16_err = rel(prefix_causal_attention(q, k, v, pk, pv, options=options), exact)
    del exact
    few = min(queries, 1024)
    emulated = fp8.fp8_capture_attention(q[:few], k[:few], v[:few], pk, pv, options=options, kernel=emulated_sdpa_fp8)
    emulation_err = rel(emulated, _exact_capture_attention(q[:few], k[:few], v[:few], pk, pv))
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
