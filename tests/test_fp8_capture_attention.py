"""FP8 attention in the capture (``attention/fp8_capture_attention.py``) on the CPU: the power-of-two
scales by hand, the orchestration (the pages in blocks, the chunk causal, the log-sum-exp merge,
GQA) exact on the emulated cuDNN kernel with exact casts, its E4M3 numerics, the values' centring
against a coarse accumulator, the capture through the cores' hook, and the flag's refusals. cuDNN's own kernel runs in ``tests/gpu``."""

import functools

import pytest
import torch

from megatron_longstraw.attention import fp8_capture_attention as fp8
from megatron_longstraw.attention.partials import expand_groups
from megatron_longstraw.attention.prefix_attention import prefix_causal_attention_math
from megatron_longstraw.config.kernels import KernelOptions
from megatron_longstraw.config.model import PrecisionConfig
from megatron_longstraw.testing.fp8_attention_emulation import emulated_sdpa_fp8


def test_power_of_two_scales_by_hand():
    amax = torch.tensor([1.0, 448.0, 0.0, 1000.0, float("inf"), 3.0e-3, 1e-38])
    assert fp8.pow2_scale(amax).tolist() == [256.0, 1.0, 1.0, 0.25, 1.0, 2.0 ** 17, 2.0 ** 126]
    x = torch.tensor([[-3.0, 0.5], [2.0, 1.0]], dtype=torch.bfloat16)
    x8, descale = fp8.cast_fp8(x)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (1, 1, 1, 1) and descale.item() == 1 / 128
    assert torch.equal(x8.float() * descale.item(), x.float())  # these values are exact in E4M3


def _inputs(gen, seq, heads, groups, dim, prefix, dtype):
    q = torch.randn(seq, 1, heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(seq, 1, groups, dim, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    pk, pv = (torch.randn(prefix, 1, groups, dim, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, pk, pv


@pytest.mark.parametrize("prefix,block", [(0, 8), (23, 8), (23, 1000), (16, 8)])
@pytest.mark.parametrize("heads,groups", [(4, 2), (2, 2)])
def test_orchestration_is_exact_with_exact_casts(prefix, block, heads, groups):
    """fp64 "FP8" (every cast exact): the chunk over itself and the pages in blocks of ``block``
    (a partial last block, one block, whole blocks only, none), merged, equal plain attention."""
    q, k, v, pk, pv = _inputs(torch.Generator().manual_seed(prefix + heads), 6, heads, groups, 16, prefix,
                              torch.float64)
    got = fp8.fp8_capture_attention(q, k, v, pk, pv, 0.3, KernelOptions(prefix_block=block),
                                    kernel=emulated_sdpa_fp8, fp8_dtype=torch.float64)
    want = prefix_causal_attention_math(q, k, v, pk, pv, scale=0.3)
    assert got.shape == want.shape and got.dtype == torch.float64
    assert (got - want).abs().max().item() < 1e-12


def test_e4m3_numerics_on_the_emulated_kernel():
    """Real E4M3 casts: the output differs from bf16-input fp64 attention by FP8's rounding (a
    few percent: mean relative error within 2-10%), not more."""
    q, k, v, pk, pv = _inputs(torch.Generator().manual_seed(0), 32, 4, 2, 64, 200, torch.bfloat16)
    got = fp8.fp8_capture_attention(q, k, v, pk, pv, None, KernelOptions(prefix_block=64), kernel=emulated_sdpa_fp8)
    want = prefix_causal_attention_math(*(t.double() for t in (q, k, v, pk, pv)))
    error = ((got.double() - want).norm() / want.norm()).item()
    assert got.dtype == torch.bfloat16 and 0.01 < error < 0.1, error


def test_centred_values_keep_a_coarse_accumulator_accurate():
    """Values sharing a direction over 8,192 pages: a kernel whose ``P V`` sum loses precision
    relative to itself is far off when called on the values as they are, and the capture
    attention on the same kernel (which centres each call's values) is as accurate as on the
    exact-accumulation emulation."""
    gen = torch.Generator().manual_seed(0)
    seq, pages = 8, 8192
    q = torch.randn(seq, 1, 4, 32, generator=gen).bfloat16()
    k_all = torch.randn(pages + seq, 1, 2, 32, generator=gen).bfloat16()
    v_all = (0.5 * torch.randn(pages + seq, 1, 2, 32, generator=gen) + torch.randn(1, 1, 2, 32, generator=gen)).bfloat16()
    pk, pv, k, v = k_all[:pages], v_all[:pages], k_all[pages:], v_all[pages:]
    q_BHSD, pk_BHPD, pv_BHPD = (expand_groups(t.double().permute(1, 2, 0, 3), 4) for t in (q, pk, pv))
    want_BHSD = torch.softmax(q_BHSD @ pk_BHPD.transpose(-1, -2) * 32 ** -0.5, -1) @ pv_BHPD  # every page visible

    coarse_kernel = functools.partial(emulated_sdpa_fp8, accumulator_bits=10)  # sum truncated every 64 keys

    def rel(got, want):
        return ((got.double() - want).norm() / want.norm()).item()

    # the kernel alone on the uncentred pages (one call, the queries over every page)
    q8, descale_q = fp8.cast_fp8(q.permute(1, 2, 0, 3))
    (k8, descale_k), (v8, descale_v) = (fp8.cast_fp8(t.permute(1, 2, 0, 3)) for t in (pk, pv))
    scale_s = torch.full((1, 1, 1, 1), fp8.P_SCALE)
    scale_o = 0.5 / descale_v
    kernel_args = (q8, k8, v8, descale_q, descale_k, descale_v, scale_s, scale_o, 32 ** -0.5, False)
    coarse_plain = rel(coarse_kernel(*kernel_args)[0].double() / scale_o.double(), want_BHSD)
    exact_plain = rel(emulated_sdpa_fp8(*kernel_args)[0].double() / scale_o.double(), want_BHSD)
    # the capture attention (values centred per call) on both kernels
    want = prefix_causal_attention_math(*(t.double() for t in (q, k, v, pk, pv)))
    options = KernelOptions(prefix_block=pages)
    coarse_centred = rel(fp8.fp8_capture_attention(q, k, v, pk, pv, None, options,
                                                   kernel=coarse_kernel), want)
    exact_centred = rel(fp8.fp8_capture_attention(q, k, v, pk, pv, None, options, kernel=emulated_sdpa_fp8), want)
    assert coarse_plain > 1.5 * exact_plain, (coarse_plain, exact_plain)  # the accumulator's loss shows
    assert coarse_centred < 1.1 * exact_centred < 0.5 * exact_plain, (coarse_centred, exact_centred, exact_plain)


def test_capture_through_the_hook_matches_the_plain_capture(single_process):
    """The cores' ``capture_attention`` set to the FP8 path on the emulated kernel with exact
    casts (fp64 model): the captured pages and last logits are the plain capture's."""
    from megatron_longstraw.attention.sdpa_core import SDPACoreAttention
    from megatron_longstraw.longstraw.capture import capture_prompt
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.models.presets import resolve_hf_config
    from megatron_longstraw.testing.hf_reference import build_hf_model
    from megatron_longstraw.testing.parity import megatron_from_hf

    hf = resolve_hf_config("qwen3.5-debug")
    model = megatron_from_hf(hf, build_hf_model(hf, seed=0).double(), ModelOptions(params_dtype=torch.float64))
    tokens = torch.randint(0, hf["vocab_size"], (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = capture_prompt(model, tokens, 16)
        cores = [m for m in model.modules() if isinstance(m, SDPACoreAttention)]
        for core in cores:
            core.capture_attention = functools.partial(fp8.fp8_capture_attention, kernel=emulated_sdpa_fp8,
                                                       fp8_dtype=torch.float64)
        hooked = capture_prompt(model, tokens, 16)
    assert cores
    assert (hooked.last_logits_BV - plain.last_logits_BV).abs().max().item() < 1e-10


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_the_flag_is_refused_where_it_cannot_run(single_process):
    """On a machine without a Hopper GPU, and for a model without full attention: one line naming
    the flag; an unknown mode names it too."""
    from megatron_longstraw.models.builder import build_model
    from megatron_longstraw.models.options import ModelOptions
    from megatron_longstraw.models.presets import resolve_hf_config

    options = ModelOptions(fp8_attention="capture")
    with pytest.raises(ValueError, match=r"^--fp8-attention capture needs a CUDA GPU"):
        build_model(resolve_hf_config("qwen3.5-debug"), options)
    with pytest.raises(ValueError, match=r"^--fp8-attention capture: the model has no full-attention layer"):
        build_model(resolve_hf_config("glm-5-debug"), options)
    with pytest.raises(ValueError, match="--fp8-attention must be one of"):
        PrecisionConfig(fp8_attention="always")
    q = torch.zeros(4, 2, 2, 16)
    with pytest.raises(ValueError, match=r"^--fp8-attention capture captures one prompt at a time"):
        fp8.fp8_capture_attention(q, q[:, :, :1], q[:, :, :1], kernel=emulated_sdpa_fp8)


TORCH_CUDNN = "/opt/venv/lib/python3.12/site-packages/nvidia/cudnn/lib"
MAPS = f"""\
7f0000000000-7f0000001000 r-xp 00000000 08:01 11 {TORCH_CUDNN}/libcudnn.so.9
7f0000001000-7f0000002000 r--p 00001000 08:01 11 {TORCH_CUDNN}/libcudnn.so.9
7f0000002000-7f0000003000 r-xp 00000000 08:01 12 {TORCH_CUDNN}/libcudnn_graph.so.9
7f0000003000-7f0000004000 r-xp 00000000 08:01 13 /opt/venv/lib/python3.12/site-packages/nvidia/cuda_runtime/lib/libcudart.so.13
7f0000004000-7f0000005000 rw-p 00000000 00:00 0
7f0000005000-7f0000006000 r-xp 00000000 08:01 14 /usr/lib/x86_64-linux-gnu/libc.so.6
"""
SYSTEM_CUDNN = "7f0000006000-7f0000007000 r-xp 00000000 08:01 15 /usr/lib/x86_64-linux-gnu/libcudnn_heuristic.so.9.14.0\n"


def test_two_cudnn_folders_in_one_process_are_refused(tmp_path):
    """The folders of the cuDNN libraries a process maps (other libraries and anonymous maps
    ignored); one folder passes, a second one (a system cuDNN beside torch's) is refused in one
    line naming the flag and both folders."""
    assert fp8.cudnn_library_folders(MAPS) == [TORCH_CUDNN]
    assert fp8.cudnn_library_folders(MAPS + SYSTEM_CUDNN) == [TORCH_CUDNN, "/usr/lib/x86_64-linux-gnu"]
    one, two = tmp_path / "one", tmp_path / "two"
    one.write_text(MAPS)
    two.write_text(MAPS + SYSTEM_CUDNN)
    fp8.check_one_cudnn(str(one))
    fp8.check_one_cudnn(str(tmp_path / "absent"))  # no maps to read: nothing to check
    with pytest.raises(ValueError, match=r"^--fp8-attention capture: this process has cuDNN libraries from 2 "
                                         r"folders \(/opt/venv/.*/nvidia/cudnn/lib, /usr/lib/x86_64-linux-gnu\)"):
        fp8.check_one_cudnn(str(two))
